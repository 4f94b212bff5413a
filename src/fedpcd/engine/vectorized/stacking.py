"""Stacking for the vectorized executor: nested containers of tensors taken apart, compared, rebuilt and
stacked along a client dimension, and the "twin" (a copy of the model that ``functional_call`` runs with
substituted, stacked tensors)."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedpcd.models import FedModel

# ----- nested containers of tensors ------------------------------------------------------------------------


def tensor_leaves(obj: Any) -> list[Tensor]:
    """The tensors of nested dicts / lists / tuples, in a fixed order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensor_leaves(v)]
    return []


def skeleton(obj: Any) -> Any:
    """``obj`` with each tensor replaced by (shape, dtype): equal skeletons can be stacked leaf by leaf."""
    if isinstance(obj, Tensor):
        return ("<tensor>", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return ("<dict>", tuple((k, skeleton(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (f"<{type(obj).__name__}>", tuple(skeleton(v) for v in obj))
    return obj


def rebuild(obj: Any, tensors: Iterator[Tensor]) -> Any:
    """``obj`` with its tensors replaced, in :func:`tensor_leaves` order, by ``tensors``."""
    if isinstance(obj, Tensor):
        return next(tensors)
    if isinstance(obj, dict):
        return {k: rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebuild(v, tensors) for v in obj)
    return obj


def stack_or_share(values: Sequence[Tensor], by_identity: bool) -> tuple[Tensor, bool]:
    """(tensor, stacked): the one shared tensor if every client has the same (object, or equal values with
    ``by_identity=False``), else the values stacked along a new client dimension."""
    first = values[0]
    if all(v is first for v in values) or (
        not by_identity and all(v.shape == first.shape and torch.equal(v, first) for v in values)
    ):
        return first, False
    return torch.stack([v.detach() for v in values]), True


# ----- the twin: the model's architecture, callable with substituted (batched) tensors ---------------------


class Bound(nn.Module):
    """Holds a model so that ``functional_call`` can substitute its tensors while ``fn(model)`` runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, fn: Callable[[nn.Module], Tensor]) -> Tensor:
        return fn(self.m)


_TWINS: weakref.WeakKeyDictionary[nn.Module, Bound] = weakref.WeakKeyDictionary()


def twin_of(model: nn.Module) -> Bound:
    """A copy of ``model`` (one per reusable model object) wrapped for functional calls: the model's
    ``vmap_copy`` (the ConvNet family's has batched ``features``), a deep copy for other modules."""
    bound = _TWINS.get(model)
    if bound is None:
        bound = Bound(model.vmap_copy() if isinstance(model, FedModel) else copy.deepcopy(model))
        _TWINS[model] = bound
    return bound


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and buffers by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}
