"""fedpcd sweep (grid expansion, resumability) and fedpcd report (grouping over seeds, last-rounds mean)."""

from __future__ import annotations

import json

import pytest
import yaml

from fedpcd.cli import main
from fedpcd.errors import UserError
from fedpcd.report.groups import group_runs
from fedpcd.report.read import load_runs
from fedpcd.report.stats import last_mean, rounds_cell, rounds_to_target, swing
from fedpcd.report.tables import report_table
from fedpcd.resolve import load_config
from fedpcd.sweep.grid import expand_sweep
from fedpcd.sweep.status import run_status


def _sweep_file(tmp_path, **extra):
    spec = {
        "dataset": {"name": "synthetic"},
        "model": {"name": "mlp", "hidden": 16},
        "clients": 3,
        "rounds": 2,
        "output_dir": str(tmp_path / "runs"),
        "sweep": {
            "partition": [{"scheme": "iid"}, {"scheme": "dirichlet", "beta": 0.3, "min_size": 5}],
            "seed": [0, 1],
        },
        **extra,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_expand_sweep_grid_and_names(tmp_path):
    configs = expand_sweep(_sweep_file(tmp_path), ["rounds=3"])
    assert len(configs) == 4
    names = [c.output_dir.rsplit("/", 1)[-1] for c in configs]
    assert names == [
        "iid_seed0",
        "iid_seed1",
        "dirichlet-beta0.3-min_size5_seed0",
        "dirichlet-beta0.3-min_size5_seed1",
    ]
    assert all(c.rounds == 3 for c in configs)
    assert configs[2].partition.params()["beta"] == 0.3 and configs[3].seed == 1


def test_sweep_errors(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text("rounds: 2\n")
    with pytest.raises(UserError, match="no 'sweep:'"):
        expand_sweep(path)
    path.write_text(yaml.safe_dump({"sweep": {"seed": []}}))
    with pytest.raises(UserError, match="non-empty list"):
        expand_sweep(path)


def test_sweep_runs_skips_finished_and_report_groups_seeds(tmp_path, capsys):
    path = _sweep_file(tmp_path)
    assert main(["sweep", "--config", str(path)]) == 0
    configs = expand_sweep(path)
    assert all(run_status(c) == "done" for c in configs)
    before = [(tmp_path / "runs" / n / "summary.json").stat().st_mtime_ns for n in ["iid_seed0"]]
    assert main(["sweep", "--config", str(path)]) == 0
    assert "4 finished" in capsys.readouterr().out
    assert [(tmp_path / "runs" / n / "summary.json").stat().st_mtime_ns for n in ["iid_seed0"]] == before

    runs = load_runs(tmp_path / "runs")
    table = report_table(runs, last=1)
    rows = table.splitlines()[2:]
    assert len(rows) == 2  # two partitions, seeds grouped
    assert all("| 2 |" in row for row in rows)
    assert any(row.startswith("| dirichlet beta=0.3 min_size=5 |") for row in rows)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    up = header.index("kB up/rnd")
    for row, group in zip(rows, group_runs(runs)[1].values(), strict=True):
        per_run = [sum(r["bytes_up"] for r in run.records) / len(run.records) for run in group]
        expected = sum(per_run) / len(per_run) / 1e3
        assert float(row.strip("|").split("|")[up]) == pytest.approx(expected, abs=0.05)
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "curves.png").stat().st_size > 1000
    assert "PA-split" in (tmp_path / "rep" / "report.md").read_text()


def test_last_mean_by_hand():
    records = [{"round": r, "global_acc": a} for r, a in [(1, 0.1), (2, 0.5), (3, None), (4, 0.9)]]
    assert last_mean(records, "global_acc", 2) == pytest.approx(0.7)
    assert last_mean(records, "global_acc", 10) == pytest.approx(0.5)
    assert last_mean(records, "pa_l", 2) is None


def test_rounds_to_target_by_hand():
    curve = [(2, 0.3), (4, None), (6, 0.55), (8, 0.5), (10, 0.8)]
    records = [{"round": r, "global_acc": a} for r, a in curve]
    assert rounds_to_target(records, "global_acc", 0.3) == 2
    assert rounds_to_target(records, "global_acc", 0.5) == 6  # first crossing, not the last
    assert rounds_to_target(records, "global_acc", 0.81) is None
    assert rounds_to_target(records, "pa_l", 0.1) is None
    assert rounds_cell([2, 6, 7]) == "5.0"
    assert rounds_cell([4, None, 6]) == "5.0 (2/3)"
    assert rounds_cell([None, None]) == "-"


def _fake_run(folder, seed, curve, algorithm="fedavg"):
    """A finished 3-round run directory with the given GA curve (PA-split = GA + 0.1)."""
    folder.mkdir()
    overrides = ["dataset.name=synthetic", "model.name=mlp", "rounds=3", f"seed={seed}"]
    cfg = load_config(None, [*overrides, f"algorithm.name={algorithm}"])
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    lines = [
        {"round": i + 1, "global_acc": a, "personal_acc": a + 0.1, "bytes_up": 0, "bytes_down": 0}
        for i, a in enumerate(curve)
    ]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (folder / "summary.json").write_text(json.dumps({"rounds": 3, "wall_s": 1.0}))


def _cells(table):
    header, _, *rows = table.splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    return [dict(zip(names, (c.strip() for c in row.strip("|").split("|")), strict=True)) for row in rows]


def test_report_rounds_to_columns(tmp_path, capsys):
    for seed, curve in ((0, [0.2, 0.5, 0.7]), (1, [0.4, 0.45, 0.5])):
        _fake_run(tmp_path / f"run{seed}", seed, curve)
    table = report_table(load_runs(tmp_path), last=1, rounds_to=[40, 60])
    cells = {f" {k} ": v for k, v in _cells(table)[0].items()}
    assert cells[" R40% "].strip() == "1.5"  # seed 0 at round 2, seed 1 at round 1
    assert cells[" R60% "].strip() == "3.0 (1/2)"  # only seed 0 reaches 60%
    assert cells[" PA-G "].strip() == "-"  # runs written before PA-G existed have none
    assert main(["report", str(tmp_path), "--rounds-to", "0"]) == 2
    assert "not a GA percentage in (0, 100]" in capsys.readouterr().err


def test_report_paired_differences_by_hand(tmp_path, capsys):
    _fake_run(tmp_path / "a0", 0, [0.1, 0.5, 0.6])
    _fake_run(tmp_path / "a1", 1, [0.1, 0.7, 0.2])
    _fake_run(tmp_path / "b0", 0, [0.1, 0.6, 0.9], "fedprox")
    _fake_run(tmp_path / "b1", 1, [0.1, 0.2, 0.7], "fedprox")
    rows = _cells(report_table(load_runs(tmp_path), last=2, paired_with="fedavg"))
    prox = next(r for r in rows if r["algorithm"] == "fedprox")
    # last-2 means: fedavg 0.55 / 0.45, fedprox 0.75 / 0.45 -> paired differences +20 and 0 points
    assert prox["ΔGA vs fedavg"] == "+10.00 ± 14.14"
    assert prox["ΔPA-split vs fedavg"] == "+10.00 ± 14.14"
    # unpaired, the seed spread would hide it: GA 60.00 ± 21.21 vs 50.00 ± 7.07
    assert prox["GA"] == "60.00 ± 21.21"
    assert next(r for r in rows if r["algorithm"] == "fedavg")["ΔGA vs fedavg"] == "+0.00 ± 0.00"
    assert main(["report", str(tmp_path), "--paired-with", "moon"]) == 2
    err = capsys.readouterr().err
    assert "no runs of algorithm 'moon' to pair with; the runs have: fedavg, fedprox" in err


def test_swing_by_hand_and_report_column(tmp_path, capsys):
    records = [{"round": r, "global_acc": a} for r, a in [(1, 0.9), (2, 0.4), (3, None), (4, 0.7), (5, 0.6)]]
    assert swing(records, "global_acc", 3) == pytest.approx(0.3)  # rounds 2, 4, 5: 0.7 - 0.4
    assert swing(records, "global_acc", 2) == pytest.approx(0.1)
    assert swing(records[:1], "global_acc", 5) is None  # one value has no swing
    _fake_run(tmp_path / "a0", 0, [0.1, 0.5, 0.6])
    _fake_run(tmp_path / "a1", 1, [0.1, 0.7, 0.2])
    row = _cells(report_table(load_runs(tmp_path), last=2, with_swing=True))[0]
    assert row["GA swing"] == "30.00 ± 28.28"  # seed 0: 10 points, seed 1: 50 points
    assert "GA swing" not in report_table(load_runs(tmp_path), last=2)
    assert main(["report", str(tmp_path), "--last", "3", "--swing"]) == 0
    assert "| 55.00 ± 7.07 |" in capsys.readouterr().out  # seed 0: 0.6 - 0.1, seed 1: 0.7 - 0.1


def test_best_ga_column_by_hand(tmp_path, capsys):
    _fake_run(tmp_path / "a0", 0, [0.1, 0.5, 0.4])
    _fake_run(tmp_path / "a1", 1, [0.1, 0.7, 0.2])
    row = _cells(report_table(load_runs(tmp_path), last=1, with_best=True))[0]
    assert row["GA best"] == "60.00 ± 14.14"  # round 2 of each seed, whatever the last round says
    assert row["GA"] == "30.00 ± 14.14"
    assert main(["report", str(tmp_path), "--best"]) == 0 and "GA best" in capsys.readouterr().out


def test_report_without_runs_is_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_runs_written_before_a_key_existed_group_with_new_ones(tmp_path):
    for seed, drop in ((0, True), (1, False)):
        cfg = load_config(None, ["dataset.name=synthetic", "model.name=mlp", "rounds=1", f"seed={seed}"])
        data = cfg.to_dict()
        if drop:  # as written by an older fedpcd
            del data["personal_test"], data["model"]["clients"]
        folder = tmp_path / f"run{seed}"
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump(data))
        record = {"round": 1, "global_acc": 0.5, "bytes_up": 0, "bytes_down": 0}
        (folder / "metrics.jsonl").write_text(json.dumps(record))
        (folder / "summary.json").write_text(json.dumps({"rounds": 1, "wall_s": 1.0}))
    _, groups = group_runs(load_runs(tmp_path))
    assert len(groups) == 1


def test_a_preset_run_pairs_with_the_reference_in_its_setting_whatever_its_preset_sets(tmp_path):
    """FedGELA's `official` preset sets local.grad_clip 20: that is part of the method, so its run pairs
    with FedAvg's of the same seed; a run that differs in a key its preset does not set does not pair, and
    neither does one whose preset key was set by the config to another value than the preset's."""
    from fedpcd.report.groups import paired_run, reference_runs, same_setting
    from fedpcd.report.read import Run
    from fedpcd.resolve import load_config

    def run(name: str, *overrides: str) -> Run:
        config = load_config(None, ["seed=1", f"output_dir={tmp_path / name}", *overrides]).to_dict()
        return Run(tmp_path / name, config, [], {})

    fedavg = run("fedavg")
    official = run("official", "algorithm.name=fedgela", "algorithm.preset=official", "local.epochs=2")
    fedavg_e2 = run("fedavg_e2", "local.epochs=2")
    refs = reference_runs([fedavg, fedavg_e2], "fedavg")
    assert official.config["local"]["grad_clip"] == 20.0 and fedavg.config["local"]["grad_clip"] is None
    assert paired_run(official, refs) is fedavg_e2 and same_setting(official, fedavg_e2)
    assert not same_setting(official, fedavg)  # local.epochs: the config's, not the preset's
    clipped_10 = run("c10", "algorithm.name=fedgela", "algorithm.preset=official", "local.epochs=2",
                     "local.grad_clip=10")  # fmt: skip
    assert paired_run(clipped_10, refs) is None


def test_a_preset_names_its_method_and_keeps_its_setting_in_the_paper_layout(tmp_path):
    """In the methods x settings grid, a run under a preset is the method "NAME preset=P" (the algorithm keys
    the preset sets are its name's, not listed) in its reference's setting column (the keys it sets outside
    the algorithm, FedGELA official's gradient clip, are the method's, not a setting of their own)."""
    from fedpcd.report.grid import build_grid
    from fedpcd.report.groups import setting_columns
    from fedpcd.report.read import Run

    def run(name: str, *overrides: str) -> Run:
        config = load_config(None, [f"output_dir={tmp_path / name}", *overrides]).to_dict()
        return Run(tmp_path / name, config, [], {})

    runs = [
        run(f"{name}{p}", *algorithm, f"partition.scheme={scheme}", *(["partition.beta=0.1"] * (p == "d")))
        for p, scheme in (("p", "pathological"), ("d", "dirichlet"))
        for name, algorithm in (
            ("fedavg", ()),
            ("official", ("algorithm.name=fedgela", "algorithm.preset=official")),
            ("paper", ("algorithm.name=fedgela", "algorithm.preset=paper")),
            ("s4", ("algorithm.name=fedgela", "algorithm.scale=4")),
        )
    ]
    grid = build_grid(runs)
    assert grid.methods == ["fedavg", "fedgela preset=official", "fedgela preset=paper", "fedgela scale=4.0"]
    assert grid.settings == ["Dir(0.1)", "P10C2"] and all(len(c) == 1 for c in grid.cells.values())
    # a key the config sets away from the preset's value stays in the name
    tuned = run("tuned", "algorithm.name=fedgela", "algorithm.preset=official", "algorithm.scale=8")
    varying = ["algorithm.preset", "algorithm.scale"]
    named = {"algorithm": "preset=official scale=8.0"}
    assert setting_columns(varying, ("official", 8.0), "fedgela") == named
    assert setting_columns(varying, ("official", 5.0), "fedgela") == {"algorithm": "preset=official"}
    assert tuned.config["algorithm"]["scale"] == 8.0


def test_the_pairing_key_is_the_sorted_json_of_the_setting_but_the_algorithm(tmp_path):
    """``without_algorithm`` composes the key from each value's JSON, computed once per run: it is exactly
    ``json.dumps`` of the setting without its algorithm keys (and the method's), nested ``then`` partitions,
    unicode, floats and None included."""
    from fedpcd.report.groups import without_algorithm
    from fedpcd.report.read import Run

    overrides = [
        [],
        ["partition.scheme=longtail", "partition.rho=100", "algorithm.name=fedgela"],
        ["algorithm.name=fedprox", "local.lr=0.0125", "dataset.name=synthetic", "dataset.train_fraction=0.3"],
    ]
    for i, extra in enumerate(overrides):
        out = tmp_path / f"r{i}-é"
        run = Run(out, load_config(None, [f"output_dir={out}", *extra]).to_dict(), [], {})
        run.setting["extra.τ"] = {"b": [1, None], "a": "ü"}  # a nested, non-ASCII value
        setting = {k: v for k, v in run.setting.items() if not k.startswith("algorithm.")}
        for method_keys in (frozenset(), frozenset({"local.lr", "extra.τ"})):
            kept = {k: v for k, v in setting.items() if k not in method_keys}
            assert without_algorithm(run, method_keys) == json.dumps(kept, sort_keys=True, default=str)
