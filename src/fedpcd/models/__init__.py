"""Models: a backbone ``features(x) -> z`` plus a linear ``head``; registered by name in ``MODELS``.

Registered: ``simplecnn`` (MOON's Simple-CNN), ``conv2cifar`` (FedNH's CNN), ``resnet18`` (CIFAR form),
``mlp``, and the FedSSA CNN zoo ``cnn1`` .. ``cnn5``. An architecture's parameters are its builder's
annotated keyword parameters (``mlp``'s ``hidden``, ``simplecnn``'s ``feature_relu``), checked by
``fedpcd.params``.
"""

from __future__ import annotations

from fedpcd.models import cnn, resnet  # noqa: F401  (register the models)
from fedpcd.models.base import (
    MODELS,
    FedModel,
    backbone_keys,
    build_model,
    build_validated,
    head_keys,
    register_model,
)

__all__ = [
    "MODELS",
    "FedModel",
    "backbone_keys",
    "build_model",
    "build_validated",
    "head_keys",
    "register_model",
]
