"""``backend: flower``: one run through Flower's simulation engine (Ray), in this process.

The ServerApp runs in a thread of this process and writes the run directory exactly as ``run_local``
does; the ClientApps run in Ray actor processes (one CPU each). Ray binds to 127.0.0.1 only, Flower and
Ray keep their files in a temporary directory that is removed afterwards, and every process the run
started is checked by pid at the end and stopped if Ray left it behind.

Ctrl-C (SIGINT), SIGTERM, SIGHUP or SIGQUIT stop the run promptly, as on the local backend (one line, the
lock released, exit code 128 + the signal's number): the ServerApp stops polling, the ClientApps are killed
(silently: Ray's reports of the workers it lost are expected then), Flower's simulation returns, Ray is
shut down and its processes are stopped; the rounds written so far stay in the run directory. While
Flower's message workers run, the signal does not interrupt Flower's loop (Ray would be shut down under a
worker waiting in ``ray.get``, which then never returns or crashes the process at exit): the ClientApps are
killed until every worker has ended, and the signal's exception is raised once Flower has returned. A
SIGKILL, which no process can handle, is covered by a watchdog process (:mod:`fedpcd.flower.watchdog`)
that stops what Ray left behind once the run's process is gone.

A ClientApp that never answers is left out of its round after ``flower.round_timeout`` seconds; once the
ServerApp is done, ClientApps still busy are stopped (:func:`_stop_busy_clients`): Flower's simulation
would otherwise wait for them before it returns. A stop signal after that only hurries the clean-up: the
finished run's summary is returned.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fedpcd.config import Config
from fedpcd.engine.rounds import RoundObserver
from fedpcd.engine.run import Run
from fedpcd.errors import STOP_SIGNALS, Terminated, UserError
from fedpcd.flower import _env, procs, watchdog
from fedpcd.procs_guard import not_ignored


def client_gpus(config: Config, device: torch.device, num_cpus: int | None = None) -> tuple[int, float]:
    """(GPUs given to Ray, GPU share of one ClientApp) for the run's ``device`` (``engine.device`` resolved):
    (0, 0) on the CPU.

    On CUDA the ClientApps that run at once (``num_cpus // threads``) share all visible GPUs evenly; Ray
    makes each actor's share visible as ``cuda`` (so ``cuda:N`` is refused: select the GPU with
    ``CUDA_VISIBLE_DEVICES=N`` and ``engine.device=cuda``)."""
    if device.type != "cuda":
        return 0, 0.0
    if device.index is not None:
        raise UserError(
            f"engine.device={config.engine.device} is not supported by backend flower's simulation; "
            f"set CUDA_VISIBLE_DEVICES={device.index} and engine.device=cuda"
        )
    gpus = torch.cuda.device_count()
    at_once = max(1, (num_cpus or os.cpu_count() or 1) // (config.engine.threads or 1))
    return gpus, min(1.0, gpus / at_once)


def ray_backend_config(
    config: Config, device: torch.device, verbose: bool = False, num_cpus: int | None = None
) -> dict[str, Any]:
    """Flower's backend_config: one CPU per ClientApp, Ray on 127.0.0.1, no dashboard, quiet actors.

    Ray runs ``num_cpus // threads`` ClientApps at a time (default: all of the machine's cores); on CUDA
    (``engine.device``) they share the GPUs (:func:`client_gpus`)."""
    gpus, per_client = client_gpus(config, device, num_cpus)
    config_ = {
        "client_resources": {"num_cpus": config.engine.threads or 1, "num_gpus": per_client},
        "init_args": {
            "_node_ip_address": _env.LOOPBACK,
            "include_dashboard": False,
            "num_gpus": gpus,
            "logging_level": "INFO" if verbose else "ERROR",
            "log_to_driver": verbose,
        },
    }
    if num_cpus is not None:
        config_["init_args"]["num_cpus"] = num_cpus
    return config_


def run_flower(
    run: Run,
    observers: Sequence[RoundObserver] = (),
    progress: bool = True,
    *,
    verbose: bool = False,
    num_cpus: int | None = None,
) -> dict[str, Any]:
    """Run (or go on with) ``run`` through ``flwr.simulation.run_simulation``; write the run directory,
    return the summary. Each round goes to the ``observers`` (:func:`fedpcd.engine.rounds.run_rounds`).

    Same seed, same config => the same metrics as the local backend (clients are trained from the same
    payloads with the same seeded generators, replies are aggregated in client-id order); a resumed run
    goes on from its checkpoint on Flower. ``verbose`` shows Flower's and Ray's logs; ``num_cpus`` caps
    Ray's CPUs (ClientApps running at once).
    """
    _env.require_flwr()
    _env.require_ray()
    _env.set_offline_defaults()
    # every check, the checkpoint and the data (its problems included) before spending ~20 s on starting Ray
    with run.open() as fed:
        return _run_simulation(run, fed, observers, progress, verbose, num_cpus)


def _run_simulation(
    run: Run,
    fed: Any,
    observers: Sequence[RoundObserver],
    progress: bool,
    verbose: bool,
    num_cpus: int | None,
) -> dict[str, Any]:
    config = run.config
    result: dict[str, Any] = {}
    stop = threading.Event()  # set on a stop signal or on the way out: the ServerApp stops polling at once
    signalled: list[int] = []  # the stop signals received
    threads_before = set(threading.enumerate())
    deadline: list[threading.Timer] = []  # started by a signal, cancelled once the clean-up is done
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    with (
        _signals_handled(_on_signal(stop, deadline, signalled)),
        _env.flower_home() as base,
        _env.quiet_flower(verbose),
        warnings.catch_warnings(),
    ):
        started: set[procs.Proc] = set()
        finished = threading.Event()  # set by the ServerApp once the summary is written
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        from flwr.simulation import run_simulation

        from fedpcd.flower.client_app import app as client_app
        from fedpcd.flower.server_app import make_server_app

        def snapshot() -> None:  # every process Ray started, while they are all still up
            started.update(procs.descendants(os.getpid()) - before)
            finished.set()

        backend_config = ray_backend_config(config, fed.device, verbose, num_cpus)
        server_app = make_server_app(
            run,
            federation=fed,
            observers=observers,
            progress=progress,
            result=result,
            on_finish=snapshot,
            stop=stop,
        )
        guard = watchdog.start(base)  # stops what Ray leaves behind should this process be SIGKILLed
        before = procs.descendants(os.getpid())  # the watchdog included: it is not Ray's
        sampler = threading.Thread(target=_sample, args=(started, before, stop), daemon=True)
        sampler.start()  # Ray's processes while they are ours: some are re-parented before the end
        reaper = threading.Thread(target=_stop_busy_clients, args=(finished, stop), daemon=True)
        reaper.start()
        try:
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=config.clients,
                backend_name="ray",
                backend_config=backend_config,
            )
        except KeyboardInterrupt:  # from _on_signal, while no message worker ran
            if "summary" not in result:
                raise
            # a stop signal while a finished run cleans up: the run is complete, its summary is returned
        except Exception:
            if not signalled:
                raise
            # Flower's loop failing as it was stopped: the signal is what the caller hears (below)
        finally:
            stop.set()
            _join_server_app(threads_before, timeout=5.0)
            sampler.join()
            reaper.join()
            _shutdown_ray()  # Flower shuts it down when its loop ends; not when interrupted before that
            flwr_log.setLevel(level)
            # every process Ray started, and any process left with this run's RAY_TMPDIR in its environment
            ours = (guard.pid, os.getpid())
            started.update(procs.descendants(os.getpid()) - before)
            started.update(p for p in watchdog.with_env_mark(str(base)) if p[0] not in ours)
            leftover = procs.stop((p for p in started if procs.alive(p)), timeout=LEFTOVER_GRACE_S)
            watchdog.release(guard)
            for timer in deadline:
                timer.cancel()
    if leftover:  # pragma: no cover - depends on the OS
        raise RuntimeError(f"could not stop processes {sorted(p for p, _ in leftover)} left by Ray")
    if "summary" in result:  # a stop signal after the ServerApp finished only hurried the clean-up
        return result["summary"]
    if signalled:
        raise _stop_exception(signalled[0])
    raise RuntimeError(
        "the Flower simulation ended without finishing the run "
        "(run_flower(..., verbose=True) shows Flower's log)"
    )


LEFTOVER_GRACE_S = 2.0  # SIGTERM to SIGKILL for what Ray left at the end (Ray is shut down by then)
STOP_DEADLINE_S = 20.0  # after a stop signal, the most the clean-up may take before the process ends anyway


def _stop_exception(signum: int) -> KeyboardInterrupt:
    """What a stop signal raises, as on the local backend: KeyboardInterrupt (SIGINT) or
    :class:`~fedpcd.errors.Terminated` (the command then exits with 128 + the signal's number)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _on_signal(
    stop: threading.Event, deadline: list[threading.Timer], signalled: list[int]
) -> Callable[[int, Any], None]:
    """A stop signal (SIGINT or ``STOP_SIGNALS``): tell the ServerApp to stop polling, kill the ClientApps
    (:func:`_stop_client_apps`) and start the deadline (STOP_DEADLINE_S, after which the process ends anyway;
    the watchdog stops Ray's processes then). While no Flower message worker runs and the main thread is
    not inside Ray (whose start-up, interrupted, can leave a half-made core worker that crashes the process
    at exit), raise :func:`_stop_exception` at once. Otherwise let Flower's loop end by itself:
    the ServerApp returns at its next poll, the workers end once their ClientApps are gone
    (:func:`_stop_busy_clients` kills those started later), Flower shuts Ray down, and ``run_flower`` raises
    the exception then. Raising into Flower's loop instead would shut Ray down under a worker waiting in
    ``ray.get``, which then never returns (the process hangs at exit) or crashes the process."""

    def handler(signum: int, frame: Any) -> None:
        signalled.append(signum)
        stop.set()
        _stop_client_apps()
        if not deadline:
            timer = threading.Timer(STOP_DEADLINE_S, _end_now, args=(signum,))
            timer.daemon = True
            timer.start()
            deadline.append(timer)
        if not _message_workers() and not _inside_ray(frame):
            raise _stop_exception(signum)

    return handler


def _inside_ray(frame: Any) -> bool:
    """Whether ``frame`` (the main thread's, where the signal arrived) is inside Ray's code."""
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).partition(".")[0] == "ray":
            return True
        frame = frame.f_back
    return False


@contextmanager
def _signals_handled(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGINT and ``STOP_SIGNALS`` (SIGTERM, SIGHUP, SIGQUIT) through ``handler`` for the block (main thread
    only; those the process ignores stay ignored), Ray's own SIGTERM handler (set by ray.init) kept out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    saved = {sig: signal.signal(sig, handler) for sig in not_ignored((signal.SIGINT, *STOP_SIGNALS))}
    set_by_ray = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = set_by_ray
        for sig, previous in saved.items():
            signal.signal(sig, previous)


def _end_now(signum: int) -> None:
    print(f"fedpcd: interrupted (Flower did not stop within {STOP_DEADLINE_S:.0f} s)", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signum)


def _sample(into: set[procs.Proc], before: set[procs.Proc], stop: threading.Event) -> None:
    """Add this process's new descendants to ``into`` every second until ``stop`` is set."""
    while not stop.wait(1.0):
        into.update(procs.descendants(os.getpid()) - before)


BUSY_GRACE_S = 5.0  # once the ServerApp is done: the time Flower's message workers get to end on their own


def _stop_busy_clients(finished: threading.Event, stop: threading.Event) -> None:
    """Once the ServerApp is done (``finished``) or the run is stopped (``stop``), kill the ClientApps until
    no Flower message worker runs any more: each waits in ``ray.get`` for its ClientApp, and Flower's
    simulation does not return before they end. After a finished run the workers get BUSY_GRACE_S to end on
    their own first (one left out of its round after the round timeout would not); after a stop signal the
    ClientApps are killed at once, also those Ray starts after the signal. Killing a ClientApp (SIGKILL: none
    holds anything the run needs) ends its worker's wait (an ActorDiedError, expected and not logged)."""
    while not (finished.wait(0.2) or stop.is_set()):
        pass
    end = time.monotonic() + (0.0 if stop.is_set() else BUSY_GRACE_S)
    while _message_workers() and time.monotonic() < end and not stop.wait(0.1):
        pass
    end = time.monotonic() + STOP_DEADLINE_S
    while _message_workers() and time.monotonic() < end:
        _stop_client_apps()
        time.sleep(0.2)


def _stop_client_apps() -> None:
    """Kill this process's ClientApps (SIGKILL at once: one in a local update may take seconds to act on
    SIGTERM), with Flower's and Ray's reports of them muted: the workers' ActorDiedErrors and Ray's "worker
    died" lines are expected then, not news (:func:`_mute_ray_errors`)."""
    logging.getLogger("flwr").setLevel(logging.CRITICAL)
    _mute_ray_errors()
    procs.stop((p for p in procs.descendants(os.getpid()) if _is_client_app(p)), timeout=0.0)


def _join_server_app(before: set[threading.Thread], timeout: float) -> None:
    """Wait (up to ``timeout`` s in all) for the threads started since ``before`` other than Flower's message
    workers and daemons: the ServerApp's, which stops polling once ``stop`` is set."""
    end = time.monotonic() + timeout
    workers = set(_message_workers())
    for thread in set(threading.enumerate()) - before - workers:
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, end - time.monotonic()))


def _message_workers() -> list[threading.Thread]:
    """The threads running Flower's message loop (``vce_api.worker``; each may wait in ``ray.get`` for a
    ClientApp); none before Flower's simulation runtime starts them (also while its module is still being
    imported: a signal can arrive then) or after it ends."""
    worker = getattr(sys.modules.get("flwr.server.superlink.fleet.vce.vce_api"), "worker", None)
    if worker is None:
        return []
    code = worker.__code__
    frames = sys._current_frames()
    workers = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        if frame is not None:
            workers.append(thread)
    return workers


def _is_client_app(proc: procs.Proc) -> bool:
    """A Ray worker process running a ClientApp actor (Ray names its process ``ray::ClientAppActor``)."""
    import psutil

    try:
        return " ".join(psutil.Process(proc[0]).cmdline()).startswith("ray::ClientAppActor")
    except psutil.Error:  # gone, or a zombie
        return False


def _mute_ray_errors() -> None:
    """Stop the thread of this (the driver's) process that prints the errors Ray's nodes report.

    Ray reports every worker that ends in the middle of a task as "(raylet) A worker died or was killed ...
    Worker exit type: SYSTEM_ERROR" on stdout, ``log_to_driver`` or not; once the run stops its ClientApps
    itself those reports are expected, not news. Ray has no setting for it: this stops the thread as
    ``ray.shutdown`` does, only earlier (``ray.shutdown`` then finds it stopped)."""
    worker = getattr(sys.modules.get("ray._private.worker"), "global_worker", None)
    listener = getattr(worker, "listener_thread", None)
    subscriber = getattr(worker, "gcs_error_subscriber", None)
    if listener is None or subscriber is None or not getattr(worker, "connected", False):
        return  # Ray is not running (or is a version whose driver reports errors otherwise)
    worker.threads_stopped.set()
    subscriber.close()  # wakes the thread from its wait for the next report
    listener.join(timeout=1.0)


def _shutdown_ray() -> None:
    """Shut Ray down if it was started in this process, also half-way: a stop signal during ``ray.init``
    can leave a core worker behind that Ray's own exit handler would destroy under its running threads (a
    crash at exit)."""
    worker = sys.modules.get("ray._private.worker")
    if worker is None:
        return
    driver = worker.global_worker
    if driver.connected or hasattr(driver, "core_worker") or worker._global_node is not None:
        sys.modules["ray"].shutdown()
