"""Executors: how the round loop (:mod:`fedpcd.engine.rounds`) gets its sampled clients trained.

An :class:`Executor` takes the round's participants and returns one :class:`ClientResult` per participant,
in the order of ``ids``, and keeps the clients' personal states (for checkpoints: ``states``/``restore``).
Two implement it: :class:`LocalExecutor` here (in this process: sequential or vectorized, ``engine.executor``)
and ``fedpcd.flower.grid_executor.GridExecutor`` (Flower ClientApps, through Flower's Grid). The sequential
executor runs :func:`fedpcd.engine.federation.client_step` client after client on the architecture's
reusable model object (exactly what a Flower ClientApp does for one client).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Protocol

from fedpcd.algorithms import FedAvg
from fedpcd.algorithms.base import tensor_bytes
from fedpcd.engine.client_result import ClientResult
from fedpcd.engine.federation import Federation, client_step
from fedpcd.engine.guard import NonFiniteError, first_nonfinite, model_nonfinite
from fedpcd.engine.privacy import clip_update
from fedpcd.engine.state_store import ClientStateStore, state_store_for
from fedpcd.errors import UserError

__all__ = [
    "ClientResult",
    "Executor",
    "LocalExecutor",
    "StatesUnavailable",
    "train_clients",
    "train_sequential",
]


class StatesUnavailable(RuntimeError):
    """The clients' states could not all be collected (e.g. a Flower node did not answer): the round loop
    skips that checkpoint with a warning and keeps the previous one."""


class Executor(Protocol):
    """What the round loop needs from a way of running clients."""

    def train(
        self, algorithm: FedAvg, server: dict[str, Any], ids: Sequence[int], rnd: int, evaluate: bool
    ) -> list[ClientResult]:
        """One result per client of ``ids`` (in that order) for round ``rnd``: ``client_step`` from
        ``algorithm.payload_for(server, k)``. A client whose update is dropped as non-finite
        (``engine.on_divergence: drop``) keeps its previous state."""
        ...

    def states(self) -> Mapping[int, Any]:
        """Every client's current personal state (what a checkpoint stores); :class:`StatesUnavailable`
        when they cannot all be had."""
        ...

    def restore(self, states: Mapping[int, Any]) -> None:
        """Make ``states`` the clients' states (resume; an empty mapping: a fresh run)."""
        ...


class LocalExecutor:
    """Clients trained in this process (``engine.executor``: sequential, or vectorized where it applies);
    their states in the run's client-state store (``engine.client_state``: memory or disk)."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed

    @functools.cached_property
    def client_states(self) -> ClientStateStore:
        """The run's store, opened on first use: after the round loop has created (or checked) the run
        directory, so a disk store's folder is never made in a folder that turns out not to be this run's."""
        return state_store_for(self.fed.config, self.fed.device)

    def train(
        self, algorithm: FedAvg, server: dict[str, Any], ids: Sequence[int], rnd: int, evaluate: bool
    ) -> list[ClientResult]:
        config = self.fed.config
        drop = config.engine.on_divergence == "drop"
        before = {k: copy.deepcopy(self.client_states.get(k)) for k in ids} if drop else {}
        results = train_clients(algorithm, self.fed, server, ids, self.client_states, rnd, evaluate)
        if config.privacy.clip is not None and config.privacy.clipping == "client":
            for r in results:  # as the ClientApp does before its reply leaves the node
                if r.error is None:
                    payload = algorithm.payload_for(server, r.client)
                    r.reply, r.clipped = clip_update(
                        r.reply, payload, config.privacy.clip, config.algorithm.name
                    )
        for r in results:  # a dropped update leaves the client's state as it was (as a ClientApp does)
            if drop and r.error is None and first_nonfinite(r.reply) is not None:
                if before.get(r.client) is None:
                    self.client_states.pop(r.client, None)
                else:
                    self.client_states[r.client] = before[r.client]
        return results

    def states(self) -> Mapping[int, Any]:
        return self.client_states

    def restore(self, states: Mapping[int, Any]) -> None:
        self.client_states.replace(dict(states))  # disk: files written after the checkpoint are undone


def train_clients(
    algorithm: FedAvg,
    fed: Federation,
    server: dict[str, Any],
    ids: Sequence[int],
    client_states: MutableMapping[int, Any],
    rnd: int,
    evaluate: bool,
) -> list[ClientResult]:
    """Train (and, if ``evaluate``, personally evaluate) the participants ``ids`` of round ``rnd``.

    ``client_states`` is updated in place (a None state does not erase a stored one). ``engine.executor``:
    ``vectorized`` trains the clients at once where the algorithm and round allow (``engine.vectorized``),
    else sequentially with a warning; ``auto`` and ``sequential`` run them one after another. ``auto`` stays
    sequential while the vectorized executor is only ~1.3x faster on a CPU and not bitwise equal to the
    sequential path that Flower's ClientApps and the archived results use (rounding-level differences).
    """
    if fed.config.engine.executor == "vectorized":
        from fedpcd.engine.vectorized import train_or_none  # torch.func only when used

        results = train_or_none(algorithm, fed, server, ids, client_states, rnd, evaluate)
        if results is not None:
            return results
    return train_sequential(algorithm, fed, server, ids, client_states, rnd, evaluate)


def train_sequential(
    algorithm: FedAvg,
    fed: Federation,
    server: dict[str, Any],
    ids: Sequence[int],
    client_states: MutableMapping[int, Any],
    rnd: int,
    evaluate: bool,
) -> list[ClientResult]:
    """The sequential executor: one client after another on the reusable model object.

    A client that raises (anything but a UserError) gets a result with ``error`` set and its state left as
    it was; the round loop leaves it out (engine/guard.py)."""
    config = fed.config
    results = []
    for k in ids:
        payload = algorithm.payload_for(server, k)
        state = client_states.get(k)
        model = fed.model_for(k, fresh=state is None)
        try:
            reply, state, metrics = client_step(
                algorithm,
                model,
                fed.clients[k],
                payload,
                state,
                seed=config.seed,
                rnd=rnd,
                evaluate=evaluate,
                full_test=config.personal_test == "full",
            )
        except UserError:
            raise
        except Exception as exc:  # one client's failure is the round's business (engine/guard.py)
            bad = model_nonfinite(model)
            error: BaseException = exc
            if bad is not None:
                error = NonFiniteError(f"non-finite {bad}, then {type(exc).__name__}: {exc}")
                error.__cause__ = exc
            results.append(ClientResult(k, {}, None, tensor_bytes(payload), 0, error=error))
            continue
        if state is not None:
            client_states[k] = state
        results.append(ClientResult(k, reply, metrics, tensor_bytes(payload), tensor_bytes(reply)))
    return results
