"""The registered components' names and descriptions without importing them (``fedpcd list`` answers fast).

The built-in algorithms, models and datasets live in modules that import torch (about 2 s). Their
registrations are decorators in fedpcd's own source: ``@ALGORITHMS.register("fedavg")``,
``@register_model("mlp")``, ``@DATASETS.register("fmnist")``, ``@PARTITIONERS.register("iid")``. The catalog
reads those decorators and the decorated definitions' docstrings with :mod:`ast`, so the decorators stay the
one source of truth (tests check the catalog against the imported registries). It reads the registries
themselves instead where that costs nothing or is needed: their module is imported already (in-process
registrations included), or an installed plugin registers into them (plugins register on import).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from fedpcd.errors import UserError, choices, clip, close_matches, short
from fedpcd.registry import PLUGIN_GROUPS, Registry

# kind -> (the module holding its registry, the registry's name, the decorator calls that register into it)
HOMES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "algorithm": ("fedpcd.algorithms", "ALGORITHMS", ("ALGORITHMS.register",)),
    "model": ("fedpcd.models", "MODELS", ("register_model",)),
    "dataset": ("fedpcd.data.datasets", "DATASETS", ("DATASETS.register",)),
    "partition scheme": ("fedpcd.data.partition", "PARTITIONERS", ("PARTITIONERS.register",)),
}
_PACKAGE = Path(__file__).parent
HF_PREFIX = "hf:"  # dataset names hf:<hub name>: any Hugging Face dataset, known without registering
HF_CHOICE = f"{HF_PREFIX}<owner>/<name> (a Hugging Face dataset)"  # the last valid choice of a dataset name
HF_INSTALL = 'pip install "fedpcd[hf]"'  # what an hf: dataset needs
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# what `fedpcd list NAME` says of each shipped component, rendered by fedpcd.components.shipped_descriptions
DESCRIPTIONS = _PACKAGE / "descriptions.json"


def registry(kind: str) -> Registry[Any]:
    """The registry of ``kind`` (one of :data:`HOMES`), its modules imported."""
    module, attribute, _ = HOMES[kind]
    return getattr(importlib.import_module(module), attribute)


def catalog(kind: str) -> dict[str, str]:
    """Every registered name of ``kind`` -> its docstring ('' where it has none), sorted by name.

    From the source where neither the registry's module nor a plugin of its group is imported yet (no torch),
    else from the registry itself.
    """
    if not from_source(kind):
        reg = registry(kind)
        return {name: reg.get(name).__doc__ or "" for name in reg.names()}
    return dict(sorted(_source_registrations()[kind].items()))


def from_source(kind: str) -> bool:
    """Whether the components of ``kind`` are the shipped ones, known without importing them: neither the
    registry's module nor a plugin of its group is imported or installed (which could register more)."""
    module, _, _ = HOMES[kind]
    return module not in sys.modules and PLUGIN_GROUPS[kind][0] not in _plugin_groups()


@functools.cache
def _plugin_groups() -> frozenset[str]:
    """The entry-point groups that installed distributions declare: one scan of them per process (a plugin
    installed while fedpcd runs is seen by the next process, as its registries load plugins once too)."""
    return frozenset(entry_points().groups)


def rendered_description(name: str) -> str | None:
    """What ``fedpcd list NAME`` says of the shipped component(s) or config section ``name``, as rendered
    into ``descriptions.json`` (no import of the component or of the config schema), while only the shipped
    components exist (:func:`from_source` of every kind); else None (``fedpcd.components.describe`` imports
    and says it)."""
    return _rendered().get(name) if _rendering_applies() else None


def rendered_unknown(name: str) -> bool:
    """Whether the rendering tells that ``name`` is no component and no config section (it applies and lacks
    the name), so that its line (``unknown_name``) needs neither the components nor the config schema."""
    return _rendering_applies() and name not in _rendered() and not name.startswith(HF_PREFIX)


def _rendering_applies() -> bool:
    return bool(_rendered()) and all(from_source(kind) for kind in HOMES)


def unknown_name(name: str, configs: Iterable[str]) -> str:
    """The line for a name ``fedpcd list NAME`` does not know: its near names (``close_matches``) grouped by
    kind (the components' and the shipped ``configs``'), or that none is near."""
    named = [(f"{kind}s", list(catalog(kind))) for kind in HOMES]
    near = [(kind, close_matches(name, names)) for kind, names in [*named, ("configs", configs)]]
    groups = "; ".join(f"{kind}: {', '.join(found)}" for kind, found in near if found)
    where = "`fedpcd list` names every component, `fedpcd list configs` every shipped config"
    if not groups:
        return f"unknown name {short(name)}: no component or shipped config has it or a name near it; {where}"
    return f"unknown name {short(name)}; did you mean {groups}? ({where})"


@functools.cache
def _rendered() -> dict[str, str]:
    """``descriptions.json`` as shipped (empty where it is missing)."""
    return json.loads(DESCRIPTIONS.read_text(encoding="utf-8")) if DESCRIPTIONS.is_file() else {}


def holds(kind: str, name: str) -> bool:
    """Whether ``name`` is a component of ``kind``: registered, or (a dataset) any ``hf:<hub name>``."""
    return name in catalog(kind) or (kind == "dataset" and name.startswith(HF_PREFIX))


def check_name(kind: str, name: str) -> None:
    """A UserError naming the near and the valid names unless ``name`` is a component of ``kind``
    (:func:`holds`): the registry's own message, told from the source while only the shipped components
    exist (no torch). A dataset ``hf:<hub name>`` is checked by :func:`check_hf_name`."""
    if kind == "dataset" and name.startswith(HF_PREFIX):
        check_hf_name(name)
    elif not holds(kind, name):
        error = choices(kind, name, list(catalog(kind)))
        raise UserError(f"{error}, or {HF_CHOICE}") if kind == "dataset" else error


def check_hf_name(name: str) -> str:
    """The hub name of dataset ``hf:<owner>/<name>`` (or ``hf:<name>``); a UserError for a malformed name, or
    where the ``datasets`` package is not installed."""
    hub = name.removeprefix(HF_PREFIX)
    if not _HUB_NAME.fullmatch(hub):
        raise UserError(
            f"bad Hugging Face dataset name {clip(name)!r}: expected hf:<owner>/<name>, "
            "e.g. hf:uoft-cs/cifar10"
        )
    if importlib.util.find_spec("datasets") is None:
        raise UserError(f"dataset {name!r} needs the datasets package: {HF_INSTALL}")
    return hub


@functools.cache
def _source_registrations() -> dict[str, dict[str, str]]:
    """kind -> {name: docstring} of the registering decorators in fedpcd's source files."""
    kinds = {call: kind for kind, (_, _, calls) in HOMES.items() for call in calls}
    found: dict[str, dict[str, str]] = {kind: {} for kind in HOMES}
    for path in sorted(_PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if not any(f"{call}(" in text for call in kinds):  # parse only the files that register
            continue
        tree = ast.parse(text, str(path))
        constants = _string_constants(tree)
        for node in tree.body:  # registering decorators sit on module-level definitions
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            for call in node.decorator_list:
                kind = kinds.get(ast.unparse(call.func)) if isinstance(call, ast.Call) and call.args else None
                if kind is not None:
                    doc = ast.get_docstring(node, clean=False) or ""  # as __doc__ holds it
                    found[kind][_string_value(call.args[0], constants)] = doc
    return found


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """The module's top-level ``NAME = "text"`` assignments."""
    return {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _string_value(node: ast.expr, constants: dict[str, str]) -> str:
    """A registered name as written: a string, a module constant, or their sum (``FLWR_PREFIX + "shard"``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _string_value(node.left, constants) + _string_value(node.right, constants)
    raise ValueError(f"a registration whose name is not a string literal: {ast.unparse(node)}")
