"""The local optimiser: ``torch.optim.SGD``'s step written out (its single-tensor form, the one it takes on
the CPU; no dampening, no Nesterov), for the shared loop (:func:`fedpcd.algorithms.contract.train_loop`) and
the vectorized executor's stacked tensors. The same operations in the same order, so the weights are
bitwise those of ``torch.optim.SGD``; building torch's optimiser imports ``torch._dynamo`` (about 1 s in
every training process: the run's and each worker's), this does not."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


@torch.no_grad()
def sgd_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    buffers: list[Tensor | None],
    lr: float,
    momentum: float,
    decay: float,
) -> None:
    """One SGD step in place: g <- g + decay * w; with momentum b <- momentum * b + g (b <- g at the first
    step, ``buffers[i]`` None) and g <- b; w <- w - lr * g. A parameter without a gradient is skipped.

    Args:
        params: The weights, updated in place.
        grads: Their gradients (same order; None: no step for that weight).
        buffers: One momentum buffer per weight, None before the first step (set here); unused without
            momentum.
        lr: The step size.
        momentum: The momentum factor (0: none).
        decay: The L2 weight decay (0: none).
    """
    for i, (w, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        if decay != 0:
            g = g.add(w, alpha=decay)
        if momentum != 0:
            buf = buffers[i]
            if buf is None:
                buf = buffers[i] = g.detach().clone()
            else:
                buf.mul_(momentum).add_(g)
            g = buf
        w.add_(g, alpha=-lr)
