"""What a round does with clients that fail or diverge (both backends share it).

- A client that raised (or, on Flower, did not reply in time) is left out of the round's aggregation, with
  a warning on stderr naming the round, the client and the exception.
- A reply holding a non-finite number (train loss, weights, any float tensor) is a divergence: with
  ``engine.on_divergence: stop`` (default) the run stops with a :class:`~fedpcd.errors.DivergenceError`
  naming the round, the client(s) and the algorithm, and what to change; with ``drop`` the update is left
  out like a failure.
- Fewer than ``engine.min_clients`` updates left: the run stops (a DivergenceError when divergence left too
  few, else a RuntimeError chained to the first client's exception).
- After aggregation, a non-finite server state stops the run whatever ``on_divergence`` says.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedpcd.algorithms.context import MODEL, NUM_SAMPLES
from fedpcd.config import Config
from fedpcd.errors import DivergenceError
from fedpcd.logs import LOGGER


class NonFiniteError(ArithmeticError):
    """A client's computation failed on non-finite numbers (e.g. an SVD of NaN weights): a divergence."""


class InvalidReply(ValueError):
    """A client's reply that the server cannot aggregate (malformed, another client's, a tensor of the wrong
    shape or type, a sample count that is not the client's): that client fails the round."""


def reply_problem(update: Any, payload: Mapping[str, Any], num_samples: int) -> str | None:
    """Why the server refuses a client's reply, checked against what it sent and knows (None: it does not).

    The reply is a mapping; its ``num_samples`` is the client's own number of training samples (the server
    made the partition; a client cannot weigh itself up); every tensor of its model that the payload's model
    also holds has that tensor's shape and dtype. Non-finite values are :func:`screen_replies`' business."""
    if not isinstance(update, Mapping):
        return f"the reply is a {type(update).__name__}, not a mapping"
    if NUM_SAMPLES not in update:
        return f"the reply has no {NUM_SAMPLES!r}"
    n = update[NUM_SAMPLES]
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n != num_samples:
        return f"{NUM_SAMPLES} {n!r} is not the client's {num_samples} training samples"
    sent, got = payload.get(MODEL), update.get(MODEL)
    if got is None or not isinstance(sent, Mapping):
        return None
    if not isinstance(got, Mapping):
        return f"its {MODEL!r} is a {type(got).__name__}, not a mapping of tensors"
    for key, value in got.items():
        want = sent.get(key)
        if not isinstance(value, torch.Tensor):
            return f"{MODEL}/{key} is a {type(value).__name__}, not a tensor"
        if isinstance(want, torch.Tensor) and (value.shape != want.shape or value.dtype != want.dtype):
            return (
                f"{MODEL}/{key} is {value.dtype} {tuple(value.shape)}, the server sent "
                f"{want.dtype} {tuple(want.shape)}"
            )
    return None


def first_nonfinite(obj: Any, path: str = "") -> str | None:
    """The path of the first non-finite float or float tensor in a nested dict/list (None if all finite)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            return None if bool(torch.isfinite(obj).all()) else (path or "tensor")
        return None
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path or "value")
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            found = first_nonfinite(value, f"{path}/{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found = first_nonfinite(value, f"{path}/{i}" if path else str(i))
            if found is not None:
                return found
    return None


def model_nonfinite(model: torch.nn.Module) -> str | None:
    """The name of the first non-finite parameter or buffer of ``model`` (None if all finite)."""
    return first_nonfinite(dict(model.state_dict()))


@dataclass
class Screened:
    """The outcome of :func:`screen_replies`: positions of the updates to aggregate, and the others."""

    kept: list[int]
    failed: dict[int, str] = field(default_factory=dict)  # client id -> reason
    diverged: dict[int, str] = field(default_factory=dict)


def _fix_hint(config: Config) -> str:
    """What to change: the learning rates (local.lr and the algorithm's own, e.g. pFedMe's personal_lr), the
    gradient clip, and (when it stops the run) engine.on_divergence."""
    clip = config.local.grad_clip
    own = [
        f"algorithm.{key} (now {value:g})"
        for key, value in config.algorithm.params().items()
        if re.search(r"(^|_)lr(_|$)", key) and isinstance(value, (int, float)) and not isinstance(value, bool)
    ]
    hints = [
        f"lower {' or '.join([f'local.lr (now {config.local.lr:g})', *own])}",
        "set local.grad_clip (e.g. 10)" if clip is None else f"lower local.grad_clip (now {clip:g})",
    ]
    if config.engine.on_divergence == "stop":
        hints.append("set engine.on_divergence=drop to leave such updates out")
    return ", ".join(hints[:-1]) + " or " + hints[-1]


def _by_reason(reasons: dict[int, str]) -> str:
    """``{0: r, 1: r, 2: s}`` -> ``"0, 1 (r), 2 (s)"``: clients grouped by reason."""
    groups: dict[str, list[int]] = {}
    for k, why in reasons.items():
        groups.setdefault(why, []).append(k)
    return ", ".join(f"{', '.join(map(str, ks))} ({why})" for why, ks in groups.items())


def screen_replies(
    config: Config,
    rnd: int,
    clients: Sequence[int],
    replies: Sequence[dict[str, Any] | None],
    errors: Sequence[BaseException | None],
) -> Screened:
    """Decide which of a round's updates are aggregated (see the module doc); raises when the run stops.

    ``replies[i]``/``errors[i]`` belong to ``clients[i]``; a client with an error has no usable reply."""
    algorithm = config.algorithm.name
    out = Screened(kept=[])
    first_error: BaseException | None = None
    for i, (k, reply, error) in enumerate(zip(clients, replies, errors, strict=True)):
        if isinstance(error, NonFiniteError):
            out.diverged[k] = str(error)
        elif error is not None:
            out.failed[k] = f"{type(error).__name__}: {error}".strip()
            first_error = first_error or error
            LOGGER.warning(
                "round %d: client %d failed (%s); left out of this round's aggregation", rnd, k, out.failed[k]
            )
        elif reply is None:
            out.failed[k] = "no reply"
            LOGGER.warning("round %d: client %d sent no reply; left out of this round's aggregation", rnd, k)
        else:
            bad = first_nonfinite(reply)
            if bad is not None:
                out.diverged[k] = f"non-finite {bad}"
            else:
                out.kept.append(i)
    if out.diverged:
        who = _by_reason(out.diverged)
        if config.engine.on_divergence == "stop":
            raise DivergenceError(
                f"round {rnd}: algorithm {algorithm!r} diverged: client(s) {who}; the earlier rounds are "
                f"kept; {_fix_hint(config)}"
            )
        LOGGER.warning(
            "round %d: client(s) %s of algorithm %r diverged; their updates are dropped", rnd, who, algorithm
        )
    need = config.engine.min_clients
    if len(out.kept) < need:
        lost = {**out.failed, **out.diverged}
        detail = f"client(s) {_by_reason(lost)}"
        message = (
            f"round {rnd}: only {len(out.kept)} of {len(clients)} client update(s) of algorithm "
            f"{algorithm!r} are usable, fewer than engine.min_clients={need} ({detail})"
        )
        if first_error is None:
            raise DivergenceError(f"{message}; {_fix_hint(config)}")
        raise RuntimeError(message) from first_error
    return out


def check_server(config: Config, rnd: int, server: dict[str, Any], clients: Sequence[int]) -> None:
    """A non-finite server state after aggregation stops the run (a DivergenceError naming round and key)."""
    bad = first_nonfinite(server)
    if bad is not None:
        raise DivergenceError(
            f"round {rnd}: algorithm {config.algorithm.name!r} diverged: its server state has a non-finite "
            f"{bad} after aggregating client(s) {', '.join(map(str, clients))}; {_fix_hint(config)}"
        )
