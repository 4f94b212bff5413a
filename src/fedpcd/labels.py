"""How a run is named and what its preset's keys were overridden by, from its resolved config alone (a run's
config.yaml, archived ones included): `preset_overrides`, `run_label`, the warning line
(`overrides_line`, `warn_overrides`) and summary.json's record (`preset_record`).

No torch is loaded: a preset's values are read from the algorithms' declarations (``fedpcd.declarations``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fedpcd.presets import PROTOCOL, preset_values

PRESET = "preset"  # summary.json's record of the run's preset (`preset_record`)
_MISSING = object()


def _leaf(config: Mapping[str, Any], dotted: str, missing: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return missing
        node = node[part]
    return node


def _preset_of(config: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
    """(algorithm, preset, the preset's dotted values) of a config; None without a preset."""
    section = config.get("algorithm")
    if not isinstance(section, Mapping) or section.get("preset") is None:
        return None
    name = str(section.get("name", "fedavg"))
    return name, section["preset"], preset_values(name, section["preset"])


def preset_overrides(config: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The keys of a resolved config's preset that the config gives another value: dotted key -> (the preset's
    value, the value used), in the preset's order; empty without a preset. Works on any run's config.yaml
    (archived runs included: they are fully resolved). An unknown preset is a one-line UserError.

    Args:
        config: A resolved config as a nested dict (a run's config.yaml).
    """
    preset = _preset_of(config)
    if preset is None:
        return {}
    values = preset[2]
    used = {key: _leaf(config, key) for key in values}
    return {key: (value, used[key]) for key, value in values.items() if used[key] != value}


def method_overrides(config: Mapping[str, Any]) -> list[str]:
    """The keys of `preset_overrides` that make the run another method than its preset's: all but the
    federation and budget (``fedpcd.presets.PROTOCOL``), in the preset's order.

    Args:
        config: A resolved config as a nested dict.
    """
    return [key for key in preset_overrides(config) if key not in PROTOCOL]


def overrides_suffix(config: Mapping[str, Any]) -> str:
    """`` (overrides local.grad_clip, ...)`` for a run whose config overrides its preset's method keys
    (`method_overrides`); empty otherwise.

    Args:
        config: A resolved config as a nested dict.
    """
    method = method_overrides(config)
    return f" (overrides {', '.join(method)})" if method else ""


def run_label(config: Mapping[str, Any]) -> str:
    """A run's method as reports name it: ``fedgela``, ``fedgela preset=official``, or, with the preset's
    method keys (all but ``fedpcd.presets.PROTOCOL``) that the config overrides, ``fedgela
    preset=official (overrides local.grad_clip)``: such a run is not the preset's method.

    Args:
        config: A resolved config as a nested dict (a run's config.yaml).
    """
    preset = _preset_of(config)
    if preset is None:
        return str((config.get("algorithm") or {}).get("name", "fedavg"))
    return f"{preset[0]} preset={preset[1]}{overrides_suffix(config)}"


def _text(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, (list, dict, str)) else str(value)


def overrides_line(config: Mapping[str, Any], given: Mapping[str, str] | None = None) -> str | None:
    """The warning for a resolved config whose file or overrides give preset keys other values, e.g.
    ``preset fedgela/official: local.grad_clip=20.0 overridden by null (config file)``; None when none do.
    ``given``: dotted key -> where its value came from ("config file", "command line"), where known.

    Args:
        config: A resolved config as a nested dict.
        given: Where the values came from, lowest first (as ``layers`` of `warn_overrides`), or None.
    """
    changed = preset_overrides(config)
    if not changed:
        return None
    name, preset, _ = _preset_of(config) or ("", "", {})
    where = given or {}
    parts = [
        f"{key}={_text(value)} overridden by {_text(used)}" + (f" ({where[key]})" if key in where else "")
        for key, (value, used) in changed.items()
    ]
    return f"preset {name}/{preset}: {', '.join(parts)}"


_SAID: dict[str, str] = {}  # a warning without its keys' sources -> as said with them (for the run's run.log)


def warn_overrides(
    config: Mapping[str, Any],
    layers: Mapping[str, Mapping[str, Any]] | None = None,
    said: set[str] | None = None,
) -> str | None:
    """Log `overrides_line`'s warning for a resolved config and return it (None: no preset key
    overridden). ``layers``: where the values came from, lowest first ("config file": the file's tree,
    "command line": the overrides' tree); each overridden key is named with the last layer that gives it.
    Once said here, the same warning in the run's run.log (`run_log_line`) names the sources too.
    ``said``: the warnings said already (a sweep's runs sharing one: said once), updated.

    Args:
        config: A resolved config as a nested dict.
        layers: The source trees by name, lowest first, or None.
        said: The warnings said already, updated, or None.
    """
    from fedpcd.logs import LOGGER

    changed = preset_overrides(config)
    given = {}
    for source, tree in (layers or {}).items():
        given.update({key: source for key in changed if _leaf(tree, key, _MISSING) is not _MISSING})
    line = overrides_line(config, given)
    if line is not None and line not in (said or ()):
        _SAID[overrides_line(config) or ""] = line
        LOGGER.warning(line)
        if said is not None:
            said.add(line)
    return line


def run_log_line(config: Mapping[str, Any]) -> str | None:
    """The preset warning of a run for its run.log: as this process said it (with the keys' sources) or, said
    by another process (a sweep's worker), without them.

    Args:
        config: A resolved config as a nested dict.
    """
    line = overrides_line(config)
    return None if line is None else _SAID.get(line, line)


def preset_record(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a run's summary.json records of its preset: its name, the keys it sets with their values and the
    keys the config overrode (key -> [preset's value, value used]); None without a preset.

    Args:
        config: A resolved config as a nested dict.
    """
    preset = _preset_of(config)
    if preset is None:
        return None
    overridden = {key: list(pair) for key, pair in preset_overrides(config).items()}
    return {"name": preset[1], "sets": preset[2], "overridden": overridden}
