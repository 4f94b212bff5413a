"""Gradient clipping on stacked tensors, each client (dim 0) its own, before the shared loop's SGD step
(:func:`fedpcd.algorithms.sgd.sgd_update`, elementwise, so per client on stacked tensors too)."""

from __future__ import annotations

import torch
from torch import Tensor


def clip_per_client(grads: list[Tensor | None], clip: float | None) -> list[Tensor | None]:
    """``clip_grad_norm_`` per client on stacked gradients (dim 0 is the client): each client's gradients
    scaled by min(1, clip / (their total norm + 1e-6)); unchanged when ``clip`` is None."""
    present = [g for g in grads if g is not None]
    if clip is None or not present:
        return grads
    norms = torch.stack([torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for g in present], 1)
    coef = (clip / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)
    return [None if g is None else g * coef.view(-1, *[1] * (g.dim() - 1)) for g in grads]
