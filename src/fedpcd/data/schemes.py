"""The partition schemes, registered in ``PARTITIONERS`` (``fedpcd.data.partition`` re-exports them).

Each is ``scheme(labels, num_clients, num_classes, rng, *, <parameters>) -> per-client index arrays`` and
draws only from ``rng``. Its keyword-only parameters are its config keys, checked by their annotations
before it runs (``fedpcd.params``); what a scheme still checks itself needs the data (class and sample
counts, the number of clients).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, Field

from fedpcd.data.scheme_base import (
    PARTITIONERS,
    SchemeSplit,
    _as_int64,
    _class_indices,
    _count_matrix,
    _cut_bounds,
    _require,
    resolve_params,
)
from fedpcd.errors import UserError, short
from fedpcd.params import PathText
from fedpcd.utils import read_json, show_path


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
    beta: Annotated[float, Field(gt=0.0)] = 0.5,
    min_size: Annotated[int, Field(ge=0)] = 10,
    cap_fair_share: bool = False,
    max_retries: Annotated[int, Field(ge=0)] = 1000,
) -> list[np.ndarray]:
    """Dirichlet label skew (Hsu et al., arXiv:1909.06335, 2019; the recipe of the FedGELA, FedSC and FedNH
    papers, FedGELA App. C.2).

    For each class c: q ~ Dir(beta * 1_K), shuffle the indices of c and cut them at floor(cumsum(q) * n_c).
    The whole draw is repeated until every client holds >= ``min_size`` samples (MOON's loop; at most
    ``max_retries`` redraws, then a UserError instead of looping forever as the official codes do).
    ``cap_fair_share=True`` is the MOON / FedGELA / FedMR code variant: before cutting class c, q_j is zeroed
    for clients that already hold >= N/K samples and q renormalised (classes are visited in order 0..C-1).
    """
    n_total = len(labels)
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
    classes_per_client: Annotated[int, Field(ge=1)] = 2,
    legacy_duplicate: bool = False,
) -> list[np.ndarray]:
    """Pathological "PxCy" (FedMR, Fan et al., TMLR 2023, App. C.1.2; ``partition_class`` of the FedMR and
    FedGELA official code).

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
    shards_per_client: Annotated[int, Field(ge=1)] = 2,
) -> list[np.ndarray]:
    """FedAvg's shards (McMahan et al., AISTATS 2017; also the FedNH benchmark code's ``shards``).

    Sort the indices by label (random order within a label), cut them into K * shards_per_client near-equal
    contiguous shards (np.array_split) and give each client ``shards_per_client`` shards drawn at random
    without replacement. Complete and disjoint.
    """
    s = shards_per_client
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


@PARTITIONERS.register("natural")
def natural(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    groups: tuple[np.ndarray, np.ndarray] | None,
) -> SchemeSplit:
    """The dataset's own clients: one per LEAF writer or speaking role, or FLamby centre.

    With as many clients as the dataset has groups holding training samples, every group is a client (in
    group order); with fewer, ``num_clients`` of them are drawn without replacement from ``rng`` (LEAF's
    "a fixed number of users, chosen by seed") and kept in group order. Each client's local test split is
    its own group's test samples. ``groups`` (the train and test samples' group ids) come from the dataset
    (``make_partition``); datasets without natural clients refuse this scheme.
    """
    if groups is None:
        others = ", ".join(n for n in PARTITIONERS.names() if n != "natural")
        raise UserError(
            "partition scheme 'natural' needs a dataset with its own clients (femnist, shakespeare, "
            f"isic2019); this one has none: use one of {others}"
        )
    train_groups, test_groups = groups
    present = np.unique(train_groups)
    if num_clients > len(present):
        raise UserError(
            f"partition scheme 'natural': the dataset has {len(present)} clients with training samples, "
            f"fewer than clients={num_clients}; use clients <= {len(present)}"
        )
    chosen = (
        present if num_clients == len(present) else np.sort(rng.choice(present, num_clients, replace=False))
    )
    train = [np.flatnonzero(train_groups == g) for g in chosen]

    def test_split(test_labels: np.ndarray, test_rng: np.random.Generator) -> list[np.ndarray]:
        return [np.flatnonzero(test_groups == g) for g in chosen]

    return SchemeSplit(train, test_split, {"groups": [int(g) for g in chosen]})


@PARTITIONERS.register("explicit")
def explicit(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    path: PathText = "",
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


# Flower Datasets' partitioners, registered as flwr:<name> (flwr-datasets is imported only when one runs)
from fedpcd.data import flwr_schemes  # noqa: E402, F401
