"""``engine.workers``: a round's clients trained by worker processes and this process at once.

A :class:`WorkerPool` of ``workers`` processes is this one plus ``workers - 1`` worker processes, started
once per run (on first use, so the first round already runs while they start) and kept for every round.
Each worker holds the run's :class:`~fedpcd.engine.federation.Federation`: its data tensors come through
torch's shared memory (no copy per worker), its clients are rebuilt from the partition and its model objects
are its own, pinned to ``engine.threads`` (default 1) torch threads. A task travels to a worker as the
algorithm object and a :class:`~fedpcd.engine.tasks.ClientTask` (payload and stored state), pickled; the
:class:`~fedpcd.engine.tasks.ClientReply` (update, new state, metrics) comes back the same way. Client
states stay with the round loop's executor, so checkpoints and resume are those of ``workers: 1``.

Every task runs :func:`fedpcd.engine.client_update.run_clients`, the code of ``workers: 1`` and of Flower's
ClientApp, and a client's computation depends only on its task (its generator is seeded by seed, round and
client; a client without state starts from the architecture's seeded initial weights), so the replies are
bitwise those of ``workers: 1`` whichever process runs a client; they are returned in task order, and the
round loop aggregates in client-id order.

Scheduling: sequential clients are handed out one at a time, largest first, to whichever process is free
(the workers through a queue one task deep, this process between its own tasks), so uneven clients balance
out and the round ends on small ones. With ``engine.executor: vectorized`` each process trains one
contiguous share of the clients (shares balanced by sample count) at once; the vectorized executor's
rounding then depends on the share, as it depends on its chunks (its results equal the sequential ones up to
float rounding, not bitwise).

A worker that dies (killed, out of memory) breaks the pool: it is restarted and the clients it left
unanswered run again once; if the pool breaks again they are failed clients, left out of the round as
``engine.min_clients`` allows (engine/guard.py). Workers ignore Ctrl-C (this process stops them) and exit
when this process dies, even by SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from fedpcd.algorithms import Algorithm
from fedpcd.engine.client_update import run_clients
from fedpcd.engine.federation import Federation, set_threads
from fedpcd.engine.tasks import ClientReply, ClientTask
from fedpcd.logs import LOGGER
from fedpcd.models import MODELS
from fedpcd.procs_guard import die_with_parent, starting_children, unblock_ctrl_c, usable_cores

__all__ = ["WorkerDied", "WorkerPool"]


class WorkerDied(RuntimeError):
    """The worker process running a client died (twice) before answering: the client failed this round."""


# ----- in a worker ------------------------------------------------------------------------------------------

_FEDERATION: Federation | None = None


def _start_worker(fed: Federation, parent: int) -> None:
    global _FEDERATION
    unblock_ctrl_c(signal.SIG_IGN)  # Ctrl-C is the round loop's: it stops the pool
    die_with_parent(parent)
    set_threads(fed.config)
    _FEDERATION = fed


class NotInWorker(RuntimeError):
    """A worker cannot rebuild what the task needs (a class defined where a fresh process cannot import it):
    this process runs the clients instead."""


def _work(algorithm: bytes, tasks: bytes) -> bytes:
    """Run pickled tasks in a worker; the pickled replies."""
    assert _FEDERATION is not None
    try:
        unpickled, todo = pickle.loads(algorithm), pickle.loads(tasks)
        for arch in _FEDERATION.config.model.architectures(_FEDERATION.config.clients):
            MODELS.get(arch)
    except Exception as exc:  # noqa: BLE001 - e.g. a class defined in a notebook, a model registered there
        raise NotInWorker(f"{type(exc).__name__}: {exc}") from None
    return _dumps(run_clients(unpickled, _FEDERATION, todo))


def _dumps(replies: list[ClientReply]) -> bytes:
    """Pickled replies; an exception that does not pickle travels as a RuntimeError with its text."""
    for reply in replies:
        if reply.error is not None:
            try:
                pickle.dumps(reply.error)
            except Exception:  # noqa: BLE001 - any unpicklable exception
                reply.error = RuntimeError(f"{type(reply.error).__name__}: {reply.error}")
    return pickle.dumps(replies, protocol=pickle.HIGHEST_PROTOCOL)


# ----- in the round loop's process ------------------------------------------------------------------------


class WorkerPool:
    """This process and ``workers - 1`` worker processes running a round's tasks (see the module doc)."""

    def __init__(self, fed: Federation, workers: int) -> None:
        if workers < 2:
            raise ValueError("a WorkerPool needs at least 2 processes (workers: 1 runs in-process)")
        self.fed = fed
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self.unavailable: str | None = None  # why the workers cannot run the clients (all run here then)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers - 1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self.fed, os.getpid()),
            )
        return self._pool

    def run(self, algorithm: Algorithm, tasks: Sequence[ClientTask]) -> list[ClientReply]:
        """The replies to ``tasks``, in their order."""
        if not tasks or self.unavailable is not None:
            return run_clients(algorithm, self.fed, tasks)
        pickled = pickle.dumps(algorithm, protocol=pickle.HIGHEST_PROTOCOL)
        groups = self._groups(tasks)
        replies: dict[int, ClientReply] = {}
        lost = self._schedule(algorithm, pickled, tasks, groups, replies)
        if lost:  # a worker died: a fresh pool runs its clients again, once
            self.close()
            again = self._schedule(algorithm, pickled, tasks, [[i] for i in lost], replies, local=False)
            for i in again:
                task = tasks[i]
                error = WorkerDied(f"the worker process running client {task.client} died")
                replies[i] = ClientReply(task.client, {}, None, 0, 0, error=error)
        return [replies[i] for i in range(len(tasks))]

    def _groups(self, tasks: Sequence[ClientTask]) -> list[list[int]]:
        """Positions of the tasks a process runs at once: one by one, or (vectorized) one share per process,
        contiguous in task order, balanced by the clients' sample counts."""
        if self.fed.config.engine.executor != "vectorized":
            return [[i] for i in range(len(tasks))]
        sizes = [self.fed.clients[t.client].num_samples for t in tasks]
        total, shares, current, done = sum(sizes), [], [], 0
        for i, n in enumerate(sizes):
            current.append(i)
            done += n
            if done >= total * (len(shares) + 1) / self.workers and len(shares) < self.workers - 1:
                shares.append(current)
                current = []
        return [s for s in [*shares, current] if s]

    def _schedule(
        self,
        algorithm: Algorithm,
        pickled: bytes,
        tasks: Sequence[ClientTask],
        groups: list[list[int]],
        replies: dict[int, ClientReply],
        local: bool = True,
    ) -> list[int]:
        """Run ``groups`` of task positions, the largest first, in the workers (``pickled``: ``algorithm``
        as they get it) and (``local``) this process; replies into ``replies``. Returns the positions whose
        worker died."""
        size = {i: self.fed.clients[t.client].num_samples for i, t in enumerate(tasks)}
        # the largest first, to whichever process is free (longest processing time first: the round ends on
        # small clients, so the processes finish together)
        pending: deque[list[int]] = deque(sorted(groups, key=lambda g: -sum(size[i] for i in g)))
        running: dict[Future[bytes], list[int]] = {}
        lost: list[int] = []
        broken = False
        pool = self._executor()
        while pending or running:
            for future in [f for f in running if f.done()]:  # collect, so that workers get the next ones
                group = running.pop(future)
                try:
                    answers = pickle.loads(future.result())
                except BrokenProcessPool:
                    broken = True
                    lost += group
                    continue
                except NotInWorker as exc:  # from now on this process runs every client
                    self.unavailable = str(exc)
                    LOGGER.warning(
                        "engine.workers: a worker process cannot run this run's clients (%s); they run in "
                        "this process",
                        exc,
                    )
                    answers = run_clients(algorithm, self.fed, [tasks[i] for i in group])
                for i, reply in zip(group, answers, strict=True):
                    replies[i] = reply
            busy = self.unavailable is not None
            # each worker busy and, while more tasks wait than processes take, one queued (the vectorized
            # executor's shares, one per process, are never queued behind each other)
            while pending and not broken and not busy and len(running) < self.workers - (len(pending) <= 1):
                group = pending.popleft()
                try:
                    with starting_children():  # a worker it starts: no traceback on a signal at start-up
                        running[pool.submit(_work, pickled, pickle.dumps([tasks[i] for i in group]))] = group
                except BrokenProcessPool:
                    broken = True
                    pending.appendleft(group)
            if pending and (local or busy):
                group = pending.popleft()
                for i, reply in zip(
                    group, run_clients(algorithm, self.fed, [tasks[i] for i in group]), strict=True
                ):
                    replies[i] = reply
                continue
            if broken:  # what no process can take now is lost
                lost += [i for group in pending for i in group]
                pending.clear()
            if running:
                wait(running, return_when=FIRST_COMPLETED)
        return sorted(lost)

    def close(self) -> None:
        """Stop the worker processes (at once: queued tasks are dropped)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            if p.is_alive():
                p.kill()
        for p in processes:
            p.join(timeout=10)


START_COST_S = 5.0  # a worker's start (spawn, torch's import, the federation) on a loaded 2-core machine
WORKER_BYTES = 256 << 20  # a worker's own memory besides its models (torch's runtime; measured ~170 MB)


def auto_workers(fed: Federation) -> tuple[int, str]:
    """``engine.workers: auto``: (processes, why). The usable cores (:func:`usable_cores`), capped by the
    clients per round and by the available memory (a worker holds its own model objects and torch's
    runtime); one process on a GPU, which trains the clients one after another (``engine.executor: auto``
    is sequential everywhere; ``engine.executor: vectorized`` batches them)."""
    import psutil

    config = fed.config
    if fed.device.type != "cpu":
        return (
            1,
            "on a GPU one process, its clients one after another (engine.executor: vectorized batches them)",
        )
    cores = usable_cores()
    per_round = config.clients_per_round
    model = sum(t.numel() * t.element_size() for t in fed.model_for(0).state_dict().values())
    memory = int(psutil.virtual_memory().available // (WORKER_BYTES + 16 * model))
    workers = max(1, min(cores, per_round, memory))
    why = {cores: f"{cores} usable cores", per_round: f"{per_round} clients per round", memory: "memory"}
    return workers, why[workers] if workers > 1 else why.get(1, "one core")


def worker_count(fed: Federation) -> int:
    """``engine.workers`` for this run: the number given, or ``auto`` (:func:`auto_workers`)."""
    setting: Any = fed.config.engine.workers
    return int(setting) if setting != "auto" else auto_workers(fed)[0]
