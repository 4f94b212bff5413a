"""The Flower backend's real processes: same numbers as the local backend, loopback only, every process
stopped.

``run_flower`` through Flower's simulation engine (Ray) on Fashion-MNIST, a real deployment (one SuperLink,
two SuperNodes, long-lived ClientApp workers) on 127.0.0.1 via ``flwr run``, and Ctrl-C, SIGTERM and
SIGKILL of a running Flower simulation. The in-process round loop is tested in ``test_flower.py``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from conftest import assert_same_backend_run, log_lines, requires_fmnist  # noqa: E402
from fedpcd.backends import run_experiment  # noqa: E402
from fedpcd.flower import procs  # noqa: E402
from fedpcd.resolve import load_config

REPO = Path(__file__).resolve().parents[1]
HOME_FLWR_EXISTED = (Path.home() / ".flwr").exists()
SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]


def _loopback_only(addresses: set[str]) -> bool:
    return all(ipaddress.ip_address(a.strip("[]")).is_loopback for a in addresses)


def _listening(pids: set[int]) -> set[str]:
    """Addresses of TCP sockets in LISTEN state owned by ``pids`` (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
        except OSError:
            continue
    out = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A" or int(parts[9]) not in inodes:
                continue
            raw = bytes.fromhex(parts[1].split(":")[0])
            if v6:
                ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                out.add(str(ip.ipv4_mapped or ip))
            else:
                out.add(str(ipaddress.IPv4Address(raw[::-1])))
    return out


class SocketWatch:
    """Samples, in a thread, the processes descended from this one and the TCP addresses they listen on."""

    def __init__(self) -> None:
        self.before = procs.descendants(os.getpid())
        self.seen: set[procs.Proc] = set()
        self.addresses: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            now = procs.descendants(os.getpid()) - self.before
            self.seen |= now
            self.addresses |= _listening({p for p, _ in now})

    def __enter__(self) -> SocketWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


pytestmark = pytest.mark.procs  # every test here starts Flower's processes (and Ray's)


@pytest.fixture
def flower_tmp_env(tmp_path, monkeypatch):
    """A temporary FLWR_HOME and RAY_TMPDIR for anything that would write under $HOME or /tmp/ray."""
    for key, sub in (("FLWR_HOME", "flwr-home"), ("RAY_TMPDIR", "ray")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("FLWR_DISABLE_UPDATE_CHECK", "1")
    return tmp_path


@pytest.mark.slow
@requires_fmnist
def test_flower_simulation_equals_local_backend(flower_tmp_env):
    """Acceptance: FedNH (FedAvg's payload plus the server's prototypes), 4 clients, 2 rounds on
    Fashion-MNIST; Flower's simulation == local, bitwise (SCAFFOLD's client states: the SIGKILL test below;
    every algorithm through Flower's message path in one process: test_flower.py); run.log written once
    (run_flower holds the run directory and its ServerApp thread opens it again)."""
    from fedpcd.engine import Run
    from fedpcd.flower.simulation import run_flower

    tmp = flower_tmp_env
    args = [
        "algorithm.name=fednh",
        "dataset.name=fmnist",
        "dataset.train_fraction=0.1",
        "clients=4",
        "rounds=2",
        "seed=0",
        "engine.threads=1",
    ]
    run_experiment(load_config(None, args + [f"output_dir={tmp / 'local'}"]), progress=False)
    cfg = load_config(None, args + [f"output_dir={tmp / 'flower'}", "backend=flower"])
    with SocketWatch() as watch:
        summary = run_flower(Run.create(cfg), progress=False)
    assert_same_backend_run(tmp / "local", tmp / "flower")
    assert summary["rounds"] == 2 and summary["final"]["global_acc"] is not None
    messages = [m for _, m in log_lines(tmp / "flower" / "run.log")]
    assert [m for m in messages if m.startswith("round ") and "GA=" in m][0].startswith("round 1: GA=")
    assert sum(m.startswith("round ") and "GA=" in m for m in messages) == 2
    assert sum(m.startswith("fedpcd ") for m in messages) == 1 and messages[-1] == "finished"
    a = torch.load(tmp / "local" / "checkpoint" / "state.pt", weights_only=False)["server"]["model"]
    b = torch.load(tmp / "flower" / "checkpoint" / "state.pt", weights_only=False)["server"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Ray ran (its processes were seen), listened on loopback only, and nothing it started is left
    assert len(watch.seen) >= 3
    assert watch.addresses and _loopback_only(watch.addresses), watch.addresses
    assert not [p for p in watch.seen if procs.alive(p)]
    assert procs.descendants(os.getpid()) <= watch.before
    assert (Path.home() / ".flwr").exists() == HOME_FLWR_EXISTED  # Flower wrote nothing under $HOME


@pytest.mark.slow
def test_deployment_two_supernodes_on_loopback_completes_and_stops(flower_tmp_env):
    """Acceptance: one SuperLink + two SuperNodes (long-lived workers) on 127.0.0.1, `flwr run` of the
    repository's flower-app, 2 rounds, the same numbers as local, every process stopped by pid."""
    from fedpcd.flower.deploy import LoopbackDeployment

    tmp = flower_tmp_env
    args = SMALL + ["clients=2", "rounds=2", "seed=4"]
    run_experiment(load_config(None, args + [f"output_dir={tmp / 'local'}"]), progress=False)
    cfg = load_config(None, args + [f"output_dir={tmp / 'deployed'}"])
    with SocketWatch() as watch:
        dep = LoopbackDeployment(2, workdir=tmp / "deploy", cwd=tmp)
        with dep:
            assert len(dep.pids) == 5  # SuperLink, 2 SuperNodes, 2 workers
            summary = dep.run(cfg, app_dir=REPO / "flower-app", node_timeout=120)
            running = dep.all_processes()
    assert summary["rounds"] == 2
    assert_same_backend_run(tmp / "local", tmp / "deployed")
    assert {p for p, _ in running} >= set(dep.pids)
    assert not [p for p in running | watch.seen if procs.alive(p)], "processes left after stop()"
    assert procs.descendants(os.getpid()) <= watch.before
    assert watch.addresses and _loopback_only(watch.addresses), watch.addresses
    assert (tmp / "deploy" / "logs" / "superlink.log").exists()  # workdir given: logs are kept


@pytest.mark.slow
def test_deployment_with_tls_on_loopback(flower_tmp_env):
    """The documented TLS flags: SuperLink --ssl-*, SuperNodes --root-certificates, CLI root-certificates."""
    from fedpcd.flower.deploy import LoopbackDeployment

    tmp = flower_tmp_env
    cfg = load_config(None, SMALL + ["clients=2", "rounds=1", f"output_dir={tmp / 'tls'}"])
    dep = LoopbackDeployment(2, tls=True, cwd=tmp)
    with dep:
        link = " ".join(dep.started[0].popen.args)
        assert "--ssl-certfile" in link and "--insecure" not in link
        summary = dep.run(cfg, node_timeout=120)
        running = dep.all_processes()
    assert summary["rounds"] == 1 and summary["final"]["global_acc"] is not None
    assert not [p for p in running if procs.alive(p)]
    assert not dep.base.exists()  # the temporary working directory (certificates, homes, logs) is removed


# Fashion-MNIST with the Simple-CNN: a ClientApp is inside a real local update (seconds) when the signal
# comes, which an MLP on synthetic data hardly ever is
REAL_DATA = ["dataset.name=fmnist", "dataset.train_fraction=0.1", "model.name=simplecnn"]


def _flower_cli(
    out: Path, env_dir: Path, data: list[str] = SMALL, rounds: int = 500, resume: bool = False
) -> subprocess.Popen:
    env = {**os.environ, "FLWR_HOME": str(env_dir / "flwr-home"), "RAY_TMPDIR": str(env_dir / "ray")}
    argv = ["run", "--quiet", "backend=flower", *data, "clients=2", f"rounds={rounds}", f"output_dir={out}"]
    if resume:
        argv = ["run", "--quiet", "--resume", str(out)]
    # files, not pipes nobody drains while it runs
    with open(env_dir / "stdout.txt", "wb") as stdout, open(env_dir / "stderr.txt", "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "fedpcd.cli", *argv],
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # a terminal's Ctrl-C would not reach pytest too
        )


def _stderr(env_dir: Path) -> str:
    return (env_dir / "stderr.txt").read_text(errors="replace")[-2000:]


def _run_until_rounds(proc: subprocess.Popen, out: Path, rounds: int, timeout: float) -> set[procs.Proc]:
    """Wait until ``rounds`` rounds are written; returns every process seen descending from ``proc``."""
    seen: set[procs.Proc] = set()
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        seen |= procs.descendants(proc.pid)
        metrics = out / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count("\n") >= rounds:
            return seen | procs.descendants(proc.pid)
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the Flower run did not reach round {rounds}: {_stderr(out.parent)}")


@pytest.mark.slow
@requires_fmnist
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_stop_a_flower_run_promptly(flower_tmp_env, sig):
    """Acceptance: a terminal's Ctrl-C (SIGINT to the whole process group, Ray's workers included) or a
    SIGTERM to the command stops a Flower simulation on real data with one line and nothing else on either
    stream (Ray used to report each ClientApp stopped in the middle of a task as "(raylet) A worker died ...
    SYSTEM_ERROR"), through the clean-up (not the deadline after which the process ends anyway); Ray's
    processes are gone, the rounds written so far stay valid (the driver used to hang at exit, joining
    Flower's message workers stuck in ray.get)."""
    out = flower_tmp_env / "run"
    proc = _flower_cli(out, flower_tmp_env, REAL_DATA)
    seen = _run_until_rounds(proc, out, 2, timeout=240)
    assert any("ClientAppActor" in _cmdline(p.pid) for p in seen)  # Ray ran the ClientApps
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the Flower run did not stop within 60 s of the signal")
    assert proc.returncode == 128 + sig, _stderr(flower_tmp_env)  # as on the local backend
    # the resume hint, not "Flower did not stop within ... s" (the deadline's line)
    assert _stderr(flower_tmp_env).strip().splitlines() == [
        f"fedpcd: interrupted (resume with: fedpcd run --resume {out})"
    ]
    assert (flower_tmp_env / "stdout.txt").read_text() == ""
    assert not procs.wait_gone(seen, 10.0)  # (the watchdog is released as the run ends: may exit just after)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, len(rows) + 1))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_for_process(proc: subprocess.Popen, prefix: str, timeout: float) -> set[procs.Proc]:
    """Wait until a descendant of ``proc`` whose command line starts with ``prefix`` runs; returns every
    process seen descending from ``proc``."""
    import psutil

    seen: set[procs.Proc] = set()
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        now = procs.descendants(proc.pid)
        seen |= now
        for pid, _ in now:
            try:
                if " ".join(psutil.Process(pid).cmdline()).startswith(prefix):
                    return seen
            except psutil.Error:
                continue
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no process {prefix!r} started within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "moment", ["ray::", "ray::ClientAppActor"], ids=["ray-workers-starting", "client-apps-starting"]
)
def test_a_stop_signal_during_a_flower_runs_start_up_ends_it(flower_tmp_env, moment):
    """SIGHUP (a closed terminal) while Ray starts its first worker process, or as the first ClientApp
    starts (Flower's message workers then wait for the ClientApps in ``ray.get``): the command ends by
    itself with the one line and 128 + 1, as on the local backend, and leaves no process. It used to hang
    at exit or crash there: raising into Flower's loop shut Ray down under a message worker waiting for a
    ClientApp that Ray started after the signal had killed the others."""
    out = flower_tmp_env / "run"
    proc = _flower_cli(out, flower_tmp_env)
    seen = _wait_for_process(proc, moment, timeout=240)
    proc.send_signal(signal.SIGHUP)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the Flower run did not end within 60 s of SIGHUP")
    assert proc.returncode == 128 + signal.SIGHUP, _stderr(flower_tmp_env)
    assert _stderr(flower_tmp_env).strip().splitlines() == [
        f"fedpcd: interrupted (resume with: fedpcd run --resume {out})"
    ]
    assert not procs.wait_gone(seen, 10.0)


@pytest.mark.slow
def test_a_sigkilled_flower_run_leaves_no_ray_process_and_resumes_on_flower(flower_tmp_env):
    """A SIGKILLed run cannot clean up: its watchdog stops what Ray left (its agents kept listening).
    ``fedpcd run --resume`` then continues it on Flower (SCAFFOLD: the clients' control variates come back
    from the checkpoint) to the metrics of an uninterrupted run (the local backend's, bitwise equal)."""
    out = flower_tmp_env / "run"
    data = [*SMALL, "algorithm.name=scaffold", "seed=5"]
    proc = _flower_cli(out, flower_tmp_env, data, rounds=5)
    seen = _run_until_rounds(proc, out, 2, timeout=240)
    proc.kill()
    proc.wait()
    end = time.monotonic() + 30
    while time.monotonic() < end and [p for p in seen if procs.alive(p)]:
        time.sleep(0.5)
    assert not [p for p in seen if procs.alive(p)], "processes left after SIGKILL"
    assert not (out / "summary.json").exists()
    resumed = _flower_cli(out, flower_tmp_env, resume=True)
    assert resumed.wait(timeout=240) == 0, _stderr(flower_tmp_env)
    local = flower_tmp_env / "local"
    args = [*data, "clients=2", "rounds=5", f"output_dir={local}"]
    run_experiment(load_config(None, args), progress=False)
    assert_same_backend_run(local, out)
