"""What happens to a client's update between its local update and the aggregate, on every executor.

Client side, :func:`settle_reply` (the sequential and vectorized executors, the worker pool and Flower's
ClientApp): ``privacy.clipping: client`` clips the update before it leaves the client (the server never sees
an unclipped one, and its sample count is 1); a non-finite update under ``engine.on_divergence: drop``
keeps the client's stored state (:func:`state_to_keep` copies it before the update); then
:func:`store_state` stores a reply's new state, a reply without one (a failed client, a dropped update, an
algorithm without client state) leaving the stored one as it was.

Server side, :func:`admit_replies` (the round loop, whatever executor ran the clients): a reply the server
cannot aggregate fails its client (``guard.reply_problem``, checked against the payload that client was
sent); failures and divergences are screened (``guard.screen_replies``: left out, or the run stops);
``privacy.clipping: server`` clips the kept updates; every kept update's class statistics get their
noise (``privacy.noise_uploads``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fedpcd.algorithms import Algorithm
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.config import Config
from fedpcd.engine.federation import to_device
from fedpcd.engine.guard import InvalidReply, Screened, first_nonfinite, reply_problem, screen_replies
from fedpcd.engine.privacy import clip_update, noise_uploads, stat_bounds
from fedpcd.engine.tasks import ClientReply, ClientTask

__all__ = [
    "admit_replies",
    "client_clips",
    "drops_divergent",
    "reported_samples",
    "settle_reply",
    "state_to_keep",
    "store_state",
]


def client_clips(config: Config) -> bool:
    """Whether each client clips its own update (``privacy.clip`` with ``privacy.clipping: client``)."""
    return config.privacy.clip is not None and config.privacy.clipping == "client"


def drops_divergent(config: Config) -> bool:
    """Whether a non-finite update is left out of its round (``engine.on_divergence: drop``) rather than
    stopping the run."""
    return config.engine.on_divergence == "drop"


def reported_samples(config: Config, num_samples: int) -> int:
    """The ``num_samples`` a client's reply carries: 1 where the client clips (fixed weights, and n_k never
    leaves the client), else its ``num_samples`` (server-side clipping sets it to 1 on arrival)."""
    return 1 if client_clips(config) else num_samples


def state_to_keep(config: Config, state: Any) -> Any:
    """With ``engine.on_divergence: drop``, a copy of the client's stored state taken before its update: an
    update that is dropped must leave it as it was, even where the algorithm changed it in place."""
    return copy.deepcopy(state) if drops_divergent(config) else None


def settle_reply(
    config: Config, num_classes: int, device: torch.device, task: ClientTask, reply: ClientReply, kept: Any
) -> ClientReply:
    """The client side of the policy, before the reply leaves the client: the clip, the stored state
    ``kept`` (:func:`state_to_keep`) in place of the new one for a dropped non-finite update, the upload's
    size."""
    if client_clips(config):
        received = to_device(task.payload, device)
        bounds = stat_bounds(config, num_classes)
        reply.update, reply.clipped = clip_update(
            reply.update, received, config.privacy.clip, config.algorithm.name, bounds
        )
    if drops_divergent(config) and first_nonfinite(reply.update) is not None:
        reply.state = kept  # None: nothing was stored, and nothing is
    reply.bytes_up = tensor_bytes(reply.update)
    return reply


def store_state(reply: ClientReply, put: Callable[[int, Any], None]) -> None:
    """Store the reply's new state with ``put(client, state)``; a reply without one keeps the stored one."""
    if reply.state is not None:
        put(reply.client, reply.state)


def admit_replies(
    config: Config,
    algorithm: Algorithm,
    num_samples: Sequence[int],
    payloads: Mapping[int, Any],
    replies: list[ClientReply],
    rnd: int,
) -> tuple[list[ClientReply], Screened]:
    """The server side of the policy: the round's replies that are aggregated (clipped and noised as the
    ``privacy`` section says) and the screening's outcome; raises when the run stops (guard.py).

    ``num_samples``: every client's number of training samples; ``payloads``: what each client was sent."""
    for r in replies:  # a reply the server cannot aggregate fails its client, it never stops the run
        n = reported_samples(config, num_samples[r.client])
        problem = None if r.error else reply_problem(r.update, payloads[r.client], n)
        if problem is not None:
            r.update, r.error = {}, InvalidReply(problem)
    screened = screen_replies(
        config,
        rnd,
        [r.client for r in replies],
        [r.update if r.error is None else None for r in replies],
        [r.error for r in replies],
    )
    kept = [replies[i] for i in screened.kept]
    privacy = config.privacy
    if privacy.clip is not None:
        uploads = algorithm.upload_bounds()
        bounds = stat_bounds(config, algorithm.ctx.num_classes)
        for r in kept:
            if privacy.clipping == "server":
                name = config.algorithm.name
                r.update, r.clipped = clip_update(r.update, payloads[r.client], privacy.clip, name, bounds)
            r.update = noise_uploads(r.update, uploads, config, rnd, r.client, bounds.num_classes)
    return kept, screened
