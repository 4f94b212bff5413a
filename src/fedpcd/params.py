"""One parameter mechanism for the registered components: algorithms, models and partition schemes.

A component's parameters are declared where it is defined, as typed Python parameters with defaults:

- an algorithm: the fields of its dataclass (``scale: Annotated[float, Field(gt=0.0)] = 2.0``);
- a model: the keyword parameters of its builder after ``(in_channels, num_classes, image_size)``
  (``hidden: Annotated[int, Field(ge=1, le=16384)] = 200``);
- a partition scheme: the keyword-only parameters of its function after ``(labels, num_clients,
  num_classes, rng)`` (``rule: Literal["distinct", "official"] = "distinct"``).

Every parameter with a default is a config key; its annotation (``int``, ``float``, ``bool``, ``str``,
``Literal[...]`` for choices, ``X | None``, pydantic ``Field`` bounds inside ``Annotated``) is its check.
:func:`validate_params` turns the declaration into one pydantic ``TypeAdapter`` per parameter, once per
component (:func:`param_spec`, cached), and checks a given mapping against it: unknown keys, wrong types,
values out of range are a :class:`~fedpcd.errors.UserError` of one line naming the parameter, the value
and the valid range or choices. Checks that relate two parameters are a ``check_combination(values) ->
str | None`` attribute of the component (None: fine; else the problem): a function, or a :class:`Needs`
(declared data, so that ``fedpcd.declarations`` can render it). Checks that need the data (e.g. at
most as many classes per client as there are classes) stay in the component. An algorithm's named settings
are :class:`Preset` values (applied by ``fedpcd.presets``).

Coercion is pydantic's lax mode (an integer for a float, ``"1e-3"`` for a float as YAML 1.1 reads it,
``2.0`` for an integer, numpy scalars), except that ``true``/``false`` are only booleans: a bool is never a
number, and a bool parameter takes nothing else.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from fedpcd.errors import UserError, clip, did_you_mean, short

# the config section of each kind: errors name parameters as config keys (partition.beta, model.hidden)
SECTIONS = {"algorithm": "algorithm", "model": "model", "partition scheme": "partition"}

_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


def _path_text(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


# a file path parameter: text, or a pathlib.Path (stored as text)
PathText = Annotated[str, BeforeValidator(_path_text)]


@dataclass(frozen=True)
class ParamSpec:
    """The declared parameters of one component and the adapter that checks them."""

    kind: str  # "algorithm", "model" or "partition scheme"
    name: str  # the registered name
    annotations: dict[str, Any]  # parameter -> annotation (Any where none is given)
    defaults: dict[str, Any]  # parameter -> default, in declaration order
    adapters: dict[str, TypeAdapter[Any]]  # parameter -> the pydantic adapter of its annotation
    combination: Callable[[dict[str, Any]], str | None] | None = None

    def validate(self, given: Mapping[str, Any], prefix: str | None = None) -> dict[str, Any]:
        """Every parameter: the defaults overlaid with ``given`` checked and coerced; else one UserError.

        ``prefix`` is the config key the parameters sit under in messages (default: the kind's section)."""
        where = prefix or SECTIONS.get(self.kind, self.kind)
        given = dict(given)
        unknown = sorted(set(given) - set(self.defaults), key=str)
        if unknown:
            valid = ", ".join(sorted(self.defaults)) or "(none)"
            raise UserError(
                f"unknown parameter {short(unknown[0])} for {self.kind} {self.name!r}"
                f"{did_you_mean(unknown[0], self.defaults)}; valid parameters: {valid}"
            )
        values = {**copy.deepcopy(self.defaults), **given}  # defaults are checked too (and e.g. resolved)
        for key, value in list(values.items()):
            value = self._check_bool(where, key, value)
            try:
                values[key] = self.adapters[key].validate_python(value)
            except ValidationError:
                raise self._bad(where, key, value) from None
        problem = self.combination(values) if self.combination else None
        if problem:
            raise UserError(f"bad parameters for {self.kind} {self.name!r}: {problem}")
        return values

    def expected(self, key: str) -> str:
        """The valid values of one parameter, as the error shows them."""
        return expected(self.annotations[key])

    def _check_bool(self, where: str, key: str, value: Any) -> Any:
        """numpy booleans as bools; a bool for a parameter that takes none, or a non-bool for a bool one:
        UserError (pydantic's lax mode would turn True into 1 and "yes" into True)."""
        if isinstance(value, np.bool_):
            value = bool(value)
        bases = _bases(self.annotations[key])
        if isinstance(value, bool) and not bases & {bool, object}:
            raise self._bad(where, key, value)
        if bases <= {bool, type(None)} and not isinstance(value, bool) and value is not None:
            raise self._bad(where, key, value)
        return value

    def _bad(self, where: str, key: str, value: Any) -> UserError:
        return UserError(
            f"bad value for '{clip(f'{where}.{key}')}' of {self.kind} {self.name!r} ({short(value)}): "
            f"{self.expected(key)}"
        )


def declared_params(target: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(annotations, defaults) of the parameters with a default: a dataclass's init fields, or a
    function's keyword parameters (a wrapped function is read through ``__wrapped__``)."""
    if dataclasses.is_dataclass(target) and isinstance(target, type):
        hints = typing.get_type_hints(target, include_extras=True)
        defaults: dict[str, Any] = {}
        for f in dataclasses.fields(target):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = f.default_factory()
    else:
        fn = inspect.unwrap(target)
        hints = typing.get_type_hints(fn, include_extras=True)
        defaults = {
            p.name: p.default
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty
        }
    return {key: hints.get(key, Any) for key in defaults}, defaults


@functools.cache
def param_spec(kind: str, name: str, target: Any) -> ParamSpec:
    """The :class:`ParamSpec` of a registered class or function (built once per component)."""
    annotations, defaults = declared_params(target)
    return make_spec(kind, name, annotations, defaults, getattr(target, "check_combination", None))


def make_spec(
    kind: str,
    name: str,
    annotations: dict[str, Any],
    defaults: dict[str, Any],
    combination: Callable[[dict[str, Any]], str | None] | None = None,
) -> ParamSpec:
    """The :class:`ParamSpec` of parameters given by their annotations and defaults (an adapter each)."""
    adapters = {key: TypeAdapter(a, config=_CONFIG) for key, a in annotations.items()}
    return ParamSpec(kind, name, annotations, defaults, adapters, combination)


def param_defaults(kind: str, name: str, target: Any) -> dict[str, Any]:
    """The declared parameters with their defaults (a fresh copy each time)."""
    return copy.deepcopy(param_spec(kind, name, target).defaults)


def validate_params(
    kind: str, name: str, target: Any, given: Mapping[str, Any] | None = None, prefix: str | None = None
) -> dict[str, Any]:
    """Check ``given`` against ``target``'s declared parameters; every parameter, defaults filled.

    The one entry point for algorithms (``target`` the dataclass), models (the builder) and partition
    schemes (the scheme function); a bad key or value is a one-line UserError naming the valid ones."""
    return param_spec(kind, name, target).validate(given or {}, prefix)


@dataclass(frozen=True)
class Needs:
    """A ``check_combination`` as data: a non-null ``key`` needs ``other`` to be one of ``allowed``."""

    key: str
    other: str
    allowed: tuple[str, ...]

    def __call__(self, values: Mapping[str, Any]) -> str | None:
        if values[self.key] is None or values[self.other] in self.allowed:
            return None
        wanted = " or ".join(self.allowed)
        return f"{self.key} ({values[self.key]}) needs {self.other} {wanted}, not {values[self.other]!r}"


@dataclass(frozen=True)
class Preset:
    """A named, documented set of config values (``values``: dotted key from the config root -> value), an
    algorithm's ``presets`` entry (``fedpcd.presets``)."""

    summary: str
    # values: dotted key -> value; unset: a PROTOCOL key it does not set -> why not
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    unset: Mapping[str, str] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------------- what the errors show


def _unpack(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[T, m1, m2]`` -> (T, [m1, m2]); anything else -> (annotation, [])."""
    if typing.get_origin(annotation) is Annotated:
        inner, *meta = typing.get_args(annotation)
        more_inner, more_meta = _unpack(inner)
        return more_inner, more_meta + meta
    return annotation, []


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a union (``X | None``), else the annotation itself."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _bases(annotation: Any) -> set[type]:
    """The Python types an annotation admits (``object`` for Any or a type not known here)."""
    inner, _ = _unpack(annotation)
    out: set[type] = set()
    for member in _members(inner):
        member, _ = _unpack(member)
        if member is Any:
            out.add(object)
        elif member is None or member is type(None):
            out.add(type(None))
        elif typing.get_origin(member) is Literal:
            out.update(type(v) for v in typing.get_args(member))
        elif isinstance(typing.get_origin(member) or member, type):
            out.add(typing.get_origin(member) or member)
        else:
            out.add(object)
    return out


def _bounds(meta: list[Any]) -> str:
    """' >= 1', ' in (0, 1]', or '' from Field / annotated_types constraints."""
    lower = upper = None
    for item in meta:
        for c in item.metadata if isinstance(item, FieldInfo) else [item]:  # annotated_types' Ge, Gt, ...
            if getattr(c, "ge", None) is not None:
                lower = ("[", ">=", c.ge)
            elif getattr(c, "gt", None) is not None:
                lower = ("(", ">", c.gt)
            elif getattr(c, "le", None) is not None:
                upper = ("]", "<=", c.le)
            elif getattr(c, "lt", None) is not None:
                upper = (")", "<", c.lt)

    def num(x: Any) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)

    if lower and upper:
        return f" in {lower[0]}{num(lower[2])}, {num(upper[2])}{upper[0]}"
    bound = lower or upper
    return f" {bound[1]} {num(bound[2])}" if bound else ""


_NOUNS = {
    bool: "true or false",
    int: "an integer",
    float: "a finite number",
    str: "a string",
    dict: "a mapping",
}


def _noun(annotation: Any, outer: list[Any]) -> str:
    inner, meta = _unpack(annotation)
    meta = outer + meta
    origin = typing.get_origin(inner) or inner
    if inner is Any:
        return "any value"
    if inner is None or inner is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(str(v) for v in typing.get_args(inner))
    if origin in (list, tuple):
        return "a list"
    text = _NOUNS.get(origin, getattr(origin, "__name__", str(origin)))
    return text + (_bounds(meta) if origin in (int, float) else "")


def expected(annotation: Any) -> str:
    """What a parameter takes, for an error: ``valid choices: a, b`` for a Literal (or a Literal or null),
    else ``expected an integer >= 1`` / ``expected a finite number in (0, 1], or null``."""
    inner, meta = _unpack(annotation)
    members = [_unpack(m)[0] for m in _members(inner)]
    choices = [m for m in members if typing.get_origin(m) is Literal]
    nullable = any(m is None or m is type(None) for m in members)
    if choices and len(choices) + nullable == len(members):
        values = [str(v) for m in choices for v in typing.get_args(m)]
        return "valid choices: " + ", ".join(values + ["null"] * nullable)
    parts = [_noun(m, meta) for m in _members(inner) if _unpack(m)[0] not in (None, type(None))]
    return "expected " + " or ".join(parts) + (", or null" if nullable else "")


_TYPE_WORDS = {dict: "mapping", list: "list", tuple: "list"}


def type_text(annotation: Any) -> str:
    """A parameter's annotation, readable: ``float > 0``, ``int >= 1, or null``, ``one of: a, b``."""
    inner, meta = _unpack(annotation)
    words: list[str] = []
    options: list[str] = []
    nullable = False
    for member in _members(inner):
        member, own = _unpack(member)
        origin = typing.get_origin(member) or member
        if member is None or member is type(None):
            nullable = True
        elif origin is Literal:
            options.extend(str(v) for v in typing.get_args(member))
        elif member is Any:
            words.append("any")
        elif origin in (int, float):
            words.append(origin.__name__ + _bounds(meta + own))
        else:
            words.append(_TYPE_WORDS.get(origin, getattr(origin, "__name__", str(origin))))
    if options:
        words.insert(0, "one of: " + ", ".join(options + ["null"] * nullable))
    elif nullable:
        words.append("null")
    return ", or ".join(words)


def param_description(annotation: Any) -> str:
    """The ``description`` of a ``Field`` inside ``Annotated``, around the annotation or one member of its
    union (``Annotated[int, Field(description=...)] | None``); ``""`` where none is declared."""
    inner, meta = _unpack(annotation)
    for member in _members(inner):
        meta = meta + _unpack(member)[1]
    return next((m.description for m in meta if isinstance(m, FieldInfo) and m.description), "")


def field_type(info: FieldInfo) -> str:
    """A config field's type as ``type_text`` writes it, bounds included (``int >= 1``)."""
    return type_text(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)


class Section(BaseModel):
    """A config section. Its docstring gets an ``Attributes:`` part listing each field with its type, default
    and ``Field(description=...)``, so ``help()`` on a section shows its keys."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        lines = []
        for name, info in cls.model_fields.items():
            default = "" if info.default_factory or info.is_required() else f" Default: {info.default!r}."
            lines.append(f"    {name} ({field_type(info)}): {info.description}{default}")
        if lines:
            cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n\nAttributes:\n" + "\n".join(lines)


class LocalTraining(Section):
    """Local optimisation settings shared by all algorithms: the config section ``local``, one schema for
    the config file and the algorithms (``Context.local``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    epochs: int = Field(1, ge=1, description="Passes over its training data each client makes per round.")
    batch_size: int = Field(
        64,
        ge=1,
        description="Mini-batch size of local SGD. A pass's last batch may be smaller; one of a single "
        "sample is left out where the model has BatchNorm layers, which cannot normalise one sample in "
        "training.",
    )
    lr: float = Field(0.01, gt=0.0, description="Learning rate of local SGD (in round 1; see lr_decay).")
    lr_decay: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Learning rate in round r: lr * lr_decay^(r-1) (FedNH: 0.99; 1: constant).",
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum, in [0, 1).")
    weight_decay: float = Field(1.0e-5, ge=0.0, description="SGD weight decay (L2 penalty).")
    grad_clip: float | None = Field(
        None, gt=0.0, description="Clip each step's gradient to this L2 norm; null: no clipping."
    )
