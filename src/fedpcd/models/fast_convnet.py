"""The ConvNet family's fast CPU kernels (simplecnn, conv2cifar, cnn1..cnn5): bit-identical predictions and
a vmap rule for training many clients' copies at once.

- :func:`convnet_logits` / :func:`convnet_features`: ``model(x)`` / ``model.features(x)`` without gradient,
  bit for bit, with the 2x2 max-pool + ReLU on strided views (:func:`pool_relu_masks`: max_pool2d's values,
  faster than its CPU kernel with indices on the large map); ``ConvNet.inference_forward`` /
  ``inference_features`` return them.
- :func:`batched_features`: ``features`` as one ``autograd.Function`` with its own vmap rule
  (:func:`convnet_features_stacked`). vmap would turn a convolution with per-client weights into a grouped
  convolution, which oneDNN runs slower than a loop over the clients; here, per client, the convolutions use
  the fastest backward kernels measured (weight gradient alone, input gradient by ``conv_transpose2d``), the
  first max-pool + ReLU goes through the strided views (with their gradient routing) and the second through
  ``max_pool2d`` in channels-last layout; the fully connected layers are batched matmuls over the clients.
  ``ConvNet.vmap_copy`` puts it on the copy that the vectorized executor vmaps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ConvNetLayers(Protocol):
    """The layers of ``fedpcd.models.cnn.ConvNet`` that these kernels read."""

    feature_relu: bool
    conv1: nn.Conv2d
    conv2: nn.Conv2d
    fc1: nn.Linear
    fc2: nn.Linear
    head: nn.Linear


def pool_relu_masks(a: Tensor, masks: bool) -> tuple[Tensor, list[Tensor]]:
    """relu(2x2 max-pool of ``a``) in two stages (column pairs, then row pairs) on strided views, and (with
    ``masks``) where the gradient goes: float masks (top row, bottom row) of the outputs, zero where the
    output is 0, and (right column) of the first stage. Ties go to the first element in row-major order, as
    ``max_pool2d`` routes its gradient; the values are exactly max_pool2d(relu(a), 2)'s (its CPU forward with
    indices is several times slower at these sizes)."""
    n, c, h, w = a.shape
    if h % 2 or w % 2:  # max_pool2d floors: drop the last row / column
        a = a[..., : h // 2 * 2, : w // 2 * 2].contiguous()
        h, w = h // 2 * 2, w // 2 * 2
    cols = a.reshape(n, c, h, w // 2, 2)
    left, right = cols[..., 0], cols[..., 1]
    half = torch.maximum(left, right)  # [n, c, h, w/2]
    rows = half.view(n, c, h // 2, 2, w // 2)
    top, bottom = rows[:, :, :, 0], rows[:, :, :, 1]
    out = torch.relu(torch.maximum(top, bottom))
    if not masks:
        return out, []
    below, positive = bottom > top, out > 0
    return out, [(positive & ~below).to(a.dtype), (positive & below).to(a.dtype), (right > left).to(a.dtype)]


def pool_relu_backward(g: Tensor, masks: Sequence[Tensor], shape: torch.Size) -> Tensor:
    """The gradient of :func:`pool_relu_masks` w.r.t. its input of ``shape``, from the output gradient."""
    to_top, to_bottom, to_right = masks
    n, c, h2, w2 = g.shape
    half = g.new_empty(n, c, h2, 2, w2)
    torch.mul(g, to_top, out=half[:, :, :, 0])
    torch.mul(g, to_bottom, out=half[:, :, :, 1])
    half = half.view(n, c, 2 * h2, w2)
    ga = g.new_empty(n, c, 2 * h2, w2, 2)
    torch.mul(half, to_right, out=ga[..., 1])
    torch.sub(half, ga[..., 1], out=ga[..., 0])  # exact: half * (1 - right)
    ga = ga.view(n, c, 2 * h2, 2 * w2)
    if tuple(shape[-2:]) != (2 * h2, 2 * w2):
        ga = F.pad(ga, (0, shape[-1] - 2 * w2, 0, shape[-2] - 2 * h2))
    return ga


def per_client(x: Tensor, shared_x: bool, *stacked: Tensor) -> Iterator[tuple[Tensor, ...]]:
    """(x_k, w1_k, ...) for each client k: ``x`` is [K, ...] or, with ``shared_x``, the same for all."""
    columns = [t.unbind(0) for t in stacked]
    xs = [x] * len(columns[0]) if shared_x else x.unbind(0)
    return zip(xs, *columns, strict=True)


def weight_grad(grad_out: Tensor, inp: Tensor, weight: Tensor) -> Tensor:
    """A stride-1, unpadded convolution's weight gradient (oneDNN's backward kernel alone)."""
    args = (grad_out, inp, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])
    return torch.ops.aten.convolution_backward(*args)[1]


class _ConvStack(torch.autograd.Function):
    """ConvNet's two (conv 5x5 -> ReLU -> max-pool 2) stages for K clients, flattened: [K, B, F]. One node
    per step (no per-layer autograd bookkeeping); per client the fast CPU kernels: the weight gradient alone
    (:func:`weight_grad`), the input gradient by ``conv_transpose2d``, the first pooling by
    :func:`pool_relu_masks`, the second by ``max_pool2d`` in channels-last layout (its fast kernel for the
    small maps; ReLU after the max, which routes the same gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, shared_x: bool, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor
    ) -> Tensor:
        flat, saved = [], []
        for xk, w1k, b1k, w2k, b2k in per_client(x, shared_x, w1, b1, w2, b2):
            a1 = F.conv2d(xk, w1k, b1k)
            p1, m1 = pool_relu_masks(a1, masks=True)
            a2 = F.conv2d(p1, w2k, b2k).contiguous(memory_format=torch.channels_last)
            p2, where2 = F.max_pool2d(a2, 2, return_indices=True)
            p2 = p2.relu_()
            flat.append(p2.flatten(1))  # the NCHW order of the flattened features (a copy)
            saved.append((xk, p1, m1, a2, where2, p2, a1.shape))
        ctx.saved, ctx.weights, ctx.shared_x = saved, (w1, w2), shared_x
        return torch.stack(flat)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        w1, w2 = ctx.weights
        grads: list[list[Tensor]] = [[], [], [], [], []]  # x, w1, b1, w2, b2
        for k, (xk, p1, m1, a2, where2, p2, shape1) in enumerate(ctx.saved):
            gp2 = g[k].view(p2.shape).contiguous(memory_format=torch.channels_last) * (p2 > 0)
            ga2 = torch.ops.aten.max_pool2d_with_indices_backward(
                gp2, a2, [2, 2], [2, 2], [0, 0], [1, 1], False, where2
            ).contiguous()
            grads[3].append(weight_grad(ga2, p1, w2[k]))
            grads[4].append(ga2.sum(dim=(0, 2, 3)))
            ga1 = pool_relu_backward(F.conv_transpose2d(ga2, w2[k]), m1, shape1)
            grads[1].append(weight_grad(ga1, xk, w1[k]))
            grads[2].append(ga1.sum(dim=(0, 2, 3)))
            if ctx.needs_input_grad[0]:
                grads[0].append(F.conv_transpose2d(ga1, w1[k]))
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.stack(grads[0])
            gx = gx.sum(0) if ctx.shared_x else gx
        return gx, None, *[torch.stack(gs) for gs in grads[1:]]


def _conv_stack_nograd(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    a = pool_relu_masks(F.conv2d(x, w1, b1), masks=False)[0]
    return pool_relu_masks(F.conv2d(a, w2, b2), masks=False)[0].flatten(1)


def convnet_features_stacked(
    x: Tensor, shared_x: bool, params: Sequence[Tensor], feature_relu: bool
) -> Tensor:
    """``ConvNet.features`` of K clients: ``x`` is [K, B, C, H, W] (or [B, C, H, W] for all with
    ``shared_x``), ``params`` the stacked conv1, conv2, fc1, fc2 weights and biases ([K, ...] each);
    returns [K, B, feature_dim]. Convolutions per client (:class:`_ConvStack`), the FC layers as batched
    matmuls."""
    w1, b1, w2, b2, f1w, f1b, f2w, f2b = params
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2, b2)):
        flat = _ConvStack.apply(x, shared_x, w1, b1, w2, b2)
    else:
        flat = torch.stack([_conv_stack_nograd(*c) for c in per_client(x, shared_x, w1, b1, w2, b2)])
    h = F.relu(torch.baddbmm(f1b.unsqueeze(1), flat, f1w.transpose(1, 2)))
    z = torch.baddbmm(f2b.unsqueeze(1), h, f2w.transpose(1, 2))
    return F.relu(z) if feature_relu else z


class _ConvNetFeatures(torch.autograd.Function):
    """``ConvNet.features`` whose vmap rule is :func:`convnet_features_stacked` on the physical tensors."""

    generate_vmap_rule = False

    @staticmethod
    def forward(feature_relu: bool, x: Tensor, *params: Tensor) -> Tensor:
        return convnet_features_stacked(x, True, [p.unsqueeze(0) for p in params], feature_relu)[0]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.feature_relu = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # outside vmap only: recompute
        needs = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs, strict=True)]
        with torch.enable_grad():
            out = convnet_features_stacked(
                inputs[0], True, [p.unsqueeze(0) for p in inputs[1:]], ctx.feature_relu
            )[0]
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, g, allow_unused=True))
        return (None, *[next(grads) if t.requires_grad else None for t in inputs])

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], feature_relu: bool, x: Tensor, *params: Tensor
    ) -> Any:
        n = info.batch_size
        shared_x = in_dims[1] is None
        if not shared_x:
            x = x.movedim(in_dims[1], 0)
        stacked = [
            p.expand(n, *p.shape) if d is None else p.movedim(d, 0)
            for p, d in zip(params, in_dims[2:], strict=True)
        ]
        return convnet_features_stacked(x, shared_x, stacked, feature_relu), 0


@torch.no_grad()
def convnet_features(model: ConvNetLayers, x: Tensor) -> Tensor:
    """``model.features(x)`` of a ConvNet without gradient, bit for bit, with the faster max-pool (the
    convolutions and linear layers are the model's own): ``ConvNet.inference_features``."""
    a = pool_relu_masks(model.conv1(x), masks=False)[0]
    a = pool_relu_masks(model.conv2(a), masks=False)[0]
    z = model.fc2(F.relu(model.fc1(torch.flatten(a, 1))))
    return F.relu(z) if model.feature_relu else z


def convnet_logits(model: ConvNetLayers, x: Tensor) -> Tensor:
    """``model(x)`` of a ConvNet without gradient, bit for bit: ``ConvNet.inference_forward``, what
    predictions use."""
    return model.head(convnet_features(model, x))


def batched_features(self: ConvNetLayers, x: Tensor) -> Tensor:
    """``ConvNet.features`` as one autograd node whose vmap rule is :func:`convnet_features_stacked`: bound
    to the copy the vectorized executor vmaps (``ConvNet.vmap_copy``)."""
    return _ConvNetFeatures.apply(
        self.feature_relu,
        x,
        self.conv1.weight,
        self.conv1.bias,
        self.conv2.weight,
        self.conv2.bias,
        self.fc1.weight,
        self.fc1.bias,
        self.fc2.weight,
        self.fc2.bias,
    )
