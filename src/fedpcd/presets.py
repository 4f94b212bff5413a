"""Named settings of an algorithm: ``algorithm.preset: paper | official | ...``.

An algorithm class declares its presets as a class attribute ``presets: {name: Preset}`` (next to its
options, in its own module; a subclass does not inherit them). A preset is a set of config values given
by dotted keys from the config's root: mostly ``algorithm.<option>``, but also the optimizer (``local.lr``,
FedAvg's ``server.optimizer``) or the federation (``clients``, ``participation``) where the paper's or the
released code's behaviour depends on them (FedSSA's tuned T_stable only holds in its code's whole setting).

:func:`apply_preset` fills these values into a raw config before it is validated, only where the config does
not give the key itself. Precedence, lowest first: the schema's defaults < the preset < the config file < the
command line's ``KEY=VALUE`` overrides (a key that ``fedpcd init``'s file and the shipped example leave
commented out is not given). The run's config.yaml (the resolved config) keeps ``algorithm.preset`` and every
value, so it reruns as it is.

A config that gives a preset key another value than the preset's still runs, with one warning line naming
each such key; ``fedpcd.labels`` finds them in any resolved config (an archived run's included) and names
such a run ``fedgela preset=official (overrides local.grad_clip)``. The keys of :data:`PROTOCOL` (the
federation and the training budget) are the preset's setting, not its method: overriding them is warned about,
but the run is still the preset's method, in another setting (its label names only the other keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpcd.declarations import declaration
from fedpcd.errors import UserError, did_you_mean, short
from fedpcd.params import Preset

__all__ = ["PROTOCOL", "apply_preset", "describe_presets", "preset_values", "presets_of"]


# the keys of a preset that give the experiment's federation and budget rather than the method
PROTOCOL = ("rounds", "clients", "participation", "local.epochs", "model.name")


def presets_of(algorithm: str) -> dict[str, Preset]:
    """The presets of the registered algorithm ``algorithm`` (name -> Preset; empty when it has none): those
    its class declares itself, never a base class's (most methods subclass FedAvg, whose presets are FedAvgM
    and FedAdam; FedGE declares FedGELA's). Known without importing the algorithm
    (``fedpcd.declarations``)."""
    return dict(declaration("algorithm", algorithm).presets)


def preset_values(algorithm: str, preset: object) -> dict[str, Any]:
    """The dotted values of ``algorithm``'s preset ``preset``; an unknown name is a one-line UserError."""
    known = presets_of(algorithm)
    if not isinstance(preset, str) or preset not in known:
        valid = ", ".join(sorted(known)) or "(none: this algorithm has no presets)"
        raise UserError(
            f"unknown preset {short(preset)} for algorithm {algorithm!r}{did_you_mean(preset, known)}; valid "
            f"presets: {valid}"
        )
    return dict(known[preset].values)


def _nested(dotted: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _fill(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the keys of ``defaults`` it lacks (recursively into sections both have as mappings)."""
    out = dict(given)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _fill(out[key], value)
    return out


def apply_preset(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a nested config dict as given) with its ``algorithm.preset``'s values filled in wherever
    ``raw`` does not set the key itself; unchanged without a preset."""
    section = raw.get("algorithm")
    if not isinstance(section, dict) or section.get("preset") is None:
        return raw
    name = section.get("name", "fedavg")
    if not isinstance(name, str):
        return raw  # the config's own validation names the problem
    return _fill(raw, _nested(preset_values(name, section["preset"])))


def describe_presets(algorithm: str) -> list[str]:
    """Lines for ``fedpcd list``: each preset, its summary, the values it sets and why it leaves a
    :data:`PROTOCOL` key unset."""
    lines = []
    for name, preset in sorted(presets_of(algorithm).items()):
        values = ", ".join(f"{k}={v}" for k, v in preset.values.items())
        lines.append(f"  {name}: {preset.summary}")
        lines.append(f"    sets: {values}")
        lines.extend(f"    leaves {key} unset: {why}" for key, why in preset.unset.items())
    return lines
