"""Executors: how the round loop (:mod:`fedpcd.engine.rounds`) gets its sampled clients trained.

An :class:`Executor` takes the round's participants and returns one :class:`ClientReply` per participant,
in the order of ``ids``, and keeps the clients' personal states (for checkpoints: ``states``/``restore``).
Two implement it: :class:`LocalExecutor` here (this process, and with ``engine.workers`` > 1 a pool of
worker processes: :mod:`fedpcd.engine.pool`) and ``fedpcd.flower.grid_executor.GridExecutor`` (Flower
ClientApps, through Flower's Grid). Both run each client with :mod:`fedpcd.engine.client_update`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Protocol

from fedpcd.algorithms import Algorithm
from fedpcd.engine.client_update import run_clients
from fedpcd.engine.federation import Federation
from fedpcd.engine.pool import START_COST_S, WorkerPool
from fedpcd.engine.state_store import ClientStateStore, state_store_for
from fedpcd.engine.tasks import ClientReply, ClientTask
from fedpcd.engine.update_policy import store_state

__all__ = ["ClientReply", "Executor", "LocalExecutor", "StatesUnavailable"]


class StatesUnavailable(RuntimeError):
    """The clients' states could not all be collected (e.g. a Flower node did not answer): the round loop
    skips that checkpoint with a warning and keeps the previous one."""


class Executor(Protocol):
    """What the round loop needs from a way of running clients."""

    def train(
        self,
        algorithm: Algorithm,
        payloads: Mapping[int, dict[str, Any]],
        rnd: int,
        evaluate: bool,
        full_test: bool = True,
    ) -> list[ClientReply]:
        """One reply per client of ``payloads`` (client id -> what it is sent; in that order) for round
        ``rnd``; personal metrics when ``evaluate`` (PA-G too when ``full_test``). The clients' states follow
        :mod:`fedpcd.engine.update_policy` (a reply without a state keeps the stored one)."""
        ...

    def states(self) -> Mapping[int, Any]:
        """Every client's current personal state (what a checkpoint stores); :class:`StatesUnavailable`
        when they cannot all be had."""
        ...

    def restore(self, states: Mapping[int, Any]) -> None:
        """Make ``states`` the clients' states (resume; an empty mapping: a fresh run)."""
        ...

    def close(self) -> None:
        """Release what the executor started (worker processes); the run is over."""
        ...


class LocalExecutor:
    """Clients trained by this process, or with ``workers`` > 1 by a :class:`WorkerPool` of that many
    processes (bitwise the same replies); their states in the run's client-state store
    (``engine.client_state``: memory or disk)."""

    def __init__(
        self,
        fed: Federation,
        workers: int = 1,
        states: MutableMapping[int, Any] | None = None,
        *,
        adaptive: bool = False,
    ) -> None:
        """``states``: keep the clients' states in this mapping instead of the run's store (scripts and
        tests driving rounds themselves). ``adaptive`` (``engine.workers: auto``): the first round runs in
        this process, and the pool starts only if the rounds left would save more than its start costs."""
        self.fed = fed
        self.pool = WorkerPool(fed, workers) if workers > 1 else None
        self.undecided = adaptive and self.pool is not None
        if states is not None:
            self.__dict__["client_states"] = states

    @functools.cached_property
    def client_states(self) -> ClientStateStore:
        """The run's store, opened on first use: after the round loop has created (or checked) the run
        directory, so a disk store's folder is never made in a folder that turns out not to be this run's."""
        return state_store_for(self.fed.config, self.fed.device)

    def train(
        self,
        algorithm: Algorithm,
        payloads: Mapping[int, dict[str, Any]],
        rnd: int,
        evaluate: bool,
        full_test: bool = True,
    ) -> list[ClientReply]:
        tasks = self._tasks(payloads, rnd, evaluate, full_test)
        if self.pool is not None and not self.undecided:
            replies = self.pool.run(algorithm, list(tasks))
        else:
            t0 = time.perf_counter()
            replies = run_clients(algorithm, self.fed, tasks)
            if self.undecided:
                self._decide(rnd, time.perf_counter() - t0)
        for r in replies:
            store_state(r, self.client_states.__setitem__)
        return replies

    def _tasks(
        self, payloads: Mapping[int, dict[str, Any]], rnd: int, evaluate: bool, full_test: bool
    ) -> Iterator[ClientTask]:
        """The round's tasks, lazily: a disk state store loads one state at a time."""
        for k, payload in payloads.items():
            yield ClientTask(rnd, k, payload, self.client_states.get(k), evaluate, full_test)

    def _decide(self, rnd: int, seconds: float) -> None:
        """Keep the pool if the rounds left, at this round's time, would save more than its start costs."""
        assert self.pool is not None
        self.undecided = False
        left = self.fed.config.rounds - rnd
        if left * seconds * (1 - 1 / self.pool.workers) <= START_COST_S:
            self.pool = None

    def states(self) -> Mapping[int, Any]:
        return self.client_states

    def restore(self, states: Mapping[int, Any]) -> None:
        self.client_states.replace(dict(states))  # disk: files written after the checkpoint are undone

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
