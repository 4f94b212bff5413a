"""The local optimiser: ``torch.optim.SGD``'s step written out (its single-tensor form, the one it takes on
the CPU; no dampening, no Nesterov), for every client-side loop (the shared loop
:func:`fedpcd.algorithms.contract.train_loop`, APFL's, pFedMe's, CReFF's and FedETF's own) and the
vectorized executor's stacked tensors. The same operations in the same order, so the weights are bitwise
those of ``torch.optim.SGD``; building torch's optimiser imports ``torch._dynamo`` (about 1 s in every
training process: the run's and each worker's), this does not."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


class SGD:
    """``torch.optim.SGD(params, lr, momentum, weight_decay)`` as the client loops use it: ``zero_grad()``
    (gradients set to None) and ``step()`` (:func:`sgd_update`, momentum buffers from the first step)."""

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        """Every parameter's gradient to None (``set_to_none=True``)."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """One SGD step on the parameters' current gradients."""
        grads = [p.grad for p in self.params]
        sgd_update(self.params, grads, self.buffers, self.lr, self.momentum, self.weight_decay)
