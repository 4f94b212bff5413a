"""Reading the files a user hands in and a run's files: bounded reads (FIFOs and devices refused by kind, a
size limit), no link followed in a run or sweep folder, and a value schema for summary.json, metrics.jsonl
and the sweep index (one line naming the file, line and field)."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
import yaml

from conftest import TINY, cli_main, one_error_line
from fedpcd import api
from fedpcd.errors import UserError
from fedpcd.resolve import load_config
from fedpcd.run_read import read_metrics, read_summary
from fedpcd.run_schema import MAX_ROUNDS, Record, Summary, check
from fedpcd.utils import read_user_bytes, read_user_text


def _finished_run(folder: Path, seed: int = 0) -> Path:
    """A finished 2-round run directory written by hand (no training)."""
    folder.mkdir(parents=True)
    cfg = load_config(None, ["dataset.name=synthetic", "model.name=mlp", "rounds=2", f"seed={seed}"])
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    records = [{"round": r, "global_acc": 0.4 + r / 10, "personal_acc": 0.5} for r in (1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"rounds": 2, "wall_s": 1.0}))
    return folder


def test_a_fifo_is_refused_by_kind_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(
        UserError, match=r"^config file .*pipe\.yaml is a FIFO \(named pipe\); give a regular file$"
    ):
        read_user_text(fifo, "config file")


def test_a_device_is_refused_by_kind_and_a_large_file_by_size(tmp_path):
    with pytest.raises(
        UserError, match=r"^partition file /dev/zero is a character device; give a regular file$"
    ):
        read_user_bytes("/dev/zero", "partition file")
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(10_000)  # sparse: its size says it all
    with pytest.raises(UserError, match=r"^partition file .*big\.json is over 1000 bytes; keep it small$"):
        read_user_bytes(big, "partition file", limit=1000, hint="keep it small")
    assert read_user_bytes(big, "partition file", limit=10_000) == b"\0" * 10_000  # at the limit: read


def test_config_and_partition_files_that_are_not_regular_files_are_one_line_through_the_cli(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    line = one_error_line(cli_main(["config", "show", "--config", "/dev/zero"]))
    assert line == "fedpcd: error: config file /dev/zero is a character device; give a regular file"
    line = one_error_line(cli_main(["config", "show", "--config", str(fifo)]))
    assert line == f"fedpcd: error: config file {fifo} is a FIFO (named pipe); give a regular file"
    argv = ["partition", *TINY, "partition.scheme=explicit", "partition.path=/dev/zero"]
    line = one_error_line(cli_main(argv))
    assert line.endswith("/dev/zero is a character device; give a regular file"), line


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "config.yaml"])
def test_a_run_file_that_is_a_link_is_refused_not_read(tmp_path, name):
    other = _finished_run(tmp_path / "other" / "b", seed=1)
    run = _finished_run(tmp_path / "runs" / "a")
    (run / name).unlink()
    (run / name).symlink_to(other / name)
    line = one_error_line(cli_main(["report", str(tmp_path / "runs")]))
    assert line.endswith(
        f"{run / name} is a symbolic link; fedpcd never follows links in a run or sweep folder: replace it "
        "with the real file"
    ), line


@pytest.mark.parametrize(
    ("summary", "needle"),
    [
        ({"rounds": 1e30, "wall_s": 1.0}, "'rounds' must be a whole number, got 1e+30"),
        (
            {"rounds": MAX_ROUNDS + 1, "wall_s": 1.0},
            f"'rounds' must be <= {MAX_ROUNDS}, got {MAX_ROUNDS + 1}",
        ),
        ({"rounds": 2, "wall_s": float("inf")}, "'wall_s' must be a finite number, got inf"),
        ({"rounds": 2, "wall_s": -1.0}, "'wall_s' must be >= 0.0, got -1.0"),
        (
            {"rounds": 2, "wall_s": 1, "final": {"global_acc": "abc"}},
            "'final.global_acc' must be a number, got 'abc'",
        ),
        (
            {"rounds": 2, "wall_s": 1, "best": {"global_acc": 1.5}},
            "'best.global_acc' must be <= 1.0, got 1.5",
        ),
    ],
)
def test_a_summary_out_of_its_schema_is_one_line_naming_the_file_and_field(tmp_path, summary, needle):
    run = _finished_run(tmp_path / "runs" / "a")
    (run / "summary.json").write_text(json.dumps(summary))  # Python writes inf as Infinity
    with pytest.raises(UserError) as caught:
        read_summary(run / "summary.json")
    assert str(caught.value) == f"summary file {run}/summary.json is not a fedpcd summary: {needle}"
    line = one_error_line(cli_main(["report", str(tmp_path / "runs")]))
    assert line == f"fedpcd: error: summary file {run}/summary.json is not a fedpcd summary: {needle}"


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"round": 2, "global_acc": NaN}', "'global_acc' must be a finite number, got nan"),
        ('{"round": 2, "global_class_acc": [0.5, -0.1]}', "'global_class_acc[1]' must be >= 0.0, got -0.1"),
        ('{"round": -1}', "'round' must be >= 0, got -1"),
        ('{"round": 2, "bytes_up": Infinity}', "'bytes_up' must be a finite number, got inf"),
    ],
)
def test_a_metrics_line_out_of_its_schema_is_one_line_naming_the_line_and_field(tmp_path, line, needle):
    run = _finished_run(tmp_path / "runs" / "a")
    first = (run / "metrics.jsonl").read_text().splitlines()[0]
    (run / "metrics.jsonl").write_text(f"{first}\n{line}\n")
    with pytest.raises(UserError) as caught:
        read_metrics(run / "metrics.jsonl")
    assert str(caught.value) == f"metrics file {run}/metrics.jsonl line 2: {needle}"


def test_the_schemas_admit_what_the_engine_writes():
    record = {"round": 3, "global_acc": 1, "personal_acc": None, "global_class_acc": [0.0, None, 1.0]}
    assert check(Record, record, "r") is record
    summary = {"rounds": 3, "wall_s": 0, "final": {"global_acc": 0.5}, "best": {"pa_l": None}, "x": "kept"}
    assert check(Summary, summary, "s") is summary
    with pytest.raises(UserError, match=r"^r: expected a JSON object, got list$"):
        check(Record, [record], "r")


def test_a_sweep_index_row_out_of_its_schema_is_one_line(tmp_path):
    from fedpcd.sweep.index import INDEX_COLUMNS, INDEX_FILE

    index = tmp_path / INDEX_FILE
    columns = ", ".join(f"{name} {kind}" for name, kind in INDEX_COLUMNS.items())
    row = dict.fromkeys(INDEX_COLUMNS)
    row.update(output_dir="runs/a", status="done", rounds=2, final_ga=0.5)
    with sqlite3.connect(index) as db:
        db.execute(f"CREATE TABLE runs ({columns})")
        db.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(row))})", list(row.values()))
    assert api.load_index(tmp_path)["final_ga"].tolist() == [0.5]
    with sqlite3.connect(index) as db:
        db.execute("UPDATE runs SET final_ga = 7.0")
    with pytest.raises(
        UserError, match=rf"^sweep index {index} row 'runs/a': 'final_ga' must be <= 1.0, got 7.0$"
    ):
        api.load_index(tmp_path)
