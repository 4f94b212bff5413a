"""Executors: how the round's sampled clients are trained in the local simulator.

``train_clients`` is the one seam between the round loop (``simulation.run_local``) and client training: it
takes the round's participants and returns one :class:`ClientResult` per participant, in the order of
``ids``. The sequential executor runs :func:`fedpcd.engine.federation.client_step` client after client on the
architecture's reusable model object (exactly what a Flower ClientApp does for one client).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from fedpcd.algorithms import FedAvg
from fedpcd.algorithms.base import tensor_bytes
from fedpcd.engine.client_result import ClientResult
from fedpcd.engine.federation import Federation, client_step
from fedpcd.engine.guard import NonFiniteError, model_nonfinite
from fedpcd.errors import UserError

__all__ = ["ClientResult", "train_clients", "train_sequential"]


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
