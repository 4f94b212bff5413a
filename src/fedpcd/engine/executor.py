"""Executors: how the round's sampled clients are trained in the local simulator.

``train_clients`` is the one seam between the round loop (``simulation.run_local``) and client training: it
takes the round's participants and returns one :class:`ClientResult` per participant, in the order of
``ids``. The sequential executor runs :func:`fedpcd.engine.federation.client_step` client after client on the
architecture's reusable model object (exactly what a Flower ClientApp does for one client).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedpcd.algorithms import FedAvg
from fedpcd.algorithms.base import tensor_bytes
from fedpcd.engine.federation import Federation, client_step


@dataclass
class ClientResult:
    """One participant's round: its reply, personal metrics (None when not evaluated) and message sizes."""

    client: int
    reply: dict[str, Any]
    metrics: dict[str, Any] | None
    bytes_down: int
    bytes_up: int


def train_clients(
    algorithm: FedAvg,
    fed: Federation,
    server: dict[str, Any],
    ids: Sequence[int],
    client_states: dict[int, Any],
    rnd: int,
    evaluate: bool,
) -> list[ClientResult]:
    """Train (and, if ``evaluate``, personally evaluate) the participants ``ids`` of round ``rnd``.

    ``client_states`` is updated in place (a None state does not erase a stored one).
    """
    return train_sequential(algorithm, fed, server, ids, client_states, rnd, evaluate)


def train_sequential(
    algorithm: FedAvg,
    fed: Federation,
    server: dict[str, Any],
    ids: Sequence[int],
    client_states: dict[int, Any],
    rnd: int,
    evaluate: bool,
) -> list[ClientResult]:
    """The sequential executor: one client after another on the reusable model object."""
    config = fed.config
    results = []
    for k in ids:
        payload = algorithm.payload_for(server, k)
        state = client_states.get(k)
        reply, state, metrics = client_step(
            algorithm,
            fed.model_for(k, fresh=state is None),
            fed.clients[k],
            payload,
            state,
            seed=config.seed,
            rnd=rnd,
            evaluate=evaluate,
            full_test=config.personal_test == "full",
        )
        if state is not None:
            client_states[k] = state
        results.append(ClientResult(k, reply, metrics, tensor_bytes(payload), tensor_bytes(reply)))
    return results
