"""``torch.optim.SGD``'s step on stacked tensors: each client (dim 0) its own gradient clipping, weight
decay, momentum and update."""

from __future__ import annotations

import torch
from torch import Tensor


def sgd_step(
    params: list[Tensor],
    grads: list[Tensor | None],
    momenta: list[Tensor | None],
    lr: float,
    momentum: float,
    decay: float,
    clip: float | None,
) -> None:
    """``torch.optim.SGD.step`` (single-tensor form, after ``clip_grad_norm_`` when ``clip`` is set) on
    stacked tensors, each client its own: dim 0 of every tensor is the client."""
    present = [g for g in grads if g is not None]
    if clip is not None and present:
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for g in present], 1)
        coef = (clip / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)
        grads = [None if g is None else g * coef.view(-1, *[1] * (g.dim() - 1)) for g in grads]
    for w, g, buf in zip(params, grads, momenta, strict=True):
        if g is None:
            continue
        if decay != 0:
            g = g.add(w, alpha=decay)
        if momentum != 0 and buf is not None:
            buf.mul_(momentum).add_(g)
            g = buf
        w.add_(g, alpha=-lr)
