"""What an executor returns per participant (the sequential one in ``engine.executor``, the vectorized one in
``engine.vectorized``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ClientResult:
    """One participant's round: its reply, personal metrics (None when not evaluated) and message sizes."""

    client: int
    reply: dict[str, Any]
    metrics: dict[str, Any] | None
    bytes_down: int
    bytes_up: int
    # what the client raised (its reply is then empty and it is left out of aggregation, see engine/guard.py);
    # a guard.NonFiniteError when it failed on non-finite weights (a divergence)
    error: BaseException | None = None
    clipped: bool = False  # its model update was longer than privacy.clip (engine/privacy.py)
