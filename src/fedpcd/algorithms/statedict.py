"""State-dict arithmetic: copies, weighted and robust means, distances and the backbone/head split of a
model's tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedpcd.models import head_keys

StateDict = dict[str, Tensor]


def clone_state(model: nn.Module, keys: Sequence[str] | None = None) -> StateDict:
    """A detached copy of the model's state (parameters and buffers), optionally only ``keys``."""
    state = model.state_dict()
    names = state.keys() if keys is None else keys
    return {k: state[k].detach().clone() for k in names}


def backbone_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All parameters but the linear head's."""
    heads = set(head_keys(model))
    return [p for name, p in model.named_parameters() if name not in heads]


def load_backbone(model: nn.Module, backbone: Mapping[str, Tensor]) -> None:
    """Load every non-head tensor of ``model`` from ``backbone``, which must hold no head tensor.

    For methods whose classifier is not the model's linear head (fixed ETF, prototypes, personal heads).
    """
    heads = set(head_keys(model))
    if heads & set(backbone):
        raise ValueError(f"a backbone state must not hold head weights, got {sorted(heads & set(backbone))}")
    missing, unexpected = model.load_state_dict(backbone, strict=False)
    if unexpected or set(missing) != heads:
        raise ValueError(
            f"backbone state does not match the model: missing {sorted(set(missing) - heads)}, "
            f"unexpected {sorted(unexpected)}"
        )


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> StateDict:
    """sum_i w_i s_i / sum_i w_i for every key; integer buffers (BatchNorm counters) are rounded back."""
    if not states:
        raise ValueError("weighted_average needs at least one state")
    total = float(sum(weights))
    out: StateDict = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            acc = torch.zeros_like(first)
            for state, w in zip(states, weights, strict=True):
                acc.add_(state[key], alpha=w / total)
        else:
            acc64 = sum(state[key].double() * (w / total) for state, w in zip(states, weights, strict=True))
            acc = torch.round(acc64).to(first.dtype)
        out[key] = acc
    return out


def coordinate_median(states: Sequence[Mapping[str, Tensor]]) -> StateDict:
    """The coordinate-wise median of the states (the mean of the two middle values for an even count; Yin et
    al., "Byzantine-Robust Distributed Learning", ICML 2018, Def. 1); integer buffers are rounded back."""
    return _per_coordinate(states, lambda s: _middle_mean(s, (len(s) - 1) // 2, len(s) // 2 + 1))


def trimmed_mean(states: Sequence[Mapping[str, Tensor]], trim: float) -> StateDict:
    """The coordinate-wise beta-trimmed mean (Yin et al., ICML 2018, Def. 2): per coordinate, the mean of the
    values left after dropping the floor(trim * n) largest and as many smallest of the n states."""
    k = math.floor(trim * len(states))
    if len(states) - 2 * k < 1:
        raise ValueError(f"a trimmed mean dropping {k} from each end needs more than {2 * k} states")
    return _per_coordinate(states, lambda s: _middle_mean(s, k, len(s) - k))


def _middle_mean(sorted_values: Tensor, start: int, stop: int) -> Tensor:
    return sorted_values[start:stop].mean(dim=0)


def _per_coordinate(states: Sequence[Mapping[str, Tensor]], reduce: Any) -> StateDict:
    """``reduce`` applied to each key's values sorted along a leading state dimension (float64 for integer
    buffers, rounded back)."""
    if not states:
        raise ValueError("a robust mean needs at least one state")
    out: StateDict = {}
    for key, first in states[0].items():
        stacked = torch.stack([state[key] for state in states])
        if first.is_floating_point():
            out[key] = reduce(stacked.sort(dim=0).values)
        else:
            out[key] = torch.round(reduce(stacked.double().sort(dim=0).values)).to(first.dtype)
    return out


def tensor_bytes(obj: Any) -> int:
    """Bytes of all tensors in a nested dict/list (what a message would carry)."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's parameters: the run's device (``engine.device``), where the engine puts
    every model; tensors an algorithm creates to meet the model's belong there."""
    return next(model.parameters()).device


def param_names(model: nn.Module) -> list[str]:
    """Names of the model's floating-point parameters (state-dict keys; buffers excluded)."""
    return [name for name, p in model.named_parameters() if p.is_floating_point()]


def zeros_like_params(model: nn.Module) -> StateDict:
    """A zero tensor per parameter (the initial control variates, gradient states and drifts)."""
    return {n: torch.zeros_like(p.detach()) for n, p in model.named_parameters() if p.is_floating_point()}


def sq_distance(model: nn.Module, reference: Mapping[str, Tensor]) -> Tensor:
    """sum over parameters of ||w - reference||^2, differentiable in the model's parameters."""
    total = torch.zeros((), device=device_of(model))
    for name, p in model.named_parameters():
        if p.is_floating_point():
            total = total + (p - reference[name].detach()).pow(2).sum()
    return total


def average_dicts(dicts: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> StateDict:
    """sum_i w_i d_i / sum_i w_i for float tensors (control variates, gradient states)."""
    total = float(sum(weights))
    out: StateDict = {}
    for key, first in dicts[0].items():
        acc = torch.zeros_like(first)
        for d, w in zip(dicts, weights, strict=True):
            acc.add_(d[key], alpha=w / total)
        out[key] = acc
    return out


def shifted(grads: Mapping[str, Tensor], terms: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """g + terms[name] for every gradient that has a term (the others as they are): ``correct_grads``'s
    additive corrections."""
    return {name: g + terms[name] if name in terms else g for name, g in grads.items()}
