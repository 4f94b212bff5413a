"""The Python API (fedpcd.api): run (resume, on_round), RunResult, sweep, report, load_runs, load_index,
partition, describe and the lazy top level."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from typing import Annotated

import numpy as np
import pytest
import yaml
from pydantic import Field

import fedpcd
from conftest import requires_fmnist, run_records, run_summary
from fedpcd.api import report, sweep
from fedpcd.cli import main
from fedpcd.components import _block
from fedpcd.config_identity import flatten
from fedpcd.data.datasets import load_dataset
from fedpcd.data.partition import PARTITIONERS, make_partition
from fedpcd.data.stats import count_matrix
from fedpcd.engine.rundir import RunDir
from fedpcd.run_format import RunFiles
from fedpcd.sweep.index import INDEX_COLUMNS
from fedpcd.sweep.run import run_sweep

TINY = {"dataset.train_fraction": 0.05, "clients": 3, "rounds": 2}  # the tiny Fashion-MNIST run
# a config whose algorithm section the override switches: as on the command line, mu must be dropped
BASE = {"algorithm": {"name": "fedprox", "mu": 0.1}, "dataset": {"name": "fmnist"}}
# a tiny synthetic run: 2 clients, 2 rounds, seconds
SYNTHETIC = {
    "dataset": {"name": "synthetic"},
    "model": {"name": "mlp", "hidden": 8},
    "clients": 2,
    "rounds": 2,
}
# a grid of 4 runs that differ in method and setting (the report's papers' layout)
GRID = {
    "partition": [{"scheme": "iid"}, {"scheme": "pathological", "classes_per_client": 1}],
    "algorithm": [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}],
}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same tiny run twice: through fedpcd.run (a dict and keyword overrides) and through the CLI (the
    dict as a YAML file and KEY=VALUE overrides)."""
    root = tmp_path_factory.mktemp("runs")
    result = fedpcd.run(
        BASE,
        dataset__train_fraction=0.05,
        clients=3,
        rounds=2,
        algorithm__name="fedavg",
        output_dir=str(root / "api"),
    )
    config = root / "base.yaml"
    config.write_text(yaml.safe_dump(BASE))
    argv = ["run", "--quiet", "--config", str(config), "algorithm.name=fedavg", f"output_dir={root / 'cli'}"]
    assert main(argv + [f"{k}={v}" for k, v in TINY.items()]) == 0
    return root, result


def test_import_fedpcd_loads_neither_torch_nor_pandas_nor_pydantic():
    code = "import sys, fedpcd; print(sorted({'torch', 'pandas', 'pydantic'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_name_of_all_resolves_and_version_stays():
    assert fedpcd.__version__
    for name in fedpcd.__all__:
        assert getattr(fedpcd, name) is not None and name in dir(fedpcd)
    assert fedpcd.load_config is __import__("fedpcd.resolve").resolve.load_config
    with pytest.raises(AttributeError):
        fedpcd.no_such_name  # noqa: B018


@requires_fmnist
def test_run_result_is_the_run_directory_and_matches_the_cli(runs):
    root, result = runs
    files = RunFiles(result.run_dir)
    assert result.run_dir == root / "api" and files.summary.is_file()
    assert result.config.algorithm.name == "fedavg" and result.config.algorithm.params() == {}  # mu dropped
    assert (result.config.clients, result.config.rounds, result.config.dataset.train_fraction) == (3, 2, 0.05)
    assert result.summary == json.loads(files.summary.read_text())
    # metrics: metrics.jsonl as a table, one row per evaluated round, "round" first
    records = _lines(files.metrics)
    assert result.metrics.columns[0] == "round" and set(result.metrics.columns) == set(records[0])
    assert result.metrics["round"].tolist() == [1, 2]
    table = result.metrics[list(records[0])]
    table = table.astype(object).where(table.notna(), None)  # a metric not measured in a round: NaN there
    assert [row.to_dict() for _, row in table.iterrows()] == records
    # the command line, from the same settings, computed the same run
    assert run_records(result.run_dir) == run_records(root / "cli")
    assert run_summary(result.run_dir) == run_summary(root / "cli")
    assert yaml.safe_load(files.config.read_text())["algorithm"] == {"name": "fedavg"}


@requires_fmnist
def test_run_refuses_a_finished_run_directory(runs):
    root, result = runs
    before = result.run_dir.joinpath("metrics.jsonl").read_bytes()
    with pytest.raises(fedpcd.UserError, match="already holds a run"):
        fedpcd.run(result.config)
    assert result.run_dir.joinpath("metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    ("config", "overrides", "needle"),
    [
        (None, {"rounds": 0}, "bad value for 'rounds' (0)"),
        (None, {"local__lrr": 0.1}, "unknown config key 'local.lrr'"),
        (
            None,
            {"algorithm__name": "fedfoo"},
            "unknown algorithm 'fedfoo' (did you mean 'fedproto', 'fedrod' or 'fedetf'?); valid",
        ),
        (None, {"partition__beta": 0.1, "partition": "x"}, "conflicts with the overrides of keys inside it"),
        (None, {"local____lr": 0.1}, "'__' separates nested keys"),
        ({"algorithm": {"name": "fedprox", "mu": -1}}, {}, "bad value for 'algorithm.mu'"),
        (42, {}, "config must be a YAML file path, a Config, a mapping or None, got int"),
        ("/nonexistent.yaml", {}, "config file not found: /nonexistent.yaml"),
    ],
)
def test_run_bad_input_is_one_line_before_anything_is_written(tmp_path, config, overrides, needle):
    with pytest.raises(fedpcd.UserError) as info:
        fedpcd.run(config, output_dir=str(tmp_path / "out"), **overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def _missing(value) -> bool:
    """A metric a round did not measure: NaN in a DataFrame, None in metrics.jsonl."""
    return isinstance(value, float) and value != value


@requires_fmnist
def test_load_runs_one_row_per_run_and_evaluated_round(runs):
    root, _ = runs
    frame = fedpcd.load_runs(root)
    assert frame.columns[:5].tolist() == ["run", "algorithm", "dataset", "seed", "round"]
    assert frame[["run", "round"]].values.tolist() == [["api", 1], ["api", 2], ["cli", 1], ["cli", 2]]
    assert set(frame["algorithm"]) == {"fedavg"} and set(frame["dataset"]) == {"fmnist"}
    assert set(frame["seed"]) == {0}
    for name in ("api", "cli"):
        rows = frame[frame["run"] == name]
        for record, (_, row) in zip(_lines(root / name / "metrics.jsonl"), rows.iterrows(), strict=True):
            assert {key: None if _missing(row[key]) else row[key] for key in record} == record
    single = fedpcd.load_runs(root / "api")  # a run directory itself
    assert single["run"].tolist() == [".", "."]


def test_load_runs_without_a_run_is_one_line(tmp_path):
    with pytest.raises(fedpcd.UserError, match="no finished runs"):
        fedpcd.load_runs(tmp_path)
    with pytest.raises(fedpcd.UserError, match="runs folder not found"):
        fedpcd.load_runs(tmp_path / "missing")


def test_load_index_reads_the_sweeps_index(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    out = tmp_path / "grid"
    sweep.write_text(
        yaml.safe_dump(
            {
                "dataset": {"name": "synthetic"},
                "model": {"name": "mlp", "hidden": 8},
                "clients": 2,
                "rounds": 1,
                "output_dir": str(out),
                "sweep": {"seed": [1, 0]},
            }
        )
    )
    configs = run_sweep(sweep)
    frame = fedpcd.load_index(out)
    assert frame.columns.tolist() == list(INDEX_COLUMNS)
    assert frame["output_dir"].tolist() == sorted(c.output_dir for c in configs)
    assert set(frame["status"]) == {"done"} and frame["seed"].tolist() == [0, 1]
    for _, row in frame.iterrows():
        summary = json.loads(RunFiles(row["output_dir"]).summary.read_text())
        assert row["final_ga"] == summary["final"]["global_acc"]
        assert row["best_pa"] == summary["best"]["personal_acc"]
        assert json.loads(row["config"])["output_dir"] == row["output_dir"]
    with sqlite3.connect(out / "index.sqlite") as db:
        assert len(frame) == db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert fedpcd.load_index(out / "index.sqlite").equals(frame)  # the file itself works too


def test_load_index_missing_or_damaged_is_one_line(tmp_path):
    with pytest.raises(fedpcd.UserError, match="no sweep index at"):
        fedpcd.load_index(tmp_path)
    (tmp_path / "index.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(fedpcd.UserError, match="cannot read the sweep index"):
        fedpcd.load_index(tmp_path)
    assert (tmp_path / "index.sqlite").read_bytes() == b"not a database" * 100  # read only


@requires_fmnist
def test_partition_is_the_runs_partition(runs):
    """Same labels, scheme, parameters and seed as the run: the counts of its partition.json."""
    _, result = runs
    cfg = result.config
    ds = load_dataset("fmnist", None, cfg.dataset.train_fraction, cfg.seed, False)
    parts = fedpcd.partition(
        ds.train_y, cfg.partition.scheme, cfg.clients, cfg.seed, **cfg.partition.params()
    )
    written = json.loads(RunFiles(result.run_dir).partition.read_text())
    counts = [c["train_counts"] for c in written["clients"]]
    assert count_matrix(parts, ds.train_y.numpy(), 10).tolist() == counts


LABELS = np.repeat(np.arange(10), 30)
SCHEMES = [s for s in PARTITIONERS.names() if s not in ("explicit", "natural")]  # a file; a dataset's own


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_equals_make_partition_whatever_the_test_labels(scheme):
    test = np.random.default_rng(1).permutation(np.repeat(np.arange(10), 7))
    parts = fedpcd.partition(LABELS, scheme, clients=6, seed=3)  # nid2 needs 6
    expected = make_partition(LABELS, test, 6, scheme, {}, 3).train
    assert len(parts) == 6
    for got, want in zip(parts, expected, strict=True):
        assert got.dtype == np.int64 and np.array_equal(got, want)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined) and set(joined) <= set(range(len(LABELS)))  # disjoint


def test_partition_parameters_seed_and_errors(tmp_path):
    iid = fedpcd.partition(LABELS, "iid", clients=7, seed=0)
    assert sorted(np.concatenate(iid).tolist()) == list(range(300))
    assert {len(p) for p in iid} <= {42, 43}  # 300 = 7 * 42 + 6: sizes differ by at most one
    a = fedpcd.partition(LABELS, clients=5, seed=4, beta=0.1)
    b = fedpcd.partition(LABELS.tolist(), "dirichlet", 5, 4, beta=0.1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    held = count_matrix(fedpcd.partition(LABELS, "pathological", 5, 0, classes_per_client=2), LABELS, 10)
    assert ((held > 0).sum(axis=1) == 2).all()
    path = tmp_path / "clients.json"
    path.write_text(json.dumps({"clients": [[5, 1], [0, 299]]}))
    explicit = fedpcd.partition(LABELS, "explicit", clients=2, path=path)
    assert [p.tolist() for p in explicit] == [[5, 1], [0, 299]]
    with pytest.raises(fedpcd.UserError, match="unknown parameter 'bet' for partition scheme 'dirichlet'"):
        fedpcd.partition(LABELS, bet=0.1)
    with pytest.raises(fedpcd.UserError, match="unknown partition scheme 'zigzag'; valid choices: dirichlet"):
        fedpcd.partition(LABELS, "zigzag")
    with pytest.raises(fedpcd.UserError, match="labels must lie in"):
        fedpcd.partition(LABELS, "iid", num_classes=5)


# ----- run: on_round and resume -------------------------------------------------------------------------


def test_on_round_gets_each_record_as_written_and_an_exception_stops_the_run_resumably(tmp_path):
    seen = []
    whole = fedpcd.run(SYNTHETIC, output_dir=str(tmp_path / "whole"), on_round=seen.append)
    assert seen == _lines(whole.run_dir / "metrics.jsonl") and [r["round"] for r in seen] == [1, 2]

    def stop_in_round_2(record: dict) -> None:
        if record["round"] == 2:
            raise RuntimeError("enough")

    stopped = tmp_path / "stopped"
    with pytest.raises(RuntimeError, match="enough"):
        fedpcd.run(SYNTHETIC, output_dir=str(stopped), on_round=stop_in_round_2)
    assert RunDir(stopped).load_checkpoint()["round"] == 1  # round 2's checkpoint was never written
    assert not (stopped / "summary.json").exists()
    later = []
    resumed = fedpcd.run(SYNTHETIC, output_dir=str(stopped), resume=True, on_round=later.append)
    assert [r["round"] for r in later] == [2]
    assert run_records(stopped) == run_records(whole.run_dir)  # as if it had never stopped
    assert run_summary(stopped) == run_summary(whole.run_dir)
    assert resumed.run_dir == stopped and resumed.summary == json.loads(
        (stopped / "summary.json").read_text()
    )
    assert resumed.metrics["round"].tolist() == [
        1,
        2,
    ] and resumed.config.to_dict() == whole.config.to_dict() | {"output_dir": str(stopped)}


def test_resume_takes_a_run_directory_as_the_cli_does_and_returns_a_finished_run_as_it_is(tmp_path):
    for name in ("api", "cli"):
        with pytest.raises(RuntimeError):
            fedpcd.run(SYNTHETIC, output_dir=str(tmp_path / name), on_round=_stop)
    result = fedpcd.run(tmp_path / "api", resume=True)
    assert main(["run", "--quiet", "--resume", str(tmp_path / "cli")]) == 0
    assert run_records(tmp_path / "api") == run_records(tmp_path / "cli")
    assert result.config.output_dir == str(tmp_path / "api") and result.metrics["round"].tolist() == [1, 2]
    written = (tmp_path / "api" / "metrics.jsonl").read_bytes()
    again = fedpcd.run(str(tmp_path / "api"), resume=True)  # finished: nothing runs
    assert again.summary == result.summary and (tmp_path / "api" / "metrics.jsonl").read_bytes() == written
    with pytest.raises(fedpcd.UserError, match="as written: of the overrides only rounds=N"):
        fedpcd.run(tmp_path / "api", resume=True, seed=3)
    with pytest.raises(fedpcd.UserError, match="nothing to resume"):
        fedpcd.run(tmp_path, resume=True)  # a folder that is no run


def _stop(record: dict) -> None:
    raise RuntimeError("stop after round 1")


def test_resume_starts_a_new_run_and_refuses_a_run_of_another_config(tmp_path):
    out = tmp_path / "run"
    fresh = fedpcd.run(SYNTHETIC, output_dir=str(out), resume=True)  # nothing there yet: it starts
    assert fresh.metrics["round"].tolist() == [1, 2]
    written = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(fedpcd.UserError) as info:
        fedpcd.run(SYNTHETIC, output_dir=str(out), resume=True, rounds=3, local__lr=0.5)
    message = str(info.value)
    assert "holds a run of another config (local.lr: 0.01 -> 0.5; rounds: 2 -> 3)" in message
    assert "\n" not in message
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == written  # nothing touched
    # where it lives and who watches it are not the run's settings
    same = fedpcd.run(SYNTHETIC, output_dir=str(out), resume=True, engine__workers=1)
    assert same.summary == fresh.summary
    with pytest.raises(fedpcd.UserError, match="already holds a run"):
        fedpcd.run(SYNTHETIC, output_dir=str(out))


def test_on_round_on_flower_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(fedpcd.UserError, match="a per-round callback needs backend=local"):
        fedpcd.run(SYNTHETIC, backend="flower", output_dir=str(tmp_path / "out"), on_round=print)
    assert not (tmp_path / "out").exists()


# ----- sweep, load_runs' settings and config, report ----------------------------------------------------


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The 4 runs of GRID (1 round each) through fedpcd.api.sweep, the overrides applied to each."""
    root = tmp_path_factory.mktemp("grid")
    path = root / "sweep.yaml"
    path.write_text(yaml.safe_dump({**SYNTHETIC, "output_dir": str(root / "runs"), "sweep": GRID}))
    index = sweep(path, overrides={"rounds": 1, "local.lr": 0.05, "model__hidden": 4})
    return path, root / "runs", index


def test_sweep_returns_its_index_with_the_overrides_applied(grid):
    path, runs, index = grid
    assert index.equals(fedpcd.load_index(runs)) and len(index) == 4 and set(index["status"]) == {"done"}
    for config in map(json.loads, index["config"]):
        assert (config["rounds"], config["local"]["lr"], config["model"]["hidden"]) == (1, 0.05, 4)
    written = {p: p.read_bytes() for p in runs.rglob("metrics.jsonl")}
    assert sweep(path, overrides={"rounds": 1, "local.lr": 0.05, "model__hidden": 4}).equals(index)
    assert {p: p.read_bytes() for p in runs.rglob("metrics.jsonl")} == written  # finished runs: skipped


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"jobs": 0}, "jobs must be a whole number >= 1 or 'auto', got 0"),
        ({"jobs": True}, "jobs must be a whole number >= 1 or 'auto', got True"),
        ({"overrides": ["rounds=1"]}, "overrides must be a mapping of config keys to values, got list"),
        ({"overrides": {1: 2}}, "override keys are dotted config keys (text), got 1"),
        ({"overrides": {"rounds": object()}}, "override 'rounds': object is not a config value"),
        ({"overrides": {"colour": "red"}}, "unknown config key 'colour'"),
    ],
)
def test_sweep_bad_options_are_one_line_before_any_run(tmp_path, options, needle):
    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump({**SYNTHETIC, "output_dir": str(tmp_path / "runs"), "sweep": {"seed": [0]}})
    )
    with pytest.raises(fedpcd.UserError) as info:
        sweep(path, **options)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "runs").exists()


def test_load_runs_has_the_setting_and_the_resolved_config_as_columns(grid):
    _, runs, _ = grid
    frame = fedpcd.load_runs(runs)
    assert frame.columns[:6].tolist() == ["run", "algorithm", "dataset", "seed", "round", "setting"]
    assert len(frame) == 4  # one evaluated round each
    for _, row in frame.iterrows():
        config = yaml.safe_load((runs / row["run"] / "config.yaml").read_text())
        expected = {
            ("config.clients" if key == "clients" else key): json.dumps(value)
            if isinstance(value, (list, dict))
            else value
            for key, value in flatten(config).items()
            if key != "seed"
        }
        assert {key: row[key] for key in expected} == expected
        # the settings as the report's tables name them
        assert row["setting"] == {"iid": "IID", "pathological": "P2C1"}[row["partition.scheme"]]
    assert frame["algorithm.name"].tolist() == frame["algorithm"].tolist()
    assert sorted(frame["algorithm.mu"].dropna().tolist()) == [0.1, 0.1]  # fedprox's only
    assert frame["clients"].tolist() == [[0, 1]] * 4 and set(frame["config.clients"]) == {2}
    assert set(frame["local.lr"]) == {0.05} and set(frame["model.hidden"]) == {4}
    assert frame.columns.tolist().index("global_acc") < frame.columns.tolist().index("dataset.name")
    table = frame.groupby(["setting", "algorithm"])["global_acc"].mean()  # what the columns are for
    assert table.index.tolist() == [
        ("IID", "fedavg"),
        ("IID", "fedprox"),
        ("P2C1", "fedavg"),
        ("P2C1", "fedprox"),
    ]


def test_report_returns_the_tables_and_writes_the_files_of_fedpcd_report(grid, tmp_path):
    _, runs, _ = grid
    result = report(runs, out=tmp_path / "api", paired_with="fedavg", last=1)
    argv = ["report", str(runs), "--out", str(tmp_path / "cli"), "--paired-with", "fedavg", "--last", "1"]
    assert main(argv) == 0
    assert result.markdown == (tmp_path / "api" / "report.md").read_text()
    assert result.markdown == (tmp_path / "cli" / "report.md").read_text()

    def files(folder):
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    assert files(tmp_path / "api") == files(tmp_path / "cli") and "report.md" in files(tmp_path / "api")
    headings = [line[3:] for line in result.markdown.splitlines() if line.startswith("## ")]
    tabled = [h for h in headings if h in result.tables]
    assert list(result.tables) == tabled and "All runs" in tabled  # every table, keyed by its heading
    assert "GA (%), mean of the last 1 evaluated round" in tabled
    ga = result.tables["GA (%), mean of the last 1 evaluated round"]
    assert ga.columns.tolist() == ["method", "IID", "P2C1"] and ga["method"].tolist() == [
        "fedavg",
        "fedprox mu=0.1",
    ]
    runs_table = result.tables["All runs"]
    markdown_rows = [
        line for line in result.markdown.split("## All runs")[1].splitlines() if line.startswith("|")
    ]
    assert runs_table.columns.tolist() == [c.strip() for c in markdown_rows[0].strip("|").split("|")]
    assert len(runs_table) == len(markdown_rows) - 2 == 4
    assert runs_table["seeds"].tolist() == [1, 1, 1, 1] and runs_table["rounds"].dtype.kind == "i"
    # one seed per row: GA is a number (the run's last GA in %); the pivot tables' cells as in the markdown
    ga_runs = fedpcd.load_runs(runs).set_index(["algorithm", "partition.scheme"])["global_acc"]
    for _, row in runs_table.iterrows():
        name, scheme = row["algorithm"].split()[0], row["partition"].split()[0]
        assert row["GA"] == round(100 * ga_runs[(name, scheme)], 2)
        assert (
            f"{row['GA']:.2f}"
            in ga.set_index("method").loc[row["algorithm"], {"iid": "IID"}.get(scheme, "P2C1")]
        )
    # without out: the same tables (the markdown without the figures' sections), nothing written
    alone = report(runs, paired_with="fedavg", last=1)
    assert list(alone.tables) == list(result.tables)
    assert all(alone.tables[key].equals(table) for key, table in result.tables.items())
    assert not any(p.name in ("report.md", "curves.png") for p in runs.rglob("*"))


def test_report_single_layout_options_and_bad_options(grid, tmp_path):
    _, runs, _ = grid
    one = runs / sorted(p.name for p in runs.iterdir() if p.is_dir())[0]
    plain, swing = report(one, last=1), report(one, last=1, swing=True, best=True)
    assert list(plain.tables) == list(swing.tables) == ["All runs"] and len(plain.tables["All runs"]) == 1
    added = [c for c in swing.tables["All runs"].columns if c not in plain.tables["All runs"].columns]
    assert added == ["GA swing", "GA best"]
    assert swing.tables["All runs"]["GA swing"].isna().all()  # "-": one round has no swing
    assert (
        swing.tables["All runs"]["GA best"].tolist() == plain.tables["All runs"]["GA"].tolist()
    )  # one round
    for options, needle in [
        ({"last": 0}, "last must be a whole number >= 1, got 0"),
        ({"rounds_to": ["x"]}, "rounds_to must be a list of accuracies in %"),
    ]:
        with pytest.raises(fedpcd.UserError, match=needle):
            report(runs, **options)
    with pytest.raises(fedpcd.UserError, match="no finished runs"):
        report(tmp_path)


# ----- describe: the description column -----------------------------------------------------------------


def _toy_model(
    in_channels: int,
    num_classes: int,
    image_size: int,
    *,
    width: Annotated[int, Field(ge=1, description="Hidden units of the one layer.")] = 4,
    bias: bool = True,
):
    """A toy model (Doe et al., 2024)."""


def test_described_parameters_get_a_description_column_and_the_others_none():
    assert _block("model", "toy", _toy_model).splitlines() == [
        "model toy (test_api._toy_model)",
        "paper: Doe et al., 2024",
        "description: A toy model (Doe et al., 2024).",
        "parameters (set as model.<parameter>=<value>):",
        "parameter  type      default  description",
        "---------  --------  -------  ------------------------------",
        "width      int >= 1  4        Hidden units of the one layer.",
        "bias       bool      true     -",
    ]
    assert "description" not in fedpcd.describe("mlp").split("parameters (")[1]  # none declared: no column
