"""Building a federation from a config, and the two steps every backend shares.

``build_federation`` loads the dataset once, partitions it and wraps each client as index tensors into the
shared tensors. ``client_step`` is one client's work in one round (local update, then personal evaluation)
and ``sample_clients`` the seeded choice of participants: the local simulator and the Flower apps both call
them, which is why the two backends give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpcd.algorithms import ClientData, Context, FedAvg, LocalTraining, build_algorithm
from fedpcd.config import Config
from fedpcd.data.datasets import Dataset, load_dataset
from fedpcd.data.partition import Partition, make_partition
from fedpcd.engine.metrics import accuracy, personal_metrics, predict, split_metrics
from fedpcd.models import build_model
from fedpcd.utils import derive_seed

INIT_STREAM = -1  # seed stream of the initial model (rounds use 1..R)


@dataclass
class Federation:
    config: Config
    dataset: Dataset
    partition: Partition
    clients: list[ClientData]
    context: Context
    _models: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = field(default_factory=dict, repr=False)

    def new_model(self, architecture: str | None = None) -> nn.Module:
        """A model of ``architecture`` (default: client 0's, the server's reference), initialised from the
        run's seed (identical wherever it is built)."""
        torch.manual_seed(derive_seed(self.config.seed, INIT_STREAM))
        return build_model(
            architecture or self.config.model.architecture(0),
            self.dataset.in_channels,
            self.dataset.num_classes,
            self.dataset.image_size,
            **self.config.model.params(),
        )

    def model_for(self, client: int, fresh: bool = False) -> nn.Module:
        """The one reusable model object of ``client``'s architecture; ``fresh``: reset to its seeded initial
        weights (the engine does this whenever the client has no state yet, e.g. at first participation)."""
        arch = self.config.model.architecture(client)
        if arch not in self._models:
            model = self.new_model(arch)
            self._models[arch] = (model, {k: v.clone() for k, v in model.state_dict().items()})
        model, initial = self._models[arch]
        if fresh:
            model.load_state_dict(initial)
        return model

    def new_algorithm(self) -> FedAvg:
        algorithm = build_algorithm(self.config.algorithm.name, self.config.algorithm.params())
        algorithm.setup(self.context)
        return algorithm


def set_threads(config: Config) -> None:
    """engine.threads, default 1: on a loaded small machine more threads spin-wait and run slower."""
    torch.set_num_threads(config.engine.threads or 1)


def build_federation(config: Config) -> Federation:
    """Load data, partition it (a pure function of labels, scheme and seed) and wrap the clients."""
    ds = load_dataset(
        config.dataset.name,
        config.dataset.root,
        config.dataset.train_fraction,
        config.seed,
        config.dataset.download,
    )
    train_y = ds.train_y.numpy()
    partition = make_partition(
        train_y,
        ds.test_y.numpy(),
        config.clients,
        config.partition.scheme,
        config.partition.params(),
        config.seed,
        num_classes=ds.num_classes,
    )
    x, test_x = ds.normalized("train"), ds.normalized("test")
    clients = [
        ClientData(
            id=k,
            x=x,
            y=ds.train_y,
            train_idx=torch.as_tensor(partition.train[k], dtype=torch.long),
            test_x=test_x,
            test_y=ds.test_y,
            local_test_idx=torch.as_tensor(partition.test[k], dtype=torch.long),
            num_classes=ds.num_classes,
            augment=ds.augment,
        )
        for k in range(config.clients)
    ]
    ctx = Context(
        num_clients=config.clients,
        num_classes=ds.num_classes,
        rounds=config.rounds,
        seed=config.seed,
        local=LocalTraining(**config.local.model_dump()),
        heterogeneous=len(config.model.architectures(config.clients)) > 1,
        input_shape=(ds.in_channels, ds.image_size, ds.image_size),
    )
    return Federation(config, ds, partition, clients, ctx)


def sample_clients(num_clients: int, participation: float, seed: int, rnd: int) -> list[int]:
    """The round's participants: round(participation * K) clients (>= 1), without replacement, sorted."""
    m = max(1, round(participation * num_clients))
    if m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, rnd, 0x5A))
    return sorted(int(k) for k in rng.choice(num_clients, size=m, replace=False))


def global_accuracy(
    algorithm: FedAvg, model: nn.Module, fed: Federation, server: dict[str, Any]
) -> float | None:
    """GA: the global predictor on the full test set (None for purely personalised methods)."""
    predictor = algorithm.global_predictor(model, server)
    return (
        accuracy(predict(predictor, fed.dataset.normalized("test")), fed.dataset.test_y)
        if predictor
        else None
    )


def client_step(
    algorithm: FedAvg,
    model: nn.Module,
    data: ClientData,
    payload: dict[str, Any],
    state: Any,
    *,
    seed: int,
    rnd: int,
    evaluate: bool,
    full_test: bool = True,
) -> tuple[dict[str, Any], Any, dict[str, Any] | None]:
    """One client's round: local update from a (seed, round, client) generator, then personal metrics
    (on the full test set, or with ``full_test=False`` on the client's local test split only)."""
    rng = torch.Generator().manual_seed(derive_seed(seed, rnd, data.id))
    algorithm.round = rnd
    reply, state = algorithm.local_update(model, data, payload, state, rng)
    metrics = None
    if evaluate:
        predictor = algorithm.personal_predictor(model, payload, state)
        if full_test:
            pred = predict(predictor, data.test_x)
            metrics = personal_metrics(pred, data.test_y, data.local_test_idx, data.label_counts)
        else:
            split = data.local_test_idx
            pred = predict(predictor, data.test_x[split]) if len(split) else split
            metrics = split_metrics(pred, data.test_y[split])
    return reply, state, metrics
