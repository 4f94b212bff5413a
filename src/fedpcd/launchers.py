"""Where a sweep's runs execute: ``fedpcd sweep --launcher local | ray | slurm``.

A launcher only runs ``sweep.run.run_one`` somewhere: :meth:`Launcher.submit` hands it one run of the grid
and :meth:`Launcher.wait` returns the runs that ended (and those running); what to run, skipping finished
runs, resuming stopped ones, the index, the progress line and the one line per failure stay in
``sweep.run.run_sweep``, the same for every launcher.

- ``local`` (``--jobs N``, N > 1): N spawned worker processes on this machine that die with the sweep
  (``procs_guard``), each run's ``engine.workers: auto`` taking its share of the cores (``FEDPCD_CORES``);
  ``--jobs auto`` (the default) takes N from the runs to do and the machine (``sweep.run.auto_jobs``).
- ``ray``: one Ray task per run on an existing cluster (``--address``, else ``RAY_ADDRESS``) or on one started
  on this machine for the sweep (loopback only, no dashboard) and stopped at its end. ``--jobs N``: N runs at
  once (at most as many as the cluster's CPUs hold), each reserving the cluster's CPUs // N (at most one
  node's); by default one CPU per run and as many runs as the cluster has CPUs.
- ``slurm``: one Slurm job per run through submitit (``--slurm KEY=VALUE``: :data:`SLURM_KEYS`); its job
  files and logs go to ``<output_dir>/submitit``. ``--jobs N``: at most N jobs queued or running at once
  (default: the whole grid). ``--slurm cluster=local`` runs the jobs as processes on this machine instead,
  which end with the sweep's process.

Ray and Slurm runs need fedpcd installed on every node and the sweep's output_dir (and the data) at the same
path on all of them; a run starts in the folder the sweep was started from, so relative paths mean the same.
A run's exception comes back as itself (its type and message) and is one ``FAILED`` line, as in the local
pool; its traceback goes to the run's log (Ray's worker logs, the Slurm job's stderr). Interrupting the sweep
(Ctrl-C, SIGTERM) cancels the runs it submitted; they resume from their checkpoints on the next sweep.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import pickle
import shutil
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from types import TracebackType
from typing import Any

from fedpcd.errors import STOP_SIGNALS, Terminated, UserError, choices, clip
from fedpcd.procs_guard import (
    CORES_VAR,
    POLL_S,
    die_with_parent,
    not_ignored,
    starting_children,
    unblock_ctrl_c,
    usable_cores,
)

RunResult = tuple[str, float | None, float]  # run_one's result: folder, summary wall time, seconds
RunOne = Callable[[dict[str, Any], bool], RunResult]  # sweep.run.run_one, handed in (it imports this module)
LAUNCHERS = ("local", "ray", "slurm")
CLUSTER_EXTRA = 'pip install "fedpcd[cluster]"'
# --slurm KEY=VALUE: key -> (submitit's AutoExecutor parameter, type); time in minutes, mem in GB
SLURM_KEYS: dict[str, tuple[str, type]] = {
    "partition": ("slurm_partition", str),
    "time": ("timeout_min", int),
    "cpus": ("cpus_per_task", int),
    "mem": ("mem_gb", float),
    "gpus": ("gpus_per_node", int),
}
SLURM_CLUSTERS = ("slurm", "local")  # --slurm cluster=: Slurm, or submitit's processes on this machine
SLURM_TIME_MIN = 60  # a job's time limit unless --slurm time=MINUTES (submitit's own default is 5)
SUBMITIT_FOLDER = "submitit"  # in the sweep's output_dir: the jobs' pickles and logs


class Launcher:
    """Runs a sweep's runs: ``with launcher:`` starts it (sets ``slots``), ``submit`` hands it a run,
    ``wait`` says which ended, ``result`` returns one's result or raises its exception; leaving the block
    cancels the runs still going (an interrupted sweep) and stops what the launcher started."""

    slots: int | None = 1  # runs submitted at once (None: all of them)
    parallel: int | None = None  # runs that run at once, for the ETA (None: those running now)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def describe(self) -> str:
        """One line saying where the runs go (printed once it started)."""
        raise NotImplementedError

    def submit(self, run: RunOne, config_data: dict[str, Any], resume: bool) -> Any:
        """Start ``run(config_data, resume)`` (``sweep.run.run_one``); a handle for ``wait``, ``result``."""
        raise NotImplementedError

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        """(the handles whose runs ended, those running now), waiting up to ``timeout`` s for one to end."""
        raise NotImplementedError

    def result(self, handle: Any) -> RunResult:
        """An ended run's result; raises the run's exception where it failed."""
        raise NotImplementedError

    def lost(self, handle: Any) -> bool:
        """Whether an ended run ended because the process running it died (a kill, or code that ended the
        process), not by an exception of its own: the sweep then runs it once more."""
        return False

    def close(self) -> None:
        """Cancel the runs still going and release what the launcher started."""


def make_launcher(
    name: str, jobs: int | None, address: str | None, slurm: list[str] | None, root: Path
) -> Launcher | None:
    """The launcher ``name`` for a sweep whose output_dir is ``root``; None: the runs go one after another
    in this process (``local`` with one job). Checks the options and that Ray or submitit is installed."""
    if name not in LAUNCHERS:
        raise choices("launcher", name, LAUNCHERS)
    if address is not None and name != "ray":
        raise UserError("--address goes with --launcher ray (the address of a Ray cluster)")
    if slurm and name != "slurm":
        raise UserError("--slurm KEY=VALUE goes with --launcher slurm")
    if name == "ray":
        return RayLauncher(jobs, address or os.environ.get("RAY_ADDRESS") or None)
    if name == "slurm":
        return SlurmLauncher(jobs, slurm or [], root / SUBMITIT_FOLDER)
    return LocalLauncher(jobs) if jobs and jobs > 1 else None


def _require(module: str, launcher: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"--launcher {launcher} needs {module}, which is not installed: {CLUSTER_EXTRA}")


# ----- local: a process pool on this machine -------------------------------------------------------------


def _start_job(parent: int, cores: int) -> None:
    """A sweep worker: dies with the sweep, its runs' ``engine.workers: auto`` use ``cores`` cores, and it
    keeps the dataset it loaded last for its next run."""
    from fedpcd.data.datasets import keep_datasets

    keep_datasets(True)
    die_with_parent(parent)
    for sig in not_ignored(STOP_SIGNALS):
        signal.signal(sig, _worker_signal)
    unblock_ctrl_c(_worker_signal)  # blocked while it was started
    os.environ[CORES_VAR] = str(cores)


_IN_RUN = threading.Event()  # in a sweep worker: set while it runs a run


def _worker_signal(signum: int, frame: Any) -> None:
    """A sweep worker's Ctrl-C, SIGTERM, SIGHUP or SIGQUIT: in a run, it stops as the command's own process
    does (KeyboardInterrupt, :class:`Terminated`: its lock released); idle, the worker exits quietly (no
    KeyboardInterrupt traceback from the pool's wait for work)."""
    if not _IN_RUN.is_set():
        raise SystemExit(128 + signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _run_in_worker(run: RunOne, config_data: dict[str, Any], resume: bool) -> RunResult:
    """``run`` in a sweep worker, marked as running for :func:`_worker_signal`."""
    _IN_RUN.set()
    try:
        return run(config_data, resume)
    finally:
        _IN_RUN.clear()


class WorkerDied(RuntimeError):
    """The worker process that ran a sweep's run died before the run ended (killed, or ended by code)."""


class LocalLauncher(Launcher):
    """``jobs`` spawned worker processes that die with this one; a run counts as running once a worker has
    taken it. A worker that dies (``kill -9``, a plugin calling ``os._exit``) breaks the pool and every run
    in it: those runs are :meth:`lost`, and the next ``submit`` starts a fresh pool."""

    def __init__(self, jobs: int, why: str = "") -> None:
        self.slots = self.parallel = jobs
        self.why = why  # --jobs auto: what set the number
        self._share = 1
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> LocalLauncher:
        self._share = max(1, usable_cores() // self.slots)  # each run's engine.workers: auto takes its share
        self._pool = self._new_pool()
        return self

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.slots, get_context("spawn"), initializer=_start_job, initargs=(os.getpid(), self._share)
        )

    def describe(self) -> str:
        why = f" (--jobs auto: {self.why})" if self.why else ""
        return f"sweep: runs in {self.slots} worker processes on this machine{why}"

    def submit(self, run: RunOne, config_data: dict[str, Any], resume: bool) -> Future[RunResult]:
        assert self._pool is not None
        with starting_children():  # a worker it starts: no traceback on a signal at start-up
            try:
                return self._pool.submit(_run_in_worker, run, config_data, resume)
            except BrokenProcessPool:  # a worker died: its pool takes no more runs
                self._pool.shutdown(wait=True)
                self._pool = self._new_pool()
                return self._pool.submit(_run_in_worker, run, config_data, resume)

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        done, pending = wait(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        return [f for f in handles if f in done], [f for f in handles if f in pending and f.running()]

    def result(self, handle: Future[RunResult]) -> RunResult:
        try:
            return handle.result()
        except BrokenProcessPool:
            raise WorkerDied(
                "its worker process died before the run ended (killed, or code in it ended the process)"
            ) from None

    def lost(self, handle: Future[RunResult]) -> bool:
        return isinstance(handle.exception(), BrokenProcessPool)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None and issubclass(kind, Terminated) and self._pool is not None:
            # SIGTERM reached the sweep only (Ctrl-C reaches the workers too): Ctrl-C its workers, so their
            # runs stop at once, locks released, instead of the shutdown waiting for them to finish
            for process in list(getattr(self._pool, "_processes", None) or {}):  # pids of its workers
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process, signal.SIGINT)
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# ----- ray and slurm: a run in another process or on another machine ------------------------------------


def _run_remote(
    run: RunOne,
    cwd: str,
    cores: int | None,
    config_data: dict[str, Any],
    resume: bool,
    owner: int | None = None,
) -> tuple[bool, Any]:
    """``run`` (``sweep.run.run_one``) in a Ray worker or a Slurm job, started in the sweep's folder ``cwd``
    (``cores``: its ``FEDPCD_CORES``; ``owner``: a process on this machine whose end ends this one, the
    sweep's with submitit's local processes): (True, its result), or (False, its exception, which the sweep
    raises) with the traceback on this process's stderr (the run's log)."""
    if owner is not None:  # Ctrl-C stops the run (started with it ignored, see SlurmLauncher.submit)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=_exit_with, args=(owner,), name="fedpcd-sweep-watch", daemon=True).start()
    try:
        os.chdir(cwd)
        if cores is not None:
            os.environ[CORES_VAR] = str(cores)
        return True, run(config_data, resume)
    except Exception as exc:
        traceback.print_exc()
        try:  # it travels pickled: one that does not come back intact is sent as its type and message
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return False, exc.with_traceback(None)


@contextlib.contextmanager
def _sigint_ignored(ignore: bool) -> Iterator[None]:
    """SIGINT ignored for the block where ``ignore`` (the processes started meanwhile inherit it); only the
    main thread sets signal handlers."""
    if not ignore or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit_with(pid: int) -> None:
    """End this process once the process ``pid`` has ended (a zombie included: ended, not yet reaped)."""
    import psutil

    try:
        owner = psutil.Process(pid)
        while owner.is_running() and owner.status() != psutil.STATUS_ZOMBIE:
            time.sleep(POLL_S)
    except psutil.Error:  # gone meanwhile
        pass
    os._exit(1)


def _outcome(outcome: tuple[bool, Any]) -> RunResult:
    ok, value = outcome
    if not ok:
        raise value
    return value


class RayLauncher(Launcher):
    """One Ray task per run (no retries: a failure is the run's); every submitted run counts as running,
    since no more are submitted than the cluster's CPUs hold."""

    def __init__(self, jobs: int | None, address: str | None) -> None:
        _require("ray", "ray")
        if address:
            _check_reachable(address)
        self.jobs, self.address = jobs, address
        self._task: Any = None
        self.cpus = 1  # per run
        self._active: set[Any] = set()

    def __enter__(self) -> RayLauncher:
        import logging

        from fedpcd.flower import _env  # Ray's offline, loopback-only switches (before Ray is imported)

        _env.set_offline_defaults()
        import ray

        quiet: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
        try:
            if self.address:
                ray.init(address=self.address, **quiet)
            else:  # "local": a new cluster, not one a `ray start` left on this machine
                ray.init(
                    address="local",
                    num_cpus=usable_cores(),
                    include_dashboard=False,
                    _node_ip_address=_env.LOOPBACK,
                    **quiet,
                )
        except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UserError(f"cannot connect to {self._where()}: {clip(first, 200)}") from None
        total = int(ray.cluster_resources().get("CPU", 0))
        node = max((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]), default=0)
        if node < 1:
            self.close()
            raise UserError(f"{self._where()} has no CPUs to run on")
        self.cpus = min(node, max(1, total // self.jobs)) if self.jobs else 1
        self.slots = self.parallel = max(1, min(self.jobs or total, total // self.cpus))  # no run waits
        self._task = ray.remote(_run_remote).options(num_cpus=self.cpus, max_retries=0)
        return self

    def _where(self) -> str:
        return f"the Ray cluster at {self.address}" if self.address else "a Ray cluster on this machine"

    def describe(self) -> str:
        return f"sweep: runs on {self._where()}, {self.slots} at a time, {self.cpus} CPU each"

    def submit(self, run: RunOne, config_data: dict[str, Any], resume: bool) -> Any:
        ref = self._task.remote(run, os.getcwd(), self.cpus, config_data, resume)
        self._active.add(ref)
        return ref

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        import ray

        ready, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        if ready:  # and every other one that ended meanwhile
            ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        return ready, [h for h in handles if h not in ready]

    def result(self, handle: Any) -> RunResult:
        import ray

        self._active.discard(handle)
        return _outcome(ray.get(handle))

    def close(self) -> None:
        import ray

        for ref in self._active:
            ray.cancel(ref, force=True)
        self._active.clear()
        ray.shutdown()


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """One line where nothing answers at a Ray address ``host:port`` (Ray itself would retry for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():  # e.g. "auto": Ray looks the cluster up itself
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout).close()
    except OSError as exc:
        raise UserError(
            f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}; start one with `ray start "
            "--head` and give the address it prints, or leave --address out to start one for the sweep"
        ) from None


def parse_slurm(items: list[str]) -> tuple[str, dict[str, Any]]:
    """``--slurm KEY=VALUE`` items: (the cluster, submitit's AutoExecutor parameters)."""
    valid = [*SLURM_KEYS, "cluster"]
    cluster, params = "slurm", {"timeout_min": SLURM_TIME_MIN}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--slurm takes KEY=VALUE, got {item!r}; keys: {', '.join(valid)}")
        if key == "cluster":
            if value not in SLURM_CLUSTERS:
                raise choices("--slurm cluster", value, SLURM_CLUSTERS)
            cluster = value
            continue
        if key not in SLURM_KEYS:
            raise choices("--slurm key", key, valid)
        name, kind = SLURM_KEYS[key]
        try:
            params[name] = kind(value)
        except ValueError:
            number = "a whole number" if kind is int else "a number"
            raise UserError(f"--slurm {key}= takes {number}, got {value!r}") from None
        if kind is not str and params[name] <= 0:
            raise UserError(f"--slurm {key}= must be above 0, got {value!r}")
    return cluster, params


class SlurmLauncher(Launcher):
    """One Slurm job per run through submitit's AutoExecutor; a job counts as running once Slurm (or the
    local process) says so, and the ETA divides by the jobs running now."""

    def __init__(self, jobs: int | None, items: list[str], folder: Path) -> None:
        self.cluster, self.params = parse_slurm(items)
        _require("submitit", "slurm")
        if self.cluster == "slurm" and not all(shutil.which(command) for command in ("sbatch", "srun")):
            raise UserError(
                "--launcher slurm: Slurm's sbatch and srun are not on the PATH (submit from a Slurm login "
                "node); --slurm cluster=local runs the jobs on this machine instead"
            )
        self.jobs, self.folder = jobs, folder
        self._executor: Any = None
        self._active: set[Any] = set()

    def __enter__(self) -> SlurmLauncher:
        import submitit

        from fedpcd.utils import make_folder, refuse_link

        refuse_link(self.folder)
        make_folder(self.folder)
        self._executor = submitit.AutoExecutor(folder=self.folder, cluster=self.cluster)
        self._executor.update_parameters(**self.params)
        self.slots = self.jobs
        return self

    def describe(self) -> str:
        where = "on Slurm" if self.cluster == "slurm" else "as processes on this machine"
        at_once = f"at most {self.jobs} at a time" if self.jobs else "all at once"
        return f"sweep: one submitit job per run {where}, {at_once} (job files and logs: {self.folder})"

    def submit(self, run: RunOne, config_data: dict[str, Any], resume: bool) -> Any:
        self._executor.update_parameters(name=f"fedpcd-{Path(config_data['output_dir']).name}"[:128])
        owner = os.getpid() if self.cluster == "local" else None  # Slurm's jobs are cancelled instead
        try:
            # submitit prints sbatch's errors (said below); its local controller processes, which Ctrl-C
            # would make print a traceback, start with SIGINT ignored: the run's process and the sweep act
            with contextlib.redirect_stderr(io.StringIO()), _sigint_ignored(owner is not None):
                job = self._executor.submit(_run_remote, run, os.getcwd(), None, config_data, resume, owner)
        except Exception as exc:  # sbatch refused it (a partition, a time limit): so it would every run
            why = "; ".join(line.strip() for line in str(exc).strip().splitlines()) or type(exc).__name__
            raise UserError(f"submitting a Slurm job failed: {clip(why, 300)}") from None
        self._active.add(job)
        return job

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        ended = [job for job in handles if job.done()]
        if not ended:
            time.sleep(timeout)
        return ended, [job for job in handles if job not in ended and job.state == "RUNNING"]

    def result(self, handle: Any) -> RunResult:
        self._active.discard(handle)
        return _outcome(handle.result())

    def close(self) -> None:
        for job in self._active:
            job.cancel(check=False)
        self._active.clear()
