"""Batched personal evaluation: the clients' personal models stacked and vmapped over chunks of the test
set (or of their local test splits, padded to the longest); the rest evaluated one by one as the sequential
executor does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedpcd.algorithms import Algorithm, LocalWork
from fedpcd.algorithms.readout import Readout
from fedpcd.engine.federation import Federation
from fedpcd.engine.metrics import (
    personal_evaluation,
    personal_metrics,
    predict_stacked,
    split_metrics,
)
from fedpcd.engine.vectorized.clients import Client, Pending
from fedpcd.engine.vectorized.stacking import (
    Bound,
    model_tensors,
    rebuild,
    skeleton,
    stack_or_share,
    tensor_leaves,
)

EVAL_BATCH = 1024  # test samples per vmapped evaluation chunk (fewer when many clients are stacked)


def evaluate_or_defer(
    algorithm: Algorithm,
    fed: Federation,
    model: nn.Module,
    client: Client,
    work: LocalWork,
    pos: int,
    pending: list[Pending],
    full_test: bool,
) -> dict[str, Any] | None:
    """The client's personal metrics after its update (``work``): deferred (None) when the personal
    predictor can be batched (it is the model itself, or a :class:`Readout` over it), else computed now."""
    predictor = algorithm.personal_predictor(model, work)
    readout = predictor if isinstance(predictor, Readout) and predictor.model is model else None
    if predictor is model or readout is not None:
        tensors = {n: t.detach().clone() for n, t in model_tensors(model).items()}
        pending.append((pos, client, tensors, readout))
        return None
    return personal_evaluation(predictor, client.data, full_test)


def evaluate_batched(
    algorithm: Algorithm, bound: Bound, pending: list[Pending], full_test: bool
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Personal metrics of the deferred clients: their models stacked and vmapped over chunks of the full
    test set, or (``full_test`` False) of their local test splits, padded to the longest."""
    groups: dict[Any, list[Pending]] = {}
    for item in pending:
        readout = item[3]
        logits = None if readout is None else readout.logits
        key = (id(item[1].data.test_x), logits, skeleton(None if readout is None else readout.tensors))
        groups.setdefault(key, []).append(item)
    for items in groups.values():
        weights, readouts = [it[2] for it in items], [it[3] for it in items]
        data = items[0][1].data
        if full_test:
            preds = predict_group(bound, weights, readouts, data.test_x, shared_x=True)
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
            preds = predict_group(bound, weights, readouts, data.test_x[padded], shared_x=False)
        for (pos, client, _, _), pred, split in zip(items, preds, splits, strict=True):
            yield pos, split_metrics(pred[: len(split)], client.data.test_y[split])


def predict_group(
    bound: Bound,
    weights: list[dict[str, Tensor]],
    readouts: list[Readout | None],
    x: Tensor,
    shared_x: bool,
) -> Tensor:
    """[M, n] predictions of M personal models on ``x`` ([n, ...] for all with ``shared_x``, else [M, n,
    ...]): the model with ``weights[i]`` (and, unless all ``readouts`` are None, the readout's logits with
    ``readouts[i].tensors``; one logits function for all), vmapped over the clients in chunks of the
    samples."""
    extras = [None if r is None else r.tensors for r in readouts]
    names = list(weights[0])
    shared: dict[str, Tensor] = {}
    stacked: dict[str, Tensor] = {}
    for n in names:
        value, is_stacked = stack_or_share([w[n] for w in weights], by_identity=False)
        if not is_stacked and not stacked and n == names[-1]:  # vmap needs one batched input
            value, is_stacked = value.expand(len(weights), *value.shape), True
        (stacked if is_stacked else shared)[n] = value
    template = extras[0]
    readout_logits = None if readouts[0] is None else readouts[0].logits
    leaf_lists = [tensor_leaves(e) for e in extras]
    extra_shared: dict[int, Tensor] = {}
    extra_stacked: dict[int, Tensor] = {}
    for i in range(len(leaf_lists[0])):
        value, is_stacked = stack_or_share([leaves[i] for leaves in leaf_lists], by_identity=True)
        (extra_stacked if is_stacked else extra_shared)[i] = value
    n_leaves = len(leaf_lists[0])

    def logits(tensors: dict[str, Tensor], extra_t: dict[int, Tensor], xb: Tensor) -> Tensor:
        t = {**shared, **tensors}
        params = {f"m.{n}": t[n] for n in names}
        if template is None:
            return functional_call(bound, params, (lambda m: m(xb),))
        e = {**extra_shared, **extra_t}
        extra = rebuild(template, iter([e[i] for i in range(n_leaves)]))
        return functional_call(bound, params, (lambda m: readout_logits(m, xb, extra),))

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
