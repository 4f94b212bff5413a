"""The vectorized executor (issue 21): the round's clients of one architecture trained at once.

Same numbers as the sequential executor up to float rounding, for every algorithm that declares it is covered
(``vector_attrs`` in the class's own body: FedAvg, FedProx, FedRS, FedLC, FedMR, FedNH, FedGELA, FedGE,
SCAFFOLD, FedDyn, FedDC, FedNTD, FedNova, MOON, FedProc, FedSC, CReFF, FedPer, FedBABU, LG-FedAvg,
FedClassAvg, Local, FedAvg-FT, FedRoD, FedETF, FedProto, FD, FedSSA) and keeps FedAvg's ``local_update``,
``fit``, ``train`` and ``before_step``. Not covered (the sequential executor runs them, with a warning):
methods whose client runs more than one training loop (Ditto, FedRep) or trains two models jointly (FML,
FedKD), and FedSC's ``compat_official`` audit mode (it collects features during training).

How it reproduces ``FedAvg.local_update`` = ``begin_local``; ``fit`` (the shared ``train`` loop);
``end_local`` for K clients:

- ``begin_local`` runs per client on the reusable model object, as in the sequential executor; the model's
  tensors and the client's working context (the payload and state the loss sees, and the attributes named in
  ``vector_attrs``) are stacked along a leading client dimension. A tensor that is the same object for every
  client (the global model in FedProx's payload, an ETF) is shared instead. Trainable are the tensors
  ``trainable_parameters`` returns (model parameters or context tensors: FedNH's scale, FedGELA's
  projection); every other model parameter stays as loaded. Clients whose contexts differ in structure
  (MOON's previous model, absent at a first participation) or that train different tensors are trained as
  separate groups.
- Training is step-synchronous: at step s every client with a batch left takes it from its own stream
  (``ClientData.batches`` with the client's generator, epoch after epoch: the sequential loop's batches and
  augmentation draws). Clients are grouped by batch size (one group at the full batch size; the short last
  batches form small groups), so batch-level losses (FedMR's decorrelation) are exact. Per group,
  ``torch.func.vmap`` over the clients evaluates ``vector_loss`` through ``functional_call`` on a copy of the
  model (a "twin"), and one backward pass gives every client's gradient. A frozen model inside the loss
  (FedNTD's teacher, MOON's global and previous models: ``base.frozen_forward``) is a nested
  ``functional_call`` on the twin, vmapped with the rest (shared or per-client weights).
- ``before_step``'s ``correct_grads`` (SCAFFOLD's c - c_i, FedDyn's and FedDC's regulariser gradients) is
  vmapped over the clients' stacked gradients, parameters, payloads, states and ``vector_attrs``.
- The optimiser is ``torch.optim.SGD``'s single-tensor update on stacked tensors, each client its own:
  gradient-norm clipping as ``clip_grad_norm_`` (total norm over the trainable tensors, coefficient
  max / (norm + 1e-6) clamped to 1), g + wd w, momentum buffer b <- m b + g (zero-initialised: the first
  step is b = g, as torch's clone), w <- w - lr b. The mean train loss is accumulated as the loop does.
- Then each client is re-entered (``begin_local`` again, which must not draw from the generator), the trained
  tensors are written into the model and the context, and ``end_local`` (control variates, drifts,
  FedBABU's and FedAvg-FT's fine-tuning, which stays sequential) and the personal evaluation run as in the
  sequential executor. Client states are committed once the whole round succeeded; anything the executor
  cannot stack makes the round run sequentially (:func:`train_or_none`).
- Personal evaluation is batched: when the personal predictor is the model itself, or the algorithm gives
  ``personal_extra`` / ``personal_logits`` (FedGELA, FedNH), the clients' personal models are stacked and
  vmapped over chunks of the full test set, or of their local test splits padded to the longest
  (``personal_test: split``). Predictions equal the sequential ones up to ties within float rounding.

Speed on a CPU. vmap turns a convolution with per-client weights into a grouped convolution, which oneDNN
runs slower than a loop over the clients. The ConvNet family (simplecnn, conv2cifar, cnn1..cnn5) therefore
gets a twin whose ``features`` is one autograd.Function with its own vmap rule: per client, the
convolutions with the fastest backward kernels measured (weight gradient alone, input gradient by
``conv_transpose2d``), the first max-pool + ReLU from strided views (max_pool2d's values and gradient routing,
faster than its CPU kernel with indices on the large map) and the second by ``max_pool2d`` in channels-last
layout; the fully connected layers as batched matmuls over the clients. ``metrics.predict`` uses the
strided-view pooling for a bit-identical, faster ConvNet forward (:func:`fast_predictor`). Other
architectures go through plain vmap (BatchNorm included: running statistics are stacked per-client buffers
updated in place).

``engine.executor: auto`` runs the sequential executor (see ``fedpcd.engine.executor.train_clients``); this
one runs with ``executor: vectorized``, for any architecture, in chunks of clients whose stacked state fits
``MEMORY_BUDGET``. On a CPU it is fastest for the ConvNet family: 1.04-1.13x a plain PyTorch loop for
simplecnn on fmnist on a quiet 2-core machine (1.3-1.7x when the machine is loaded, which slows the plain
loop's many small operations more); the MLP on fmnist ran at 0.7x and ResNet-18 at 0.3-0.6x. There the
per-client convolution kernels bound it (benchmarks/speed.py prints the bound); on a GPU the per-step launch
overhead that vectorisation removes dominates instead (not measured here: no GPU).

Float rounding differs from the sequential executor's (other kernels, other summation orders): usually
1e-8 after a round, but a ReLU unit whose input is within rounding of 0, or FedMR's decorrelation with its
1e-8 variance guard on a nearly constant dimension, can amplify it to 1e-4 over tens of steps (two
sequential runs with equivalent loss formulas drift apart the same way).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedpcd.algorithms import ClientData, FedAvg
from fedpcd.algorithms.base import round_lr, tensor_bytes
from fedpcd.algorithms.fedavg import LocalWork
from fedpcd.engine.executor import ClientResult
from fedpcd.engine.federation import Federation, to_device
from fedpcd.engine.metrics import personal_metrics, predict, predict_stacked, split_metrics
from fedpcd.errors import UserError
from fedpcd.models.cnn import ConvNet
from fedpcd.utils import derive_seed

MEMORY_BUDGET = 2 << 30  # bytes of stacked per-client state and activations trained at once (chunks beyond)
EVAL_BATCH = 1024  # test samples per vmapped evaluation chunk (fewer when many clients are stacked)


class Fallback(Exception):
    """The vectorized executor cannot run this round (the reason); the sequential one runs it instead."""


# ----- when it applies -------------------------------------------------------------------------------------


def blocker(algorithm: FedAvg, fed: Federation, ids: Sequence[int]) -> str | None:
    """Why the vectorized executor does not run this round (None: it does)."""
    reason = algorithm.vectorize_blocker()
    if reason is not None:
        return reason
    cls = type(algorithm)
    for hook in ("local_update", "fit", "train", "before_step"):
        if getattr(cls, hook) is not getattr(FedAvg, hook):
            return f"{cls.__name__} overrides {hook}"
    if len(ids) < 2:
        return "fewer than 2 participants"
    if len({fed.config.model.architecture(k) for k in ids}) > 1:
        return "the participants have different architectures"
    return None


_WARNED: set[str] = set()


def train_or_none(
    algorithm: FedAvg,
    fed: Federation,
    server: dict[str, Any],
    ids: Sequence[int],
    client_states: Any,
    rnd: int,
    evaluate: bool,
) -> list[ClientResult] | None:
    """The round's results from the vectorized executor, or None when the sequential one should run it
    (a warning says why, once per reason)."""
    reason = blocker(algorithm, fed, ids)
    if reason is None:
        try:
            return train_vectorized(algorithm, fed, server, ids, client_states, rnd, evaluate)
        except UserError:
            raise
        except Fallback as exc:
            reason = str(exc)
        except Exception as exc:  # the sequential executor reruns the round and reports per client
            reason = f"{type(exc).__name__}: {exc}"
    if reason not in _WARNED and reason != "fewer than 2 participants":
        _WARNED.add(reason)
        warnings.warn(f"vectorized executor not used ({reason}); running clients sequentially", stacklevel=3)
    return None


# ----- nested containers of tensors ------------------------------------------------------------------------


def _leaves(obj: Any) -> list[Tensor]:
    """The tensors of nested dicts / lists / tuples, in a fixed order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaves(v)]
    return []


def _skeleton(obj: Any) -> Any:
    """``obj`` with each tensor replaced by (shape, dtype): equal skeletons can be stacked leaf by leaf."""
    if isinstance(obj, Tensor):
        return ("<tensor>", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return ("<dict>", tuple((k, _skeleton(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (f"<{type(obj).__name__}>", tuple(_skeleton(v) for v in obj))
    return obj


def _rebuild(obj: Any, tensors: Iterator[Tensor]) -> Any:
    """``obj`` with its tensors replaced, in :func:`_leaves` order, by ``tensors``."""
    if isinstance(obj, Tensor):
        return next(tensors)
    if isinstance(obj, dict):
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, tensors) for v in obj)
    return obj


def _stack_or_share(values: Sequence[Tensor], by_identity: bool) -> tuple[Tensor, bool]:
    """(tensor, stacked): the one shared tensor if every client has the same (object, or equal values with
    ``by_identity=False``), else the values stacked along a new client dimension."""
    first = values[0]
    if all(v is first for v in values) or (
        not by_identity and all(v.shape == first.shape and torch.equal(v, first) for v in values)
    ):
        return first, False
    return torch.stack([v.detach() for v in values]), True


# ----- the twin: the model's architecture, callable with substituted (batched) tensors ---------------------


class _Bound(nn.Module):
    """Holds a model so that ``functional_call`` can substitute its tensors while ``fn(model)`` runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, fn: Callable[[nn.Module], Tensor]) -> Tensor:
        return fn(self.m)


_TWINS: weakref.WeakKeyDictionary[nn.Module, _Bound] = weakref.WeakKeyDictionary()


def _twin(model: nn.Module) -> _Bound:
    """A copy of ``model`` (one per reusable model object) wrapped for functional calls; the ConvNet family
    gets the fast batched ``features``."""
    bound = _TWINS.get(model)
    if bound is None:
        twin = copy.deepcopy(model)
        if _fast_convnet(model):
            twin.features = types.MethodType(_fast_features, twin)  # type: ignore[method-assign]
        bound = _Bound(twin)
        _TWINS[model] = bound
    return bound


def _fast_convnet(model: nn.Module) -> bool:
    return type(model) is ConvNet and type(model).features is ConvNet.features


def _model_tensors(model: nn.Module) -> dict[str, Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


# ----- the ConvNet fast path -------------------------------------------------------------------------------


def _pool_relu_masks(a: Tensor, masks: bool) -> tuple[Tensor, list[Tensor]]:
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


def _pool_relu_backward(g: Tensor, masks: Sequence[Tensor], shape: torch.Size) -> Tensor:
    """The gradient of :func:`_pool_relu_masks` w.r.t. its input of ``shape``, from the output gradient."""
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


def _per_client(x: Tensor, shared_x: bool, *stacked: Tensor) -> Iterator[tuple[Tensor, ...]]:
    """(x_k, w1_k, ...) for each client k: ``x`` is [K, ...] or, with ``shared_x``, the same for all."""
    columns = [t.unbind(0) for t in stacked]
    xs = [x] * len(columns[0]) if shared_x else x.unbind(0)
    return zip(xs, *columns, strict=True)


def _weight_grad(grad_out: Tensor, inp: Tensor, weight: Tensor) -> Tensor:
    """A stride-1, unpadded convolution's weight gradient (oneDNN's backward kernel alone)."""
    args = (grad_out, inp, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])
    return torch.ops.aten.convolution_backward(*args)[1]


class _ConvStack(torch.autograd.Function):
    """ConvNet's two (conv 5x5 -> ReLU -> max-pool 2) stages for K clients, flattened: [K, B, F]. One node
    per step (no per-layer autograd bookkeeping); per client the fast CPU kernels: the weight gradient alone
    (:func:`_weight_grad`), the input gradient by ``conv_transpose2d``, the first pooling by
    :func:`_pool_relu_masks`, the second by ``max_pool2d`` in channels-last layout (its fast kernel for the
    small maps; ReLU after the max, which routes the same gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, shared_x: bool, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor
    ) -> Tensor:
        flat, saved = [], []
        for xk, w1k, b1k, w2k, b2k in _per_client(x, shared_x, w1, b1, w2, b2):
            a1 = F.conv2d(xk, w1k, b1k)
            p1, m1 = _pool_relu_masks(a1, masks=True)
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
            grads[3].append(_weight_grad(ga2, p1, w2[k]))
            grads[4].append(ga2.sum(dim=(0, 2, 3)))
            ga1 = _pool_relu_backward(F.conv_transpose2d(ga2, w2[k]), m1, shape1)
            grads[1].append(_weight_grad(ga1, xk, w1[k]))
            grads[2].append(ga1.sum(dim=(0, 2, 3)))
            if ctx.needs_input_grad[0]:
                grads[0].append(F.conv_transpose2d(ga1, w1[k]))
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.stack(grads[0])
            gx = gx.sum(0) if ctx.shared_x else gx
        return gx, None, *[torch.stack(gs) for gs in grads[1:]]


def _conv_stack_nograd(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    a = _pool_relu_masks(F.conv2d(x, w1, b1), masks=False)[0]
    return _pool_relu_masks(F.conv2d(a, w2, b2), masks=False)[0].flatten(1)


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
        flat = torch.stack([_conv_stack_nograd(*c) for c in _per_client(x, shared_x, w1, b1, w2, b2)])
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
def convnet_logits(model: ConvNet, x: Tensor) -> Tensor:
    """``model(x)`` of a ConvNet without gradient, bit for bit, with the faster max-pool (the convolutions
    and linear layers are the model's own): the predictor :func:`fedpcd.engine.metrics.predict` uses."""
    a = _pool_relu_masks(model.conv1(x), masks=False)[0]
    a = _pool_relu_masks(model.conv2(a), masks=False)[0]
    z = model.fc2(F.relu(model.fc1(torch.flatten(a, 1))))
    return model.head(F.relu(z) if model.feature_relu else z)


def fast_predictor(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """A faster, bit-identical no-gradient forward of ``model`` where there is one (the ConvNet family:
    :func:`convnet_logits`), else the model itself."""
    return functools.partial(convnet_logits, model) if _fast_convnet(model) else model


def _fast_features(self: ConvNet, x: Tensor) -> Tensor:
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


# ----- memory: how many clients at once --------------------------------------------------------------------

_ACTIVATIONS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _activation_bytes(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Bytes of the module outputs of one sample's forward pass (an estimate of its activations)."""
    if model not in _ACTIVATIONS:
        total = 0

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            nonlocal total
            total += sum(t.numel() * t.element_size() for t in _leaves(output))

        handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model(torch.zeros(1, *input_shape, device=next(model.parameters()).device))
        finally:
            model.train(was_training)
            for h in handles:
                h.remove()
        _ACTIVATIONS[model] = total
    return _ACTIVATIONS[model]


def _chunk_size(model: nn.Module, fed: Federation, ids: Sequence[int]) -> int:
    """Clients trained at once within MEMORY_BUDGET: stacked weights, momentum, gradients and copies (x5),
    and a batch's activations (3x the module outputs: saved tensors, gradients, functional ops)."""
    shape = fed.context.input_shape or tuple(fed.clients[0].x.shape[1:])
    params = sum(t.numel() * t.element_size() for t in _model_tensors(model).values())
    batch = min(fed.context.local.batch_size, max(fed.clients[k].num_samples for k in ids))
    per_client = 5 * params + 3 * batch * _activation_bytes(model, tuple(shape))
    return max(1, MEMORY_BUDGET // max(per_client, 1))


# ----- the executor ----------------------------------------------------------------------------------------


@dataclass
class _Client:
    """One participant of a chunk: its inputs, its working context after ``begin_local`` and its stream."""

    k: int
    data: ClientData
    payload: dict[str, Any]
    state: Any
    rng: torch.Generator
    context: dict[str, Any]  # {"payload", "state", "attrs"}: what the loss sees
    tensors: dict[str, Tensor]  # the model's tensors after begin_local (snapshots)
    trainable: list[str]  # keys "m:<name>" / "c:<leaf index>" of the trainable tensors, optimiser order


# a client whose personal evaluation is batched: (result position, client, model tensors, personal_extra)
Pending = tuple[int, _Client, dict[str, Tensor], dict[str, Any] | None]


def _context(algorithm: FedAvg, work: LocalWork) -> dict[str, Any]:
    attrs = {a: getattr(algorithm, a) for a in type(algorithm).vector_attrs}
    return {"payload": work.payload, "state": work.state, "attrs": attrs}


def _begin(
    algorithm: FedAvg, fed: Federation, server: dict[str, Any], k: int, client_states: Any, rnd: int
) -> _Client:
    payload = algorithm.payload_for(server, k)
    state = client_states.get(k)
    model = fed.model_for(k, fresh=state is None)
    device = next(model.parameters()).device
    payload, state = to_device(payload, device), to_device(state, device)
    rng = torch.Generator().manual_seed(derive_seed(fed.config.seed, rnd, k))
    algorithm.round = rnd
    work = algorithm.begin_local(model, fed.clients[k], payload, state, rng)
    context = _context(algorithm, work)
    names = {id(p): f"m:{n}" for n, p in model.named_parameters()}
    names.update({id(t): f"c:{i}" for i, t in enumerate(_leaves(context))})
    trainable = []
    for p in algorithm.trainable_parameters(model, work.payload, work.state):
        if p.requires_grad:
            if id(p) not in names:
                raise Fallback("a trainable tensor is neither a model parameter nor in the loss's inputs")
            trainable.append(names[id(p)])
    tensors = {n: t.detach().clone() for n, t in _model_tensors(model).items()}
    return _Client(k, fed.clients[k], payload, state, rng, context, tensors, trainable)


def _streams(client: _Client, batch_size: int, epochs: int) -> Iterator[tuple[Tensor, Tensor]]:
    """The client's batches, epoch after epoch, as the shared loop draws them."""
    for _ in range(epochs):
        yield from client.data.batches(batch_size, client.rng)


def train_vectorized(
    algorithm: FedAvg,
    fed: Federation,
    server: dict[str, Any],
    ids: Sequence[int],
    client_states: Any,
    rnd: int,
    evaluate: bool,
) -> list[ClientResult]:
    """Train (and, if ``evaluate``, personally evaluate) the participants ``ids``, chunk by chunk; the same
    results as the sequential executor up to float rounding. Raises :class:`Fallback` when the clients'
    contexts cannot be stacked (nothing is committed then)."""
    chunk = max(2, _chunk_size(fed.model_for(ids[0]), fed, ids))
    results: list[ClientResult] = []
    new_states: dict[int, Any] = {}
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        results += _train_chunk(algorithm, fed, server, part, client_states, rnd, evaluate, new_states)
    for k, state in new_states.items():
        client_states[k] = state
    return results


def _train_chunk(
    algorithm: FedAvg,
    fed: Federation,
    server: dict[str, Any],
    ids: Sequence[int],
    client_states: Any,
    rnd: int,
    evaluate: bool,
    new_states: dict[int, Any],
) -> list[ClientResult]:
    clients = [_begin(algorithm, fed, server, k, client_states, rnd) for k in ids]
    skeletons = [_skeleton(c.context) for c in clients]
    # clients whose loss inputs differ in structure (MOON's previous model, absent at a first participation)
    # or that train different tensors are trained in separate groups
    groups: list[tuple[tuple[Any, list[str]], list[int]]] = []
    for j, c in enumerate(clients):
        key = (skeletons[j], c.trainable)
        members = next((m for k, m in groups if k == key), None)
        if members is None:
            groups.append((key, [j]))
        else:
            members.append(j)
    model = fed.model_for(clients[0].k)
    final: list[dict[str, Tensor]] = [{} for _ in clients]
    losses: list[float] = [0.0] * len(clients)
    for _, members in groups:
        group_final, group_losses = _train_steps(algorithm, model, [clients[j] for j in members])
        for j, f, loss in zip(members, group_final, group_losses, strict=True):
            final[j], losses[j] = f, loss

    results = []
    pending: list[Pending] = []
    bound = _twin(model)
    for j, c in enumerate(clients):
        model = fed.model_for(c.k, fresh=c.state is None)
        algorithm.round = rnd
        work = algorithm.begin_local(
            model, c.data, c.payload, c.state, torch.Generator().manual_seed(c.rng.initial_seed())
        )
        context = _context(algorithm, work)
        if _skeleton(context) != skeletons[j]:
            raise Fallback("begin_local gave a different context on re-entry")
        _write_back(model, context, final[j])
        model.train()  # as the shared loop leaves it
        # end_local goes on with the client's generator where its batches left it, as in the sequential loop
        reply, state = algorithm.end_local(model, c.data, dataclasses.replace(work, rng=c.rng), losses[j])
        if state is not None:
            new_states[c.k] = state
        metrics = None
        if evaluate:
            metrics = _evaluate_or_defer(algorithm, fed, model, c, state, len(results), pending)
        results.append(ClientResult(c.k, reply, metrics, tensor_bytes(c.payload), tensor_bytes(reply)))
    if pending:
        for pos, metrics in _evaluate_batched(algorithm, bound, pending, fed.config.personal_test == "full"):
            results[pos].metrics = metrics
    return results


def _write_back(model: nn.Module, context: dict[str, Any], final: dict[str, Tensor]) -> None:
    """Put one client's trained (or in-place updated) tensors into the model and its re-entered context."""
    tensors = _model_tensors(model)
    leaves = _leaves(context)
    with torch.no_grad():
        for key, value in final.items():
            kind, name = key.split(":", 1)
            target = tensors[name] if kind == "m" else leaves[int(name)]
            target.copy_(value)


def _train_steps(
    algorithm: FedAvg, model: nn.Module, clients: list[_Client]
) -> tuple[list[dict[str, Tensor]], list[float]]:
    """The shared loop for all ``clients`` at once; per client the trained tensors (trainable ones and those
    the loss updated in place) and the mean train loss."""
    cfg = algorithm.ctx.local
    lr = round_lr(cfg, algorithm.round)
    momentum, decay, clip = cfg.momentum, cfg.weight_decay, algorithm.max_grad_norm()
    batch_size, epochs = cfg.batch_size, cfg.epochs
    first = clients[0]
    n_clients = len(clients)
    trainable_keys = first.trainable
    bound = _twin(model)
    bound.m.train()

    # stacked (per-client) and shared tensors, by key "m:<model tensor>" / "c:<context leaf>"
    shared: dict[str, Tensor] = {}
    stacked: dict[str, Tensor] = {}
    buffers = {n for n, _ in model.named_buffers()}
    for name in first.tensors:
        key = f"m:{name}"
        value, is_stacked = _stack_or_share([c.tensors[name] for c in clients], by_identity=False)
        if key in trainable_keys or name in buffers:  # buffers may be updated in place (BatchNorm)
            is_stacked, value = True, value if is_stacked else value.expand(n_clients, *value.shape).clone()
        (stacked if is_stacked else shared)[key] = value
    leaf_lists = [_leaves(c.context) for c in clients]
    for i in range(len(leaf_lists[0])):
        key = f"c:{i}"
        values = [leaves[i] for leaves in leaf_lists]
        value, is_stacked = _stack_or_share(values, by_identity=True)
        if key in trainable_keys and not is_stacked:
            value, is_stacked = value.detach().expand(n_clients, *value.shape).clone(), True
        (stacked if is_stacked else shared)[key] = value
    trainable = {k: stacked[k] for k in trainable_keys}
    carried = {k: v for k, v in stacked.items() if k not in trainable}
    initial_carried = {k: v.clone() for k, v in carried.items()}
    momenta = {k: torch.zeros_like(v) for k, v in trainable.items()} if momentum != 0 else {}

    template = first.context
    n_leaves = len(leaf_lists[0])
    model_names = list(first.tensors)
    param_names = [n for n, _ in model.named_parameters()]

    def enter(tr: dict[str, Tensor], per: dict[str, Tensor]) -> tuple[dict[str, Tensor], Any, Any]:
        """One client's tensors by key, payload and state (and its ``vector_attrs`` set on the algorithm)."""
        t = {**shared, **per, **tr}
        context = _rebuild(template, iter([t[f"c:{i}"] for i in range(n_leaves)]))
        for attr, value in context["attrs"].items():
            setattr(algorithm, attr, value)
        return t, context["payload"], context["state"]

    def client_loss(tr: dict[str, Tensor], per: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        t, payload, state = enter(tr, per)
        params = {f"m.{n}": t[f"m:{n}"] for n in model_names}
        return functional_call(bound, params, (lambda m: algorithm.vector_loss(m, (x, y), payload, state),))

    def client_grads(
        grads: dict[str, Tensor], tr: dict[str, Tensor], per: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        t, payload, state = enter(tr, per)
        return algorithm.correct_grads(grads, {n: t[f"m:{n}"] for n in param_names}, payload, state)

    batched_loss = vmap(client_loss, in_dims=(0, 0, 0, 0), randomness="error")
    correcting = type(algorithm).correct_grads is not FedAvg.correct_grads
    batched_grads = vmap(client_grads, in_dims=(0, 0, 0), randomness="error")
    device = next(iter(trainable.values())).device

    # the schedule: client j has steps_j = epochs * ceil(n_j / B) batches; its batch at step s has size_j(s)
    sizes = [c.data.num_samples for c in clients]
    per_epoch = [math.ceil(n / batch_size) for n in sizes]
    steps = [epochs * p for p in per_epoch]
    streams = [_streams(c, batch_size, epochs) for c in clients]
    totals = torch.zeros(n_clients, device=device)
    final: list[dict[str, Tensor]] = [{} for _ in clients]
    rows = list(range(n_clients))  # row r of the stacked tensors holds client rows[r]
    saved_attrs = {a: getattr(algorithm, a) for a in type(algorithm).vector_attrs}

    def retire(keep: list[int]) -> None:
        """Keep the stacked rows ``keep``; the other clients are done: save their tensors."""
        nonlocal trainable, carried, momenta, rows
        if len(keep) == len(rows):
            return
        kept = set(keep)
        for r, j in enumerate(rows):
            if r not in kept:
                final[j] = {k: v[r].clone() for k, v in trainable.items()}
                for k, v in carried.items():
                    if not torch.equal(v[r], initial_carried[k][j]):  # updated in place (BatchNorm)
                        final[j][k] = v[r].clone()
        if keep:
            idx = torch.tensor(keep, device=device, dtype=torch.long)
            trainable = {k: v.index_select(0, idx) for k, v in trainable.items()}
            carried = {k: v.index_select(0, idx) for k, v in carried.items()}
            momenta = {k: v.index_select(0, idx) for k, v in momenta.items()}
            rows = [rows[r] for r in keep]

    try:
        for s in range(max(steps, default=0)):
            retire([r for r, j in enumerate(rows) if steps[j] > s])
            groups: dict[int, list[int]] = {}
            for r, j in enumerate(rows):
                groups.setdefault(min(batch_size, sizes[j] - (s % per_epoch[j]) * batch_size), []).append(r)
            batches = [next(streams[j]) for j in rows]
            for size, members in groups.items():
                xs = torch.stack([batches[r][0] for r in members])
                ys = torch.stack([batches[r][1] for r in members])
                whole = len(members) == len(rows)
                idx = None if whole else torch.tensor(members, device=device, dtype=torch.long)
                tr = trainable if whole else {k: v.index_select(0, idx) for k, v in trainable.items()}
                per = carried if whole else {k: v.index_select(0, idx) for k, v in carried.items()}
                mom = momenta if whole else {k: v.index_select(0, idx) for k, v in momenta.items()}
                leaves = {k: v.detach().requires_grad_() for k, v in tr.items()}
                losses = batched_loss(leaves, per, xs, ys)
                grads = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
                with torch.no_grad():
                    if correcting:  # before_step's correct_grads, per client
                        grads = _corrected(batched_grads, list(tr), grads, tr, per)
                    _sgd(list(tr.values()), list(grads), [mom.get(k) for k in tr], lr, momentum, decay, clip)
                    if idx is not None:
                        for src, dst in ((tr, trainable), (per, carried), (mom, momenta)):
                            for k, v in src.items():
                                dst[k].index_copy_(0, idx, v)
                    pos = torch.tensor([rows[r] for r in members], device=device, dtype=torch.long)
                    totals.index_add_(0, pos, losses.detach() * size)
        retire([])
    finally:
        for attr, value in saved_attrs.items():
            setattr(algorithm, attr, value)
    mean_losses = [float(totals[j]) / max(sizes[j] * epochs, 1) for j in range(n_clients)]
    return final, mean_losses


def _corrected(
    batched: Callable[..., dict[str, Tensor]],
    keys: list[str],
    grads: Sequence[Tensor | None],
    trainable: dict[str, Tensor],
    carried: dict[str, Tensor],
) -> list[Tensor | None]:
    """``grads`` (stacked, in ``keys`` order) after the vmapped ``correct_grads`` (``batched``), which sees
    the model parameters' gradients by name (those that exist, as ``before_step`` does)."""
    pairs = list(zip(keys, grads, strict=True))
    fixed = batched({k[2:]: g for k, g in pairs if g is not None and k.startswith("m:")}, trainable, carried)
    return [fixed.get(k[2:], g) if g is not None and k.startswith("m:") else g for k, g in pairs]


def _sgd(
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


# ----- personal evaluation ---------------------------------------------------------------------------------


def _evaluate_or_defer(
    algorithm: FedAvg,
    fed: Federation,
    model: nn.Module,
    client: _Client,
    state: Any,
    pos: int,
    pending: list[Pending],
) -> dict[str, Any] | None:
    """client_step's personal metrics: deferred (None) when the personal predictor can be batched (it is the
    model itself, or the algorithm gives ``personal_extra``), else computed now."""
    data = client.data
    predictor = algorithm.personal_predictor(model, client.payload, state)
    extra = None if predictor is model else algorithm.personal_extra(model, client.payload, state)
    if predictor is model or extra is not None:
        tensors = {n: t.detach().clone() for n, t in _model_tensors(model).items()}
        pending.append((pos, client, tensors, extra))
        return None
    if fed.config.personal_test == "full":
        pred = predict(predictor, data.test_x)
        return personal_metrics(pred, data.test_y, data.local_test_idx, data.label_counts)
    split = data.local_test_idx
    pred = predict(predictor, data.test_x[split]) if len(split) else split
    return split_metrics(pred, data.test_y[split])


def _evaluate_batched(
    algorithm: FedAvg, bound: _Bound, pending: list[Pending], full_test: bool
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Personal metrics of the deferred clients: their models stacked and vmapped over chunks of the full
    test set, or (``full_test`` False) of their local test splits, padded to the longest."""
    groups: dict[Any, list[Pending]] = {}
    for item in pending:
        key = (id(item[1].data.test_x), item[3] is None, _skeleton(item[3]))
        groups.setdefault(key, []).append(item)
    for items in groups.values():
        weights, extras = [it[2] for it in items], [it[3] for it in items]
        data = items[0][1].data
        if full_test:
            preds = _predict_group(algorithm, bound, weights, extras, data.test_x, shared_x=True)
            for (pos, client, _, _), pred in zip(items, preds, strict=True):
                d = client.data
                yield pos, personal_metrics(pred, d.test_y, d.local_test_idx, d.label_counts)
            continue
        splits = [it[1].data.local_test_idx for it in items]
        longest = max(len(split) for split in splits)
        if longest == 0:
            preds = [split for split in splits]
        else:
            padded = torch.zeros(len(splits), longest, dtype=torch.long, device=splits[0].device)
            for i, split in enumerate(splits):
                padded[i, : len(split)] = split
            preds = _predict_group(algorithm, bound, weights, extras, data.test_x[padded], shared_x=False)
        for (pos, client, _, _), pred, split in zip(items, preds, splits, strict=True):
            yield pos, split_metrics(pred[: len(split)], client.data.test_y[split])


def _predict_group(
    algorithm: FedAvg,
    bound: _Bound,
    weights: list[dict[str, Tensor]],
    extras: list[dict[str, Any] | None],
    x: Tensor,
    shared_x: bool,
) -> Tensor:
    """[M, n] predictions of M personal models on ``x`` ([n, ...] for all with ``shared_x``, else [M, n,
    ...]): the model with ``weights[i]`` (and, unless all ``extras`` are None, ``personal_logits`` with
    ``extras[i]``), vmapped over the clients in chunks of the samples."""
    names = list(weights[0])
    shared: dict[str, Tensor] = {}
    stacked: dict[str, Tensor] = {}
    for n in names:
        value, is_stacked = _stack_or_share([w[n] for w in weights], by_identity=False)
        if not is_stacked and not stacked and n == names[-1]:  # vmap needs one batched input
            value, is_stacked = value.expand(len(weights), *value.shape), True
        (stacked if is_stacked else shared)[n] = value
    template = extras[0]
    leaf_lists = [_leaves(e) for e in extras]
    extra_shared: dict[int, Tensor] = {}
    extra_stacked: dict[int, Tensor] = {}
    for i in range(len(leaf_lists[0])):
        value, is_stacked = _stack_or_share([leaves[i] for leaves in leaf_lists], by_identity=True)
        (extra_stacked if is_stacked else extra_shared)[i] = value
    n_leaves = len(leaf_lists[0])

    def logits(tensors: dict[str, Tensor], extra_t: dict[int, Tensor], xb: Tensor) -> Tensor:
        t = {**shared, **tensors}
        params = {f"m.{n}": t[n] for n in names}
        if template is None:
            return functional_call(bound, params, (lambda m: m(xb),))
        e = {**extra_shared, **extra_t}
        extra = _rebuild(template, iter([e[i] for i in range(n_leaves)]))
        return functional_call(bound, params, (lambda m: algorithm.personal_logits(m, xb, extra),))

    many = vmap(logits, in_dims=(0, 0, None if shared_x else 0), randomness="error")
    chunk = max(64, EVAL_BATCH * 8 // max(len(weights), 8))
    bound.m.eval()
    try:
        if shared_x:
            return predict_stacked(lambda xb: many(stacked, extra_stacked, xb), x, chunk)
        with torch.no_grad():
            parts = [
                many(stacked, extra_stacked, x[:, i : i + chunk]).argmax(-1)
                for i in range(0, x.shape[1], chunk)
            ]
        return torch.cat(parts, dim=1)
    finally:
        bound.m.train()
