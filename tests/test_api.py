"""The Python API (fedpcd.api): run, RunResult, load_runs, load_index, partition and the lazy top level."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import yaml

import fedpcd
from conftest import requires_fmnist, run_records, run_summary
from fedpcd.cli import main
from fedpcd.data.datasets import load_dataset
from fedpcd.data.partition import PARTITIONERS, make_partition
from fedpcd.data.stats import count_matrix
from fedpcd.run_format import RunFiles
from fedpcd.sweep import INDEX_COLUMNS, run_sweep

TINY = {"dataset.train_fraction": 0.05, "clients": 3, "rounds": 2}  # the tiny Fashion-MNIST run
# a config whose algorithm section the override switches: as on the command line, mu must be dropped
BASE = {"algorithm": {"name": "fedprox", "mu": 0.1}, "dataset": {"name": "fmnist"}}


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
    assert fedpcd.load_config is __import__("fedpcd.config").config.load_config
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
        (None, {"algorithm__name": "fedfoo"}, "unknown algorithm 'fedfoo'; valid choices: creff"),
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
