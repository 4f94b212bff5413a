"""A Flower run ends once its ServerApp is done: a ClientApp that never answers is left out of its round
after ``flower.round_timeout`` seconds, and is then stopped instead of holding the finished run open; a
Ctrl-C while the finished run cleans up is not an interrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

import fedpcd  # noqa: E402
from fedpcd.flower import procs  # noqa: E402

SRC = str(Path(fedpcd.__file__).resolve().parents[1])

# An installed plugin whose import (in every process that looks a model up, the ClientApps' Ray actors
# included) makes client 0 sleep "forever" (10^6 s) in round 2's local update.
_HANG = """
import sys, time
client_app = sys.modules.get("fedpcd.flower.client_app")
if client_app is not None:
    run_client = client_app.run_client

    def hanging(algorithm, fed, task):
        if task.client == 0 and task.round == 2:
            time.sleep(10**6)
        return run_client(algorithm, fed, task)

    client_app.run_client = hanging
"""


def _plugin(site: Path) -> None:
    info = site / "fedpcd_hang-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Name: fedpcd-hang\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedpcd.models]\nhang = fedpcd_hang\n")
    (site / "fedpcd_hang.py").write_text(_HANG)


def _start(tmp_path: Path, site: Path) -> subprocess.Popen[bytes]:
    """A 2-round Flower run in ``tmp_path`` whose client 0 hangs in round 2 (the plugin in ``site``)."""
    for sub in ("flwr-home", "ray"):
        (tmp_path / sub).mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": f"{SRC}{os.pathsep}{site}",
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "RAY_TMPDIR": str(tmp_path / "ray"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    argv = [
        *("run", "--quiet", "backend=flower", "dataset.name=synthetic", "model.name=mlp", "model.hidden=8"),
        # the timeout is the test's wait for the hung client; a healthy ClientApp answers round 1 of this tiny
        # model, its Ray actor's start included, in about 2.5 s on a loaded 2-core machine
        *("local.batch_size=32", "clients=2", "rounds=2", "flower.round_timeout=30"),
        f"output_dir={tmp_path / 'run'}",
    ]
    with open(tmp_path / "err", "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "fedpcd.cli", *argv],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )


@pytest.mark.slow
def test_a_hung_client_app_does_not_hold_a_finished_flower_run(tmp_path):
    """Two such runs side by side (each mostly waits out the round timeout): one left to end on its own, one
    sent a Ctrl-C once its summary is written (while the hung ClientApp is being stopped)."""
    site = tmp_path / "site"
    _plugin(site)
    folders = {"on-its-own": tmp_path / "alone", "ctrl-c-after-the-summary": tmp_path / "ctrl-c"}
    started = {case: _start(folder, site) for case, folder in folders.items()}
    seen: dict[str, set[procs.Proc]] = {case: set() for case in folders}
    ctrl_c = {"ctrl-c-after-the-summary"}
    end = time.monotonic() + 600  # generous: Ray's start-up and shut-down take minutes on a loaded machine
    try:
        while any(p.poll() is None for p in started.values()) and time.monotonic() < end:
            for case, proc in started.items():
                if proc.poll() is not None:
                    continue
                seen[case] |= procs.descendants(proc.pid)
                if case in ctrl_c and (folders[case] / "run" / "summary.json").exists():
                    time.sleep(1.0)  # the ServerApp has returned; the hung ClientApp is stopped after 5 s
                    proc.send_signal(signal.SIGINT)
                    ctrl_c.discard(case)
            time.sleep(0.2)
    finally:
        hung = [case for case, proc in started.items() if proc.poll() is None]
        for case in hung:
            os.killpg(started[case].pid, signal.SIGKILL)
            started[case].wait()
        if hung:
            pytest.fail(f"the finished Flower run ({hung[0]}) did not exit: " + _err(folders[hung[0]]))
    for case, folder in folders.items():
        stderr = _err(folder)
        assert started[case].returncode == 0, (case, stderr)
        assert "interrupted" not in stderr and "Traceback" not in stderr, (case, stderr)
        assert json.loads((folder / "run" / "summary.json").read_text())["rounds"] == 2, case
        assert (
            "round 2: client 0 failed (TimeoutError: no reply within the round timeout (30 s))"
            in (folder / "run" / "run.log").read_text()
        ), case
        assert len(seen[case]) >= 3, case  # Ray ran
        assert not procs.wait_gone(seen[case], 30.0), f"processes of the run left ({case})"


def _err(folder: Path) -> str:
    return (folder / "err").read_text(errors="replace")[-2000:]


def test_message_workers_are_the_threads_in_flowers_message_loop():
    """``_message_workers`` finds a thread running Flower's message loop (``vce_api.worker``) while it runs,
    and not after it ends, nor any other thread: a stop signal raises at once only while none runs (a worker
    may wait in ray.get for a ClientApp, and Ray must not be shut down under it)."""
    import queue
    import threading

    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.fleet.vce.metrics import VceMetrics

    from fedpcd.flower.simulation import _message_workers

    f_stop, idle = threading.Event(), threading.Event()
    loop = threading.Thread(
        target=vce_api.worker, args=(queue.Queue(), queue.Queue(), {}, None, f_stop, VceMetrics())
    )
    other = threading.Thread(target=idle.wait)
    loop.start()
    other.start()
    try:
        assert _message_workers() == [loop]
    finally:
        f_stop.set()
        idle.set()
        loop.join()
        other.join()
    assert _message_workers() == []


def test_a_stop_signal_while_flower_is_imported_finds_no_message_worker(monkeypatch):
    """A signal that arrives while Flower's message-loop module is half imported (found by the chaos
    benchmark: SIGHUP during ``import flwr.simulation``) finds no message worker instead of failing on the
    module's missing ``worker``, so the stop raises at once, as before Flower's start."""
    import types

    from fedpcd.flower.simulation import _message_workers

    half = types.ModuleType("flwr.server.superlink.fleet.vce.vce_api")  # its body not run yet
    monkeypatch.setitem(sys.modules, half.__name__, half)
    assert _message_workers() == []
