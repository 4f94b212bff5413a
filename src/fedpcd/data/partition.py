"""Label-skew partitions: which training samples each client holds, and its matching local test split.

A partition is a pure function of `(labels, scheme, params, seed)`: every scheme draws only from the
`np.random.Generator` it is given (`make_partition` seeds it with `np.random.default_rng(seed)`), never
from numpy's or Python's global random state, so the same inputs always give identical index arrays.

Schemes (`PARTITIONERS`, defined in `fedpcd.data.schemes`, `paper_schemes` and `flwr_schemes`; a scheme's
keyword-only parameters with defaults are its config keys, typed and bounded by their annotations and checked
by `resolve_params`):

- `iid`: shuffle and split evenly.
- `dirichlet`: per class, client shares q ~ Dir(beta * 1_K) (the MOON / FedGELA / FedSC recipe).
- `pathological`: FedMR / FedGELA "PxCy": every client holds exactly `classes_per_client` classes.
- `shards`: FedAvg's sort-by-label shards.
- `longtail`: a long-tailed pool (FedSC, LDAM profile) partitioned by another scheme.
- `fedssa`: FedSSA's (pFedHN-style) k classes per client with U(0.4, 0.6) proportions.
- `nid2`: `biased_clients` clients with a block of classes each, plus one client holding every class.
- `explicit`: client index lists read from a JSON file.
- `natural`: the dataset's own clients (LEAF writers / roles, FLamby centres), a seeded subset of them.

Each client's local test split is cut from the official test set by `local_test_split` so that its class
mix follows the client's training mix (FedGELA's per-client test split), except for schemes that define their
own (`fedssa` applies its (class, proportion) lists to the test pool, as its code does).

Indices inside one client's array come in the order the procedure produced them (class by class); the order
carries no meaning, and loaders shuffle.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

from fedpcd.data import flwr_schemes  # noqa: F401  (registers Flower's partitioners)
from fedpcd.data.paper_schemes import LONGTAIL_THEN, fedssa, longtail, longtail_sizes, nid2
from fedpcd.data.scheme_base import (
    PARTITIONERS,
    SchemeSplit,
    TestSplitFn,
    _as_int64,
    _check_labels,
    _class_indices,
    _count_matrix,
    _require,
    resolve_params,
    scheme_params,
)
from fedpcd.data.schemes import dirichlet, explicit, iid, natural, pathological, shards
from fedpcd.errors import UserError

__all__ = [
    "LONGTAIL_THEN",
    "PARTITIONERS",
    "Partition",
    "SchemeSplit",
    "TestSplitFn",
    "dirichlet",
    "explicit",
    "fedssa",
    "iid",
    "local_test_split",
    "longtail",
    "longtail_sizes",
    "make_partition",
    "natural",
    "nid2",
    "pathological",
    "resolve_params",
    "scheme_params",
    "shards",
]


@dataclass
class Partition:
    """Per-client index arrays into the training set and into the official test set.

    Attributes:
        num_classes: The number of classes C.
        train: Each client's indices into the training set (int64 arrays, one per client).
        test: Each client's local test split: indices into the official test set.
    """

    num_classes: int
    train: list[np.ndarray]
    test: list[np.ndarray]

    @property
    def num_clients(self) -> int:
        """The number of clients K."""
        return len(self.train)

    def train_counts(self, train_labels: np.ndarray) -> np.ndarray:
        """The number of training samples of each class per client.

        Args:
            train_labels: The labels of the training set that `train` indexes.

        Returns:
            A [K, C] matrix of counts.
        """
        return _count_matrix(self.train, train_labels, self.num_classes)

    def test_counts(self, test_labels: np.ndarray) -> np.ndarray:
        """The number of local test samples of each class per client.

        Args:
            test_labels: The labels of the official test set that `test` indexes.

        Returns:
            A [K, C] matrix of counts.
        """
        return _count_matrix(self.test, test_labels, self.num_classes)


def local_test_split(
    train_counts: np.ndarray, test_labels: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Cut the official test set into local test splits whose class mix follows each client's train mix.

    FedGELA's per-client test split (docs/design.md section 8), driven by the realised train counts: for
    each class c, shuffle the test indices of c and give client j the slice between cut points
    floor(cumsum(share) * n_c), where share_j = train_counts[j, c] / sum_j train_counts[j, c]. The splits are
    disjoint; a class that no client holds is left unused.

    Args:
        train_counts: A [K, C] matrix: each client's number of training samples of each class.
        test_labels: The labels of the official test set, in [0, C).
        rng: The generator that shuffles each class's test indices.

    Returns:
        Each client's local test split: an int64 array of indices into the test set.

    Raises:
        UserError: `train_counts` is not a matrix, or a test label lies outside [0, C).
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


def make_partition(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    scheme: str,
    params: dict,
    seed: int,
    num_classes: int | None = None,
    groups: tuple[np.ndarray, np.ndarray] | None = None,
) -> Partition:
    """Partition the training set among `num_clients` clients; cut each client's local test split.

    The scheme runs with `np.random.default_rng(seed)`, then the same generator draws the local test splits
    ([`local_test_split`][fedpcd.data.partition.local_test_split] on the realised train counts, or the
    scheme's own split). Pure: same inputs, identical output.

    Args:
        train_labels: The labels of the training set, in [0, num_classes).
        test_labels: The labels of the official test set, in [0, num_classes).
        num_clients: The number of clients K, from 1 to the number of training samples.
        scheme: A partition scheme's name (`fedpcd list` prints them).
        params: The scheme's parameters; defaults fill the missing ones.
        seed: The seed of the generator, a non-negative integer.
        num_classes: The number of classes; default 1 + the largest label.
        groups: The train and test samples' group ids (the dataset's own clients), for the `natural`
            scheme; None for datasets without them.

    Returns:
        The clients' training index arrays and local test splits.

    Raises:
        UserError: An unknown scheme or parameter (the message names the valid ones), a value out of its
            range, a label outside [0, num_classes), or more clients than training samples.
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
    resolved = resolve_params(scheme, params)
    rng = np.random.default_rng(int(seed))
    if "groups" in inspect.signature(fn).parameters:  # a scheme of the dataset's own clients (``natural``)
        resolved = {**resolved, "groups": groups}
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
