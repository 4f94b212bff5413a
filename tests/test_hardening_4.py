"""Hardening, round 4: bounded reads of every file a user hands in (FIFOs and devices refused by kind, a size
limit), no link followed when reading a run or sweep folder, a value schema for the run files a reader loads,
a bounded sweep grid, control characters escaped on the terminal, every terminal stop signal handled as
Ctrl-C, and a sweep that survives a dead worker. CLI cases run the real command line in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import fedpcd
from fedpcd import api
from fedpcd.config import load_config
from fedpcd.errors import STOP_SIGNALS, UserError
from fedpcd.report import read_metrics, read_summary
from fedpcd.run_schema import MAX_ROUNDS, Record, Summary, check
from fedpcd.sweep import MAX_RUNS, expand_sweep
from fedpcd.utils import read_user_bytes, read_user_text, show_text

SRC = str(Path(fedpcd.__file__).resolve().parents[1])  # this checkout's package, for the subprocesses
TINY = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "local.batch_size=32", "clients=2"]


def _cli(argv: list[str], timeout: float = 120, **popen: object) -> subprocess.CompletedProcess[str]:
    """The real command line, ``fedpcd ARGV``, to its end."""
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **popen,
    )


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The command failed with exit code 2 and exactly one 'fedpcd: error:' line on stderr."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpcd: error: "), proc.stderr
    return lines[0]


def _finished_run(folder: Path, seed: int = 0) -> Path:
    """A finished 2-round run directory written by hand (no training)."""
    folder.mkdir(parents=True)
    cfg = load_config(None, ["dataset.name=synthetic", "model.name=mlp", "rounds=2", f"seed={seed}"])
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    records = [{"round": r, "global_acc": 0.4 + r / 10, "personal_acc": 0.5} for r in (1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"rounds": 2, "wall_s": 1.0}))
    return folder


# ----- 4. bounded reads: one helper for every file a user hands in ------------------------------------------


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
    line = _one_error_line(_cli(["config", "show", "--config", "/dev/zero"], timeout=60))
    assert line == "fedpcd: error: config file /dev/zero is a character device; give a regular file"
    line = _one_error_line(_cli(["config", "show", "--config", str(fifo)], timeout=60))
    assert line == f"fedpcd: error: config file {fifo} is a FIFO (named pipe); give a regular file"
    argv = ["partition", *TINY, "partition.scheme=explicit", "partition.path=/dev/zero"]
    line = _one_error_line(_cli(argv, timeout=120))
    assert line.endswith("/dev/zero is a character device; give a regular file"), line


# ----- 7. readers never follow a link in a run or sweep folder ----------------------------------------------


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "config.yaml"])
def test_a_run_file_that_is_a_link_is_refused_not_read(tmp_path, name):
    other = _finished_run(tmp_path / "other" / "b", seed=1)
    run = _finished_run(tmp_path / "runs" / "a")
    (run / name).unlink()
    (run / name).symlink_to(other / name)
    line = _one_error_line(_cli(["report", str(tmp_path / "runs")], timeout=60))
    assert line.endswith(
        f"{run / name} is a symbolic link; fedpcd never follows links in a run or sweep folder: replace it "
        "with the real file"
    ), line


# ----- 8. a value schema for what a reader loads ------------------------------------------------------------


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
    line = _one_error_line(_cli(["report", str(tmp_path / "runs")], timeout=60))
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
    from fedpcd.sweep import INDEX_COLUMNS, INDEX_FILE

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


# ----- 3. a bounded sweep grid ------------------------------------------------------------------------------


def test_a_sweep_grid_over_the_limit_is_counted_and_refused_before_it_is_built(tmp_path):
    sweep = {"output_dir": str(tmp_path / "s"), "sweep": {f"a{i}": list(range(100)) for i in range(4)}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    start = time.monotonic()
    line = _one_error_line(_cli(["sweep", "--config", str(path), "--dry-run"], timeout=60))
    assert time.monotonic() - start < 30  # 10^8 configs would take hours
    assert line == (
        f"fedpcd: error: the sweep in {path} has 100,000,000 runs (100 a0 x 100 a1 x 100 a2 x 100 a3), over "
        f"the limit of {MAX_RUNS:,}; split it into several sweep files"
    )


def test_a_sweep_grid_at_the_limit_is_not_refused_by_the_count(tmp_path, monkeypatch):
    import fedpcd.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "MAX_RUNS", 4)
    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path / "s"), "sweep": {"seed": [0, 1], "rounds": [1, 2]}})
    )
    assert len(expand_sweep(path, TINY)) == 4
    path.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path / "s"), "sweep": {"seed": [0, 1, 2], "rounds": [1, 2]}})
    )
    with pytest.raises(UserError, match=r"has 6 runs \(2 rounds x 3 seed\), over the limit of 4;"):
        expand_sweep(path, TINY)


# ----- 9. control characters are escaped on the terminal ----------------------------------------------------


def test_show_text_escapes_every_control_character_and_keeps_printable_text():
    assert show_text("runs/ä b") == "runs/ä b"
    assert show_text("a\x1b[31mred\nb\r\u202e") == "a\\x1b[31mred\\nb\\r\\u202e"
    assert show_text(ValueError("x\ty")) == "x\\ty"


def test_an_output_dir_with_an_escape_sequence_is_printed_escaped(tmp_path):
    out = tmp_path / "a\x1b[2Jb"
    proc = _cli(["run", "--quiet", *TINY, "rounds=1", f"output_dir={out}"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x1b" not in proc.stderr
    assert f"run directory: {tmp_path}/a\\x1b[2Jb  (" in proc.stdout
    line = _one_error_line(_cli(["run", "--quiet", *TINY, "rounds=1", f"output_dir={out}"], timeout=180))
    assert "\x1b" not in line and "a\\x1b[2Jb" in line  # already holds a run: the error line is escaped too


# ----- 5. every signal that ends a process at a terminal, handled as Ctrl-C ---------------------------------


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_each_stop_signal_ends_a_run_with_one_line_its_lock_released(tmp_path, sig):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC}
    argv = ["run", "--quiet", *TINY, "rounds=100000", "engine.checkpoint_every=1", f"output_dir={out}"]
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedpcd.cli", *argv], stdout=subprocess.DEVNULL, stderr=err, env=env
        )
    try:
        while (
            proc.poll() is None and not (out / "metrics.jsonl").exists() or not _lines(out / "metrics.jsonl")
        ):
            time.sleep(0.1)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "err").read_text().splitlines() == [
        f"fedpcd: interrupted (resume with: fedpcd run --resume {out})"
    ]
    assert (out / ".lock").read_text() == ""  # released (a holder that dies leaves its pid there)


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


# ----- 6. SIGKILL during start-up: the folder restarts, no temp file stays ----------------------------------

_KILL_AT = """
import os, signal, sys
import fedpcd.engine.rounds, fedpcd.utils
from fedpcd.cli import main
at = sys.argv[1]
if at == "data":  # while the data loads, before any run file is written
    fedpcd.engine.rounds.build_federation = lambda config: os.kill(os.getpid(), signal.SIGKILL)
else:  # between writing a run file's temp file and renaming it into place
    replace = os.replace
    def killing(src, dst):
        if str(dst).endswith(at):
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst)
    fedpcd.utils.os.replace = killing
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("at", ["data", "config.yaml", "partition.json"])
def test_a_run_killed_during_start_up_restarts_as_readme_says(tmp_path, at):
    ref, out = tmp_path / "ref", tmp_path / "out"
    argv = ["run", "--quiet", *TINY, "rounds=1"]
    assert _cli([*argv, f"output_dir={ref}"], timeout=180).returncode == 0
    env = {**os.environ, "PYTHONPATH": SRC}
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AT, at, *argv, f"output_dir={out}"],
        capture_output=True,
        env=env,
        timeout=180,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    if at == "partition.json":  # config.yaml is in place: the resume restarts it from round 0
        again = _cli(["run", "--quiet", "--resume", str(out)], timeout=180)
    else:  # nothing to resume: the resume says so in one line, and the same command starts it again
        line = _one_error_line(_cli(["run", "--quiet", "--resume", str(out)], timeout=60))
        assert line == (
            f"fedpcd: error: {out} was stopped before its run started (no config.yaml yet): start it again "
            "with the same fedpcd run command (same config and output_dir)"
        )
        again = _cli([*argv, f"output_dir={out}"], timeout=180)
    assert again.returncode == 0, again.stderr
    assert _without_wall(out) == _without_wall(ref)
    assert not [p.name for p in out.rglob("*.tmp")]


def _without_wall(run: Path) -> list[dict[str, object]]:
    """A run's metrics.jsonl records without their wall times (the rest is bitwise reproducible)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in records]


# ----- 2. a dead sweep worker: its run retried once on a fresh worker, then failed; the sweep goes on ----


def _sweep_file(tmp_path: Path, rounds: int) -> Path:
    path = tmp_path / "sweep.yaml"
    base = {"output_dir": str(tmp_path / "s"), "rounds": rounds, "engine": {"checkpoint_every": 1}}
    path.write_text(yaml.safe_dump({**base, "sweep": {"seed": [0, 1]}}))
    return path


def test_a_sweep_worker_killed_mid_run_is_retried_on_a_fresh_worker(tmp_path):
    from fedpcd.flower import procs

    path = _sweep_file(tmp_path, rounds=30)
    env = {**os.environ, "PYTHONPATH": SRC}
    argv = [sys.executable, "-m", "fedpcd.cli", "sweep", "--config", str(path), "--jobs", "2", *TINY]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
    try:
        metrics = tmp_path / "s" / "seed0" / "metrics.jsonl"
        while proc.poll() is None and _lines(metrics) < 1:
            time.sleep(0.1)
        holder = int((tmp_path / "s" / "seed0" / ".lock").read_text())  # the worker running seed0
        assert holder in {p[0] for p in procs.descendants(proc.pid)}
        os.kill(holder, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert f"retry {tmp_path / 's' / 'seed0'}: its worker process died; once more" in stdout
    assert "Traceback" not in stderr and "sweep: all 2 runs finished" in stdout
    assert all((tmp_path / "s" / f"seed{i}" / "summary.json").is_file() for i in (0, 1))


_WORKER_ONLY_KILL = """
import multiprocessing, os, signal
if multiprocessing.parent_process() is not None:  # a sweep's worker process only
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _plugin(site: Path, code: str) -> None:
    """An installed plugin (a dist-info with its entry point, and its module) in the folder ``site``."""
    info = site / "fedpcd_exit-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Name: fedpcd-exit\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedpcd.models]\nexit = fedpcd_exit\n")
    (site / "fedpcd_exit.py").write_text(code)


def test_a_plugin_that_kills_every_worker_fails_its_runs_with_a_one_line_summary(tmp_path):
    site = tmp_path / "site"
    _plugin(site, _WORKER_ONLY_KILL)
    path = _sweep_file(tmp_path, rounds=1)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{site}"}
    proc = subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", "sweep", "--config", str(path), "--jobs", "2", *TINY],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("its worker process died; once more") == 2
    failed = [line for line in proc.stderr.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 2 and all(
        line.endswith("(killed, or code in it ended the process)") for line in failed
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fedpcd: error: ")]
    assert len(errors) == 1 and errors[0].startswith("fedpcd: error: sweep: 2 of 2 runs failed, 0 finished")


# ----- 10. a plugin that ends the process at import ---------------------------------------------------------


def test_a_plugin_calling_os_exit_at_import_is_a_failed_plugin_not_a_silent_exit_0(tmp_path):
    site = tmp_path / "site"
    _plugin(site, "import os\nos._exit(0)\n")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{site}"}
    proc = subprocess.run(
        [sys.executable, "-m", "fedpcd.cli", "run", *TINY, "rounds=1", f"output_dir={tmp_path / 'r'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert _one_error_line(proc) == (
        "fedpcd: error: plugin 'exit' (fedpcd.models = fedpcd_exit from fedpcd-exit) failed to load: "
        "PluginExit: it called os._exit(0) while imported"
    )


# ----- partition.json is part of what a checkpoint vouches for ----------------------------------------------


def test_a_partition_json_changed_since_the_checkpoint_is_refused_at_resume(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--quiet", *TINY, "rounds=1", "engine.checkpoint_every=1", f"output_dir={out}"]
    assert _cli(argv, timeout=180).returncode == 0
    more = ["run", "--quiet", "--resume", str(out), "--allow-config-change", "rounds"]
    config = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(config.replace("rounds: 1\n", "rounds: 2\n"))
    partition = json.loads((out / "partition.json").read_text())
    (out / "partition.json").write_text(json.dumps(partition, indent=1))  # same data, other bytes: changed
    line = _one_error_line(_cli(more, timeout=120))
    assert line == (
        f"fedpcd: error: {out}/partition.json changed since the checkpoint (its SHA-256 differs): a run "
        "cannot go on with another partition; restore the file or start a new run"
    )
    (out / "partition.json").write_text(json.dumps(partition))  # as the run wrote it: it goes on
    assert _cli(more, timeout=180).returncode == 0
    assert [r["round"] for r in _without_wall(out)] == [1, 2]


# ----- found by benchmarks/chaos.py: shared memory that cannot grow is one line, not a traceback -----------


def test_a_shared_memory_file_that_cannot_grow_is_one_line():
    from fedpcd.procs_guard import out_of_memory_line

    exc = RuntimeError(
        "unable to resize file </torch_7499_2285932653_4> to the right size: File too large (27)"
    )
    line = out_of_memory_line(exc)
    assert line is not None and line.startswith(
        "out of shared memory: tensors sent to worker processes did not fit in /dev/shm (full, or over the "
        "file size limit, ulimit -f); free space there, or make the run smaller"
    )
    assert out_of_memory_line(RuntimeError("unable to open file")) is None


def test_a_pool_worker_starts_with_ctrl_c_ignored_and_this_process_keeps_its_handler():
    """Found by benchmarks/chaos.py: a terminal's Ctrl-C while a pool worker still imported torch printed its
    KeyboardInterrupt traceback. Workers started inside ``children_ignore_ctrl_c`` start with SIGINT ignored
    (their initializer then says what Ctrl-C does there)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from fedpcd.procs_guard import children_ignore_ctrl_c

    before = signal.getsignal(signal.SIGINT)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        with children_ignore_ctrl_c():
            future = pool.submit(signal.getsignal, signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before
        assert future.result(timeout=60) == signal.SIG_IGN


# ----- also seen: a pool worker left a zombie after it ended -----------------------------------------------


def test_no_worker_process_is_left_after_a_workers_2_run_returns_not_even_a_zombie(tmp_path):
    import psutil

    from fedpcd.engine.simulation import run_local

    config = load_config(None, [*TINY, "clients=4", "rounds=2", "engine.workers=2", f"output_dir={tmp_path}"])
    run_local(config, progress=False)
    left = {}
    for child in psutil.Process().children(recursive=True):
        try:
            left[child.pid] = (child.status(), " ".join(child.cmdline()))
        except psutil.ZombieProcess:
            left[child.pid] = (psutil.STATUS_ZOMBIE, "")
        except psutil.NoSuchProcess:  # gone, and reaped
            continue
    # multiprocessing's resource tracker lives as long as this process; no worker, live or zombie, is left
    assert not [pid for pid, (_, cmd) in left.items() if "resource_tracker" not in cmd], left
