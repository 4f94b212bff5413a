"""Reliability: checkpoints and resume (SIGKILL at random moments), weights_only loading, the
divergence guard, client failures, the run-directory lock, overwrite protection, input validation."""

from __future__ import annotations

import json
import math
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_records, run_summary
from fedpcd.algorithms import ALGORITHMS, FedAvg
from fedpcd.backends import resume_run, run_experiment
from fedpcd.cli import main
from fedpcd.engine.records import record_line
from fedpcd.engine.rundir import RunDir
from fedpcd.errors import DivergenceError, UserError
from fedpcd.resolve import load_config
from fedpcd.run_format import code_version
from fedpcd.run_read import read_metrics
from fedpcd.sweep.status import run_status

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=50"]
# per-algorithm settings that keep a 2-round run short (defaults sized for real data)
FAST = {
    "creff": ["algorithm.retrain_epochs=2", "algorithm.feats_per_class=5"],
    "fedetf": ["algorithm.finetune_rounds=1"],
    "fedkd": ["algorithm.shared_model=mlp"],
    "fml": ["algorithm.shared_model=mlp"],
    "fedbn": ["model.name=mlp_bn"],  # FedBN needs BatchNorm layers
}


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_config(None, [*SMALL, *extra, f"output_dir={tmp_path / name}"])


def _interrupt_in_round(monkeypatch, rnd: int) -> None:
    """Make the next run die (KeyboardInterrupt) writing round ``rnd``'s record, before its checkpoint."""
    original = RunDir.append

    def append(self, record):
        if record["round"] == rnd:
            monkeypatch.setattr(RunDir, "append", original)
            raise KeyboardInterrupt
        original(self, record)

    monkeypatch.setattr(RunDir, "append", append)


# ----- checkpoints and resume ---------------------------------------------------------------------


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "fedpcd.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def test_sigkill_at_random_moments_then_resume_matches_uninterrupted(tmp_path):
    """Acceptance: a run SIGKILLed three times at random moments (right after its directory appeared, before
    the first checkpoint; then inside random rounds, between checkpoints every 2 rounds) and resumed each
    time ends with the metrics.jsonl and summary of an uninterrupted run."""
    args = [*SMALL, "clients=4", "rounds=20", "local.epochs=2", "local.batch_size=10"]
    args += ["engine.checkpoint_every=2"]  # rounds after the last checkpoint are recomputed on resume
    assert main(["run", "--quiet", *args, f"output_dir={tmp_path / 'full'}"]) == 0
    cut = tmp_path / "cut"
    rng = random.Random(22)
    kills = []
    for attempt in range(3):
        started = (cut / "config.yaml").exists()  # else killed before it existed: start again
        proc = _cli("run", "--quiet", *(["--resume", str(cut)] if started else [*args, f"output_dir={cut}"]))
        end = time.monotonic() + 60
        if attempt == 0:  # just after the run directory appeared: before the first checkpoint
            while not (cut / "config.yaml").exists() and proc.poll() is None and time.monotonic() < end:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.05))
        else:  # at a random moment of a round a few rounds on
            target = _lines(cut / "metrics.jsonl") + rng.randint(1, 3)
            while _lines(cut / "metrics.jsonl") < target and proc.poll() is None and time.monotonic() < end:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.1))
        if proc.poll() is None:
            proc.kill()  # SIGKILL: no handler, no cleanup
            kills.append(_lines(cut / "metrics.jsonl"))
        proc.wait()
        assert proc.returncode in (0, -9), proc.stderr.read().decode()
        proc.stderr.close()
    assert len(kills) >= 2 and max(kills) < 20, kills
    again = ["--resume", str(cut)] if (cut / "config.yaml").exists() else [*args, f"output_dir={cut}"]
    assert main(["run", "--quiet", *again]) == 0
    assert run_records(cut) == run_records(tmp_path / "full")
    assert run_summary(cut) == run_summary(tmp_path / "full")
    assert not list((cut / "checkpoint").glob(".state.pt.*"))  # no temp file of a killed write is left


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_checkpoint_loads_weights_only_and_resumes_identically(tmp_path, monkeypatch, name):
    """Server and client states of every registered algorithm load with torch.load(weights_only=True), and
    a run cut in round 2 (after round 1's checkpoint) resumes to the uninterrupted run's metrics."""
    args = ["clients=3", "rounds=2", "participation=0.67", f"algorithm.name={name}", *FAST.get(name, [])]
    run_experiment(_cfg(tmp_path, "full", *args), progress=False)
    ckpt = torch.load(tmp_path / "full" / "checkpoint" / "state.pt", weights_only=True)
    assert ckpt["round"] == 2 and set(ckpt) >= {"server", "client_states", "metrics", "rng"}
    _interrupt_in_round(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(tmp_path, "cut", *args), progress=False)
    assert RunDir(tmp_path / "cut").load_checkpoint()["round"] == 1
    resume_run(tmp_path / "cut", progress=False)
    assert run_records(tmp_path / "cut") == run_records(tmp_path / "full")


class _Payload:
    """An object whose unpickling would run code: what a hostile checkpoint would hold."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/fedpcd-pwned",))


def test_foreign_checkpoint_never_runs_code(tmp_path, capsys):
    run_experiment(_cfg(tmp_path, "run", "clients=2", "rounds=1"), progress=False)
    (tmp_path / "run" / "summary.json").unlink()  # looks interrupted: --resume loads the checkpoint
    state = {"round": 1, "server": {"x": _Payload()}, "client_states": {}}
    torch.save(state, tmp_path / "run" / "checkpoint" / "state.pt")
    Path("/tmp/fedpcd-pwned").unlink(missing_ok=True)
    assert main(["run", "--resume", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot load checkpoint" in err and "never code" in err and "Traceback" not in err
    assert not Path("/tmp/fedpcd-pwned").exists()
    # report --geometry reads checkpoints through the same loader
    from fedpcd.engine import load_finished

    with pytest.raises(UserError, match="cannot load checkpoint"):
        load_finished(tmp_path / "run")
    assert not Path("/tmp/fedpcd-pwned").exists()


def test_killed_before_first_checkpoint_restarts_from_round_0(tmp_path, monkeypatch):
    """A run killed before its first checkpoint can be resumed (from round 0, with its config.yaml), and
    the sweep resumes such a run instead of skipping it."""
    args = ["clients=3", "rounds=2"]
    run_experiment(_cfg(tmp_path, "full", *args), progress=False)
    _interrupt_in_round(monkeypatch, 1)
    cfg = _cfg(tmp_path, "cut", *args)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, progress=False)
    assert not RunDir(tmp_path / "cut").checkpoint.exists() and (tmp_path / "cut" / "config.yaml").exists()
    assert run_status(cfg) == "resume"
    resume_run(tmp_path / "cut", progress=False)
    assert run_records(tmp_path / "cut") == run_records(tmp_path / "full")
    assert run_status(cfg) == "done"
    # a finished run is not run again by --resume: its summary is returned as it is
    assert resume_run(tmp_path / "cut", progress=False) == json.loads(
        (tmp_path / "cut/summary.json").read_text()
    )


def test_torn_metrics_line_on_resume(tmp_path, monkeypatch):
    args = ["clients=3", "rounds=3"]
    run_experiment(_cfg(tmp_path, "full", *args), progress=False)
    _interrupt_in_round(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(tmp_path, "cut", *args), progress=False)
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "global_acc": 0.1')  # a write cut short by a kill
    assert (
        len(read_metrics(tmp_path / "cut" / "metrics.jsonl", resuming=True)) == 2
    )  # the torn line is ignored
    resume_run(tmp_path / "cut", progress=False)
    assert run_records(tmp_path / "cut") == run_records(tmp_path / "full")


def test_corrupt_metrics_line_is_a_user_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\nnot json\n{"round": 2}\n')
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        read_metrics(path, resuming=True)


def test_run_files_honour_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        run_experiment(_cfg(tmp_path, "run", "clients=2", "rounds=1"), progress=False)
    finally:
        os.umask(old)
    for name in ["config.yaml", "partition.json", "metrics.jsonl", "summary.json", "checkpoint/state.pt"]:
        assert stat.S_IMODE((tmp_path / "run" / name).stat().st_mode) == 0o640, name


# ----- the divergence guard -----------------------------------------------------------------------


SEQ = [*SMALL, "engine.executor=sequential"]  # the injections below patch FedAvg.local_update


def _poison(monkeypatch, client: int, rnd: int, how: str = "loss") -> None:
    """Client ``client`` in round ``rnd``: a NaN train loss ('loss'), NaN weights ('weights'), an exception
    ('raise'), or NaN weights and then an exception (an SVD of NaN, as in FedKD: 'svd'). Runs that use it
    pin the sequential executor (the vectorized one does not call local_update)."""
    original = FedAvg.local_update

    def local_update(self, model, data, work):
        if data.id == client and work.round == rnd:
            if how == "raise":
                raise ValueError("injected failure")
            if how == "svd":
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))
                raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        reply, state = original(self, model, data, work)
        if data.id == client and work.round == rnd:
            if how == "loss":
                reply["train_loss"] = float("nan")
            else:
                key = next(iter(reply["model"]))
                reply["model"][key] = torch.full_like(reply["model"][key], float("inf"))
        return reply, state

    monkeypatch.setattr(FedAvg, "local_update", local_update)


@pytest.mark.parametrize(
    ("args", "rates"),
    [
        (["algorithm.name=fedavg"], "local.lr (now 0.01)"),
        (["algorithm.name=pfedme"], "local.lr (now 0.01) or algorithm.personal_lr (now 0.1)"),
        (["algorithm.name=ditto", "local.lr=0.05"], "local.lr (now 0.05)"),
    ],
)
def test_the_divergence_hint_names_the_algorithms_own_learning_rates(args, rates):
    """pFedMe's inner steps run at its personal_lr: a divergence says to lower that too."""
    from fedpcd.engine.guard import _fix_hint

    hint = _fix_hint(load_config(None, ["local.lr=0.01", *args]))
    assert hint.startswith(f"lower {rates}, set local.grad_clip (e.g. 10) or set engine.on_divergence=drop")


@pytest.mark.parametrize("how", ["loss", "weights", "svd"])
def test_injected_nan_stops_the_run_naming_round_client_and_algorithm(tmp_path, monkeypatch, capsys, how):
    _poison(monkeypatch, client=1, rnd=2, how=how)
    out = tmp_path / "run"
    assert main(["run", "--quiet", *SEQ, "clients=3", "rounds=3", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpcd: error: round 2: algorithm 'fedavg' diverged: client(s) 1 (")
    assert "local.lr" in err and "engine.on_divergence=drop" in err and "\n" not in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    assert [r["round"] for r in rows] == [1]  # everything before the divergence is kept
    assert RunDir(out).load_checkpoint()["round"] == 1


def test_a_stopped_run_says_where_and_why_until_it_goes_on(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, client=1, rnd=2)
    out = tmp_path / "runs" / "a"
    assert main(["run", "--quiet", *SEQ, "clients=3", "rounds=3", f"output_dir={out}"]) == 2
    error = capsys.readouterr().err.removeprefix("fedpcd: error: ").strip()
    stopped = json.loads((out / "stopped.json").read_text())
    assert stopped == {"round": 2, "error": "DivergenceError", "message": error, "code": code_version()}
    monkeypatch.undo()  # the cause is fixed
    finished = tmp_path / "runs" / "b"  # the same run, uninterrupted
    run_experiment(_cfg(tmp_path, "runs/b", *SEQ, "clients=3", "rounds=3"), progress=False)
    assert main(["report", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.endswith(
        "Runs without a summary (stopped, or still running), left out above: "
        "`a` (stopped in round 2: DivergenceError)\n"
    )
    assert main(["run", "--quiet", "--resume", str(out)]) == 0  # goes on from round 1's checkpoint
    assert not (out / "stopped.json").exists() and run_summary(out)["rounds"] == 3
    without_wall = [{k: v for k, v in r.items() if k != "wall_s"} for r in run_records(out)]
    assert without_wall == [{k: v for k, v in r.items() if k != "wall_s"} for r in run_records(finished)]


def test_huge_lr_is_a_divergence_not_nan_in_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=2", "local.lr=1e6", f"output_dir={out}"]) == 2
    assert "diverged" in capsys.readouterr().err
    text = (out / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text


def test_on_divergence_drop_leaves_the_update_out_and_goes_on(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, client=1, rnd=2, how="weights")
    cfg = _cfg(tmp_path, "run", "clients=3", "rounds=3", "engine.on_divergence=drop", *SEQ)
    summary = run_experiment(cfg, progress=False)
    assert summary["final"]["round"] == 3
    rows = run_records(tmp_path / "run")
    assert rows[1]["clients"] == [0, 2] and rows[1]["left_out"] == [1]
    assert "left_out" not in rows[0] and "left_out" not in rows[2]
    assert "round 2: client(s) 1 (non-finite model/" in capsys.readouterr().err


def test_server_state_divergence_stops_whatever_on_divergence_says(tmp_path, monkeypatch):
    def aggregate(self, server, replies):
        server["model"] = {k: torch.full_like(v, float("nan")) for k, v in server["model"].items()}
        return server

    monkeypatch.setattr(FedAvg, "aggregate", aggregate)
    with pytest.raises(DivergenceError, match="round 1: algorithm 'fedavg' diverged: its server state"):
        run_experiment(
            _cfg(tmp_path, "run", "clients=2", "rounds=1", "engine.on_divergence=drop"), progress=False
        )


def test_metrics_lines_are_strict_json():
    with pytest.raises(RuntimeError, match="non-finite metric"):
        record_line({"round": 1, "global_acc": math.nan})


# ----- client failures ----------------------------------------------------------------------------


def test_client_exception_is_left_out_with_a_warning(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, client=1, rnd=2, how="raise")
    summary = run_experiment(_cfg(tmp_path, "run", "clients=3", "rounds=3", *SEQ), progress=False)
    assert summary["final"]["round"] == 3
    err = capsys.readouterr().err
    assert "warning: round 2: client 1 failed (ValueError: injected failure)" in err
    rows = run_records(tmp_path / "run")
    assert rows[1]["clients"] == [0, 2] and rows[1]["left_out"] == [1]


def test_too_few_clients_left_stops_the_run(tmp_path, monkeypatch):
    _poison(monkeypatch, client=1, rnd=1, how="raise")
    cfg = _cfg(tmp_path, "run", "clients=3", "rounds=2", "engine.min_clients=3", *SEQ)
    with pytest.raises(RuntimeError, match=r"round 1: only 2 of 3 client update\(s\).*min_clients=3") as info:
        run_experiment(cfg, progress=False)
    assert isinstance(info.value.__cause__, ValueError)  # the client's own traceback is kept


# ----- the run directory: lock, overwrite protection ----------------------------------------------


def test_second_process_on_a_running_directory_exits_2_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    run_experiment(_cfg(tmp_path, "run", "clients=2", "rounds=1"), progress=False)
    (out / "summary.json").unlink()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from fedpcd.engine.rundir import RunDir\n"
            "with RunDir(sys.argv[1]).lock():\n    print('locked', flush=True); time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        assert main(["run", "--resume", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"in use by another fedpcd process (pid {holder.pid})" in err
        assert [r["round"] for r in read_metrics(out / "metrics.jsonl", resuming=True)] == [
            1
        ]  # nothing duplicated
    finally:
        holder.kill()
        holder.wait()
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--quiet"]) == 0  # the lock died with its process
    err = capsys.readouterr().err
    assert f"cleared the stale lock of process {holder.pid} in {out}" in err
    assert (out / ".lock").read_text() == ""  # released cleanly: nothing stale left
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert "stale lock" not in capsys.readouterr().err


def test_output_dir_that_holds_a_run_or_is_a_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=1", f"output_dir={out}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=1", f"output_dir={out}"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=1", f"output_dir={afile}"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=1", f"output_dir={afile}/sub"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_dir_is_a_user_error(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=1", f"output_dir={ro / 'run'}"]) == 2
        assert "cannot create output_dir" in capsys.readouterr().err
    finally:
        ro.chmod(0o755)


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "not a fedpcd run directory" in capsys.readouterr().err


# ----- input validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["local.lr=inf"], "'local.lr' ('inf'): must be a finite number"),
        (["local.lr=.nan"], "'local.lr' (nan): must be a finite number"),
        (["seed=-1"], "'seed' (-1)"),
        (["algorithm.name=feddyn", "algorithm.alpha=.inf"], "algorithm.alpha"),
        (["engine.min_clients=4", "clients=3"], "engine.min_clients=4 is more than the 3 client(s)"),
        (["engine.on_divergence=ignore"], "'engine.on_divergence'"),
    ],
)
def test_bad_values_exit_2(args, needle, capsys):
    assert main(["run", *SMALL, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_non_utf8_config_exits_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"seed: 1\nname: caf\xe9\n")
    assert main(["run", "--config", str(path)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


# ----- data files ---------------------------------------------------------------------------------


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes((0, 0, 0x08, arr.ndim)) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


def _idx_set(folder: Path, n_train: int = 20, n_test: int = 10) -> None:
    rng = np.random.default_rng(0)
    _write_idx(folder / "train-images-idx3-ubyte", rng.integers(0, 256, (n_train, 28, 28)))
    _write_idx(folder / "train-labels-idx1-ubyte", np.arange(n_train) % 10)
    _write_idx(folder / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 28, 28)))
    _write_idx(folder / "t10k-labels-idx1-ubyte", np.arange(n_test) % 10)


def test_truncated_idx_file_is_named_with_its_sizes(tmp_path, capsys):
    _idx_set(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    argv = [
        "partition",
        "dataset.name=mnist",
        f"dataset.root={tmp_path}",
        "dataset.download=false",
        "clients=2",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "truncated" in err and "7840 bytes" in err and "7740" in err


def test_official_shaped_file_with_wrong_content_fails_its_checksum(tmp_path, capsys, monkeypatch):
    _idx_set(tmp_path, n_test=10000)  # the official test-set shape, random content
    argv = [
        "partition",
        "dataset.name=fmnist",
        f"dataset.root={tmp_path}",
        "dataset.download=false",
        "clients=2",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "t10k-images-idx3-ubyte is corrupt" in err and "8181f5470baa50b63fa0f6fddb340f0a" in err
    monkeypatch.setenv("FEDPCD_SKIP_CHECKSUMS", "1")
    assert main(argv) == 0


def test_debian_fashion_mnist_matches_the_official_checksums():
    from fedpcd.data.files import md5
    from fedpcd.data.idx import IDX_MD5, _read_bytes

    folder = Path("/usr/share/datasets/fashion-mnist")
    if not folder.is_dir():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    names = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte"}
    names |= {"test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
    for key, stem in names.items():
        assert md5(_read_bytes(folder / f"{stem}.gz")) == IDX_MD5["fmnist"][key]


# ----- FedDyn's extra metric ----------------------------------------------------------------------


def test_feddyn_reports_the_mean_of_the_local_models(tmp_path):
    from fedpcd.algorithms import build_algorithm
    from fedpcd.engine.federation import build_federation

    cfg = _cfg(tmp_path, "run", "clients=3", "rounds=1", "algorithm.name=feddyn", "algorithm.alpha=0.1")
    fed = build_federation(cfg)
    algo = build_algorithm("feddyn", {"alpha": 0.1})
    algo.setup(fed.context)
    model = fed.model_for(0, fresh=True)
    server = algo.init_server(model)
    g = torch.Generator().manual_seed(0)
    locals_ = [
        {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in server["model"].items()}
        for _ in range(3)
    ]
    server = algo.aggregate(server, [{"model": m, "num_samples": 10} for m in locals_])
    (name, predictor), *rest = list(algo.extra_global_predictors(model, server))
    assert name == "local_mean" and not rest
    for key, value in predictor.state_dict().items():
        torch.testing.assert_close(value, sum(m[key] for m in locals_) / 3)
    summary = run_experiment(cfg, progress=False)
    assert 0.0 <= summary["final"]["global_acc_local_mean"] <= 1.0
    assert summary["best"]["global_acc_local_mean"] is not None
