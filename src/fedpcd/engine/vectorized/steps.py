"""The vectorized executor's training loop: the shared loop ``train_loop`` for a group of clients at once,
step-synchronous, one vmapped loss and one backward pass per batch-size group and step."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedpcd.algorithms import Algorithm, LocalWork
from fedpcd.algorithms.common import round_lr
from fedpcd.algorithms.sgd import sgd_update
from fedpcd.engine.vectorized.clients import Client, batch_stream, work_of
from fedpcd.engine.vectorized.sgd import clip_per_client
from fedpcd.engine.vectorized.stacking import rebuild, stack_or_share, tensor_leaves, twin_of


def train_steps(
    algorithm: Algorithm, model: nn.Module, clients: list[Client]
) -> tuple[list[dict[str, Tensor]], list[float], list[int]]:
    """The shared loop for all ``clients`` at once; per client the trained tensors (trainable ones and those
    the loss updated in place), the mean train loss and the number of steps."""
    cfg = algorithm.ctx.local
    first = clients[0]
    lr = round_lr(cfg, first.round)
    momentum, decay, clip = cfg.momentum, cfg.weight_decay, cfg.grad_clip
    batch_size, epochs = cfg.batch_size, cfg.epochs
    n_clients = len(clients)
    trainable_keys = first.trainable
    bound = twin_of(model)
    bound.m.train()

    # stacked (per-client) and shared tensors, by key "m:<model tensor>" / "c:<context leaf>"
    shared: dict[str, Tensor] = {}
    stacked: dict[str, Tensor] = {}
    buffers = {n for n, _ in model.named_buffers()}
    for name in first.tensors:
        key = f"m:{name}"
        value, is_stacked = stack_or_share([c.tensors[name] for c in clients], by_identity=False)
        if key in trainable_keys or name in buffers:  # buffers may be updated in place (BatchNorm)
            is_stacked, value = True, value if is_stacked else value.expand(n_clients, *value.shape).clone()
        (stacked if is_stacked else shared)[key] = value
    leaf_lists = [tensor_leaves(c.context) for c in clients]
    for i in range(len(leaf_lists[0])):
        key = f"c:{i}"
        values = [leaves[i] for leaves in leaf_lists]
        value, is_stacked = stack_or_share(values, by_identity=True)
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

    spare = torch.Generator()  # the works' generator under vmap (a loss must not draw)

    def enter(tr: dict[str, Tensor], per: dict[str, Tensor]) -> tuple[dict[str, Tensor], LocalWork]:
        """One client's tensors by key and its work (payload, state and working values)."""
        t = {**shared, **per, **tr}
        context = rebuild(template, iter([t[f"c:{i}"] for i in range(n_leaves)]))
        return t, work_of(context, spare, first.round)

    def client_loss(tr: dict[str, Tensor], per: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        t, work = enter(tr, per)
        params = {f"m.{n}": t[f"m:{n}"] for n in model_names}
        return functional_call(bound, params, (lambda m: algorithm.traceable_loss(m, (x, y), work),))

    def client_grads(
        grads: dict[str, Tensor], tr: dict[str, Tensor], per: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        t, work = enter(tr, per)
        return algorithm.correct_grads(grads, {n: t[f"m:{n}"] for n in param_names}, work)

    batched_loss = vmap(client_loss, in_dims=(0, 0, 0, 0), randomness="error")
    correcting = type(algorithm).correct_grads is not Algorithm.correct_grads
    batched_grads = vmap(client_grads, in_dims=(0, 0, 0), randomness="error")
    device = next(iter(trainable.values())).device

    # the schedule: client j has steps_j = epochs * ceil(n_j / B) batches; its batch at step s has size_j(s)
    sizes = [c.data.num_samples for c in clients]
    per_epoch = [math.ceil(n / batch_size) for n in sizes]
    steps = [epochs * p for p in per_epoch]
    streams = [batch_stream(c, batch_size, epochs) for c in clients]
    totals = torch.zeros(n_clients, device=device)
    final: list[dict[str, Tensor]] = [{} for _ in clients]
    rows = list(range(n_clients))  # row r of the stacked tensors holds client rows[r]

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
                if correcting:  # correct_grads, per client, as the shared loop calls it
                    grads = corrected_grads(batched_grads, list(tr), grads, tr, per)
                clipped = clip_per_client(list(grads), clip)
                momenta_of = [mom.get(k) for k in tr]  # zero-initialised: the first step's m * 0 + g is g
                sgd_update(list(tr.values()), clipped, momenta_of, lr, momentum, decay)
                if idx is not None:
                    for src, dst in ((tr, trainable), (per, carried), (mom, momenta)):
                        for k, v in src.items():
                            dst[k].index_copy_(0, idx, v)
                pos = torch.tensor([rows[r] for r in members], device=device, dtype=torch.long)
                totals.index_add_(0, pos, losses.detach() * size)
    retire([])
    mean_losses = [float(totals[j]) / max(sizes[j] * epochs, 1) for j in range(n_clients)]
    return final, mean_losses, steps


def corrected_grads(
    batched: Callable[..., dict[str, Tensor]],
    keys: list[str],
    grads: Sequence[Tensor | None],
    trainable: dict[str, Tensor],
    carried: dict[str, Tensor],
) -> list[Tensor | None]:
    """``grads`` (stacked, in ``keys`` order) after the vmapped ``correct_grads`` (``batched``), which sees
    the model parameters' gradients by name (those that exist, as the shared loop passes them)."""
    pairs = list(zip(keys, grads, strict=True))
    fixed = batched({k[2:]: g for k, g in pairs if g is not None and k.startswith("m:")}, trainable, carried)
    return [fixed.get(k[2:], g) if g is not None and k.startswith("m:") else g for k, g in pairs]
