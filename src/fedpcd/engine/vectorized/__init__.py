"""The vectorized executor: the round's clients of one architecture trained at once.

Same numbers as the sequential executor up to float rounding, for every algorithm that declares the capability
(``fedpcd.algorithms.vectorizable.Vectorizable``, which ``FedAvg`` inherits) and keeps the contract's
``local_update`` and ``fit`` (FedAvg, FedProx, FedRS, FedLC, FedMR, FedNH, FedGELA, FedGE, SCAFFOLD, FedDyn,
FedDC, FedNTD, FedNova, MOON, FedProc, FedSC, CReFF, FedPer, FedBABU, LG-FedAvg, FedClassAvg, Local,
FedAvg-FT, FedRoD, FedETF, FedProto, FD, FedSSA, FedBN) unless its ``vectorize_blocker`` names a reason. It
reads nothing else of an algorithm than the contract's hooks and that capability (``vectorize_blocker``,
``traceable_loss``). Not covered (the sequential executor runs them, with a warning): methods whose client
runs more than one training loop (Ditto, FedRep) or trains two models jointly (FML, FedKD, APFL), Per-FedAvg's
meta-learning steps, FedMR's Lite variant (random picks inside the loss) and FedSC's ``compat_official`` audit
mode (it collects features during training).

How it reproduces the contract's ``local_update`` = ``begin_local``; ``fit`` (the shared loop ``train_loop``);
``end_local`` for K clients:

- ``begin_local`` runs once per client on the reusable model object with the client's own ``LocalWork``, as in
  the sequential executor (its model tensors are kept); the model's tensors and the tensors of each work (the
  payload and state the loss sees, and the method's working values, e.g. FedNH's ``work.scale``) are stacked
  along a leading client dimension, and ``traceable_loss`` and ``correct_grads`` under vmap read one client's
  slices through a ``LocalWork`` of the same structure (with nothing received). A tensor that is the same
  object for every client (the global model in FedProx's payload, an ETF) is shared instead. Trainable are the
  tensors ``trainable_parameters`` returns (model parameters or working tensors: FedNH's scale, FedGELA's
  projection); every other model parameter stays as loaded. Clients whose works differ in structure (MOON's
  previous model, absent at a first participation; a working value that is not a tensor and differs) or that
  train different tensors are trained as separate groups.
- Training is step-synchronous: at step s every client with a batch left takes it from its own stream
  (``ClientData.batches`` with the client's generator, epoch after epoch: the sequential loop's batches and
  augmentation draws). Clients are grouped by batch size (one group at the full batch size; the short last
  batches form small groups), so batch-level losses (FedMR's decorrelation) are exact. Per group,
  ``torch.func.vmap`` over the clients evaluates ``traceable_loss`` through ``functional_call`` on a copy of
  the model (a "twin"), and one backward pass gives every client's gradient. A frozen model inside the loss
  (FedNTD's teacher, MOON's global and previous models: ``common.frozen_forward``) is a nested
  ``functional_call`` on the twin, vmapped with the rest (shared or per-client weights).
- ``correct_grads`` (SCAFFOLD's c - c_i, FedDyn's and FedDC's regulariser gradients) is vmapped over the
  clients' stacked gradients, parameters and works.
- The optimiser is the shared loop's step (``fedpcd.algorithms.sgd.sgd_update``: ``torch.optim.SGD``'s
  single-tensor update) on stacked tensors, each client its own:
  gradient-norm clipping as ``clip_grad_norm_`` (total norm over the trainable tensors, coefficient max /
  (norm + 1e-6) clamped to 1), g + wd w, momentum buffer b <- m b + g (zero-initialised: the first step is b =
  g, as torch's clone), w <- w - lr b. The mean train loss is accumulated as the loop does.
- Then per client its model tensors (as ``begin_local`` left them) and its trained tensors are written into
  the model and its work, the work's ``steps`` set, and ``end_local`` (control variates, drifts, FedBABU's and
  FedAvg-FT's fine-tuning, which stays sequential) and the personal evaluation run as in the sequential
  executor. Client states are committed once the whole round succeeded; anything the executor cannot stack
  makes the round run sequentially (:func:`train_or_none`).
- Personal evaluation is batched: when the personal predictor is the model itself, or a ``Readout`` over it
  (FedGELA, FedNH, FedRoD), the clients' personal models are stacked and vmapped over chunks of the full test
  set, or of their local test splits padded to the longest (``personal_test: split``). Predictions equal the
  sequential ones up to ties within float rounding.

The twin is the model's ``vmap_copy``: for the ConvNet family (simplecnn, conv2cifar, cnn1..cnn5) one whose
``features`` runs per-client CPU kernels under vmap (vmap would turn a convolution with per-client weights
into a grouped convolution, slower on a CPU than a loop over the clients), and predictions use the model's
``inference_forward`` (both in ``fedpcd.models.fast_convnet``). Other architectures go through plain vmap
(BatchNorm included: running statistics are stacked per-client buffers updated in place).

It runs only when asked for, ``engine.executor: vectorized``, on any device and architecture, in chunks of
clients whose stacked state fits ``MEMORY_BUDGET``; ``engine.executor: auto`` is the sequential executor on
the CPU and on CUDA alike (``fedpcd.engine.client_update.run_clients``). Its speed against the sequential
executor is in docs/performance.md.

Float rounding differs from the sequential executor's (other kernels, other summation orders): usually
1e-8 after a round, but a ReLU unit whose input is within rounding of 0, or FedMR's decorrelation with its
1e-8 variance guard on a nearly constant dimension, can amplify it to 1e-4 over tens of steps (two
sequential runs with equivalent loss formulas drift apart the same way).

Modules: this one (when it applies, chunks of clients within ``MEMORY_BUDGET``, the round), ``clients``
(``begin_local`` per client, batch streams, write-back), ``steps`` (the step-synchronous loop), ``sgd`` (the
optimiser on stacked tensors), ``evaluation`` (batched personal evaluation), ``stacking`` (nested containers
of tensors, the twin).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedpcd.algorithms import Algorithm
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.algorithms.vectorizable import Vectorizable
from fedpcd.engine.federation import Federation
from fedpcd.engine.tasks import ClientReply, ClientTask
from fedpcd.engine.vectorized.clients import Fallback, Pending, begin, write_back
from fedpcd.engine.vectorized.evaluation import evaluate_batched, evaluate_or_defer
from fedpcd.engine.vectorized.stacking import model_tensors, skeleton, tensor_leaves, twin_of
from fedpcd.engine.vectorized.steps import train_steps
from fedpcd.errors import UserError

__all__ = ["MEMORY_BUDGET", "Fallback", "blocker", "train_or_none", "train_vectorized"]

MEMORY_BUDGET = 2 << 30  # bytes of stacked per-client state and activations trained at once (chunks beyond)


# ----- when it applies -------------------------------------------------------------------------------------


def blocker(algorithm: Algorithm, fed: Federation, ids: Sequence[int]) -> str | None:
    """Why the vectorized executor does not run this round (None: it does): the algorithm must declare the
    capability (:class:`~fedpcd.algorithms.vectorizable.Vectorizable`), keep the contract's training loop and
    not block this configuration."""
    cls = type(algorithm)
    if not isinstance(algorithm, Vectorizable):
        return f"{cls.__name__} is not covered by the vectorized executor (it is not Vectorizable)"
    reason = algorithm.vectorize_blocker()
    if reason is not None:
        return reason
    for hook in ("local_update", "fit"):
        if getattr(cls, hook) is not getattr(Algorithm, hook):
            return f"{cls.__name__} is not covered by the vectorized executor (it overrides {hook})"
    if len(ids) < 2:
        return "fewer than 2 participants"
    if len({fed.config.model.architecture(k) for k in ids}) > 1:
        return "the participants have different architectures"
    return None


_WARNED: set[str] = set()


def train_or_none(
    algorithm: Algorithm, fed: Federation, tasks: Sequence[ClientTask]
) -> list[ClientReply] | None:
    """The replies to ``tasks`` from the vectorized executor, or None when the sequential one should run
    them (a warning says why, once per reason)."""
    reason = blocker(algorithm, fed, [t.client for t in tasks])
    if reason is None:
        try:
            return train_vectorized(algorithm, fed, tasks)
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


# ----- memory: how many clients at once --------------------------------------------------------------------

_ACTIVATIONS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _activation_bytes(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Bytes of the module outputs of one sample's forward pass (an estimate of its activations)."""
    if model not in _ACTIVATIONS:
        total = 0

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            nonlocal total
            total += sum(t.numel() * t.element_size() for t in tensor_leaves(output))

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
    params = sum(t.numel() * t.element_size() for t in model_tensors(model).values())
    batch = min(fed.context.local.batch_size, max(fed.clients[k].num_samples for k in ids))
    per_client = 5 * params + 3 * batch * _activation_bytes(model, tuple(shape))
    return max(1, MEMORY_BUDGET // max(per_client, 1))


# ----- the round -------------------------------------------------------------------------------------------


def train_vectorized(algorithm: Algorithm, fed: Federation, tasks: Sequence[ClientTask]) -> list[ClientReply]:
    """Train (and, where the task says so, personally evaluate) the clients of ``tasks``, chunk by chunk;
    the same replies as the sequential executor up to float rounding. Raises :class:`Fallback` when the
    clients' contexts cannot be stacked."""
    ids = [t.client for t in tasks]
    chunk = max(2, _chunk_size(fed.model_for(ids[0]), fed, ids))
    replies: list[ClientReply] = []
    for start in range(0, len(tasks), chunk):
        replies += _train_chunk(algorithm, fed, tasks[start : start + chunk])
    return replies


def _train_chunk(algorithm: Algorithm, fed: Federation, tasks: Sequence[ClientTask]) -> list[ClientReply]:
    """One chunk of the round: ``begin_local`` per client, the clients trained in groups of equal structure
    (:func:`~fedpcd.engine.vectorized.steps.train_steps`), then per client the write-back, ``end_local`` and
    the personal evaluation (batched where it can be)."""
    clients = [begin(algorithm, fed, task) for task in tasks]
    skeletons = [skeleton(c.context) for c in clients]
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
    steps: list[int] = [0] * len(clients)
    for _, members in groups:
        group_final, group_losses, group_steps = train_steps(algorithm, model, [clients[j] for j in members])
        for j, f, loss, n in zip(members, group_final, group_losses, group_steps, strict=True):
            final[j], losses[j], steps[j] = f, loss, n

    results: list[ClientReply] = []
    pending: list[Pending] = []
    bound = twin_of(model)
    task = tasks[0]
    for j, c in enumerate(clients):
        model = fed.model_for(c.k)
        write_back(model, c, final[j])
        model.train()  # as the shared loop leaves it
        # end_local goes on with the client's work, its generator where its batches left it, as in the
        # sequential loop
        work = c.work
        work.steps = steps[j]
        reply, state = algorithm.end_local(model, c.data, work, losses[j])
        work.state = state  # what personal_predictor reads, as after local_update
        metrics = None
        if task.evaluate:
            metrics = evaluate_or_defer(algorithm, fed, model, c, work, len(results), pending, task.full_test)
        results.append(ClientReply(c.k, reply, metrics, tensor_bytes(c.payload), 0, state=state))
    if pending:
        for pos, metrics in evaluate_batched(algorithm, bound, pending, task.full_test):
            results[pos].metrics = metrics
    return results
