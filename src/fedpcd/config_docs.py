"""docs/configuration.md, generated from the config schema (``fedpcd.config.Config``): every key with its
section, type, default, valid values and meaning. tests/test_daily_loop.py regenerates it and compares it
byte for byte, so a key added to the schema without a description, or a page not regenerated, fails.

Regenerate: ``python -c "import fedpcd.config_docs as d; d.write_page('docs/configuration.md')"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from fedpcd.config import Config
from fedpcd.params import field_type
from fedpcd.utils import atomic_write_text, plain_text

HEADER = """# Configuration

Every key of a config file, with its type, default and meaning; every key is optional. `fedpcd init`
writes them all with their defaults, `fedpcd config show --config FILE KEY=VALUE ...` prints the resolved
config a run would write. The sections `partition`, `model` and `algorithm` also take the chosen scheme's,
model's and algorithm's own parameters: `fedpcd list NAME` shows them (type, default, meaning).

This page is generated from the schema (`fedpcd.config_docs`); tests/test_daily_loop.py checks that it is
current.
"""


def _section(info: FieldInfo) -> type[BaseModel] | None:
    """The section class of a field that holds one (``SecAggConfig | None`` too), else None."""
    for member in (info.annotation, *getattr(info.annotation, "__args__", ())):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return info.default


def _cell(text: str) -> str:
    """Text in a table cell: its bars escaped, and its angle brackets (hf:<owner>/<name>), never HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _tables(model: type[BaseModel], prefix: str, title: str, intro: str) -> list[str]:
    """The section ``model``'s table (a row per key, in declaration order), then its subsections' tables; a
    key without a description is a ValueError."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    sections = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        if not info.description:
            raise ValueError(f"config key {key} has no description (Field(description=...))")
        section, default = _section(info), _default(info)
        if section is not None:
            sections.append((key, section, info))
            if default is not None:  # a section always there: its keys' table only
                continue
        kind = "mapping, or null" if section is not None else field_type(info)
        meaning = plain_text(info.description)
        rows.append(f"| `{key}` | {_cell(kind)} | `{json.dumps(default)}` | {_cell(meaning)} |")
    out = ["", f"## {title}", "", intro, "", *rows] if intro else ["", f"## {title}", "", *rows]
    for key, section, info in sections:
        out += _tables(section, f"{key}.", key, plain_text(info.description))
    return out


def configuration_page() -> str:
    """The Markdown of docs/configuration.md: the top-level keys, then one table per section."""
    return HEADER + "\n".join(_tables(Config, "", "Top-level keys", "")) + "\n"


def write_page(path: str | Path) -> None:
    """Write :func:`configuration_page` to ``path`` (atomically)."""
    atomic_write_text(path, configuration_page())
