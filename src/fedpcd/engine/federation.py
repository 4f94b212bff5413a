"""Building a federation from a config, and the two steps every backend shares.

``build_federation`` loads the dataset once, partitions it and wraps each client as index tensors into the
shared tensors, all on the run's device (``engine.device``); ``sample_clients`` is the seeded choice of a
round's participants. One client's round is ``fedpcd.engine.client_update``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpcd import seeds
from fedpcd.algorithms import Algorithm, ClientData, Context, build_algorithm
from fedpcd.algorithms.readout import feature_map
from fedpcd.algorithms.statedict import param_names
from fedpcd.config import Config
from fedpcd.data.datasets import load_configured
from fedpcd.data.partition import Partition, make_partition
from fedpcd.data.tensors import Dataset
from fedpcd.engine.metrics import (
    CLASS_MEANS,
    accuracy,
    feature_means,
    held_missing_angles,
    mean_angle,
    mean_of_angles,
    per_class_accuracy,
    predict,
)
from fedpcd.errors import UserError
from fedpcd.models import batchnorm_keys, build_model
from fedpcd.run_format import ANGLES


@dataclass
class Federation:
    config: Config
    dataset: Dataset  # CPU tensors, as loaded (the partition and the run directory read these)
    partition: Partition
    clients: list[ClientData]  # index tensors into the shared tensors below, all on ``device``
    context: Context
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    test_x: torch.Tensor | None = None  # the normalised test set on ``device`` (GA)
    test_y: torch.Tensor | None = None
    batchnorm: frozenset[str] = frozenset()  # the architectures with BatchNorm (``ClientData.batchnorm``)
    _models: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        """For the worker pool: the clients travel as the partition (rebuilt by ``__setstate__``), the model
        objects not at all; the tensors themselves go through torch's shared memory (no copy per worker)."""
        state = dict(self.__dict__)
        state["clients"] = (self.clients[0].x, self.clients[0].y) if self.clients else None
        state["_models"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        shared = state.pop("clients")
        self.__dict__.update(state)
        self.clients = []
        if shared is not None:
            self.clients = make_clients(
                self.config, self.dataset, self.partition, *shared, self.test_x, self.test_y, self.batchnorm
            )

    def new_model(self, architecture: str | None = None) -> nn.Module:
        """A model of ``architecture`` (default: client 0's, the server's reference), initialised from the
        run's seed (identical wherever it is built); torch's global generator is left as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds.initial_model(self.config.seed))
            model = build_model(
                architecture or self.config.model.architecture(0),
                self.dataset.in_channels,
                self.dataset.num_classes,
                self.dataset.image_size,
                **self.config.model.params(),
            )
        return model.to(self.device)  # initialised on the CPU: the same weights on every device

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

    def new_algorithm(self) -> Algorithm:
        algorithm = build_algorithm(self.config.algorithm.name, self.config.algorithm.params())
        algorithm.setup(self.context)
        return algorithm


def set_threads(config: Config) -> None:
    """engine.threads, default 1: on a loaded small machine more threads spin-wait and run slower."""
    torch.set_num_threads(config.engine.threads or 1)


def resolve_device(name: str) -> torch.device:
    """``engine.device`` -> a torch device: cpu, cuda, cuda:N, or auto (cuda if available, else cpu).

    A CUDA device that is not there is a UserError (exit 2), never a silent fall-back to the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"engine.device={name} but no CUDA device is available; choose cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UserError(
                f"engine.device={name} but only {count} CUDA device(s) are available; "
                f"choose cuda:0..cuda:{count - 1}, cpu or auto"
            )
    return device


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` (nested dicts, lists and tuples of tensors and scalars) with every tensor on ``device``.

    Tensors already there are returned as they are (no copy), and so is a dict none of whose leaves moved:
    in the local simulator this is the identity. Other mappings (e.g. a ClientStateStore) become plain dicts.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        moved = {k: to_device(v, device) for k, v in obj.items()}
        return obj if type(obj) is dict and all(moved[k] is v for k, v in obj.items()) else moved
    if isinstance(obj, (list, tuple)):
        items = [to_device(v, device) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else type(obj)(items)
    return obj


def build_federation(config: Config) -> Federation:
    """Load data, partition it (a pure function of labels, scheme and seed) and wrap the clients.

    The normalised images, labels and every client's index tensors are put on ``engine.device`` once;
    the Dataset keeps its CPU tensors (partition statistics, the run directory)."""
    device = resolve_device(config.engine.device)
    ds = load_configured(config)
    train_y = ds.train_y.numpy()
    partition = make_partition(
        train_y,
        ds.test_y.numpy(),
        config.clients,
        config.partition.scheme,
        config.partition.params(),
        config.seed,
        num_classes=ds.num_classes,
        groups=ds.groups,
    )
    x, test_x = (ds.normalized(split).to(device) for split in ("train", "test"))
    train_y, test_y = ds.train_y.to(device), ds.test_y.to(device)
    with torch.random.fork_rng(devices=[]):  # throw-away models: the run's random streams are untouched
        models = {
            arch: build_model(arch, ds.in_channels, ds.num_classes, ds.image_size, **config.model.params())
            for arch in config.model.architectures(config.clients)
        }
    reference = models[config.model.architecture(0)]
    batchnorm = frozenset(arch for arch, model in models.items() if batchnorm_keys(model))
    clients = make_clients(config, ds, partition, x, train_y, test_x, test_y, batchnorm)
    ctx = Context(
        num_clients=config.clients,
        num_classes=ds.num_classes,
        rounds=config.rounds,
        seed=config.seed,
        local=config.local,
        heterogeneous=len(config.model.architectures(config.clients)) > 1,
        input_shape=(ds.in_channels, ds.image_size, ds.image_size),
        parameter_names=tuple(param_names(reference)),
    )
    return Federation(config, ds, partition, clients, ctx, device, test_x, test_y, batchnorm)


def make_clients(
    config: Config,
    ds: Dataset,
    partition: Partition,
    x: torch.Tensor,
    y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    batchnorm: frozenset[str] = frozenset(),
) -> list[ClientData]:
    """Every client as index tensors (on the tensors' device) into the shared normalised tensors;
    ``batchnorm``: the architectures with BatchNorm layers (their clients train on no batch of one sample)."""
    device = x.device
    return [
        ClientData(
            id=k,
            x=x,
            y=y,
            train_idx=torch.as_tensor(partition.train[k], dtype=torch.long, device=device),
            test_x=test_x,
            test_y=test_y,
            local_test_idx=torch.as_tensor(partition.test[k], dtype=torch.long, device=device),
            num_classes=ds.num_classes,
            augment=ds.augment,
            batchnorm=config.model.architecture(k) in batchnorm,
        )
        for k in range(config.clients)
    ]


def sample_clients(num_clients: int, per_round: int, seed: int, rnd: int) -> list[int]:
    """The round's participants: ``per_round`` of the ``num_clients`` clients (``Config.clients_per_round``),
    without replacement, sorted."""
    if per_round >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(seeds.participants(seed, rnd))
    return sorted(int(k) for k in rng.choice(num_clients, size=per_round, replace=False))


def global_accuracy(
    algorithm: Algorithm, model: nn.Module, fed: Federation, server: dict[str, Any]
) -> float | None:
    """GA: the global predictor on the full test set (None for purely personalised methods)."""
    predictor = algorithm.global_predictor(model, server)
    return accuracy(predict(predictor, _test_x(fed)), _test_y(fed)) if predictor else None


def global_evaluation(
    algorithm: Algorithm, model: nn.Module, fed: Federation, server: dict[str, Any]
) -> tuple[float | None, list[float | None] | None, dict[str, float]]:
    """(GA, the global model's accuracy on each class of the test set, the accuracies of the algorithm's
    extra global predictors): GA and the classes (None for a class without test samples) are None without a
    global model; the extra accuracies are ``global_acc_<name>`` in metrics.jsonl
    (``Algorithm.extra_global_predictors``)."""
    test_x, test_y = _test_x(fed), _test_y(fed)
    ga, classes = None, None
    predictor = algorithm.global_predictor(model, server)
    if predictor:
        pred = predict(predictor, test_x)
        row = per_class_accuracy(pred, test_y, fed.dataset.num_classes).tolist()
        ga, classes = accuracy(pred, test_y), [None if math.isnan(v) else round(v, 4) for v in row]
    extra = {
        name: accuracy(predict(extra_predictor, test_x), test_y)
        for name, extra_predictor in algorithm.extra_global_predictors(model, server)
    }
    return ga, classes, extra


def class_mean_angles(
    algorithm: Algorithm,
    model: nn.Module,
    fed: Federation,
    server: dict[str, Any],
    metrics: Sequence[tuple[int, dict[str, Any] | None]],
) -> dict[str, float | None]:
    """``geometry: true``'s angles in degrees (``fedpcd.run_format.ANGLES``; definitions in
    ``fedpcd.engine.metrics``): the global model's over all classes (one pass of its features over the test
    set; None without a global model), and the mean over the participants (``metrics``: (client, personal
    metrics) pairs, each with the personal model's class means) of their held and missing angles."""
    angle_all = None
    predictor = algorithm.global_predictor(model, server)
    if predictor:
        model.eval()
        features = feature_map(predictor, model)
        angle_all = mean_angle(feature_means(features, _test_x(fed), _test_y(fed), fed.dataset.num_classes))
    pairs = [
        held_missing_angles(m[CLASS_MEANS], fed.clients[k].label_counts)
        for k, m in metrics
        if m is not None and CLASS_MEANS in m
    ]
    held, missing = mean_of_angles([p[0] for p in pairs]), mean_of_angles([p[1] for p in pairs])
    return dict(zip(ANGLES, (angle_all, held, missing), strict=True))


def _test_x(fed: Federation) -> torch.Tensor:
    return fed.test_x if fed.test_x is not None else fed.dataset.normalized("test")


def _test_y(fed: Federation) -> torch.Tensor:
    return fed.test_y if fed.test_y is not None else fed.dataset.test_y
