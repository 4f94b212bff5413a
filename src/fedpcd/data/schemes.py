"""The general partition schemes, registered in ``PARTITIONERS``: ``iid``, ``dirichlet``, ``pathological``,
``shards``, ``natural``, ``explicit`` (``paper_schemes`` holds particular papers' and ``flwr_schemes``
Flower's; ``fedpcd.data.partition`` imports them all and re-exports the built-in ones).

Each is ``scheme(labels, num_clients, num_classes, rng, *, <parameters>) -> per-client index arrays`` and
draws only from ``rng``. Its keyword-only parameters are its config keys, checked by their annotations
before it runs (``fedpcd.params``); what a scheme still checks itself needs the data (class and sample
counts, the number of clients).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field

from fedpcd.data.scheme_base import (
    PARTITIONERS,
    SchemeSplit,
    _as_int64,
    _class_indices,
    _cut_bounds,
    _require,
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
