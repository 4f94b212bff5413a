"""``backend: flower``: one run through Flower's simulation engine (Ray), in this process.

The ServerApp runs in a thread of this process and writes the run directory exactly as ``run_local``
does; the ClientApps run in Ray actor processes (one CPU each). Ray binds to 127.0.0.1 only, Flower and
Ray keep their files in a temporary directory that is removed afterwards, and every process the run
started is checked by pid at the end and stopped if Ray left it behind.

Ctrl-C (SIGINT) or SIGTERM stop the run promptly: the ServerApp stops polling for replies, the ClientApps
are killed (silently: Ray's reports of the workers it lost are expected then), Ray is shut down and its
processes are stopped, and the rounds written so far stay in the run directory. A SIGKILL, which no
process can handle, is covered by a watchdog process (:mod:`fedpcd.flower.watchdog`) that stops what Ray
left behind once the run's process is gone.

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

from fedpcd.config import Config
from fedpcd.engine.rounds import RoundObserver
from fedpcd.engine.run import Run
from fedpcd.errors import STOP_SIGNALS, UserError
from fedpcd.flower import _env, procs, watchdog


def client_gpus(config: Config, num_cpus: int | None = None) -> tuple[int, float]:
    """(GPUs given to Ray, GPU share of one ClientApp) for ``engine.device``: (0, 0) on the CPU.

    On CUDA the ClientApps that run at once (``num_cpus // threads``) share all visible GPUs evenly; Ray
    makes each actor's share visible as ``cuda`` (so ``cuda:N`` is refused: select the GPU with
    ``CUDA_VISIBLE_DEVICES=N`` and ``engine.device=cuda``)."""
    import torch

    from fedpcd.engine.federation import resolve_device

    device = resolve_device(config.engine.device)
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


def ray_backend_config(config: Config, verbose: bool = False, num_cpus: int | None = None) -> dict[str, Any]:
    """Flower's backend_config: one CPU per ClientApp, Ray on 127.0.0.1, no dashboard, quiet actors.

    Ray runs ``num_cpus // threads`` ClientApps at a time (default: all of the machine's cores); on CUDA
    (``engine.device``) they share the GPUs (:func:`client_gpus`)."""
    gpus, per_client = client_gpus(config, num_cpus)
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
    stop = threading.Event()  # set on the way out: the ServerApp thread stops polling at once
    threads_before = set(threading.enumerate())
    deadline: list[threading.Timer] = []  # started by a signal, cancelled once the clean-up is done
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    with (
        _signals_handled(stop, deadline),
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
        reaper = threading.Thread(target=_stop_busy_clients, args=(finished, stop, threads_before))
        reaper.daemon = True
        reaper.start()
        try:
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=config.clients,
                backend_name="ray",
                backend_config=ray_backend_config(config, verbose, num_cpus),
            )
        except (KeyboardInterrupt, SystemExit):
            if "summary" not in result:
                raise
            # a stop signal while a finished run cleans up: the run is complete, its summary is returned
        finally:  # also on Ctrl-C (KeyboardInterrupt) and SIGTERM (SystemExit), see _on_signal
            stop.set()
            _join_new_threads(threads_before, timeout=5.0)
            sampler.join()
            reaper.join()
            started.update(procs.descendants(os.getpid()) - before)
            # ClientApps still training: stopping them makes Flower's message workers, which wait for
            # them in ray.get, fail cleanly (ActorDiedError) before Ray is shut down under them
            flwr_log.setLevel(logging.CRITICAL)  # the workers' ActorDiedErrors are expected
            _mute_ray_errors()  # ... and so are Ray's reports of the ClientApps it lost
            procs.stop(p for p in started if procs.alive(p) and _is_client_app(p))
            _join_new_threads(threads_before, timeout=5.0, workers=True)
            _shutdown_ray()
            flwr_log.setLevel(level)
            # ... and any process left with this run's RAY_TMPDIR in its environment (not the watchdog)
            ours = (guard.pid, os.getpid())
            started.update(p for p in watchdog.with_env_mark(str(base)) if p[0] not in ours)
            leftover = procs.stop(p for p in started if procs.alive(p))
            watchdog.release(guard)
            for timer in deadline:
                timer.cancel()
    if leftover:  # pragma: no cover - depends on the OS
        raise RuntimeError(f"could not stop processes {sorted(p for p, _ in leftover)} left by Ray")
    if "summary" not in result:
        raise RuntimeError(
            "the Flower simulation ended without finishing the run "
            "(run_flower(..., verbose=True) shows Flower's log)"
        )
    return result["summary"]


STOP_DEADLINE_S = 8.0  # after Ctrl-C, the most the clean-up may take before the process ends anyway


def _on_signal(stop: threading.Event, deadline: list[threading.Timer]) -> Callable[[int, Any], None]:
    """Ctrl-C or SIGTERM, in this order: tell the ServerApp to stop polling; stop printing Ray's error reports
    (:func:`_mute_ray_errors`); kill the ClientApps (SIGKILL at once: one in a local update may take seconds
    to act on SIGTERM, and none holds anything the run needs: the client states live in this process), so
    that Flower's message workers leave ``ray.get`` (an ActorDiedError, expected and not logged) before
    Flower shuts Ray down under them (Ray then ends the whole process with exit code 1); raise
    KeyboardInterrupt (SIGINT) or SystemExit(15) (SIGTERM, as Ray's own handler does). Should the clean-up
    still hang, the process ends after STOP_DEADLINE_S; the watchdog stops Ray's processes then."""

    def handler(signum: int, frame: Any) -> None:
        stop.set()
        logging.getLogger("flwr").setLevel(logging.CRITICAL)
        _mute_ray_errors()
        procs.stop((p for p in procs.descendants(os.getpid()) if _is_client_app(p)), timeout=0.0)
        timer = threading.Timer(STOP_DEADLINE_S, _end_now, args=(signum,))
        timer.daemon = True
        timer.start()
        deadline.append(timer)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(signum)

    return handler


@contextmanager
def _signals_handled(stop: threading.Event, deadline: list[threading.Timer]) -> Iterator[None]:
    """SIGINT and ``STOP_SIGNALS`` (SIGTERM, SIGHUP, SIGQUIT) through :func:`_on_signal` for the block
    (main thread only), Ray's own SIGTERM handler (set by ray.init) kept out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    handler = _on_signal(stop, deadline)
    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, *STOP_SIGNALS)}
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
    os._exit(130 if signum == signal.SIGINT else signum)


def _sample(into: set[procs.Proc], before: set[procs.Proc], stop: threading.Event) -> None:
    """Add this process's new descendants to ``into`` every second until ``stop`` is set."""
    while not stop.wait(1.0):
        into.update(procs.descendants(os.getpid()) - before)


BUSY_GRACE_S = 5.0  # once the ServerApp is done: the time Flower's message workers get to end on their own


def _stop_busy_clients(
    finished: threading.Event, stop: threading.Event, before: set[threading.Thread]
) -> None:
    """Once ``finished`` is set (the ServerApp is done), stop the ClientApps if Flower's message workers (the
    threads started since ``before``) are still running after BUSY_GRACE_S: each waits in ``ray.get`` for a
    ClientApp that has not answered (one left out of its round after the round timeout), and Flower's
    simulation does not return before they end. Stopping the ClientApps (SIGKILL: the run is done, none holds
    anything it needs) ends their wait (an ActorDiedError, expected and not logged). Returns at once when
    ``stop`` is set first (the run ends otherwise)."""
    while not finished.wait(0.5):
        if stop.is_set():
            return
    end = time.monotonic() + BUSY_GRACE_S
    while any(_is_message_worker(t) for t in set(threading.enumerate()) - before):
        if stop.wait(0.1):
            return
        if time.monotonic() >= end:
            logging.getLogger("flwr").setLevel(logging.CRITICAL)  # the workers' ActorDiedErrors are expected
            _mute_ray_errors()  # ... and so are Ray's reports of the ClientApps it lost
            procs.stop((p for p in procs.descendants(os.getpid()) if _is_client_app(p)), timeout=0.0)
            return


def _join_new_threads(before: set[threading.Thread], timeout: float, workers: bool = False) -> None:
    """Wait (up to ``timeout`` s in all) for the threads started since ``before``: the ServerApp's, which
    stops polling once ``stop`` is set, or with ``workers`` Flower's message workers, which wait for a
    ClientApp in ``ray.get`` (a whole local update) unless the ClientApp was stopped."""
    end = time.monotonic() + timeout
    for thread in set(threading.enumerate()) - before:
        if thread is threading.current_thread() or thread.daemon or _is_message_worker(thread) != workers:
            continue
        thread.join(max(0.0, end - time.monotonic()))


def _is_client_app(proc: procs.Proc) -> bool:
    """A Ray worker process running a ClientApp actor (Ray names its process ``ray::ClientAppActor``)."""
    import psutil

    try:
        return " ".join(psutil.Process(proc[0]).cmdline()).startswith("ray::ClientAppActor")
    except psutil.Error:  # gone, or a zombie
        return False


def _is_message_worker(thread: threading.Thread) -> bool:
    return thread.name.startswith("ThreadPoolExecutor")  # Flower's vce_api runs messages in such a pool


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
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
