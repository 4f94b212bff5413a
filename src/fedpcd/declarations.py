"""What a registered algorithm or model declares, known without importing it: its typed parameters, presets
and flags (:class:`Declaration`).

The declarations live with the components, in modules that import torch (about 2 s): an algorithm's
dataclass fields and ``presets``, a model builder's keyword parameters (``fedpcd.params``). The shipped
components' declarations are also kept, as rendered from the imported registries by
:func:`shipped_declarations`, in the package's ``declarations.json``, so that loading a config (``fedpcd
config show``, a preset's values, a run's label in a report) needs no torch while only the shipped
components exist (``fedpcd.catalog.from_source``). ``benchmarks/render_docs.py`` writes the file with the
results pages, and the tests compare it with its rendering byte for byte, so it cannot go stale unnoticed.

Each rendered annotation is rebuilt into the same annotation (``int``, ``float``, ``bool``, ``str``, None,
``Literal``, unions, ``Annotated[T, Field(...)]``), so the rebuilt :class:`~fedpcd.params.ParamSpec`
checks, coerces and words its errors as the declared one; the rendering refuses anything it would not
rebuild exactly. A check relating two parameters (``check_combination``) is rendered where it is data
(``fedpcd.params.Needs``, FedGELA's); where it is code, the component is imported when its parameters are
checked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field
from pydantic.fields import FieldInfo
from pydantic.types import AllowInfNan

from fedpcd.params import Needs, ParamSpec, PathText, Preset, make_spec, param_spec

__all__ = ["Declaration", "declaration", "model_weights", "shipped_declarations"]

DECLARATIONS = Path(__file__).parent / "declarations.json"
KINDS = ("algorithm", "model")  # the kinds whose declarations are rendered (partition schemes need no torch)
# the input a model's size is checked for: the largest built-in one (3x32x32, 100 classes)
SIZE_INPUT = (3, 100, 32)


@dataclass(frozen=True)
class Declaration:
    """What one registered algorithm or model declares.

    Attributes:
        spec: Its parameters, their checks and defaults.
        presets: An algorithm's own presets (not a base class's), by name.
        heterogeneous: An algorithm that trains clients of different architectures.
        plain_mean: An algorithm whose server takes only the sample-weighted mean of the client models
            (FedAvg's ``aggregate``), which SecAgg+ needs.
        weights: A model's number of weights at its defaults for :data:`SIZE_INPUT`, why it cannot be built
            with them, or None where the check does not apply (:func:`model_weights`).
    """

    spec: ParamSpec
    presets: dict[str, Preset] = field(default_factory=dict)
    heterogeneous: bool = False
    plain_mean: bool = False
    weights: int | str | None = None


def declaration(kind: str, name: str) -> Declaration:
    """The declaration of the registered ``kind`` (``algorithm`` or ``model``) ``name``: as rendered while
    only the shipped components exist (no torch), else from the imported registry. ``name`` must be
    registered (``fedpcd.catalog.check_name``)."""
    from fedpcd.catalog import from_source, registry

    if from_source(kind) and name in _rendered().get(kind, {}):
        return _shipped(kind, name)
    return _declared(kind, name, registry(kind).get(name))


def _declared(kind: str, name: str, target: Any) -> Declaration:
    """The declaration read from the imported class (an algorithm) or builder (a model)."""
    spec = param_spec(kind, name, target)
    if kind == "model":
        return Declaration(spec, weights=_built_weights(target, name, spec.defaults))
    from fedpcd.algorithms import Algorithm

    return Declaration(
        spec,
        presets=dict(vars(target).get("presets", {})),
        heterogeneous=bool(target.heterogeneous),
        plain_mean=target.aggregate is Algorithm.aggregate,
    )


def model_weights(name: str, params: dict[str, Any]) -> int | str | None:
    """The number of weights of model ``name`` built with ``params`` for :data:`SIZE_INPUT` (on torch's meta
    device: no memory), or the message of why it cannot be built, or None where the check does not apply
    (input-specific, or the meta device unsupported). At the model's defaults: its declaration's."""
    found = declaration("model", name)
    if _key(params) == _key(found.spec.defaults):
        return found.weights
    from fedpcd.catalog import registry

    return _built_weights(registry("model").get(name), name, params)


def _key(params: Mapping[str, Any]) -> str:
    return repr(sorted(params.items()))  # repr keeps 1, 1.0, True and "1" apart


# (builder, name, parameters' repr) -> what _built_weights answers: each built once per process
_WEIGHTS: dict[tuple[Any, str, str], int | str | None] = {}


def _built_weights(builder: Any, name: str, params: Mapping[str, Any]) -> int | str | None:
    key = (builder, name, _key(params))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = _meta_weights(name, dict(params))
    return _WEIGHTS[key]


def _meta_weights(name: str, params: dict[str, Any]) -> int | str | None:
    import torch

    from fedpcd.errors import UserError, clip, short
    from fedpcd.models import build_validated

    try:
        with torch.device("meta"):
            model = build_validated(name, *SIZE_INPUT, params)
    except (UserError, NotImplementedError):  # input-specific or meta-unsupported: the real build decides
        return None
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        reason = clip(str(exc).strip().split("\n")[0])
        return f"model {name!r} cannot be built with {short(params)}: {reason}"
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------- the rendering


def shipped_declarations() -> str:
    """The text of ``declarations.json``: kind -> name -> declaration of each algorithm and model defined in
    fedpcd, from the imported registries (components that tests or plugins register are left out).

    Raises:
        ValueError: A declaration the rendering would not rebuild exactly (extend :func:`_encode`).
    """
    from fedpcd.catalog import registry

    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        reg = registry(kind)
        targets = {n: reg.get(n) for n in reg.names() if reg.get(n).__module__.startswith("fedpcd.")}
        out[kind] = {n: _render(kind, n, target) for n, target in sorted(targets.items())}
    return json.dumps(out, indent=1, ensure_ascii=False) + "\n"


def _render(kind: str, name: str, target: Any) -> dict[str, Any]:
    found = _declared(kind, name, target)
    spec = found.spec
    data: dict[str, Any] = {
        "params": {k: {"type": _encode(a), "default": spec.defaults[k]} for k, a in spec.annotations.items()},
        "combination": _encode_check(spec.combination),
    }
    if kind == "algorithm":
        data["presets"] = {
            p: {"summary": s.summary, "values": dict(s.values), "unset": dict(s.unset)}
            for p, s in found.presets.items()
        }
        data.update(heterogeneous=found.heterogeneous, plain_mean=found.plain_mean)
    else:
        data["weights"] = found.weights
    rebuilt = _rebuilt(kind, name, json.loads(json.dumps(data)))  # as read back from the file
    if _fingerprint(rebuilt) != _fingerprint(found):
        raise ValueError(f"{kind} {name!r}: its declaration is not rebuilt exactly from its rendering")
    return data


def _fingerprint(found: Declaration) -> str:
    """What must survive the rendering: every annotation, default, check and preset, as repr writes them."""
    spec = found.spec
    return repr(
        (
            spec.annotations,
            spec.defaults,
            _encode_check(spec.combination),
            found.presets,
            found.heterogeneous,
            found.plain_mean,
            found.weights,
        )
    )


@functools.cache
def _rendered() -> dict[str, Any]:
    """``declarations.json`` as shipped (empty where it is missing)."""
    return json.loads(DECLARATIONS.read_text(encoding="utf-8")) if DECLARATIONS.is_file() else {}


@functools.cache
def _shipped(kind: str, name: str) -> Declaration:
    """The declaration of a shipped component as rendered, rebuilt once per process."""
    return _rebuilt(kind, name, _rendered()[kind][name])


def _rebuilt(kind: str, name: str, data: dict[str, Any]) -> Declaration:
    """The :class:`Declaration` of a rendered entry ``data`` (its JSON, parsed)."""
    annotations = {k: _decode(p["type"]) for k, p in data["params"].items()}
    defaults = {k: p["default"] for k, p in data["params"].items()}
    check = _decode_check(kind, name, data["combination"])
    spec = make_spec(kind, name, annotations, defaults, check)
    presets = {p: Preset(**values) for p, values in data.get("presets", {}).items()}
    flags = {k: data[k] for k in ("heterogeneous", "plain_mean", "weights") if k in data}
    return Declaration(spec, presets=presets, **flags)


def _encode_check(check: Any) -> Any:
    """A ``check_combination`` as JSON: null (none), a :class:`~fedpcd.params.Needs`'s fields, or true (code:
    the component is imported to run it)."""
    if check is None:
        return None
    return dataclasses.asdict(check) if isinstance(check, Needs) else True


def _decode_check(kind: str, name: str, data: Any) -> Callable[[dict[str, Any]], str | None] | None:
    if data is None:
        return None
    if isinstance(data, dict):
        return Needs(data["key"], data["other"], tuple(data["allowed"]))

    def imported(values: dict[str, Any]) -> str | None:
        from fedpcd.catalog import registry

        return registry(kind).get(name).check_combination(values)

    return imported


_SCALARS: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "null": None, "any": Any}
_BOUNDS = ("gt", "ge", "lt", "le")  # the bounds a Field keeps as metadata, one per item


def _encode(annotation: Any) -> Any:
    """A parameter's annotation as JSON: a scalar type's name, ``{"literal": [...]}``, ``{"union": [...]}``,
    ``{"annotated": ..., "field": {Field's keywords}}`` or ``"path"`` (``fedpcd.params.PathText``)."""
    if annotation is PathText:
        return "path"
    for word, value in _SCALARS.items():
        if annotation is value or (value is None and annotation is type(None)):
            return word
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return {"literal": list(typing.get_args(annotation))}
    if origin in (Union, types.UnionType):  # written X | Y (rebuilt so)
        return {"union": [_encode(member) for member in typing.get_args(annotation)]}
    if origin is Annotated:
        inner, *meta = typing.get_args(annotation)
        if len(meta) == 1 and isinstance(meta[0], FieldInfo):
            return {"annotated": _encode(inner), "field": _field_keywords(meta[0])}
    raise ValueError(f"an annotation the rendering does not hold: {annotation!r}")


def _field_keywords(info: FieldInfo) -> dict[str, Any]:
    keywords: dict[str, Any] = {}
    for item in info.metadata:
        bounds = {b: getattr(item, b) for b in _BOUNDS if getattr(item, b, None) is not None}
        if isinstance(item, AllowInfNan):
            keywords["allow_inf_nan"] = item.allow_inf_nan
        elif len(bounds) == 1:
            keywords.update(bounds)
        else:
            raise ValueError(f"a Field constraint the rendering does not hold: {item!r}")
    if info.description:
        keywords["description"] = info.description
    return keywords


def _decode(data: Any) -> Any:
    """The annotation :func:`_encode` wrote as ``data``."""
    if data == "path":
        return PathText
    if isinstance(data, str):
        return _SCALARS[data]
    if "literal" in data:
        return Literal[tuple(data["literal"])]
    if "union" in data:
        return functools.reduce(operator.or_, [_decode(member) for member in data["union"]])
    return Annotated[_decode(data["annotated"]), Field(**data["field"])]
