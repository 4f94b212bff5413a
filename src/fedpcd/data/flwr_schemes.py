"""Flower Datasets' partitioners as partition schemes ``flwr:<name>`` (package flwr-datasets, ``fedpcd[hf]``).

Only those that add something to fedpcd's own schemes: shards of a chosen size (``flwr:shard``), IID samples
with client sizes growing linearly, quadratically or exponentially with the client id (``flwr:linear``,
``flwr:square``, ``flwr:exponential``), fixed client sizes with a Dirichlet class mix inside each client
(``flwr:inner_dirichlet``) and k classes per client chosen at random (``flwr:pathological``). Flower's
``DirichletPartitioner``, ``IidPartitioner`` and ``NaturalIdPartitioner`` are fedpcd's ``dirichlet``, ``iid``
and ``natural``.

Each runs Flower's partitioner on the training labels, held as a small in-memory ``datasets.Dataset`` (the
label and the sample index) in an order drawn from the scheme's ``rng``, with a seed drawn from it too: the
same seed gives the same split, and the size-skew partitioners, which cut the dataset in its order, get IID
samples. Any dataset works: only the labels are used. Flower's refusals of impossible settings are one-line
UserErrors; its warnings (classes left unused, redrawn proportions) are logged once each.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from fedpcd.data.scheme_base import PARTITIONERS, _require
from fedpcd.errors import UserError, clip

FLWR_PREFIX = "flwr:"
LOG = logging.getLogger("fedpcd.data")


def flwr_split(
    scheme: str,
    make: Callable[[ModuleType, int], Any],
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Per-client training indices from a Flower partitioner: ``make(flwr_datasets.partitioner, seed)``
    builds it for ``num_clients`` partitions of the column ``label``; it runs on ``labels`` in an
    ``rng``-drawn order."""
    from fedpcd.data.hf import require  # torch with it: only when a Flower scheme runs

    datasets = require("datasets", f"partition scheme {scheme!r}")
    partitioners = require("flwr_datasets.partitioner", f"partition scheme {scheme!r}")
    order = rng.permutation(len(labels)).astype(np.int64)
    seed = int(rng.integers(2**32))
    table = datasets.Dataset.from_dict({"label": np.asarray(labels)[order], "index": order})
    partitioner = make(partitioners, seed)
    partitioner.dataset = table
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parts = [
                np.asarray(partitioner.load_partition(k)["index"], dtype=np.int64) for k in range(num_clients)
            ]
        except ValueError as exc:  # Flower's checks: too many clients, sizes that do not fit, ...
            raise UserError(f"partition scheme {scheme!r}: {clip(' '.join(str(exc).split()), 300)}") from None
    flwr_warnings = [w for w in caught if issubclass(w.category, UserWarning)]  # not its libraries' notices
    for message in dict.fromkeys(str(w.message).split(". ")[0] for w in flwr_warnings):
        LOG.warning("partition scheme %r: %s", scheme, message)
    return parts


@PARTITIONERS.register(FLWR_PREFIX + "shard")
def flwr_shard(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_shards_per_partition: Annotated[int, Field(ge=1)] | None = 2,
    shard_size: Annotated[int, Field(ge=1)] | None = None,
    keep_incomplete_shard: bool = False,
) -> list[np.ndarray]:
    """Flower Datasets' ShardPartitioner (McMahan et al., AISTATS 2017): label-sorted shards of
    ``shard_size`` samples (default N / (K x shards per client)), ``num_shards_per_partition`` per client
    at random; with ``num_shards_per_partition: null``, every shard of ``shard_size`` spread over the
    clients (``keep_incomplete_shard``: the last, shorter one too)."""
    return flwr_split(
        FLWR_PREFIX + "shard",
        lambda flwr, seed: flwr.ShardPartitioner(
            num_clients, "label", num_shards_per_partition, shard_size, keep_incomplete_shard, seed=seed
        ),
        labels,
        num_clients,
        rng,
    )


def _shard_combination(values: dict[str, Any]) -> str | None:
    if values["num_shards_per_partition"] is None and values["shard_size"] is None:
        return "set num_shards_per_partition or shard_size (or both)"
    return None


flwr_shard.check_combination = _shard_combination  # type: ignore[attr-defined]


def _sized(
    partitioner: str, scheme: str, labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    return flwr_split(
        scheme, lambda flwr, seed: getattr(flwr, partitioner)(num_clients), labels, num_clients, rng
    )


@PARTITIONERS.register(FLWR_PREFIX + "linear")
def flwr_linear(
    labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Flower Datasets' LinearPartitioner: IID samples, the k-th client (from 1) holding a share
    proportional to k (quantity skew; the rounding remainder goes to the last client)."""
    return _sized("LinearPartitioner", FLWR_PREFIX + "linear", labels, num_clients, rng)


@PARTITIONERS.register(FLWR_PREFIX + "square")
def flwr_square(
    labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Flower Datasets' SquarePartitioner: IID samples, the k-th client (from 1) holding a share
    proportional to k^2."""
    return _sized("SquarePartitioner", FLWR_PREFIX + "square", labels, num_clients, rng)


@PARTITIONERS.register(FLWR_PREFIX + "exponential")
def flwr_exponential(
    labels: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Flower Datasets' ExponentialPartitioner: IID samples, the k-th client (from 1) holding a share
    proportional to e^k (every client needs at least one sample: few clients only)."""
    return _sized("ExponentialPartitioner", FLWR_PREFIX + "exponential", labels, num_clients, rng)


@PARTITIONERS.register(FLWR_PREFIX + "inner_dirichlet")
def flwr_inner_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    partition_sizes: list[Annotated[int, Field(ge=0)]] | None = None,
    alpha: Annotated[float, Field(gt=0.0)] = 0.5,
) -> list[np.ndarray]:
    """Flower Datasets' InnerDirichletPartitioner (FedDyn, Acar et al., ICLR 2021): client sizes fixed
    (``partition_sizes``, one per client; default: all samples in near-equal shares), each client's class
    mix drawn from Dir(alpha) and filled sample by sample (an exhausted class is dropped from the mix)."""
    if partition_sizes is None:
        sizes = [len(a) for a in np.array_split(np.arange(len(labels)), num_clients)]
    else:
        sizes = list(partition_sizes)
        _require(
            len(sizes) == num_clients,
            f"flwr:inner_dirichlet partition_sizes lists {len(sizes)} sizes for {num_clients} clients",
        )
        _require(
            sum(sizes) <= len(labels),
            f"flwr:inner_dirichlet partition_sizes add up to {sum(sizes)}, more than the {len(labels)} "
            "samples",
        )
    return flwr_split(
        FLWR_PREFIX + "inner_dirichlet",
        lambda flwr, seed: flwr.InnerDirichletPartitioner(sizes, "label", float(alpha), seed=seed),
        labels,
        num_clients,
        rng,
    )


@PARTITIONERS.register(FLWR_PREFIX + "pathological")
def flwr_pathological(
    labels: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    num_classes_per_partition: Annotated[int, Field(ge=1)] = 2,
    class_assignment_mode: Literal["random", "deterministic", "first-deterministic"] = "random",
) -> list[np.ndarray]:
    """Flower Datasets' PathologicalPartitioner (Li et al., ICDE 2022): each client holds
    ``num_classes_per_partition`` classes, chosen at random (``random``), client k's first class k mod C and
    the rest at random (``first-deterministic``, the paper's), or classes k..k+n-1 mod C
    (``deterministic``); each class split evenly among its holders (a class nobody drew stays unused)."""
    present = len(np.unique(labels))
    _require(
        num_classes_per_partition <= present,
        f"flwr:pathological num_classes_per_partition must be at most the {present} classes present, "
        f"got {num_classes_per_partition}",
    )
    return flwr_split(
        FLWR_PREFIX + "pathological",
        lambda flwr, seed: flwr.PathologicalPartitioner(
            num_clients, "label", num_classes_per_partition, class_assignment_mode, seed=seed
        ),
        labels,
        num_clients,
        rng,
    )
