"""Models: a backbone ``features(x) -> z`` plus a linear ``head``; registered by name in ``MODELS``.

Registered: ``simplecnn`` (MOON's Simple-CNN), ``conv2cifar`` (FedNH's CNN), ``resnet10`` and ``resnet18``
(CIFAR form, ``norm: batch | group``), ``wrn`` (WRN-depth-width), ``efficientnet_b0``, ``mlp``, the FedSSA
CNN zoo ``cnn1`` .. ``cnn5``, ``simplecnn_bn`` and ``mlp_bn`` (with BatchNorm layers, for FedBN), and
``lstm`` (LEAF's Shakespeare LSTM; the only one reading token sequences). An architecture's parameters are
its builder's annotated keyword parameters (``mlp``'s ``hidden``, ``simplecnn``'s ``feature_relu``), checked
by ``fedpcd.params``.
"""

from __future__ import annotations

from fedpcd.models import cnn, efficientnet, resnet, sequence  # noqa: F401  (register the models)
from fedpcd.models.base import (
    MODELS,
    FedModel,
    backbone_keys,
    batchnorm_keys,
    build_model,
    build_validated,
    head_keys,
    register_model,
)

__all__ = [
    "MODELS",
    "FedModel",
    "backbone_keys",
    "batchnorm_keys",
    "build_model",
    "build_validated",
    "head_keys",
    "register_model",
]
