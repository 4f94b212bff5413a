"""``aggregation.robust``: a Byzantine-robust mean of each quantity the server averages, in place of its mean.

Each algorithm declares what its server averages (``uploads``, :class:`fedpcd.algorithms.context.Upload`): the
model and its ``model``-kind uploads (FedNH's scale, FedGELA's projection), averaged like the model, and
per-class ``rows`` (class means, FedSSA's header rows), averaged per class over the clients that hold it.

- ``median`` / ``trimmed_mean``: each averaged quantity becomes the coordinate-wise median or trimmed mean of
  the kept replies' values (Yin et al., "Byzantine-Robust Distributed Learning", ICML 2018, Defs. 1-2),
  unweighted: a client cannot buy influence with its sample count. A per-class row is reduced over the
  clients holding that class, and every holder's row, as every reply's model-kind quantity, is replaced by
  the result before the algorithm's own rule runs: its weighted mean of identical values is that value,
  whatever the weights (class counts), and what follows (FedNH's smoothing, FedSC's relational prototypes,
  CReFF's re-trained classifier) sees only robust values. The model-kind quantities are then set to their
  robust value exactly.
- ``krum`` / ``multi_krum`` (Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient
  Descent", NeurIPS 2017): each of the n replies' model vectors (the model and model-kind uploads) gets the
  score sum of squared distances to its n - f - 2 nearest others (f = ``aggregation.byzantine``); Krum keeps
  the reply of the least score, Multi-Krum the m = ``krum_select`` (default n - f) least. The model-kind
  quantities are the uniform mean of the kept replies' (substituted as above), the per-class ones the
  algorithm's rule over the kept replies.

What it bounds: a minority of clients sending well-formed, finite but arbitrary values moves each coordinate
at most to the range of the honest values (median, trimmed mean), or is never picked while its vector is far
from the honest ones (Krum). What it does not: a majority of such clients, or poisoning too small per
coordinate to be trimmed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedpcd.algorithms import ALGORITHMS, Algorithm, declared_uploads, mean_aggregating
from fedpcd.algorithms.context import CLASSES, MODEL, row_classes
from fedpcd.algorithms.statedict import StateDict, coordinate_median, trimmed_mean, weighted_average
from fedpcd.config import Config
from fedpcd.errors import UserError

Reduce = Callable[[Sequence[dict[str, Any]]], StateDict]
KRUM = ("krum", "multi_krum")


def check_robust(config: Config) -> None:
    """At the start of a run: ``aggregation.robust`` needs an algorithm that declares what its server averages
    (Krum: a model among it), neither SecAgg+ (the server sees only the mean) nor DP noise (calibrated for the
    mean), and for Krum more than 2f + 2 clients per round (and at most that many for ``krum_select``)."""
    agg = config.aggregation
    robust = agg.robust
    if robust == "none":
        return
    name = config.algorithm.name
    able = mean_aggregating(model=robust in KRUM)
    if name not in able:
        known = declared_uploads(ALGORITHMS.get(name)) is not None
        what = "averages no model" if known else "aggregates its own way"
        raise UserError(
            f"aggregation.robust={robust} replaces the server's means, but algorithm {name!r} {what}; use it "
            f"with one of: {', '.join(able)}, or set aggregation.robust=none"
        )
    if config.privacy.secagg is not None or config.privacy.noise_multiplier > 0:
        raise UserError(
            f"aggregation.robust={robust} needs every update on the server and the plain mean's sensitivity; "
            "it does not combine with privacy.secagg or privacy.noise_multiplier > 0"
        )
    if robust in KRUM:
        n = config.clients_per_round
        if n <= 2 * agg.byzantine + 2:
            raise UserError(
                f"aggregation.robust={robust} with aggregation.byzantine={agg.byzantine} needs more than "
                f"2f+2={2 * agg.byzantine + 2} clients per round, {n} are sampled; lower "
                "aggregation.byzantine or raise clients or participation"
            )
        if robust == "multi_krum" and agg.krum_select is not None and agg.krum_select > n:
            raise UserError(
                f"aggregation.krum_select={agg.krum_select} is more than the {n} clients sampled per round; "
                f"set it to at most {n} or null (n - f)"
            )


def krum_scores(vectors: torch.Tensor, byzantine: int) -> torch.Tensor:
    """Blanchard et al. (2017), Sec. 4: score(i) = sum of ||V_i - V_j||^2 over the n - f - 2 j != i nearest to
    V_i (rows of ``vectors``, float64)."""
    n = len(vectors)
    closest = n - byzantine - 2
    if closest < 1:
        raise ValueError(f"Krum with f={byzantine} needs more than {2 * byzantine + 2} updates, got {n}")
    dist = torch.cdist(vectors, vectors).pow(2)
    dist.fill_diagonal_(float("inf"))
    return dist.sort(dim=1).values[:, :closest].sum(dim=1)


def krum_pick(vectors: torch.Tensor, byzantine: int, select: int = 1) -> list[int]:
    """The indices of the ``select`` least Krum scores (ties: the lower index), ascending by score: Krum's
    choice for 1, Multi-Krum's for m."""
    order = torch.argsort(krum_scores(vectors, byzantine), stable=True)
    return order[:select].tolist()


def _flat(reply: dict[str, Any], keys: Sequence[str]) -> torch.Tensor:
    """The floating tensors of ``keys`` (a tensor or a state dict each) in ``reply``, flattened into one
    float64 vector."""
    parts = []
    for key in keys:
        value = reply[key]
        tensors = value.values() if isinstance(value, dict) else [value]
        parts += [t.detach().double().flatten().cpu() for t in tensors if torch.is_floating_point(t)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _reduce_values(values: Sequence[Any], reduce: Reduce) -> Any:
    """``reduce`` of a tensor or a state dict over the replies."""
    if isinstance(values[0], torch.Tensor):
        return reduce([{"v": v} for v in values])["v"]
    return reduce(values)


def robust_rows(
    replies: list[dict[str, Any]], key: str, reduce: Reduce, num_classes: int
) -> list[dict[str, Any]]:
    """The replies with every holder's row of each class c (in ``key``: rows aligned with its ``classes``, or
    one per class) replaced by ``reduce`` of the rows of c over the replies that hold c."""
    out = [dict(r) for r in replies]
    held = [row_classes(r, num_classes, r[key].device).tolist() for r in replies]
    for r in out:
        r[key] = r[key].clone()
    for c in range(num_classes):
        where = []
        for i, classes in enumerate(held):
            if c in classes:
                where.append((i, classes.index(c) if CLASSES in replies[i] else c))
        if not where:
            continue
        row = _reduce_values([replies[i][key][pos] for i, pos in where], reduce)
        for i, pos in where:
            out[i][key][pos] = row
    return out


def robust_aggregate(
    config: Config, server: dict[str, Any], replies: list[dict[str, Any]], algorithm: Algorithm | None = None
) -> dict[str, Any]:
    """The server state after the round's robust aggregation (module docstring) of ``algorithm`` (None: one
    that averages only the model, as FedAvg does)."""
    agg = config.aggregation
    uploads = algorithm.upload_bounds() if algorithm is not None else ()
    joined = [k for k in (MODEL, *(u.key for u in uploads if u.kind == "model")) if k in replies[0]]
    own = algorithm is not None and type(algorithm).aggregate is not Algorithm.aggregate
    if agg.robust in KRUM:
        select = 1 if agg.robust == "krum" else agg.krum_select or len(replies) - agg.byzantine
        vectors = torch.stack([_flat(r, joined) for r in replies])
        replies = [replies[i] for i in sorted(krum_pick(vectors, agg.byzantine, select))]
        reduce: Reduce = lambda states: weighted_average(states, [1.0] * len(states))  # noqa: E731
    else:
        trimmed = functools.partial(trimmed_mean, trim=agg.trim)
        reduce = coordinate_median if agg.robust == "median" else trimmed
        for u in uploads:
            if u.kind == "rows" and u.key in replies[0]:
                replies = robust_rows(replies, u.key, reduce, algorithm.ctx.num_classes)
    robust = {key: _reduce_values([r[key] for r in replies], reduce) for key in joined}
    if own:  # the rule sees the robust values in every reply (what it computes from the mean uses them)
        server = algorithm.aggregate(server, [{**r, **robust} for r in replies])
    server.update(robust)  # exactly, not a weighted mean of copies
    return server
