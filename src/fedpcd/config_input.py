"""Reading what users write for a config: YAML files, ``KEY=VALUE`` overrides and how they apply to a file
(``apply_overrides``), and the bounds every value must meet before it is validated (``fedpcd.config``).

YAML is read with aliases refused (a few hundred bytes of them expand to gigabytes), nesting bounded, a
mapping's key given twice refused (YAML would keep the last silently), and its size bounded before it is
parsed: a config file of at most ``MAX_CONFIG_BYTES``, lists and mappings of at most ``MAX_ITEMS`` entries
(refused as the parser meets the entry past the bound, so a huge list costs milliseconds, not minutes). An
override's value is a YAML scalar or list; every value of the merged tree must be finite, fit 64-bit
integers or float32 (what tensors hold) and hold no NUL character. Problems are one-line UserErrors.

``--config`` also takes the name of a config the package ships (:func:`config_path`): ``example``,
``paper/fedgela-cifar10-full``, ``headline/fedsc-fmnist``; the repository's ``configs/`` links to that folder.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from fedpcd.errors import UserError, clip, did_you_mean, short
from fedpcd.utils import read_user_text, show_path

MAX_DEPTH = 32  # nesting levels of a config (YAML file, override value, or the merged tree)
MAX_CONFIG_BYTES = 256 * 1024  # a config or sweep file (the shipped ones are under 5 KB)
MAX_ITEMS = 10_000  # entries of one YAML list or mapping
_MERGE = "tag:yaml.org,2002:merge"  # the '<<' key
_INT64 = 2**63


class YamlRefused(Exception):
    """YAML that the config loader refuses (aliases, deep nesting, unreadable numbers)."""


# libyaml's parser where PyYAML has it (about ten times the pure-Python one); the same checks either way
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_events(text: str) -> None:
    """Refuse, from the parser's events (before any data is built), aliases (``*name``: a few hundred bytes of
    them expand to gigabytes), nesting deeper than ``MAX_DEPTH`` levels, and lists and mappings of more than
    ``MAX_ITEMS`` entries (at the entry past the bound: a huge list costs milliseconds)."""
    try:
        _check_parse(yaml.parse(text, Loader=_LOADER))
    except yaml.YAMLError:  # libyaml's own limits (a nesting of 1000) come first: the pure-Python parser
        if _LOADER is not yaml.SafeLoader:  # meets ours before, or the same YAML error
            _check_parse(yaml.parse(text, Loader=yaml.SafeLoader))
        raise


def _check_parse(events: Iterator[yaml.Event]) -> None:
    anchors: set[str] = set()
    open_: list[list[Any]] = []  # per open collection: [its start event, nodes met in it]
    for event in events:
        if isinstance(event, yaml.NodeEvent):
            if (
                isinstance(event, yaml.AliasEvent) and event.anchor in anchors
            ):  # an undefined one: YAML's error
                raise YamlRefused(
                    f"uses the YAML alias *{clip(event.anchor, 40)} "
                    f"(line {event.start_mark.line + 1}); aliases are not allowed in configs: write it out"
                )
            if event.anchor is not None:
                anchors.add(event.anchor)
            if open_:
                parent = open_[-1]
                pairs = 2 if isinstance(parent[0], yaml.MappingStartEvent) else 1
                if parent[1] // pairs >= MAX_ITEMS:
                    raise YamlRefused(
                        f"has a list or mapping of more than {MAX_ITEMS} entries (line "
                        f"{parent[0].start_mark.line + 1}); a config holds settings, not data: "
                        "put data in a file"
                    )
                parent[1] += 1
            if len(open_) + 1 > MAX_DEPTH:
                raise YamlRefused(f"is nested more than {MAX_DEPTH} levels deep")
            if isinstance(event, yaml.CollectionStartEvent):
                open_.append([event, 0])
        elif isinstance(event, yaml.CollectionEndEvent):
            open_.pop()


class _ConfigLoader(_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a key given twice in one mapping (YAML itself keeps the last silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the constructor's own error follows
                    break
                if first is not None:
                    where = f"line {line}" if first == line else f"lines {first} and {line}"
                    raise YamlRefused(f"gives the key {short(key)} twice ({where}); keep one of them")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """YAML text as plain data, without aliases, deep nesting or huge collections (those raise
    ``YamlRefused``): the parser's events are checked first (:func:`_check_events`), then the data built."""
    try:
        _check_events(text)
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more than 4300 digits
        raise YamlRefused(f"holds a value that cannot be read ({clip(str(exc), 60)})") from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; values are parsed as YAML scalars/lists."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UserError(
                f"bad override {short(item)}; expected KEY=VALUE with a dotted key, e.g. partition.beta=0.1"
            )
        try:
            value = load_yaml(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        except YamlRefused as exc:
            raise UserError(f"override '{clip(key)}' {exc}") from None
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"override {short(item)} conflicts with an earlier override of {short(part)}")
            node = child
        node[leaf] = value
    return tree


def merge_dicts(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


def shipped_configs() -> dict[str, Path]:
    """The configs the package ships, by name: the path below its ``configs`` folder without ``.yaml``
    (``example``, ``paper/fedgela-cifar10-full``), sorted."""
    from importlib import resources

    folder = Path(str(resources.files("fedpcd") / "configs"))  # installed as files (a wheel or a checkout)
    return dict(sorted((p.relative_to(folder).with_suffix("").as_posix(), p) for p in folder.rglob("*.yaml")))


def config_path(value: str) -> str:
    """The file that ``--config VALUE`` names: ``value`` itself where anything but a folder exists there, else
    the shipped config of that name (``.yaml`` optional); neither: a one-line UserError."""
    here = Path(value)
    if (here.exists() or here.is_symlink()) and not here.is_dir():
        return value
    shipped = shipped_configs()
    name = value.removesuffix(".yaml")
    if name in shipped:
        return str(shipped[name])
    tail = name.rsplit("configs/", 1)[-1]  # configs/example.yaml outside a clone: the shipped example
    if tail != name and tail in shipped:
        raise UserError(f"config file not found: {show_path(value)}; the package ships it as --config {tail}")
    if here.is_dir():
        problem = f"--config {show_path(value)} is a folder, not a config file"
    else:
        problem = f"config file not found: {show_path(value)}"
    near = did_you_mean(name, shipped)
    raise UserError(
        f"{problem}; no shipped config has that name either{near} (`fedpcd list configs` shows them)"
    )


def read_yaml(path: str | Path, links: bool = True) -> dict[str, Any]:
    """The mapping in a YAML config file (read by :func:`fedpcd.utils.read_user_text`: at most
    ``MAX_CONFIG_BYTES``, a regular file, with ``links=False`` never through a symbolic link: a run folder's
    config.yaml); a missing, unreadable, non-UTF-8 or non-mapping one: UserError."""
    p = Path(path)
    if not os.path.lexists(p):
        raise UserError(f"config file not found: {show_path(p)}")
    hint = "a config holds settings, not data: put data in a file"
    text = read_user_text(p, "config file", MAX_CONFIG_BYTES, links, hint)
    try:
        tree = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {p} is not valid YAML{where}") from None
    except YamlRefused as exc:
        raise UserError(f"config file {p} {exc}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise UserError(f"config file {p} must hold a mapping of keys, got {type(tree).__name__}")
    return tree


def check_values(tree: Any, key: str = "", depth: int = 0) -> None:
    """Every value of a config tree: at most ``MAX_DEPTH`` levels deep, no NUL in a string (not a path or a
    name), integers that fit in 64 bits, floats finite and representable as float32 (what tensors hold)."""
    name = clip(key or "config")
    if depth > MAX_DEPTH:
        raise UserError(f"config key '{name}' is nested more than {MAX_DEPTH} levels deep")
    if isinstance(tree, dict):
        for k, v in tree.items():
            check_values(v, f"{key}.{k}" if key else str(k), depth + 1)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            check_values(v, f"{key}[{i}]", depth + 1)
    elif isinstance(tree, str) and "\x00" in tree:
        raise UserError(f"bad value for '{name}' ({short(tree)}): contains a NUL character")
    elif isinstance(tree, int) and not isinstance(tree, bool) and not -_INT64 <= tree < _INT64:
        raise UserError(f"bad value for '{name}' ({short(tree)}): must fit in 64 bits (|x| < 2^63)")
    elif isinstance(tree, float):
        if not math.isfinite(tree):
            raise UserError(f"bad value for '{name}' ({tree!r}): must be a finite number")
        try:
            as_float32 = struct.unpack("f", struct.pack("f", tree))[0]
        except OverflowError:
            as_float32 = math.inf
        if math.isinf(as_float32) or (tree != 0.0 and as_float32 == 0.0):
            raise UserError(
                f"bad value for '{name}' ({tree!r}): must be representable as float32 (0, or 1.4e-45 <= |x| "
                "<= 3.4e+38)"
            )


# Overriding one of these drops the file's other keys of that section (they belong to the old choice).
SWITCHES = (("partition", "scheme"), ("model", "name"), ("algorithm", "name"))


def apply_overrides(raw: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``raw`` updated by the nested overrides ``extra``; an override that switches the scheme, model or
    algorithm (``SWITCHES``) drops that section's other keys of ``raw`` (they were for the old choice)."""
    for section, key in SWITCHES:
        given, new = raw.get(section), extra.get(section)
        if isinstance(given, dict) and isinstance(new, dict) and key in new and new[key] != given.get(key):
            raw = {**raw, section: {}}
    return merge_dicts(raw, extra)
