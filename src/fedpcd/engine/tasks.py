"""What the server sends a client for one round (:class:`ClientTask`) and what it gets back
(:class:`ClientReply`), on every backend: the in-process executor, the worker pool and Flower
(``fedpcd.engine.client_update`` runs a task)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedpcd.algorithms import Algorithm
from fedpcd.algorithms.context import NUM_SAMPLES, TRAIN_LOSS


@dataclass
class ClientTask:
    """One client's round as the server sends it."""

    round: int
    client: int
    payload: dict[str, Any]  # ``algorithm.payload_for(server, client)``
    state: Any  # the client's stored state (None: none yet; the model then starts from its initial weights)
    evaluate: bool  # personal metrics after the update (an evaluated round)
    full_test: bool = True  # the personal model on the full test set (PA-L, PA-V, PA-G), else its split only


@dataclass
class ClientReply:
    """One client's round as the server gets it back.

    ``update`` is the algorithm's reply (what its ``aggregate`` reads); ``state`` the state to store (None:
    keep the stored one); ``error`` what the client raised (``update`` is then empty and the round leaves
    the client out, engine/guard.py; a :class:`~fedpcd.engine.guard.NonFiniteError` for a divergence)."""

    client: int
    update: dict[str, Any]
    metrics: dict[str, Any] | None  # personal metrics (None when not evaluated)
    bytes_down: int
    bytes_up: int
    state: Any = None
    error: BaseException | None = None
    clipped: bool = False  # its model update was longer than privacy.clip (engine/privacy.py)

    @property
    def num_samples(self) -> int:
        """n_k as the client reports it."""
        return int(self.update[NUM_SAMPLES])

    @property
    def train_loss(self) -> float | None:
        """The update's mean training loss (None when the algorithm does not report one)."""
        loss = self.update.get(TRAIN_LOSS)
        return None if loss is None else float(loss)


def payloads_for(
    algorithm: Algorithm, server: dict[str, Any], ids: Iterable[int]
) -> dict[int, dict[str, Any]]:
    """Each participant's payload (``algorithm.payload_for``), computed once per round: its task carries it
    to the client, and the server checks and clips the client's reply against it."""
    return {k: algorithm.payload_for(server, k) for k in ids}
