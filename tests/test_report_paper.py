"""The papers' layout of `fedpcd report` (methods x settings, last/best, communication, figures, CSV), the
sweep's `setting` axis, its results index, failed runs and a sweep killed mid-way."""

from __future__ import annotations

import csv
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from fedpcd.cli import main
from fedpcd.errors import UserError
from fedpcd.report.grid import build_grid, is_reference, partition_name
from fedpcd.report.paper import (
    cells_csv,
    communication_table,
    difference_table,
    legend,
    mean_ranks,
    paired_differences,
    pivot_table,
    ranking_table,
    reading,
)
from fedpcd.report.read import Run
from fedpcd.sweep.grid import expand_sweep
from fedpcd.sweep.status import run_status

PATHOLOGICAL = {"scheme": "pathological", "classes_per_client": 2}
DIRICHLET = {"scheme": "dirichlet", "beta": 0.1, "min_size": 10}


def test_partition_names():
    assert partition_name(PATHOLOGICAL, 10) == "P10C2"
    assert partition_name(DIRICHLET, 100) == "Dir(0.1)"
    assert partition_name({"scheme": "iid"}, 5) == "IID"
    assert partition_name({"scheme": "longtail", "rho": 0.01, "then": {"scheme": "iid"}}, 5) == "LT(0.01)+IID"


def _run(algorithm, partition, seed, ga, pa, clients=10, bytes_per_round=1000):
    config = {
        "seed": seed,
        "clients": clients,
        "participation": 1.0,
        "partition": partition,
        "algorithm": algorithm,
        "output_dir": "x",
    }
    records = [
        {"round": r, "global_acc": g, "personal_acc": p, "bytes_up": bytes_per_round, "bytes_down": 0}
        for r, (g, p) in enumerate(zip(ga, pa, strict=True), start=1)
    ]
    return Run(Path("/nonexistent"), config, records, {"rounds": len(ga), "wall_s": 1.0})


def _runs():
    fedavg, fedprox = {"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}
    return [
        _run(fedavg, PATHOLOGICAL, 0, [0.2, 0.6, 0.4], [0.9, 0.9, 0.9]),
        _run(fedavg, PATHOLOGICAL, 1, [0.3, 0.5, 0.5], [0.8, 0.8, 0.8]),
        _run(fedprox, PATHOLOGICAL, 0, [0.6, 0.7, 0.7], [0.5, 0.5, 0.5]),
        _run(fedprox, PATHOLOGICAL, 1, [0.1, 0.2, 0.3], [0.6, 0.6, 0.6]),
        _run(fedavg, DIRICHLET, 0, [0.5, 0.5, 0.5], [0.7, 0.7, 0.7], clients=100, bytes_per_round=2e6),
        _run(fedprox, DIRICHLET, 0, [0.1, 0.4, 0.6], [0.7, 0.7, 0.7], clients=100, bytes_per_round=2e6),
    ]


def _cells(table, row):
    line = next(x for x in table.splitlines() if x.startswith(f"| {row} |"))
    return [c.strip() for c in line.strip("|").split("|")[1:]]


def test_grid_names_orders_and_pivots_by_hand():
    grid = build_grid(_runs())
    assert grid.methods == ["fedavg", "fedprox mu=0.1"]  # the reference method first
    assert grid.settings == ["P10C2", "Dir(0.1) K=100"]  # the usual client count first; usual values left out
    last = pivot_table(grid, "global_acc", "last", last=2)
    assert last.splitlines()[0] == "| method | P10C2 | Dir(0.1) K=100 |"
    fedavg_p = [statistics.fmean([0.6, 0.4]), statistics.fmean([0.5, 0.5])]
    fedprox_p = [statistics.fmean([0.7, 0.7]), statistics.fmean([0.2, 0.3])]
    expected = f"{100 * statistics.fmean(fedavg_p):.2f} ± {100 * statistics.stdev(fedavg_p):.2f}"
    assert _cells(last, "fedavg")[0] == f"**{expected}**"  # 50.00 beats fedprox's 47.50
    assert _cells(last, "fedprox mu=0.1")[0] == (
        f"{100 * statistics.fmean(fedprox_p):.2f} ± {100 * statistics.stdev(fedprox_p):.2f}"
    )
    # one seed: no std, "(1)" as the table's fullest cells have 2; ties with fedavg's 50.00
    assert _cells(last, "fedprox mu=0.1")[1] == "**50.00 (1)**"
    assert _cells(last, "fedavg")[1] == "**50.00 (1)**"
    best = pivot_table(grid, "global_acc", "best", last=2)
    assert _cells(best, "fedavg")[0] == "**55.00 ± 7.07**"  # best rounds 0.6 and 0.5
    assert _cells(best, "fedprox mu=0.1")[0] == "50.00 ± 28.28"  # 0.7 and 0.3
    assert _cells(pivot_table(grid, "personal_acc", "last", 2), "fedavg")[0] == "**85.00 ± 7.07**"


def test_a_preset_of_the_reference_algorithm_is_a_method_compared_with_it():
    """FedAvg under its preset fedadam is FedAdam: a row of its own, paired with plain FedAvg of the same
    setting and seed, never the reference."""
    from fedpcd.presets import preset_values

    fedavg, fedprox = {"name": "fedavg"}, {"name": "fedprox"}
    fedadam = {"name": "fedavg", "preset": "fedadam"}
    runs = [
        _run(fedavg, PATHOLOGICAL, 0, [0.2, 0.4], [0.5, 0.5]),
        _run(fedavg, PATHOLOGICAL, 1, [0.3, 0.5], [0.5, 0.5]),
        _run(fedadam, PATHOLOGICAL, 0, [0.3, 0.6], [0.5, 0.5]),
        _run(fedadam, PATHOLOGICAL, 1, [0.4, 0.6], [0.5, 0.5]),
        _run(fedprox, PATHOLOGICAL, 0, [0.3, 0.3], [0.5, 0.5]),
    ]
    server = {k.split(".")[1]: v for k, v in preset_values("fedavg", "fedadam").items()}
    for run in runs[2:4]:
        run.config["server"] = server  # as the preset resolves
    grid = build_grid(runs)
    assert grid.methods == ["fedavg", "fedavg preset=fedadam", "fedprox"]  # the reference (plain) first
    diffs = paired_differences(grid, "global_acc", "last", 1)
    assert diffs[("fedavg preset=fedadam", "P10C2")] == pytest.approx([0.6 - 0.4, 0.6 - 0.5])
    assert diffs[("fedprox", "P10C2")] == pytest.approx([0.3 - 0.4])
    assert is_reference("fedavg", "fedavg") and is_reference("fedavg weighting=batches", "fedavg")
    assert not is_reference("fedavg preset=fedadam", "fedavg")


def test_settings_go_from_mild_to_strong_skew_then_unusual_client_counts():
    fedavg = {"name": "fedavg"}
    parts = [
        ({"scheme": "pathological", "classes_per_client": 2}, 5),
        ({"scheme": "pathological", "classes_per_client": 2}, 10),
        ({"scheme": "dirichlet", "beta": 0.1}, 10),
        ({"scheme": "iid"}, 10),
        ({"scheme": "pathological", "classes_per_client": 3}, 10),
        ({"scheme": "dirichlet", "beta": 0.5}, 10),
    ]
    grid = build_grid([_run(fedavg, part, 0, [0.5], [0.5], clients=k) for part, k in parts])
    assert grid.settings == ["IID", "Dir(0.5)", "Dir(0.1)", "P10C3", "P10C2", "P5C2"]


def test_mean_ranks_and_ranking_by_hand():
    grid = build_grid(_runs())
    # GA, last 2: P10C2 fedavg 0.50 > fedprox 0.475; Dir(0.1): both 0.50, a tie sharing ranks 1 and 2
    assert mean_ranks(grid, "global_acc", "last", 2) == {"fedavg": [1.0, 1.5], "fedprox mu=0.1": [2.0, 1.5]}
    # PA, last 2: P10C2 fedavg 0.85 > fedprox 0.55; Dir(0.1): 0.7 and 0.7
    assert mean_ranks(grid, "personal_acc", "last", 2) == {"fedavg": [1.0, 1.5], "fedprox mu=0.1": [2.0, 1.5]}
    table = ranking_table(grid, last=2)
    assert table.splitlines()[0] == (
        "| method | GA mean rank (settings) | GA ↑/↓ vs fedavg (settings) "
        "| PA-split mean rank (settings) | PA-split ↑/↓ vs fedavg (settings) |"
    )
    # P10C2, fedprox minus fedavg: GA +20 / -25 points (t = 0.18, within the spread), PA-split -40 / -20
    # (mean -30, std 14.14: t = 3.0 < t_{0.975, 1} = 12.7); Dir(0.1) has one seed: never marked
    assert [_cells(table, m) for m in ("fedavg", "fedprox mu=0.1")] == [
        ["1.2 (2)", "reference", "1.2 (2)", "reference"],
        ["1.8 (2)", "-", "1.8 (2)", "-"],
    ]
    assert table.splitlines()[2].startswith("| fedavg |")  # best mean GA rank first
    assert ranking_table(build_grid(_runs()[:4]), last=2) is None  # one setting: nothing to rank over


def test_mean_ranks_leave_out_missing_cells_and_share_tied_ranks():
    fedavg, fedprox, fedper = {"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}, {"name": "fedper"}
    runs = [
        _run(fedavg, PATHOLOGICAL, 0, [0.5], [0.6]),
        _run(fedprox, PATHOLOGICAL, 0, [0.5], [0.6]),
        _run(fedper, PATHOLOGICAL, 0, [None], [0.9]),  # no global model: no GA, no GA rank
        _run(fedavg, DIRICHLET, 0, [0.3], [0.4]),  # fedprox has no Dir(0.1) run
        _run(fedper, DIRICHLET, 0, [None], [0.2]),
    ]
    grid = build_grid(runs)
    assert (grid.methods, grid.settings) == (["fedavg", "fedper", "fedprox mu=0.1"], ["Dir(0.1)", "P10C2"])
    assert mean_ranks(grid, "global_acc", "last", 1) == {"fedavg": [1.0, 1.5], "fedprox mu=0.1": [1.5]}
    # PA-split: Dir(0.1) fedavg 0.4 > fedper 0.2; P10C2 fedper 0.9, then fedavg and fedprox tied (ranks 2, 3)
    ranks = mean_ranks(grid, "personal_acc", "last", 1)
    assert ranks == {"fedavg": [1.0, 2.5], "fedper": [2.0, 1.0], "fedprox mu=0.1": [2.5]}


def test_cells_csv_by_hand():
    grid = build_grid(_runs())
    rows = list(csv.DictReader(cells_csv(grid, last=2).splitlines()))
    assert [(r["method"], r["setting"], r["seeds"]) for r in rows] == [
        ("fedavg", "P10C2", "2"),
        ("fedavg", "Dir(0.1) K=100", "1"),
        ("fedprox mu=0.1", "P10C2", "2"),
        ("fedprox mu=0.1", "Dir(0.1) K=100", "1"),
    ]
    fedprox_p10c2 = [statistics.fmean([0.7, 0.7]), statistics.fmean([0.2, 0.3])]
    assert rows[2]["global_acc_last_mean"] == f"{statistics.fmean(fedprox_p10c2):.6f}"
    assert rows[2]["global_acc_last_std"] == f"{statistics.stdev(fedprox_p10c2):.6f}"
    assert (rows[2]["global_acc_best_mean"], rows[2]["global_acc_best_std"]) == ("0.500000", "0.282843")
    assert (rows[1]["global_acc_last_mean"], rows[1]["global_acc_last_std"]) == ("0.500000", "")  # one seed
    assert (rows[0]["pa_l_last_mean"], rows[0]["pa_l_last_std"]) == ("", "")  # not recorded by these runs


def _three_seeds():
    """fedavg and two methods on one partition, 3 seeds, GA curves of 2 rounds (last 1 is read)."""
    fedavg, fedrs, fedlc = {"name": "fedavg"}, {"name": "fedrs"}, {"name": "fedlc"}
    ga = {
        "fedavg": [0.50, 0.60, 0.70],
        "fedrs": [0.53, 0.62, 0.74],  # +3, +2, +4 points: separated above
        "fedlc": [0.40, 0.70, 0.69],  # -10, +10, -1: within the spread
    }
    runs = []
    for name, algorithm in (("fedavg", fedavg), ("fedrs", fedrs), ("fedlc", fedlc)):
        for seed, value in enumerate(ga[name]):
            runs.append(_run(algorithm, PATHOLOGICAL, seed, [0.1, value], [0.9, 0.9]))
    runs.append(_run(fedrs, DIRICHLET, 0, [0.1, 0.8], [0.9, 0.9]))  # a second setting: fedrs only, 1 seed
    runs.append(_run(fedavg, DIRICHLET, 0, [0.1, 0.7], [0.9, 0.9]))
    return build_grid(runs)


def test_three_seeds_paired_differences_marks_and_counts_by_hand():
    grid = _three_seeds()
    diffs = paired_differences(grid, "global_acc", "last", 1)
    assert diffs[("fedrs", "P10C2")] == pytest.approx([0.03, 0.02, 0.04])
    assert diffs[("fedlc", "P10C2")] == pytest.approx([-0.10, 0.10, -0.01])
    assert diffs[("fedrs", "Dir(0.1)")] == pytest.approx([0.10])
    assert ("fedavg", "P10C2") not in diffs
    table = pivot_table(grid, "global_acc", "last", 1)
    fedrs = [statistics.fmean([0.53, 0.62, 0.74]), statistics.stdev([0.53, 0.62, 0.74])]
    assert grid.settings == ["Dir(0.1)", "P10C2"]
    assert _cells(table, "fedrs")[1] == f"**{100 * fedrs[0]:.2f} ± {100 * fedrs[1]:.2f}** ↑"
    assert _cells(table, "fedrs")[0] == "**80.00 (1)**"  # one seed: "(1)", no arrow
    fedlc = [0.40, 0.70, 0.69]  # no arrow: its differences' t = 0.0033 / (0.1 / sqrt 3) < 2
    assert (
        _cells(table, "fedlc")[1]
        == f"{100 * statistics.fmean(fedlc):.2f} ± {100 * statistics.stdev(fedlc):.2f}"
    )
    assert _cells(table, "fedavg")[1] == "60.00 ± 10.00"
    delta = difference_table(grid, "global_acc", "last", 1)
    assert _cells(delta, "fedrs") == ["+10.00 (1)", "+3.00 ± 1.00 ↑"]
    assert _cells(delta, "fedlc") == ["-", f"-0.33 ± {100 * statistics.stdev([-0.1, 0.1, -0.01]):.2f}"]
    assert not any(line.startswith("| fedavg |") for line in delta.splitlines())
    ranking = ranking_table(grid, last=1)
    assert _cells(ranking, "fedrs")[:2] == ["1.0 (2)", "↑1"]
    assert _cells(ranking, "fedlc")[:2] == ["3.0 (1)", "-"]


def test_reading_says_only_what_the_marks_support():
    grid = _three_seeds()
    text = reading(grid, last=1)
    assert text.startswith("N = 1-3 seeds per cell")
    assert "GA, separated from fedavg (↑ / ↓): above it: fedrs (P10C2)." in text
    assert "PA-split: no method is separated from fedavg." in text  # equal PA everywhere
    assert "fedlc" not in text  # within the spread: not named
    # fedavg's GA moves 0.1 -> 0.7 over its last 2 rounds at most (seed 2, P10C2), reading the last 2 rounds
    assert (
        "fedavg's own GA moves by up to 60.00 points between its last 2 evaluated rounds (P10C2, seed 2)"
        in (reading(grid, last=2))
    )
    single = build_grid([r for members in grid.cells.values() for r in members if r.config["seed"] == 0])
    one = reading(single, last=1)
    assert one.startswith("1 seed in every cell.")
    assert "no difference to fedavg is marked" in one and "↑" not in pivot_table(
        single, "global_acc", "last", 1
    )
    assert "(1)" not in pivot_table(single, "global_acc", "last", 1)  # every cell has the same n
    assert "with one seed nothing is marked" in legend(single)


def test_communication_rounds_and_megabytes_by_hand():
    table = communication_table(build_grid(_runs()))
    # P10C2: fedavg's best GA is 0.6 (seed 0) and 0.5 (seed 1); fedprox reaches 0.6 in round 1 (seed 0)
    # and never reaches 0.5 (seed 1). Dir(0.1): fedavg's best 0.5, fedprox reaches it in round 3.
    assert _cells(table, "fedavg") == ["2 (0.0 MB)", "1 (2.0 MB)"]
    assert _cells(table, "fedprox mu=0.1") == ["1 (0.0 MB) [1/2]", "3 (6.0 MB)"]


def _sweep(tmp_path, algorithms, settings, rounds=2, seeds=(0,), name="sweep.yaml", out="runs"):
    spec = {
        "dataset": {"name": "synthetic"},
        "model": {"name": "mlp", "hidden": 16},
        "clients": 4,
        "rounds": rounds,
        "output_dir": str(tmp_path / out),
        "sweep": {"setting": settings, "algorithm": algorithms, "seed": list(seeds)},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


SETTINGS = [
    {"label": "P4C2", "partition": PATHOLOGICAL},
    {"label": "K6", "clients": 6, "participation": 0.5, "partition": {"scheme": "iid"}},
]


def test_setting_axis_sets_keys_together_and_names_folders(tmp_path):
    configs = expand_sweep(_sweep(tmp_path, [{"name": "fedavg"}], SETTINGS))
    assert [Path(c.output_dir).name for c in configs] == ["P4C2_fedavg_seed0", "K6_fedavg_seed0"]
    assert (configs[0].clients, configs[0].partition.scheme) == (4, "pathological")
    assert (configs[1].clients, configs[1].participation, configs[1].partition.scheme) == (6, 0.5, "iid")
    bad = _sweep(tmp_path, [{"name": "fedavg"}], ["P4C2"], name="bad.yaml")
    with pytest.raises(UserError, match="'setting'.*mapping"):
        expand_sweep(bad)


def test_report_in_the_papers_layout_regenerates_byte_identically(tmp_path, capsys, monkeypatch):
    """Twice: its figures drawn by two worker processes, then all in this process; the same bytes. Either
    way a progress bar (on a terminal only) counts every figure as it is done."""
    from fedpcd import cli
    from fedpcd.report import figures

    counted: list[tuple[str, object, int]] = []

    def bar(items, **kwargs):  # stands in for tqdm.tqdm: what was counted, and with which switches
        done = 0
        for item in items:
            yield item
            done += 1
        counted.append((kwargs["desc"], kwargs["disable"], done))

    path = _sweep(tmp_path, [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}], SETTINGS)
    assert main(["sweep", "--config", str(path)]) == 0
    with sqlite3.connect(tmp_path / "runs" / "index.sqlite") as db:
        rows = db.execute("SELECT algorithm, status, final_ga FROM runs ORDER BY output_dir").fetchall()
    assert len(rows) == 4 and {r[1] for r in rows} == {"done"} and all(0 <= r[2] <= 1 for r in rows)
    notes = tmp_path / "notes.md"
    notes.write_text("Budget: tiny.\n")
    monkeypatch.setattr("tqdm.tqdm", bar)
    outputs = []
    for folder, per_process, cores in (("a", 1, 2), ("b", 100, 1)):
        monkeypatch.setattr(figures, "FIGURES_PER_PROCESS", per_process)
        monkeypatch.setattr(cli, "usable_cores", lambda cores=cores: cores)
        out = str(tmp_path / folder / "board.md")
        assert (
            main(["report", str(tmp_path / "runs"), "--out", out, "--title", "Board", "--notes", str(notes)])
            == 0
        )
        files = sorted(p for p in (tmp_path / folder).rglob("*") if p.is_file())
        outputs.append({p.relative_to(tmp_path / folder): p.read_bytes() for p in files})
    assert outputs[0] == outputs[1]
    assert counted == [("figures", None, 6)] * 2  # two settings' curves, classes and partition, twice
    names = {p.as_posix() for p in outputs[0]}
    assert names == {
        "board.md",
        "board/cells.csv",
        "board/curves-P4C2.png",
        "board/curves-IID_K=6_participation=0.5.png",
        "board/partition-P4C2.png",
        "board/partition-IID_K=6_participation=0.5.png",
        "board/classes-P4C2.png",
        "board/classes-IID_K=6_participation=0.5.png",
    }
    text = outputs[0][Path("board.md")].decode()
    assert text.startswith("# Board\n\nBudget: tiny.\n\n")
    assert "| method | P4C2 | IID K=6 participation=0.5 |" in text
    assert "](board/curves-P4C2.png)" in text and "## All runs" in text
    assert all(outputs[0][Path(n)][:8] == b"\x89PNG\r\n\x1a\n" for n in names if n.endswith(".png"))
    cells = list(csv.DictReader(outputs[0][Path("board/cells.csv")].decode().splitlines()))
    assert [(c["method"], c["setting"]) for c in cells] == [
        ("fedavg", "P4C2"),
        ("fedavg", "IID K=6 participation=0.5"),
        ("fedprox mu=0.1", "P4C2"),
        ("fedprox mu=0.1", "IID K=6 participation=0.5"),
    ]
    assert all(0 <= float(c["global_acc_last_mean"]) <= float(c["global_acc_best_mean"]) for c in cells)


def test_sweep_goes_on_after_a_failing_run(tmp_path, monkeypatch, capsys):
    import fedpcd.sweep.run as sweep_run

    real = sweep_run.run_one

    def flaky(config_data, resume):
        if "fedprox" in config_data["output_dir"]:
            raise RuntimeError("boom")
        return real(config_data, resume)

    monkeypatch.setattr(sweep_run, "run_one", flaky)
    path = _sweep(tmp_path, [{"name": "fedprox"}, {"name": "fedavg"}], SETTINGS[:1])
    assert main(["sweep", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "FAILED" in err and "boom" in err and "1 of 2 runs failed" in err
    assert [run_status(c) for c in expand_sweep(path)] == ["new", "done"]
    failed = Path(expand_sweep(path)[0].output_dir)
    failed.mkdir(parents=True)
    (failed / "config.yaml").write_text("seed: 0\n")  # a run that failed after writing its config
    assert main(["report", str(tmp_path / "runs")]) == 0
    assert f"left out above: `{failed.name}`" in capsys.readouterr().out


def test_a_killed_sweep_resumes_without_redoing_finished_runs(tmp_path):
    path = _sweep(tmp_path, [{"name": "fedavg"}, {"name": "fedprox"}], SETTINGS, rounds=6)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedpcd.cli", "sweep", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        first = ""
        while not first.startswith("done"):
            first = proc.stdout.readline()
            assert first or proc.poll() is None, "the sweep ended before finishing a run"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    configs = expand_sweep(path)
    finished = [c for c in configs if run_status(c) == "done"]
    assert finished and len(finished) < len(configs)
    stamps = {c.output_dir: (Path(c.output_dir) / "summary.json").stat().st_mtime_ns for c in finished}
    time.sleep(0.01)
    assert main(["sweep", "--config", str(path)]) == 0
    assert all(run_status(c) == "done" for c in configs)
    assert {d: (Path(d) / "summary.json").stat().st_mtime_ns for d in stamps} == stamps
    for c in configs:
        rounds = [yaml.safe_load(line)["round"] for line in (Path(c.output_dir) / "metrics.jsonl").open()]
        assert rounds == list(range(1, 7))


@pytest.mark.parametrize("broken", ["summary.json", "metrics.jsonl", "config.yaml"])
def test_report_on_a_corrupt_run_file_is_one_line(tmp_path, capsys, broken):
    path = _sweep(tmp_path, [{"name": "fedavg"}], SETTINGS[:1], rounds=1)
    assert main(["sweep", "--config", str(path)]) == 0
    run = Path(expand_sweep(path)[0].output_dir)
    (run / broken).write_bytes(b"{not json: [\xff")
    capsys.readouterr()
    assert main(["report", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedpcd: error: ") and f"{run / broken}" in err and len(err.splitlines()) == 1
    assert "not UTF-8" in err  # the cause, named


def test_global_accuracy_per_class_is_recorded_and_drawn_for_one_run(tmp_path, capsys):
    from fedpcd.data.datasets import load_dataset

    path = _sweep(tmp_path, [{"name": "fedavg"}], SETTINGS[:1], rounds=2)
    assert main(["sweep", "--config", str(path)]) == 0
    run = Path(expand_sweep(path)[0].output_dir)
    records = [yaml.safe_load(line) for line in (run / "metrics.jsonl").open()]
    counts = torch.bincount(load_dataset("synthetic", None, 1.0, 0, False).test_y).tolist()
    for r in records:  # GA is the per-class accuracies weighted by the test set's class sizes
        per_class = r["global_class_acc"]
        assert len(per_class) == len(counts)
        assert sum(a * n for a, n in zip(per_class, counts, strict=True)) / sum(counts) == pytest.approx(
            r["global_acc"], abs=1e-3
        )
    assert main(["report", str(run), "--out", str(tmp_path / "one")]) == 0
    assert "![accuracy per class](classes.png)" in (tmp_path / "one" / "report.md").read_text()
    assert (tmp_path / "one" / "classes.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_stopped_by_divergence_ranks_its_method_last_in_that_setting(tmp_path):
    """fedprox ties fedavg on Dir(0.1) and has no finished IID run; a seed of each stopped by divergence
    (stopped.json beside the finished runs) ranks it last in both settings; another error does not count."""
    from fedpcd.config_identity import dump_config
    from fedpcd.report.paper import diverged_cells
    from fedpcd.resolve import config_from_dict

    fedavg, fedprox = {"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}
    iid = {"scheme": "iid"}

    def placed(run: Run, name: str) -> Run:
        config = config_from_dict(run.config)
        (tmp_path / name).mkdir()
        dump_config(config, tmp_path / name / "config.yaml")
        return Run(tmp_path / name, config.to_dict(), run.records, run.summary)

    def stopped(algorithm: dict, partition: dict, seed: int, error: str, clients: int = 10) -> None:
        config = config_from_dict(_run(algorithm, partition, seed, [0.1], [0.1], clients=clients).config)
        folder = tmp_path / f"stopped_{algorithm['name']}_{partition['scheme']}_{seed}_{error}"
        folder.mkdir()
        dump_config(config, folder / "config.yaml")
        (folder / "stopped.json").write_text(f'{{"round": 3, "error": "{error}", "message": "x"}}')

    runs = [placed(run, f"run{i}") for i, run in enumerate(_runs())]
    runs.append(placed(_run(fedavg, iid, 0, [0.5], [0.5]), "iid_fedavg"))
    grid = build_grid(runs)
    assert grid.settings == ["IID", "P10C2", "Dir(0.1) K=100"]
    assert diverged_cells(grid) == set()
    before = {"fedavg": [1.0, 1.0, 1.5], "fedprox mu=0.1": [2.0, 1.5]}
    assert mean_ranks(grid, "global_acc", "last", 2) == before
    stopped(fedprox, DIRICHLET, 1, "DivergenceError", clients=100)
    stopped(fedprox, iid, 0, "DivergenceError")
    stopped(fedavg, PATHOLOGICAL, 2, "RuntimeError")  # not a divergence: no effect
    assert diverged_cells(grid) == {("fedprox mu=0.1", "Dir(0.1) K=100"), ("fedprox mu=0.1", "IID")}
    assert mean_ranks(grid, "global_acc", "last", 2) == {
        "fedavg": [1.0, 1.0, 1.0],
        "fedprox mu=0.1": [2.0, 2.0, 2.0],
    }
    assert _cells(ranking_table(grid, last=2), "fedprox mu=0.1")[0] == "2.0 (3)"
