"""Differential privacy with fixed clipping (``privacy`` config section), the same on both backends.

DP-FedAvg with fixed clipping (McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018, Algorithm 1; the scheme of Flower's ``DifferentialPrivacyClientSideFixedClipping`` and
``...ServerSideFixedClipping``); docs/privacy.md states the threat model and what is not protected.

1. **Clip** each client's model update Delta_k = w_k - w^t (its reply's ``model`` minus the ``model`` it
   received) to L2 norm at most C: w_k <- w^t + Delta_k * min(1, C / ||Delta_k||_2), over every floating
   tensor of the model (integer buffers such as BatchNorm's step counter are left as they are).
   ``privacy.clipping: client`` clips on the client, before the reply leaves it (in the Flower ClientApp,
   so the server never sees an unclipped update); ``server`` clips on the server before aggregating.
   Both give the same numbers. The reply's sample count becomes 1 at the same place, so the server averages
   the updates with fixed (uniform) weights, as the accounting assumes, and never learns n_k.
2. **Noise**: after aggregating the m kept updates, every floating tensor of the server's ``model`` gets
   Gaussian noise of standard deviation sigma * C / m (sigma = ``privacy.noise_multiplier``), drawn from a
   generator seeded by (seed, round), so a run is reproducible and both backends agree bitwise.
3. **Account**: :func:`dp_epsilon`, the epsilon at ``privacy.delta`` after r rounds, from Google's
   ``dp-accounting`` (its RDP accountant; the ``privacy`` extra installs it).

Coverage: the mechanism clips and noises only the model. An algorithm that uploads anything else that the
server aggregates (its ``extra_uploads``: FedNH's class means, SCAFFOLD's control variates, ...) or whose
server keeps state computed from the unnoised updates (its ``extra_server_state``: FedDyn's h) is refused in
one line (:func:`check_privacy`; :func:`clip_update` checks each reply's keys again). The run records,
per evaluated round, ``dp_clipped`` (how many of the round's updates were longer than C) and ``dp_epsilon``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedpcd.algorithms import ALGORITHMS
from fedpcd.algorithms.base import MODEL, NUM_SAMPLES, TRAIN_LOSS
from fedpcd.config import Config
from fedpcd.engine.federation import sample_clients
from fedpcd.errors import UserError
from fedpcd.utils import derive_seed

NOISE_STREAM = 0xD9  # derive_seed(seed, round, NOISE_STREAM): the noise generator of a round
COVERED = (MODEL, NUM_SAMPLES, TRAIN_LOSS)  # the reply keys the mechanism covers (docs/privacy.md)
INSTALL = "pip install 'fedpcd[privacy]' (Google's dp-accounting)"


def uncovered(algorithm_cls: type) -> str | None:
    """Why DP-FedAvg does not cover what algorithm class ``algorithm_cls`` uploads and aggregates, from its
    declarations (``extra_uploads``, ``extra_server_state``); None: it covers it."""
    extra = tuple(getattr(algorithm_cls, "extra_uploads", ()))
    if extra:
        return _uploads(extra)
    kept = tuple(getattr(algorithm_cls, "extra_server_state", ()))
    if kept:
        return f"keeps {', '.join(kept)} on the server, computed from the clients' updates before the noise"
    return None


def _uploads(keys: tuple[str, ...] | list[str]) -> str:
    return f"also uploads {', '.join(keys)} beyond its model, neither clipped nor noised"


def _refusal(algorithm: str, why: str) -> UserError:
    able = [n for n in ALGORITHMS.names() if not n.startswith("_") and uncovered(ALGORITHMS.get(n)) is None]
    return UserError(
        f"privacy.clip clips and noises only the clients' model updates, but algorithm {algorithm!r} {why}: "
        f"set privacy.clip=null or choose one of: {', '.join(able)}"
    )


def check_privacy(config: Config) -> None:
    """At the start of a run, before any data is loaded: refuse a ``privacy.clip`` run whose algorithm the
    mechanism does not cover (:func:`uncovered`), a ``privacy.delta`` not below 1/clients and, with noise, a
    missing accountant (the ``privacy`` extra)."""
    privacy = config.privacy
    if privacy.clip is None:
        return
    why = uncovered(ALGORITHMS.get(config.algorithm.name))
    if why is not None:
        raise _refusal(config.algorithm.name, why)
    if privacy.noise_multiplier > 0:
        if privacy.delta >= 1 / config.clients:
            raise UserError(
                f"privacy.delta={privacy.delta:g} is not below 1/clients={1 / config.clients:g}: such a "
                f"delta allows publishing a client's data outright; set privacy.delta below it, e.g. "
                f"clients^-1.1={config.clients**-1.1:.3g} (McMahan et al. 2018)"
            )
        _accountant()


def reported_samples(config: Config, num_samples: int) -> int:
    """The ``num_samples`` a client's reply carries: 1 where the client clips (``privacy.clip`` with
    ``privacy.clipping: client``: fixed weights, and n_k never leaves the client), else its ``num_samples``
    (server-side clipping sets it to 1 on arrival)."""
    privacy = config.privacy
    return 1 if privacy.clip is not None and privacy.clipping == "client" else num_samples


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
    """``reply`` with its model update clipped to L2 norm ``clip`` (step 1) and its sample count set to 1
    (fixed weights), and whether the update was longer. A reply holding more than :data:`COVERED`, or of
    an algorithm the mechanism does not cover, is a UserError."""
    why = uncovered(ALGORITHMS.get(algorithm)) if algorithm in ALGORITHMS else None
    extra = sorted(set(reply) - set(COVERED))
    if extra:
        why = _uploads(extra)
    if why is not None:
        raise _refusal(algorithm, why)
    new = _model_of(reply, "reply", algorithm)
    old = _model_of(payload, "payload", algorithm)
    out = {**reply, NUM_SAMPLES: 1}
    keys = [k for k, v in new.items() if torch.is_floating_point(v) and k in old]
    if not keys:
        return out, False
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(new[k] - old[k]) for k in keys]))
    if norm <= clip:
        return out, False
    scale = clip / norm
    model = dict(new)
    for k in keys:
        model[k] = old[k] + (new[k] - old[k]) * scale
    return {**out, MODEL: model}, True


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


def _accountant() -> Any:
    """The ``dp_accounting`` module, or a UserError saying how to install it."""
    try:
        import dp_accounting
    except ImportError:
        raise UserError(
            f"privacy.noise_multiplier > 0 reports the privacy spent (dp_epsilon), which needs {INSTALL}"
        ) from None
    return dp_accounting


@functools.lru_cache(maxsize=8)
def _round_rdp(clients: int, sampled: int, noise_multiplier: float) -> tuple[tuple[float, ...], np.ndarray]:
    """(RDP orders, the RDP of one round at each): the round is the Gaussian sum query on ``sampled`` of
    ``clients`` clients drawn without replacement; under the replace-one-client relation the sum of
    updates clipped to C moves by up to 2C, so the noise std sigma*C is sigma/2 sensitivities."""
    dpa = _accountant()
    orders = tuple(dpa.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    accountant = dpa.rdp.RdpAccountant(orders, dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.GaussianDpEvent(noise_multiplier / 2)
    try:
        with np.errstate(invalid="ignore"):  # a NaN (handled below) is no warning
            accountant.compose(dpa.SampledWithoutReplacementDpEvent(clients, sampled, event))
    except ArithmeticError:  # a noise multiplier so small (< ~1e-150) that sigma^2 underflows: no bound
        return orders, np.full(len(orders), np.inf)
    # r rounds compose to r times one round's RDP (what compose(event, r) computes): one round's is kept
    # (the accountant's _rdp) so each evaluated round costs no new subsampled-RDP computation (~0.3 s);
    # an order whose RDP the library could not compute (NaN) bounds nothing
    rdp = np.array(accountant._rdp, dtype=float)
    return orders, np.where(np.isnan(rdp), np.inf, rdp)


def epsilon(clients: int, sampled: int, noise_multiplier: float, rounds: int, delta: float) -> float:
    """The epsilon of (epsilon, ``delta``)-DP after ``rounds`` rounds of DP-FedAvg (user level, replace one
    client) with ``sampled`` of ``clients`` clients per round drawn without replacement and noise
    multiplier sigma: dp-accounting's RDP accountant (Wang, Balle & Kasiviswanathan, AISTATS 2019,
    Theorem 27 for the sampling; its RDP-to-DP conversion)."""
    dpa = _accountant()
    orders, rdp = _round_rdp(clients, sampled, noise_multiplier)
    return float(dpa.rdp.compute_epsilon(orders, rdp * rounds, delta)[0])


def dp_epsilon(config: Config, rounds: int) -> float | None:
    """``dp_epsilon`` of a run's record after ``rounds`` rounds: :func:`epsilon` for the run's clients,
    participation, ``privacy.noise_multiplier`` and ``privacy.delta``; None without noise (no guarantee).
    Finite: the config takes no noise multiplier below float32's smallest, 1.4e-45 (``check_values``)."""
    privacy = config.privacy
    if privacy.clip is None or not privacy.noise_multiplier:
        return None
    sampled = len(sample_clients(config.clients, config.participation, config.seed, 1))
    return epsilon(config.clients, sampled, privacy.noise_multiplier, rounds, privacy.delta)
