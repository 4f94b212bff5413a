"""Label-skew partitions: which training samples each client holds, and its matching local test split.

A partition is a pure function of ``(labels, scheme, params, seed)``: every scheme draws only from the
``np.random.Generator`` it is given (``make_partition`` seeds it with ``np.random.default_rng(seed)``), never
from numpy's or Python's global random state, so the same inputs always give identical index arrays.

Schemes (``PARTITIONERS``; a scheme's keyword-only parameters with defaults are its config keys):

- ``iid``: shuffle and split evenly.
- ``dirichlet``: per class, client shares q ~ Dir(beta * 1_K) (the MOON / FedGELA / FedSC recipe).
- ``pathological``: FedMR / FedGELA "PxCy": every client holds exactly ``classes_per_client`` classes.
- ``shards``: FedAvg's sort-by-label shards.
- ``longtail``: a long-tailed pool (FedSC, LDAM profile) partitioned by another scheme.
- ``fedssa``: FedSSA's (pFedHN-style) k classes per client with U(0.4, 0.6) proportions.
- ``explicit``: client index lists read from a JSON file.

Each client's local test split is cut from the official test set by ``local_test_split`` so that its class
mix follows the client's training mix (FedGELA's per-client test split), except for schemes that define their
own (``fedssa`` applies its (class, proportion) lists to the test pool, as its code does).

Indices inside one client's array come in the order the procedure produced them (class by class); the order
carries no meaning, and loaders shuffle.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedpcd.errors import UserError, short
from fedpcd.registry import Registry
from fedpcd.utils import read_json, show_path

PARTITIONERS: Registry[Callable[..., list[np.ndarray]]] = Registry("partition scheme")

TestSplitFn = Callable[[np.ndarray, np.random.Generator], list[np.ndarray]]


@dataclass
class Partition:
    """Per-client index arrays into the training set and into the official test set."""

    num_classes: int
    train: list[np.ndarray]
    test: list[np.ndarray]

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def train_counts(self, train_labels: np.ndarray) -> np.ndarray:
        """[K, C] number of training samples of each class per client."""
        return _count_matrix(self.train, train_labels, self.num_classes)

    def test_counts(self, test_labels: np.ndarray) -> np.ndarray:
        """[K, C] number of local test samples of each class per client."""
        return _count_matrix(self.test, test_labels, self.num_classes)


class SchemeSplit(list):
    """What a partitioner may return instead of a plain list: the per-client train index arrays (it *is* that
    list), plus, optionally, the scheme's own local test split ``test_split(test_labels, rng)`` and
    ``info`` (scheme details, e.g. fedssa's (class, proportion) lists). ``make_partition`` uses
    ``test_split`` instead of ``local_test_split`` when it is set."""

    def __init__(
        self,
        train: Sequence[np.ndarray],
        test_split: TestSplitFn | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(train)
        self.test_split = test_split
        self.info = info or {}


# ----------------------------------------------------------------------------------------------- helpers


def _count_matrix(indices: Sequence[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels)
    out = np.zeros((len(indices), num_classes), dtype=np.int64)
    for k, idx in enumerate(indices):
        if len(idx):
            out[k] = np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)[:num_classes]
    return out


def _class_indices(labels: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """The (sorted) indices of each class 0..C-1."""
    order = np.argsort(labels, kind="stable").astype(np.int64)
    counts = np.bincount(labels, minlength=num_classes)[:num_classes]
    return np.split(order, np.cumsum(counts)[:-1])


def _as_int64(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]


def _cut_bounds(shares: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    """End positions floor(cumsum(share) * n) of the chunks, row by row (``shares`` [..., K], ``n`` [...]).

    Bounds from the last positive share on are pinned to n, so float round-off neither loses a sample nor
    hands one to a trailing zero-share client."""
    n = np.asarray(n, dtype=np.int64)[..., None]
    bounds = np.minimum(np.floor(np.cumsum(shares, axis=-1) * n).astype(np.int64), n)
    width = shares.shape[-1]
    last_positive = width - 1 - np.argmax((shares > 0)[..., ::-1], axis=-1)
    pinned = np.arange(width) >= last_positive[..., None]
    return np.where(pinned, n, np.maximum(bounds, 0))


def _check_labels(labels: Any, what: str) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise UserError(f"{what} labels must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{what} labels must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


# --------------------------------------------------------------------------------------- the test split


def local_test_split(
    train_counts: np.ndarray, test_labels: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Cut the official test set into local test splits whose class mix follows each client's train mix.

    FedGELA's per-client test split (docs/design.md section 8), driven by the realised train counts: for
    each class c, shuffle the test indices of c and give client j the slice between cut points
    floor(cumsum(share) * n_c), where share_j = train_counts[j, c] / sum_j train_counts[j, c]. The splits are
    disjoint; a class that no client holds is left unused.
    """
    counts = np.asarray(train_counts, dtype=np.int64)
    if counts.ndim != 2:
        raise UserError(f"train_counts must be a [clients, classes] matrix, got shape {counts.shape}")
    num_clients, num_classes = counts.shape
    labels = _check_labels(test_labels, "test")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise UserError(f"test labels must lie in [0, {num_classes}); found {labels.min()}..{labels.max()}")
    per_class = _class_indices(labels, num_classes)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        total = int(counts[:, c].sum())
        idx = per_class[c]
        if total == 0 or len(idx) == 0:
            continue
        idx = rng.permutation(idx)
        bounds = np.cumsum(counts[:, c]) * len(idx) // total  # floor(cumsum(share) * n_c), exactly
        start = 0
        for j, end in enumerate(bounds):
            if end > start:
                parts[j].append(idx[start:end])
            start = end
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]


# ------------------------------------------------------------------------------------------------ schemes


@PARTITIONERS.register("iid")
def iid(labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """IID: shuffle all training indices and split them evenly (np.array_split, sizes differ by <= 1)."""
    return _as_int64(np.array_split(rng.permutation(len(labels)), num_clients))


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    beta: float = 0.5,
    min_size: int = 10,
    cap_fair_share: bool = False,
    max_retries: int = 1000,
) -> list[np.ndarray]:
    """Dirichlet label skew (the recipe of the FedGELA, FedSC and FedNH papers; FedGELA App. C.2).

    For each class c: q ~ Dir(beta * 1_K), shuffle the indices of c and cut them at floor(cumsum(q) * n_c).
    The whole draw is repeated until every client holds >= ``min_size`` samples (MOON's loop; at most
    ``max_retries`` redraws, then a UserError instead of looping forever as the official codes do).
    ``cap_fair_share=True`` is the MOON / FedGELA / FedMR code variant: before cutting class c, q_j is zeroed
    for clients that already hold >= N/K samples and q renormalised (classes are visited in order 0..C-1).
    """
    n_total = len(labels)
    _require(math.isfinite(beta) and beta > 0, f"dirichlet beta must be a positive number, got {beta}")
    _require(min_size >= 0, f"dirichlet min_size must be >= 0, got {min_size}")
    _require(max_retries >= 0, f"dirichlet max_retries must be >= 0, got {max_retries}")
    _require(
        min_size * num_clients <= n_total,
        f"dirichlet min_size={min_size} for {num_clients} clients needs {min_size * num_clients} samples but "
        f"there are only {n_total}; use a smaller min_size or fewer clients",
    )
    per_class = _class_indices(labels, num_classes)
    sizes_c = np.array([len(ix) for ix in per_class], dtype=np.int64)
    fair = n_total / num_clients
    alpha = np.full(num_clients, float(beta))
    for _ in range(max_retries + 1):
        # Draw the shares and compute the cut points first; samples are shuffled only for the accepted draw.
        q_all = rng.dirichlet(alpha, size=num_classes)
        if not cap_fair_share:
            q_all = _renormalise(q_all, np.ones_like(q_all, dtype=bool))
            bounds = _cut_bounds(q_all, sizes_c)
            held = np.diff(bounds, axis=1, prepend=0).sum(axis=0)
        else:
            bounds = np.zeros((num_classes, num_clients), dtype=np.int64)
            held = np.zeros(num_clients, dtype=np.int64)
            for c in range(num_classes):
                q = _renormalise(q_all[c : c + 1], (held < fair)[None, :])[0]
                bounds[c] = _cut_bounds(q, int(sizes_c[c]))
                held += np.diff(bounds[c], prepend=0)
        if held.min() >= min_size:
            break
    else:
        raise UserError(
            f"dirichlet partition: could not give every one of {num_clients} clients at least "
            f"min_size={min_size} samples in {max_retries + 1} draws (beta={beta}, {n_total} samples); "
            "use a larger beta, a smaller min_size or fewer clients"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        if sizes_c[c] == 0:
            continue
        idx = rng.permutation(per_class[c])
        for j, chunk in enumerate(np.split(idx, bounds[c][:-1])):
            if len(chunk):
                parts[j].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]


def _renormalise(q: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Zero the shares of disallowed clients and renormalise each row; a row whose allowed mass underflowed
    to zero falls back to equal shares among the allowed clients."""
    q = np.where(allowed, q, 0.0)
    total = q.sum(axis=1, keepdims=True)
    bad = ~(np.isfinite(total) & (total > 0))
    if bad.any():
        fallback = np.broadcast_to(allowed, q.shape).astype(float)
        fallback[~fallback.any(axis=1)] = 1.0  # nobody allowed (only for an empty class): any shares do
        q = np.where(bad, fallback, q)
        total = q.sum(axis=1, keepdims=True)
    return q / total


@PARTITIONERS.register("pathological")
def pathological(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    classes_per_client: int = 2,
    legacy_duplicate: bool = False,
) -> list[np.ndarray]:
    """Pathological "PxCy" (FedMR App. C.1.2; ``partition_class`` of the FedMR and FedGELA official code).

    Class assignment: a counter runs over classes 0..C-1; for client i = 0..K-1 and each of its
    ``classes_per_client`` slots, take the next class in order while the counter is < C, otherwise a uniformly
    random class, redrawn until the client does not hold it yet. So P10C2 on 10 classes gives clients 0-4
    {0,1}, {2,3}, ..., {8,9}. Samples: per class, shuffle its indices and np.array_split them into as many
    chunks as it has holders; chunk j goes to the j-th holder in client order (shares equal up to 1). Every
    class is used iff K * classes_per_client >= C; unheld classes are left out.

    ``legacy_duplicate=True`` reproduces the official FedMR code's bug: the sample split runs twice with fresh
    shuffles and the two results are concatenated, so clients get about 2x the samples, with duplicates
    (a sole holder gets every sample twice) and overlaps across clients. The paper describes the single
    split. (The official code's switch to Dirichlet beta=1e5 when classes_per_client == C is not copied.)
    """
    k = classes_per_client
    _require(
        1 <= k <= num_classes,
        f"pathological classes_per_client must be between 1 and the number of classes ({num_classes}), "
        f"got {k}",
    )
    _require(
        len(labels) >= num_clients,
        f"pathological partition: more clients ({num_clients}) than samples ({len(labels)})",
    )
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    counter = 0
    for i in range(num_clients):
        mine: set[int] = set()
        for _ in range(k):
            if counter < num_classes:
                c = counter
                counter += 1
            else:
                c = int(rng.integers(num_classes))
                while c in mine:
                    c = int(rng.integers(num_classes))
            mine.add(c)
            holders[c].append(i)
    per_class = _class_indices(labels, num_classes)
    for c in range(num_classes):
        if holders[c] and len(per_class[c]) < len(holders[c]):
            raise UserError(
                f"pathological partition: class {c} has {len(per_class[c])} samples, fewer than its "
                f"{len(holders[c])} holders; use fewer clients or classes_per_client"
            )
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for _ in range(2 if legacy_duplicate else 1):
        for c in range(num_classes):
            if not holders[c]:
                continue
            chunks = np.array_split(rng.permutation(per_class[c]), len(holders[c]))
            for client, chunk in zip(holders[c], chunks, strict=True):
                parts[client].append(chunk)
    return [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]


@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """FedAvg's shards (McMahan et al., AISTATS 2017; also the FedNH benchmark code's ``shards``).

    Sort the indices by label (random order within a label), cut them into K * shards_per_client near-equal
    contiguous shards (np.array_split) and give each client ``shards_per_client`` shards drawn at random
    without replacement. Complete and disjoint.
    """
    s = shards_per_client
    _require(s >= 1, f"shards_per_client must be >= 1, got {s}")
    n_shards = num_clients * s
    _require(
        n_shards <= len(labels),
        f"shards partition: {num_clients} clients x {s} shards = {n_shards} shards but only {len(labels)} "
        "samples; use fewer clients or shards_per_client",
    )
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    pieces = np.array_split(order, n_shards)
    owner = rng.permutation(n_shards).reshape(num_clients, s)
    return [np.concatenate([pieces[j] for j in sorted(row)]).astype(np.int64) for row in owner]


_LONGTAIL_THEN: dict[str, Any] = {"scheme": "dirichlet", "beta": 0.2}


@PARTITIONERS.register("longtail")
def longtail(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    rho: float = 10.0,
    then: dict = _LONGTAIL_THEN,  # a module constant, never mutated; scheme_params deep-copies it
) -> list[np.ndarray]:
    """Long-tailed global pool, then another scheme (FedSC, Wang et al., KDD 2025, Sec. 5.1 and Table 2).

    Class sizes follow the exponential profile of LDAM (Cao et al. 2019): n_c = floor(n_max * rho^(-c/(C-1)))
    with n_max the largest class size (a class with fewer samples keeps all it has). A seeded random subset of
    that size is kept from each class, the ``then`` scheme (a dict: ``scheme`` plus its parameters; default
    Dirichlet beta=0.2 as in FedSC) partitions that pool, and its indices are mapped back to the original
    index space. ``then`` keys missing from a dirichlet ``then`` are taken from the default (beta=0.2).
    The local test split stays balanced in origin: it is cut from the full official test set.
    """
    _require(math.isfinite(rho) and rho >= 1, f"longtail rho must be >= 1 (max class size / min), got {rho}")
    inner_scheme, inner_params = _resolve_then(then)
    per_class = _class_indices(labels, num_classes)
    n_max = max((len(ix) for ix in per_class), default=0)
    keep = []
    for idx, target in zip(per_class, longtail_sizes(n_max, num_classes, rho), strict=True):
        take = min(target, len(idx))
        if take:
            keep.append(np.sort(rng.permutation(idx)[:take]))
    pool = np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)
    _require(
        len(pool) >= num_clients,
        f"longtail pool (rho={rho}) has {len(pool)} samples, fewer than the {num_clients} clients",
    )
    try:
        inner = PARTITIONERS.get(inner_scheme)(labels[pool], num_clients, num_classes, rng, **inner_params)
    except UserError as exc:
        raise UserError(f"longtail pool of {len(pool)} samples (rho={rho}): {exc}") from None
    mapped = [pool[np.asarray(ix, dtype=np.int64)] for ix in inner]
    if isinstance(inner, SchemeSplit):
        return SchemeSplit(mapped, inner.test_split, {**inner.info, "pool": pool})
    return SchemeSplit(mapped, None, {"pool": pool})


def longtail_sizes(n_max: int, num_classes: int, rho: float) -> list[int]:
    """The long-tail class sizes floor(n_max * rho^(-c/(C-1))) for c = 0..C-1."""
    if num_classes <= 1:
        return [int(n_max)] * num_classes
    return [math.floor(n_max * rho ** (-c / (num_classes - 1))) for c in range(num_classes)]


def _resolve_then(then: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(then, Mapping):
        raise UserError(f"longtail 'then' must be a mapping like {_LONGTAIL_THEN}, got {then!r}")
    then = dict(then)
    scheme = then.get("scheme", _LONGTAIL_THEN["scheme"])
    if scheme == _LONGTAIL_THEN["scheme"]:
        then = {**_LONGTAIL_THEN, **then}
    scheme = then.pop("scheme")
    if scheme in ("longtail", "explicit"):
        valid = [s for s in PARTITIONERS.names() if s not in ("longtail", "explicit")]
        raise UserError(f"longtail 'then' scheme cannot be {scheme!r}; valid choices: {', '.join(valid)}")
    return scheme, _resolve_params(str(scheme), then)


@PARTITIONERS.register("fedssa")
def fedssa(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    classes_per_client: int = 2,
    rule: str = "distinct",
) -> list[np.ndarray]:
    """FedSSA's "k of S classes per client" (Sec. 6.1, pFedHN style; steps 1-3 as in its official code).

    1. m = ceil(k*K/S) proportion slots per class: u_1..u_m ~ U(0.4, 0.6), p_c = u / sum(u); counter r_c = m.
    2. For client i = 0..K-1, k times: pick c uniformly among the classes with the largest r_c that the client
       does not hold yet, r_c -= 1; then give the client the last unused proportion of each picked class.
    3. Per pool (train here; the official test set for the local test split, with the SAME lists): shuffle
       each class's indices and walk clients in order; each takes the next floor(n_c * p) indices of c.
       Disjoint; rounding leftovers (and the samples of unused slots) are dropped; train and test class
       mixes agree.

    Deviations, both invisible when S divides k*K (every setting in the paper): the official code's
    m = floor(k*K/S) runs out of proportions (it crashes on ``pop``) when S does not divide k*K, so m is
    rounded up; and a client never picks a class twice (the official rule can repeat a class when it is the
    sole argmax). With these, every client always gets exactly k distinct classes. ``rule="official"`` keeps
    the official pick (a class may be picked twice, the client then holds two chunks of it and fewer than k
    distinct classes); m stays rounded up.
    """
    k = classes_per_client
    _require(
        1 <= k <= num_classes,
        f"fedssa classes_per_client must be between 1 and the number of classes ({num_classes}), got {k}",
    )
    _require(rule in ("distinct", "official"), f"fedssa rule must be 'distinct' or 'official', got {rule!r}")
    m = -(-k * num_clients // num_classes)
    props: list[list[float]] = []
    for _ in range(num_classes):
        u = rng.uniform(0.4, 0.6, size=m)
        props.append(list(u / u.sum()))
    remaining = np.full(num_classes, m, dtype=np.int64)
    picks: list[list[tuple[int, float]]] = []
    for _ in range(num_clients):
        mine: list[int] = []
        for _ in range(k):
            avail = remaining.copy()
            if rule == "distinct":
                avail[mine] = np.iinfo(np.int64).min
            cands = np.flatnonzero(avail == avail.max())
            c = int(cands[rng.integers(len(cands))])
            remaining[c] -= 1
            mine.append(c)
        picks.append([(c, props[c].pop()) for c in mine])

    train = _fedssa_apply(labels, num_classes, picks, rng)
    counts = _count_matrix(train, labels, num_classes)
    for i, client in enumerate(picks):
        for c, p in client:
            if counts[i, c] == 0:
                raise UserError(
                    f"fedssa partition: client {i} would get 0 samples of its class {c} "
                    f"({int((labels == c).sum())} samples, share {p:.3f}); "
                    "use fewer clients or classes_per_client, or more data"
                )

    def test_split(test_labels: np.ndarray, test_rng: np.random.Generator) -> list[np.ndarray]:
        return _fedssa_apply(np.asarray(test_labels, dtype=np.int64), num_classes, picks, test_rng)

    return SchemeSplit(train, test_split, {"picks": picks, "slots_per_class": m})


def _fedssa_apply(
    labels: np.ndarray, num_classes: int, picks: list[list[tuple[int, float]]], rng: np.random.Generator
) -> list[np.ndarray]:
    """Step 3 of FedSSA's partition on one pool: per class shuffle, clients in order take floor(n_c * p)."""
    per_class = _class_indices(labels, num_classes)
    used = sorted({c for client in picks for c, _ in client})
    shuffled = {c: rng.permutation(per_class[c]) for c in used}
    pos = dict.fromkeys(used, 0)
    out = []
    for client in picks:
        parts = []
        for c, p in client:
            n_c = len(shuffled[c])
            take = min(math.floor(n_c * p), n_c - pos[c])
            parts.append(shuffled[c][pos[c] : pos[c] + take])
            pos[c] += take
        out.append(np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64))
    return out


@PARTITIONERS.register("nid2")
def nid2(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    biased_clients: int = 5,
) -> list[np.ndarray]:
    """``biased_clients`` clients with C/biased_clients classes each plus one client holding every class.

    With S = biased_clients + 1 (= the number of clients): each class's indices are shuffled and cut into S
    shards of floor(n_c / S) samples (the remainder is dropped). Biased client i gets shards 0..S-2 of its
    class block (the classes are cut into ``biased_clients`` contiguous blocks by np.array_split: exactly C/5
    classes each in the paper's setting); the last client gets shard S-1 of every class. Every client holds
    about N/S samples; the clients are disjoint.
    """
    if biased_clients < 1:
        raise UserError(f"nid2 biased_clients must be >= 1, got {biased_clients}")
    if num_clients != biased_clients + 1:
        raise UserError(
            f"nid2 needs exactly biased_clients + 1 = {biased_clients + 1} clients, got {num_clients}; "
            f"set clients: {biased_clients + 1} (or partition.biased_clients: {num_clients - 1})"
        )
    if num_classes < biased_clients:
        raise UserError(
            f"nid2 needs at least {biased_clients} classes (one per biased client), got {num_classes}"
        )
    shards = num_clients
    blocks = np.array_split(np.arange(num_classes), biased_clients)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, idx in enumerate(_class_indices(np.asarray(labels, dtype=np.int64), num_classes)):
        size = len(idx) // shards
        if size == 0:
            continue
        pieces = rng.permutation(idx)[: size * shards].reshape(shards, size)
        owner = next(i for i, block in enumerate(blocks) if c in block)
        parts[owner].append(pieces[: shards - 1].reshape(-1))
        parts[-1].append(pieces[shards - 1])
    return [np.concatenate(p).astype(np.int64) if p else np.zeros(0, dtype=np.int64) for p in parts]


@PARTITIONERS.register("explicit")
def explicit(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    path: str = "",
) -> list[np.ndarray]:
    """Client index lists from a JSON file: ``{"clients": [[i, ...], ...]}`` or ``{"0": [...], "1": [...]}``.

    Indices must be integers in [0, N) and must not repeat within or across clients; there must be exactly one
    list per client, and at least one index in all. Samples listed by no client are unused. A file that is
    missing, unreadable, not JSON, nested deeper than its three levels or holding a number too long to read is
    one line naming it.
    """
    _require(bool(path), "explicit partition needs 'path': a JSON file of client index lists")
    file = Path(path)
    data = read_json(file, "explicit partition file", max_depth=3)

    def bad(problem: str) -> UserError:
        return UserError(f"explicit partition file {show_path(file)}: {problem}")

    shape = 'expected {"clients": [[indices...], ...]} or {"0": [...], "1": [...], ...}'
    if isinstance(data, dict) and set(data) == {"clients"}:
        lists = data["clients"]
        if not isinstance(lists, list):
            raise bad(f"'clients' must be a list of index lists; {shape}")
    elif (
        isinstance(data, dict)
        and data
        and all(isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10 for key in data)
    ):
        ids = sorted(int(key) for key in data)
        if ids != list(range(len(ids))) or len(ids) != len(data):
            raise bad(f"client keys must be '0'..'{len(data) - 1}' without gaps, got {short(sorted(data))}")
        lists = [data[key] for key in sorted(data, key=int)]
    else:
        raise bad(shape)
    if len(lists) != num_clients:
        raise bad(f"it lists {len(lists)} clients but the config asks for {num_clients}")
    n_total = len(labels)
    out = []
    for i, items in enumerate(lists):
        if not isinstance(items, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in items
        ):
            raise bad(f"client {i}: expected a list of integer indices")
        outside = next((v for v in items if not 0 <= v < n_total), None)  # before int64: 2**70 overflows
        if outside is not None:
            raise bad(f"client {i}: index out of range [0, {n_total}): {short(outside, 40)}")
        out.append(np.asarray(items, dtype=np.int64))
    flat = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    if not flat.size:
        raise bad("every client's list is empty; list at least one sample index")
    uniq, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        raise bad(f"index {int(uniq[counts > 1][0])} is listed more than once (clients must not overlap)")
    return out


# ------------------------------------------------------------------------------------------- entry points


def _defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
    }


def scheme_params(scheme: str) -> dict[str, object]:
    """The scheme's parameters with their defaults (its config keys); UserError for an unknown scheme."""
    return copy.deepcopy(_defaults(PARTITIONERS.get(scheme)))


def _check_value(scheme: str, key: str, value: Any, default: Any) -> Any:
    def bad(expected: str) -> UserError:
        return UserError(
            f"bad value for partition parameter {key!r} of scheme {scheme!r}: "
            f"expected {expected}, got {value!r}"
        )

    if isinstance(default, bool):
        if not isinstance(value, (bool, np.bool_)):
            raise bad("true or false")
        return bool(value)
    if isinstance(default, int):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise bad("an integer")
        return int(value)
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise bad("a number")
        if not math.isfinite(float(value)):
            raise bad("a finite number")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, (str, Path)):
            raise bad("a string")
        return str(value)
    if isinstance(default, Mapping):
        if not isinstance(value, Mapping):
            raise bad("a mapping")
        return dict(value)
    return value


def _resolve_params(scheme: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The scheme's defaults overlaid with ``params``; unknown keys or wrongly typed values: UserError."""
    defaults = scheme_params(scheme)
    given = dict(params or {})
    if given.get("scheme") == scheme:  # tolerate the config section's own name field
        del given["scheme"]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        valid = ", ".join(sorted(defaults)) or "(none)"
        raise UserError(
            f"unknown parameter {unknown[0]!r} for partition scheme {scheme!r}; valid parameters: {valid}"
        )
    resolved = {
        key: _check_value(scheme, key, given.get(key, default), default) for key, default in defaults.items()
    }
    if scheme == "longtail":  # resolve the nested scheme too, so a written config shows every value used
        inner_scheme, inner_params = _resolve_then(resolved["then"])
        resolved["then"] = {"scheme": inner_scheme, **inner_params}
    return resolved


def resolve_params(scheme: str, params: Mapping[str, Any] | None = None) -> dict[str, object]:
    """All of the scheme's parameters, validated, defaults filled (longtail's ``then`` included): what
    ``make_partition`` will use, e.g. for writing the resolved config. UserError on unknown keys or bad
    values."""
    PARTITIONERS.get(scheme)
    return _resolve_params(scheme, params)


def make_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    scheme: str,
    params: dict,
    seed: int,
    num_classes: int | None = None,
) -> Partition:
    """Partition the training set among ``num_clients`` clients; cut each client's local test split.

    ``params`` are the scheme's parameters (unknown keys -> UserError listing the valid ones; defaults fill
    the rest). The scheme runs with ``np.random.default_rng(seed)``, then the same generator draws the local
    test splits (``local_test_split`` on the realised train counts, or the scheme's own split).
    ``num_classes`` defaults to 1 + the largest label. Pure: same inputs, identical output.
    """
    train = _check_labels(train_labels, "train")
    test = _check_labels(test_labels, "test")
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise UserError(f"number of clients must be a positive integer, got {num_clients!r}")
    num_clients = int(num_clients)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UserError(f"partition seed must be a non-negative integer, got {seed!r}")
    if num_classes is None:
        num_classes = int(max(train.max(initial=-1), test.max(initial=-1))) + 1
    num_classes = int(num_classes)
    _require(num_classes >= 1, f"number of classes must be >= 1, got {num_classes}")
    for what, arr in (("train", train), ("test", test)):
        if arr.size and (arr.min() < 0 or arr.max() >= num_classes):
            raise UserError(
                f"{what} labels must lie in [0, {num_classes}); found {int(arr.min())}..{int(arr.max())}"
            )
    _require(
        num_clients <= len(train),
        f"more clients ({num_clients}) than samples ({len(train)}); use fewer clients",
    )
    fn = PARTITIONERS.get(scheme)
    resolved = _resolve_params(scheme, params)
    rng = np.random.default_rng(int(seed))
    result = fn(train, num_clients, num_classes, rng, **resolved)
    if len(result) != num_clients:  # pragma: no cover - a partitioner bug
        raise RuntimeError(f"scheme {scheme!r} returned {len(result)} clients, expected {num_clients}")
    train_parts = _as_int64(result)
    test_split = getattr(result, "test_split", None)
    if test_split is not None:
        test_parts = _as_int64(test_split(test, rng))
    else:
        test_parts = local_test_split(_count_matrix(train_parts, train, num_classes), test, rng)
    return Partition(num_classes=num_classes, train=train_parts, test=test_parts)
