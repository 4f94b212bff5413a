"""What ``fedpcd list NAME`` (and ``fedpcd.describe``) says about a registered component or a config section:
its class, paper (the citation found in its docstrings), description, presets and typed parameters.

The shipped components' descriptions are also kept, as rendered from the imported registries by
:func:`shipped_descriptions`, in the package's ``descriptions.json``, so that ``fedpcd list NAME`` answers
without importing the component (and torch with it) while only the shipped components exist
(``catalog.rendered_description``). ``benchmarks/render_docs.py`` writes the file with the results pages,
and the tests compare it with its rendering byte for byte, so it cannot go stale unnoticed.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

import yaml
from pydantic import BaseModel

from fedpcd.config import Config, DatasetConfig
from fedpcd.config_identity import HF_COLUMNS
from fedpcd.config_input import shipped_configs
from fedpcd.errors import UserError
from fedpcd.params import SECTIONS, param_description, param_spec, type_text
from fedpcd.utils import plain_text, text_table

__all__ = ["default_text", "describe", "shipped_descriptions"]


_YEAR = re.compile(r"\b(?:19|20)\d\d\b")


def _paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring on one line, without reST markup (``plain_text``)."""
    return plain_text(" ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split()))


def _citation(text: str) -> str | None:
    """The first parenthesised part of ``text`` that names a year: ``Fan et al., NeurIPS 2023, "..."``."""
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "(":
            if depth == 0:
                start = i + 1
            depth += 1
        elif char == ")" and depth:
            depth -= 1
            if depth == 0 and _YEAR.search(text[start:i]):
                return text[start:i]
    return None


def _paper(obj: Any) -> str:
    """A declared ``paper`` attribute, else the citation in the description, else in the first paragraph of
    the module that defines the component (an algorithm's module opens with its paper)."""
    declared = getattr(obj, "paper", None)
    if isinstance(declared, str):
        return declared
    module = inspect.getmodule(obj)
    return (
        _citation(_paragraph(obj.__doc__)) or _citation(_paragraph(module.__doc__ if module else "")) or "-"
    )


def default_text(value: Any) -> str:
    """A default as a config file writes it (YAML flow style): ``null``, ``true``, ``''``, ``{beta: 0.2}``."""
    return (
        yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1000)
        .removesuffix("...\n")
        .strip()
    )


def _section(name: str) -> type[BaseModel] | None:
    """The class of the config section ``name`` (``privacy``, ``aggregation``, ``server``, ...), or None."""
    field_info = Config.model_fields.get(name)
    section = field_info.annotation if field_info is not None else None
    return section if isinstance(section, type) and issubclass(section, BaseModel) else None


def _section_block(name: str, section: type[BaseModel]) -> str:
    """What ``fedpcd list SECTION`` prints: the config section's keys, types, defaults and descriptions."""
    lines = [f"config section {name} ({section.__module__}.{section.__qualname__})"]
    lines.append(f"description: {_paragraph(section.__doc__)}")
    rows = [
        [
            f"{name}.{key}",
            type_text(info.annotation),
            default_text(info.get_default(call_default_factory=True)),
            info.description or "-",
        ]
        for key, info in section.model_fields.items()
    ]
    lines.extend(
        line.rstrip() for line in text_table(rows, ["key", "type", "default", "description"]).splitlines()
    )
    return "\n".join(lines)


def _block(kind: str, name: str, obj: Any) -> str:
    where = f"{obj.__module__}.{obj.__qualname__}"
    lines = [f"{kind} {name} ({where})", f"paper: {_paper(obj)}", f"description: {_paragraph(obj.__doc__)}"]
    if kind == "dataset":
        keys = ", ".join(f"dataset.{k}" for k in DatasetConfig.model_fields if k not in ("name", *HF_COLUMNS))
        lines.append(f"parameters: none of its own ({keys} apply to every dataset)")
        return "\n".join(lines)
    spec = param_spec(kind, name, obj)
    if kind == "algorithm":
        from fedpcd.presets import describe_presets

        presets = describe_presets(name)
        if presets:
            lines.append("presets (set as algorithm.preset=<name>; a key the config sets wins, warned):")
            lines.extend(presets)
    if not spec.defaults:
        lines.append("parameters: none")
        return "\n".join(lines)
    defaults = spec.validate({})  # as a config gets them (e.g. longtail's ``then`` with its scheme's)
    rows = [[key, type_text(spec.annotations[key]), default_text(value)] for key, value in defaults.items()]
    header = ["parameter", "type", "default"]
    descriptions = [plain_text(param_description(spec.annotations[key])) for key in defaults]
    if any(descriptions):  # declared as Field(description=...) in the parameter's annotation
        header.append("description")
        rows = [[*row, text or "-"] for row, text in zip(rows, descriptions, strict=True)]
    lines.append(f"parameters (set as {SECTIONS[kind]}.<parameter>=<value>):")
    lines.extend(line.rstrip() for line in text_table(rows, header).splitlines())
    return "\n".join(lines)


def describe(name: str) -> str:
    """What ``fedpcd list NAME`` prints about a registered component.

    Args:
        name: An algorithm, model, dataset or partition scheme (a name may be several of them).

    Returns:
        For each component of that name: its class or function, paper, one-line description, presets and
            parameters (type, default, and description where the parameter declares one with
            ``Field(description=...)``), as text.

    Raises:
        UserError: An unknown name (the line names the near ones, grouped by kind: algorithms, models,
            datasets, partition schemes, shipped configs).
    """
    from fedpcd.catalog import HOMES, holds, registry, rendered_description, unknown_name

    kinds = [kind for kind in HOMES if holds(kind, name)]
    if not kinds and _section(name) is not None:
        return _section_block(name, _section(name))
    if not kinds:  # answered without importing the components (no torch)
        raise UserError(unknown_name(name, shipped_configs()))
    rendered = rendered_description(name)
    if rendered is not None:
        return rendered
    # only the registries that hold the name are imported
    return "\n\n".join(_block(kind, name, registry(kind).get(name)) for kind in kinds)


def shipped_descriptions() -> str:
    """The text of ``descriptions.json``: each name of a component defined in fedpcd, and of a config
    section, -> what ``describe`` says of it, from the imported registries (components that tests or plugins
    register are left out)."""
    from fedpcd.catalog import HOMES, registry

    components = {
        name
        for kind in HOMES
        for name in registry(kind).names()
        if registry(kind).get(name).__module__.startswith("fedpcd.")
    }
    names = sorted(components | {name for name in Config.model_fields if _section(name) is not None})
    return json.dumps({name: describe(name) for name in names}, indent=1, ensure_ascii=False) + "\n"
