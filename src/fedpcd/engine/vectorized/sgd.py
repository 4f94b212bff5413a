"""The local SGD step on stacked tensors: each client (dim 0) its own gradient clipping, then the shared
loop's update (:func:`fedpcd.algorithms.sgd.sgd_update`, elementwise, so per client)."""

from __future__ import annotations

import torch
from torch import Tensor

from fedpcd.algorithms.sgd import sgd_update


def sgd_step(
    params: list[Tensor],
    grads: list[Tensor | None],
    momenta: list[Tensor | None],
    lr: float,
    momentum: float,
    decay: float,
    clip: float | None,
) -> None:
    """``clip_grad_norm_`` (when ``clip`` is set) and the SGD step on stacked tensors, each client its own:
    dim 0 of every tensor is the client; ``momenta`` zero-initialised (the first step's buffer m * 0 + g is g,
    as torch's clone)."""
    present = [g for g in grads if g is not None]
    if clip is not None and present:
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for g in present], 1)
        coef = (clip / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)
        grads = [None if g is None else g * coef.view(-1, *[1] * (g.dim() - 1)) for g in grads]
    sgd_update(params, grads, momenta, lr, momentum, decay)
