"""What identifies a run's config: its config.yaml text, its canonical form and hash, and the differences
between two configs.

A run's identity is its :func:`run_setting`: the resolved config without what does not change its numbers
(where it lives, who watches it, how many processes). The keys added after runs were archived count as
absent at their defaults (:data:`LEGACY_DEFAULTS`, :data:`HF_COLUMNS`, the ``privacy``, ``aggregation`` and
``server`` sections while off), so an archived run and a new one of the same setting compare equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from fedpcd.config import AggregationConfig, Config, PrivacyConfig, ServerConfig
from fedpcd.errors import UserError, clip, short
from fedpcd.utils import atomic_write_text


def config_yaml(config: Config) -> str:
    """The resolved config as the YAML text of a run's config.yaml."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def dump_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    atomic_write_text(path, config_yaml(config))


# key -> the value a config.yaml that lacks the key was made with (its default is another now)
LEGACY_DEFAULTS: dict[str, Any] = {"personal_full_every": 1, "geometry": False}
HF_COLUMNS = ("image_column", "label_column")  # dataset keys that count as absent at null


def run_setting(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict (config.yaml's) without what does not change a run's numbers (``output_dir``,
    ``tracking``, ``flower``, ``engine.workers``) and without the keys that count as absent: the ``privacy``,
    ``aggregation`` and ``server`` sections at their defaults, the :data:`LEGACY_DEFAULTS` keys at their
    values, the dataset's :data:`HF_COLUMNS` at null."""
    data = {k: v for k, v in data.items() if k not in ("output_dir", "tracking", "flower")}
    if isinstance(data.get("engine"), dict):
        data["engine"] = {k: v for k, v in data["engine"].items() if k != "workers"}
    for key, value in LEGACY_DEFAULTS.items():
        if data.get(key) == value:
            del data[key]
    dataset = data.get("dataset")
    if isinstance(dataset, dict):
        data["dataset"] = {k: v for k, v in dataset.items() if not (k in HF_COLUMNS and v is None)}
    sections = (("aggregation", AggregationConfig), ("privacy", PrivacyConfig), ("server", ServerConfig))
    for key, section in sections:
        if _all_default(data.get(key), section):
            del data[key]
    return data


def _all_default(given: Any, section: type[BaseModel]) -> bool:
    """Whether a config section's dict gives every key it has at the section's default (keys it lacks do
    not count)."""
    defaults = section().model_dump(mode="json")
    return isinstance(given, dict) and all(k in defaults and defaults[k] == v for k, v in given.items())


def canonical_config(config: Config) -> str:
    """The resolved config as canonical JSON (sorted keys) of its :func:`run_setting`: what a run computes,
    not where it lives or who watches it. Its SHA-256 (:func:`config_hash`) identifies a run's config in
    its checkpoints."""
    return json.dumps(run_setting(config.to_dict()), sort_keys=True, separators=(",", ":"))


def config_hash(text: str) -> str:
    """SHA-256 (hex) of a :func:`canonical_config` text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> leaf of a nested dict (an empty dict below the top is a leaf)."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old value, new value) for every leaf that differs (``ABSENT`` where a side lacks it)."""
    a, b = flatten(old), flatten(new)
    return {
        k: (a.get(k, ABSENT), b.get(k, ABSENT))
        for k in sorted(set(a) | set(b))
        if a.get(k, ABSENT) != b.get(k, ABSENT)
    }


def describe_changes(changes: dict[str, tuple[Any, Any]], limit: int = 6) -> str:
    """``key: old -> new; ...`` on one line (values shortened, at most ``limit`` keys)."""
    parts = [f"{clip(k)}: {short(a, 40)} -> {short(b, 40)}" for k, (a, b) in changes.items()]
    more = f"; and {len(parts) - limit} more" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more


# config keys a resume may change (with --allow-config-change): none changes what the rounds compute
RESUME_CHANGES = ("rounds", "engine.checkpoint_every", "engine.threads", "dataset.download")


def check_allowed_changes(allow: Sequence[str], changes: Sequence[str] = ()) -> list[str]:
    """The keys a resume may change: ``allow`` and the keys of the ``KEY=VALUE`` items ``changes`` (each one
    allowed by being given); any key outside ``RESUME_CHANGES`` is a UserError."""
    keys = [*allow, *(item.partition("=")[0] for item in changes)]
    bad = [k for k in keys if k not in RESUME_CHANGES]
    if bad:
        raise UserError(
            f"--allow-config-change {clip(bad[0])}: a resumed run may change only "
            f"{', '.join(RESUME_CHANGES)} (rounds never below the checkpoint's round)"
        )
    return keys
