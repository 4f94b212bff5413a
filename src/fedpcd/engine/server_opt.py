"""``server.optimizer``: the server's step on the round's mean model update (the ``server`` config section).

With w the server's model before the round and mean(w_k) the model its aggregation produced (after any
robust mean and DP noise), the pseudo-gradient is Delta = mean(w_k) - w, and the new model, per floating
tensor (integer buffers take the aggregate as they are):

- ``sgd``: w + eta Delta (eta = ``server.lr``; eta = 1 is plain averaging, the default: the run is unchanged);
- ``momentum``, FedAvgM (Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for
  Federated Visual Classification", 2019, Sec. 3 with their Delta = w - mean, the negative of this one):
  v <- beta v + Delta, w + eta v (v starts at 0);
- ``adagrad``, ``adam``, ``yogi``, FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
  Algorithm 2): m <- beta1 m + (1 - beta1) Delta; v <- v + Delta^2 (FedAdagrad),
  v <- v - (1 - beta2) Delta^2 sign(v - Delta^2) (FedYogi), v <- beta2 v + (1 - beta2) Delta^2 (FedAdam);
  w + eta m / (sqrt(v) + tau), with m starting at 0 and v at tau^2 (Algorithm 2's v_{-1} >= tau^2).

The state (v, or m and v) lives in the server state under ``server_opt``, so a checkpoint holds it and a
resumed run equals an uninterrupted one. It applies to algorithms whose server's model is a mean of the
clients' models (``averages_model`` with a declared aggregation, :func:`fedpcd.algorithms.mean_aggregating`)
and steps only on that model (FedNH's scale and prototypes, FedGELA's projection are as aggregated).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedpcd.algorithms import mean_aggregating
from fedpcd.algorithms.context import MODEL
from fedpcd.algorithms.statedict import StateDict
from fedpcd.config import Config, ServerConfig
from fedpcd.errors import UserError

STATE = "server_opt"  # the server-state key of the optimiser's moments


def plain(server: ServerConfig) -> bool:
    """Whether the step is plain averaging (sgd, lr 1): then nothing is computed and the run is unchanged."""
    return server.optimizer == "sgd" and server.lr == 1.0


def check_server_optimizer(config: Config) -> None:
    """At the start of a run: a server optimiser other than plain averaging needs an algorithm whose server's
    model is the mean of the clients' models."""
    opt = config.server
    if plain(opt):
        return
    able = mean_aggregating(model=True)
    if config.algorithm.name not in able:
        raise UserError(
            f"server.optimizer={opt.optimizer} with server.lr={opt.lr:g} steps on the mean model update, but "
            f"algorithm {config.algorithm.name!r} does not take its model as a mean of the clients' models; "
            f"use it with one of: {', '.join(able)}, or set server.optimizer=sgd and server.lr=1"
        )


def step(opt: ServerConfig, w: Tensor, delta: Tensor, moments: dict[str, Tensor]) -> Tensor:
    """The new value of one tensor ``w`` from its pseudo-gradient ``delta``; updates ``moments`` (m, v) in
    place (module docstring)."""
    if opt.optimizer == "sgd":
        return w + opt.lr * delta
    if opt.optimizer == "momentum":
        moments["v"] = opt.momentum * moments.get("v", torch.zeros_like(w)) + delta
        return w + opt.lr * moments["v"]
    m = opt.beta1 * moments.get("m", torch.zeros_like(w)) + (1.0 - opt.beta1) * delta
    v = moments.get("v", torch.full_like(w, opt.tau**2))
    sq = delta * delta
    if opt.optimizer == "adagrad":
        v = v + sq
    elif opt.optimizer == "yogi":
        v = v - (1.0 - opt.beta2) * sq * torch.sign(v - sq)
    else:
        v = opt.beta2 * v + (1.0 - opt.beta2) * sq
    moments["m"], moments["v"] = m, v
    return w + opt.lr * m / (torch.sqrt(v) + opt.tau)


def server_step(config: Config, before: StateDict, server: dict[str, Any]) -> dict[str, Any]:
    """``server`` with its model moved from ``before`` (the model the round started from) by the server
    optimiser along Delta = its aggregated model - ``before``, and the optimiser's state kept under
    :data:`STATE`; unchanged for plain averaging."""
    opt = config.server
    if plain(opt):
        return server
    state = {k: dict(v) for k, v in server.get(STATE, {}).items()}
    model = dict(server[MODEL])
    for key, w in before.items():
        if torch.is_floating_point(w) and key in model:
            moments = state.setdefault(key, {})
            model[key] = step(opt, w, model[key] - w, moments)
    return {**server, MODEL: model, STATE: state}
