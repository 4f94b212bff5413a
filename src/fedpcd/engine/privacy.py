"""Differential privacy with fixed clipping (``privacy`` config section), the same on both backends.

DP-FedAvg with fixed clipping (McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018, Algorithm 1; the scheme of Flower's ``DifferentialPrivacyClientSideFixedClipping`` and
``...ServerSideFixedClipping``):

1. **Clip** each client's model update Delta_k = w_k - w^t (its reply's ``model`` minus the ``model`` it
   received) to L2 norm at most C: w_k <- w^t + Delta_k * min(1, C / ||Delta_k||_2), over every floating
   tensor of the model (integer buffers such as BatchNorm's step counter are left as they are).
   ``privacy.clipping: client`` clips on the client, before the reply leaves it (in the Flower ClientApp,
   so the server never sees an unclipped update); ``server`` clips on the server before aggregating.
   Both give the same numbers.
2. **Noise**: after aggregating the m kept updates, every floating tensor of the server's ``model`` gets
   Gaussian noise of standard deviation sigma * C / m (sigma = ``privacy.noise_multiplier``), drawn from a
   generator seeded by (seed, round), so a run is reproducible and both backends agree bitwise.

The run records the parameters (config.yaml's ``privacy``) and, per evaluated round, ``dp_clipped``: how many
of the round's updates were longer than C. Caveat: the (epsilon, delta) accounting of DP-FedAvg assumes the
updates are averaged with fixed weights; the algorithm's own aggregation (FedAvg: weights by sample count)
is kept, so report a privacy guarantee only for settings that meet the assumption.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedpcd.algorithms.base import MODEL
from fedpcd.config import Config
from fedpcd.errors import UserError
from fedpcd.utils import derive_seed

NOISE_STREAM = 0xD9  # derive_seed(seed, round, NOISE_STREAM): the noise generator of a round


def _model_of(obj: Mapping[str, Any], what: str, algorithm: str) -> Mapping[str, torch.Tensor]:
    model = obj.get(MODEL)
    if not isinstance(model, Mapping):
        raise UserError(
            f"privacy.clip needs an algorithm whose {what} holds the model under 'model'; "
            f"{algorithm!r}'s has keys {sorted(obj)}: set privacy.clip=null or choose another algorithm"
        )
    return model


def clip_update(
    reply: dict[str, Any], payload: Mapping[str, Any], clip: float, algorithm: str = "the algorithm"
) -> tuple[dict[str, Any], bool]:
    """``reply`` with its model update clipped to L2 norm ``clip`` (step 1), and whether it was longer."""
    new = _model_of(reply, "reply", algorithm)
    old = _model_of(payload, "payload", algorithm)
    keys = [k for k, v in new.items() if torch.is_floating_point(v) and k in old]
    if not keys:
        return reply, False
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(new[k] - old[k]) for k in keys]))
    if norm <= clip:
        return reply, False
    scale = clip / norm
    model = dict(new)
    for k in keys:
        model[k] = old[k] + (new[k] - old[k]) * scale
    return {**reply, MODEL: model}, True


def add_noise(server: dict[str, Any], config: Config, rnd: int, kept: int) -> dict[str, Any]:
    """``server`` with Gaussian noise of std ``noise_multiplier * clip / kept`` on its model (step 2)."""
    sigma = config.privacy.noise_multiplier
    if not sigma or config.privacy.clip is None or kept == 0:
        return server
    std = sigma * config.privacy.clip / kept
    gen = torch.Generator().manual_seed(derive_seed(config.seed, rnd, NOISE_STREAM))
    model = dict(_model_of(server, "server state", config.algorithm.name))
    for k, v in model.items():  # in the state dict's order: the same draws on every backend
        if torch.is_floating_point(v):
            noise = torch.randn(v.shape, generator=gen, dtype=v.dtype) * std
            model[k] = v + noise.to(v.device)
    return {**server, MODEL: model}
