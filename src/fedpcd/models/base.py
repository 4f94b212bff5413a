"""The model contract (backbone ``features`` + linear ``head``), the model registry and key helpers."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from torch import nn

from fedpcd.errors import UserError
from fedpcd.params import validate_params
from fedpcd.registry import Registry

HEAD_PREFIX = "head."


class FedModel(nn.Module):
    """A backbone (``features``) followed by a linear head: ``forward(x) = head(features(x))``.

    ``head`` is the only submodule whose state_dict keys start with ``"head."``; algorithms that
    personalise or fix the classifier (FedRep, FedGELA, FedNH, FedSSA, ...) split the model there.
    """

    feature_dim: int
    head: nn.Linear

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The representation z, shape ``[B, feature_dim]``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, shape ``[B, num_classes]``."""
        return self.head(self.features(x))

    def inference_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What predictions call (no gradient, eval mode): ``self(x)`` bit for bit; an architecture with a
        faster kernel for the same numbers returns that. Default: the model itself."""
        return self

    def inference_features(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``features`` for predictions (no gradient, eval mode), bit for bit, as ``inference_forward`` is
        ``self(x)``: what a predictor's classifier over the features reads. Default: ``self.features``."""
        return self.features

    def vmap_copy(self) -> nn.Module:
        """A copy of the model that the vectorized executor calls through ``torch.func.functional_call`` and
        vmaps over the clients' stacked tensors; an architecture may give it batched kernels with the same
        results up to float rounding. Default: a deep copy."""
        return copy.deepcopy(self)


Builder = Callable[..., FedModel]

MODELS: Registry[Builder] = Registry("model")
_ACCEPTS: dict[str, Callable[[int, int], bool]] = {}
_TOKENS: dict[str, bool] = {}  # the architectures that read token ids (in_channels 0), not images
_BUILDERS: dict[str, Builder] = {}  # the builders as written (MODELS holds them wrapped in their checks)


def _accepts_any(in_channels: int, image_size: int) -> bool:
    return True


def register_model(
    name: str, accepts: Callable[[int, int], bool] = _accepts_any, tokens: bool = False
) -> Callable[[Builder], Builder]:
    """Register ``builder(in_channels, num_classes, image_size, **params)`` under ``name``.

    The builder's keyword parameters with defaults are the architecture's config keys, typed and bounded
    by their annotations (``fedpcd.params``). ``accepts(in_channels, image_size)`` says whether the
    architecture can take that input. ``tokens``: it reads token sequences (``in_channels`` 0,
    ``image_size`` the sequence length), not images; each kind refuses the other. The registered callable
    checks its arguments (UserError for bad sizes, too-small inputs, unknown or bad params) and keeps the
    builder's signature for introspection (``inspect.signature`` follows ``__wrapped__``).
    """

    def decorator(builder: Builder) -> Builder:
        @functools.wraps(builder)
        def checked(in_channels: int, num_classes: int, image_size: int, **params: object) -> FedModel:
            _check_input(name, in_channels, num_classes, image_size)
            values = validate_params("model", name, builder, params)
            return _build(name, in_channels, num_classes, image_size, values)

        MODELS.register(name)(checked)
        _ACCEPTS[name] = accepts
        _TOKENS[name] = tokens
        _BUILDERS[name] = builder
        return checked

    return decorator


def _check_input(name: str, in_channels: int, num_classes: int, image_size: int) -> None:
    for arg, value, least in (
        ("in_channels", in_channels, 0),  # 0: token sequences
        ("num_classes", num_classes, 1),
        ("image_size", image_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            kind = "a non-negative" if least == 0 else "a positive"
            raise UserError(f"model {name!r}: {arg} must be {kind} integer, got {value!r}")


def _build(
    name: str, in_channels: int, num_classes: int, image_size: int, params: dict[str, object]
) -> FedModel:
    tokens = in_channels == 0
    if _TOKENS[name] != tokens:
        ok = [n for n in MODELS.names() if _TOKENS[n] == tokens]
        given = f"token sequences of length {image_size}" if tokens else "images"
        wants = "token sequences" if _TOKENS[name] else "images"
        choices = ", ".join(ok) or "(none)"
        raise UserError(f"model {name!r} reads {wants} but this dataset holds {given}; use one of: {choices}")
    if not _ACCEPTS[name](in_channels, image_size):
        ok = [n for n in MODELS.names() if _TOKENS[n] == tokens and _ACCEPTS[n](in_channels, image_size)]
        raise UserError(
            f"input {in_channels}x{image_size}x{image_size} is too small for model {name!r}; "
            f"use one of: {', '.join(ok) or '(none)'}"
        )
    return _BUILDERS[name](in_channels, num_classes, image_size, **params)


def build_model(name: str, in_channels: int, num_classes: int, image_size: int, **params: object) -> FedModel:
    """Build a registered model for ``in_channels x image_size x image_size`` inputs and ``num_classes``."""
    return MODELS.get(name)(in_channels, num_classes, image_size, **params)


def build_validated(
    name: str, in_channels: int, num_classes: int, image_size: int, params: dict[str, object]
) -> FedModel:
    """Build with ``params`` that ``validate_params`` already returned for this model (the config checks
    them once, at load): the input is checked, the parameters are not checked again."""
    MODELS.get(name)
    _check_input(name, in_channels, num_classes, image_size)
    return _build(name, in_channels, num_classes, image_size, params)


def head_keys(model: nn.Module) -> list[str]:
    """The state_dict keys of the classifier head (``head.weight``, ``head.bias``), in state_dict order."""
    return [k for k in model.state_dict() if k.startswith(HEAD_PREFIX)]


def backbone_keys(model: nn.Module) -> list[str]:
    """All other state_dict keys (parameters and buffers, e.g. BatchNorm statistics), in state_dict order."""
    return [k for k in model.state_dict() if not k.startswith(HEAD_PREFIX)]


def batchnorm_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of the model's BatchNorm layers (weights, biases, running statistics, counters),
    in state-dict order."""
    prefixes = tuple(
        f"{name}." for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    )
    return [k for k in model.state_dict() if prefixes and k.startswith(prefixes)]
