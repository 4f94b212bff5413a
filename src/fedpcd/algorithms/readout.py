"""Predictors that are a model's weights plus a few tensors, and the feature space a predictor's classifier
reads (the class-mean angles: ``geometry: true``, ``fedpcd report --geometry``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedpcd.algorithms.contract import Predictor
from fedpcd.models import FedModel

TensorLogits = Callable[[nn.Module, Tensor, dict[str, Any]], Tensor]
FeatureLogits = Callable[[Tensor, dict[str, Any]], Tensor]


@dataclass(frozen=True)
class Readout:
    """A predictor that is the model's weights plus a few tensors: x -> ``logits(model, x, tensors)`` (a
    fixed ETF, prototypes, a private head beside the model).

    Returned by ``personal_predictor`` (or ``global_predictor``) instead of a closure, it exposes its tensors
    (the vectorized executor stacks the clients' ``tensors`` and evaluates them at once; ``logits`` must be
    tensor code); ``features`` (default: ``model.features``) is what its classifier reads, the feature space
    of the class-mean angles (``geometry: true``; FedGELA: the projected h); ``head``, where given, is that
    classifier: ``logits(model, x, tensors)`` is ``head(features(model, x, tensors), tensors)`` op for op, so
    that one pass gives a run's last predictions and their features."""

    model: nn.Module
    logits: TensorLogits
    tensors: dict[str, Any]
    features: TensorLogits | None = None
    head: FeatureLogits | None = None

    def __call__(self, x: Tensor) -> Tensor:
        self.model.eval()
        if self.head is not None and self.features is None and not torch.is_grad_enabled():
            # the same logits op for op, with the model's inference kernels for its features (bit for bit)
            features = (
                self.model.inference_features() if isinstance(self.model, FedModel) else self.model.features
            )
            return self.head(features(x), self.tensors)
        return self.logits(self.model, x, self.tensors)


def feature_map(predictor: Predictor, model: nn.Module) -> Predictor:
    """x -> the features the classifier of ``predictor`` (a predictor over ``model``) reads."""
    if isinstance(predictor, Readout) and predictor.features is not None:
        features, tensors = predictor.features, predictor.tensors
        return lambda x: features(model, x, tensors)
    return lambda x: model.features(x).flatten(1)
