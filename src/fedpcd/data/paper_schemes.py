"""The partition schemes of particular papers, registered in ``PARTITIONERS``: ``longtail`` (FedSC's
long-tailed pool under another scheme), ``fedssa`` (FedSSA's k classes per client with drawn proportions) and
``nid2`` (biased clients plus one holding every class).

Each is ``scheme(labels, num_clients, num_classes, rng, *, <parameters>) -> per-client index arrays`` and
draws only from ``rng`` (``fedpcd.data.schemes`` describes the contract).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, Field

from fedpcd.data.scheme_base import (
    PARTITIONERS,
    SchemeSplit,
    _class_indices,
    _count_matrix,
    _require,
    resolve_params,
)
from fedpcd.errors import UserError, short

LONGTAIL_THEN: dict[str, Any] = {"scheme": "dirichlet", "beta": 0.2}


def nested_scheme(then: dict[str, Any]) -> dict[str, Any]:
    """longtail's ``then`` resolved: its scheme (dirichlet unless named; a dirichlet ``then`` takes missing
    keys from ``LONGTAIL_THEN``) and every parameter of it, checked (errors name ``partition.then.<key>``)."""
    then = dict(then)
    if then.get("scheme", LONGTAIL_THEN["scheme"]) == LONGTAIL_THEN["scheme"]:
        then = {**LONGTAIL_THEN, **then}
    scheme = then.pop("scheme")
    if scheme in ("longtail", "explicit"):
        valid = [s for s in PARTITIONERS.names() if s not in ("longtail", "explicit")]
        raise UserError(
            f"longtail 'then' scheme cannot be {short(scheme)}; valid choices: {', '.join(valid)}"
        )
    return {"scheme": scheme, **resolve_params(str(scheme), then, prefix="partition.then")}


@PARTITIONERS.register("longtail")
def longtail(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    rho: Annotated[float, Field(ge=1.0)] = 10.0,
    # a module constant, never mutated (scheme_params deep-copies it); resolved in full by nested_scheme
    then: Annotated[dict[str, Any], AfterValidator(nested_scheme)] = LONGTAIL_THEN,
) -> list[np.ndarray]:
    """Long-tailed global pool, then another scheme (FedSC, Wang et al., KDD 2025, Sec. 5.1 and Table 2).

    Class sizes follow the exponential profile of LDAM (Cao et al. 2019): n_c = floor(n_max * rho^(-c/(C-1)))
    with n_max the largest class size (a class with fewer samples keeps all it has). A seeded random subset of
    that size is kept from each class, the ``then`` scheme (a dict: ``scheme`` plus its parameters; default
    Dirichlet beta=0.2 as in FedSC) partitions that pool, and its indices are mapped back to the original
    index space. ``then`` keys missing from a dirichlet ``then`` are taken from the default (beta=0.2);
    ``resolve_params`` fills and checks every key of ``then`` before the scheme runs.
    The local test split stays balanced in origin: it is cut from the full official test set.
    """
    inner_params = dict(then)
    inner_scheme = inner_params.pop("scheme", LONGTAIL_THEN["scheme"])
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


@PARTITIONERS.register("fedssa")
def fedssa(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    classes_per_client: Annotated[int, Field(ge=1)] = 2,
    rule: Literal["distinct", "official"] = "distinct",
) -> list[np.ndarray]:
    """FedSSA's "k of S classes per client" (Yi et al., IJCAI 2024, Sec. 6.1, pFedHN style; steps 1-3 as in
    its official code).

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
    biased_clients: Annotated[int, Field(ge=1)] = 5,
) -> list[np.ndarray]:
    """FedSC's NID2 (Wang et al., KDD 2025, Sec. 5.1): ``biased_clients`` clients with C/biased_clients
    classes each plus one client holding every class.

    With S = biased_clients + 1 (= the number of clients): each class's indices are shuffled and cut into S
    shards of floor(n_c / S) samples (the remainder is dropped). Biased client i gets shards 0..S-2 of its
    class block (the classes are cut into ``biased_clients`` contiguous blocks by np.array_split: exactly C/5
    classes each in the paper's setting); the last client gets shard S-1 of every class. Every client holds
    about N/S samples; the clients are disjoint.
    """
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
