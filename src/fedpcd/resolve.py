"""A config from what a user wrote to its resolved form: read, overridden, validated and resolved against the
registries and presets.

``load_config`` merges a YAML file with dotted ``KEY=VALUE`` overrides (``fedpcd.config_input``), applies
the algorithm's preset, validates the result against the schema (``fedpcd.config``) and resolves the
open-ended sections (the partition scheme's, model's and algorithm's own parameters) against their
registries, so the written ``config.yaml`` shows every value that was used. Those parameters are checked
here, once per load, by ``fedpcd.params.validate_params`` (their declared types and ranges); the values
written are the checked ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from fedpcd.config import Config
from fedpcd.config_identity import LEGACY_DEFAULTS
from fedpcd.config_input import apply_overrides, check_values, config_path, parse_overrides, read_yaml
from fedpcd.errors import UserError, clip, did_you_mean, short
from fedpcd.labels import warn_overrides
from fedpcd.params import validate_params

MAX_MODEL_PARAMS = 10**8  # weights of one model, for the largest built-in input (3x32x32, 100 classes)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults), apply dotted overrides, validate and resolve it.

    Resolving fills in the chosen partition scheme's, model's and algorithm's own parameters (checked
    against their declarations) and the preset's keys; an override that switches the scheme, model or
    algorithm drops the file's other keys of that section. Precedence, lowest first: defaults < the preset <
    the file < the overrides; a preset key the file or an override gives another value is one warning line.

    Args:
        path: A YAML config file, or the name of a config the package ships (``example``,
            ``headline/fednh-fmnist``: ``fedpcd list configs``); None: every default.
        overrides: ``KEY=VALUE`` items with dotted keys, values read as YAML (``["partition.beta=0.1",
            "rounds=5"]``), as on the command line.

    Returns:
        The resolved config, every key filled.

    Raises:
        UserError: A missing or invalid file, an unknown key or name, a bad value: one line naming it and
            the valid choices.
    """
    raw = read_yaml(config_path(os.fspath(path))) if path is not None else {}
    extra = parse_overrides(overrides or [])
    config = config_from_dict(apply_overrides(raw, extra))
    warn_overrides(config.to_dict(), {"config file": raw, "command line": extra})
    return config


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """A run directory's config.yaml as :func:`load_config` reads it, with the :data:`LEGACY_DEFAULTS` of the
    keys it lacks (it was written before they existed): the config the run was made with."""
    raw = read_yaml(path, links=False)
    raw = {**LEGACY_DEFAULTS, **raw} if isinstance(raw, dict) else raw
    return config_from_dict(apply_overrides(raw, parse_overrides(overrides or [])))


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate and resolve a config given as a (nested) dict.

    Without a preset the schema's checks and the components' names come before any component's module is
    imported, so a mistyped key, value or name is told without importing torch; the presets are declared by
    the algorithms' classes (:func:`fedpcd.algorithms.presets.apply_preset`)."""
    check_values(raw)
    section = raw.get("algorithm")
    if isinstance(section, dict) and section.get("preset") is not None:
        from fedpcd.algorithms.presets import apply_preset

        raw = apply_preset(raw)
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_one_line(exc, Config)) from None
    return resolve(config)


def resolve_model_params(config: Config) -> dict[str, Any]:
    """The model parameters, checked against every architecture of the federation; defaults filled for the
    parameters all of them take (values from the first architecture)."""
    from fedpcd.models import MODELS

    m = config.model
    archs = m.architectures(config.clients)
    checked = [validate_params("model", arch, MODELS.get(arch), m.params()) for arch in archs]
    common = set.intersection(*(set(own) for own in checked))
    params = {k: v for k, v in checked[0].items() if k in common}
    _check_model_size(archs, params)
    return params


def _check_model_size(archs: list[str], params: dict[str, Any]) -> None:
    """Build each architecture on torch's meta device (no memory) for the largest built-in input, 3x32x32
    with 100 classes: parameters of the wrong type or sign, or more than ``MAX_MODEL_PARAMS`` weights, are a
    UserError now, never an allocation failure later. Each builder is built once per process for given
    parameters (a sweep's or a report's many configs share them)."""
    from fedpcd.models import MODELS

    given = repr(sorted(params.items()))  # repr keeps 1, 1.0, True and "1" apart
    for arch in archs:
        key = (MODELS.get(arch), arch, given)
        if key not in _MODEL_WEIGHTS:
            _MODEL_WEIGHTS[key] = _meta_weights(arch, params)
        weights = _MODEL_WEIGHTS[key]
        if isinstance(weights, str):
            raise UserError(weights)
        if weights is not None and weights > MAX_MODEL_PARAMS:
            raise UserError(
                f"model {arch!r} with {short(params)} has {weights:.3g} weights (for 3x32x32 inputs, 100 "
                f"classes), more than the limit of {MAX_MODEL_PARAMS:.0e}; choose a smaller width"
            )


# (builder, architecture, parameters' repr) -> its number of weights, why it cannot be built, or None
_MODEL_WEIGHTS: dict[tuple[Any, str, str], int | str | None] = {}


def _meta_weights(arch: str, params: dict[str, Any]) -> int | str | None:
    """The number of weights of ``arch`` built on the meta device, else why it cannot be built (the message),
    or None where the check does not apply (input-specific, or the meta device unsupported)."""
    import torch

    from fedpcd.models import build_validated

    try:
        with torch.device("meta"):
            model = build_validated(arch, 3, 100, 32, params)
    except (UserError, NotImplementedError):  # input-specific or meta-unsupported: the real build decides
        return None
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        reason = clip(str(exc).strip().split("\n")[0])
        return f"model {arch!r} cannot be built with {short(params)}: {reason}"
    return sum(p.numel() for p in model.parameters())


def _check_min_clients(config: Config) -> None:
    per_round = config.clients_per_round
    if config.engine.min_clients > per_round:
        raise UserError(
            f"engine.min_clients={config.engine.min_clients} is more than the {per_round} client(s) sampled "
            f"per round (clients={config.clients}, participation={config.participation}); "
            "lower engine.min_clients"
        )


def _check_secagg(config: Config, algo_cls: type) -> None:
    """SecAgg+ hides each update: it needs Flower's separate parties and a server that takes only the
    sample-weighted mean of the client models (FedAvg's ``aggregate``)."""
    if config.privacy.secagg is None:
        return
    if config.backend != "flower":
        raise UserError(
            "privacy.secagg runs on the Flower backend (set backend=flower): in the local backend the server "
            "holds every client's update anyway"
        )
    from fedpcd.algorithms import Algorithm, fedavg_aggregating

    if algo_cls.aggregate is not Algorithm.aggregate:
        raise UserError(
            "privacy.secagg needs an algorithm whose server takes only the sample-weighted mean of the "
            f"client models; {config.algorithm.name!r} aggregates with its own rule. Choose one of: "
            f"{', '.join(fedavg_aggregating())}"
        )
    per_round = config.clients_per_round
    if per_round < 2:
        raise UserError(
            f"privacy.secagg needs at least 2 clients per round, {per_round} sampled (clients="
            f"{config.clients}, participation={config.participation:g}); raise participation or clients"
        )


def _check_names(config: Config) -> None:
    """The dataset, partition scheme, architectures (for clients that exist) and algorithm are components
    (``fedpcd.catalog``, which knows the shipped ones without importing them)."""
    from fedpcd.catalog import catalog, check_name

    check_name("dataset", config.dataset.name)
    check_name("partition scheme", config.partition.scheme)
    m = config.model
    if isinstance(m.name, list) and not m.name:
        raise UserError(f"model.name is an empty list; give one or more of: {', '.join(catalog('model'))}")
    bad = sorted(k for k in m.clients if not 0 <= k < config.clients)
    if bad:
        raise UserError(f"model.clients names client {bad[0]}, but clients are 0..{config.clients - 1}")
    for arch in m.architectures(config.clients):
        check_name("model", arch)
    check_name("algorithm", config.algorithm.name)


def resolve(config: Config) -> Config:
    """Check names and fill the scheme's, model's and algorithm's parameter defaults."""
    from fedpcd.data.partition import resolve_params

    # what needs no torch first: a mistake there is told without importing the models and algorithms
    _check_names(config)
    partition = resolve_params(config.partition.scheme, config.partition.params())
    _check_min_clients(config)
    _check_geometry(config)
    from fedpcd.algorithms import ALGORITHMS, algorithm_params
    from fedpcd.data.datasets import DATASETS

    DATASETS.get(config.dataset.name)
    model = resolve_model_params(config)
    algo_cls = ALGORITHMS.get(config.algorithm.name)
    if len(config.model.architectures(config.clients)) > 1 and not algo_cls.heterogeneous:
        able = ", ".join(n for n in ALGORITHMS.names() if ALGORITHMS.get(n).heterogeneous)
        raise UserError(
            f"algorithm {config.algorithm.name!r} needs one architecture for all clients, but model.name/"
            f"model.clients give several; model-heterogeneous algorithms: {able or '(none)'}"
        )
    algorithm = algorithm_params(config.algorithm.name, config.algorithm.params())
    _check_secagg(config, algo_cls)
    data = config.to_dict()
    data["partition"] = {"scheme": config.partition.scheme, **partition}
    data["model"] = {"name": config.model.name, "clients": config.model.clients, **model}
    preset = {"preset": config.algorithm.preset} if config.algorithm.preset is not None else {}
    data["algorithm"] = {"name": config.algorithm.name, **preset, **algorithm}
    check_values(data)  # again after validation: e.g. local.lr or algorithm.mu given as the text "1e39"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:  # pragma: no cover - defaults always validate
        raise UserError(_one_line(exc, Config)) from None


def _check_geometry(config: Config) -> None:
    """``geometry: true`` compares the class means of one feature space, from models trained one at a time."""
    if not config.geometry:
        return
    if len(config.model.architectures(config.clients)) > 1:
        raise UserError("geometry: true compares one feature space; model.name/model.clients give several")
    if config.engine.executor == "vectorized":
        raise UserError(
            "geometry: true reads each personal model's features, which engine.executor=vectorized does "
            "not keep; use engine.executor=sequential (or auto)"
        )


def _one_line(exc: ValidationError, model: type[BaseModel]) -> str:
    err = exc.errors()[0]
    loc = [str(part) for part in err["loc"]]
    key = clip(".".join(loc) or "config")
    if err["type"] == "extra_forbidden":
        section: Any = model
        try:
            for part in loc[:-1]:
                section = section.model_fields[part].annotation
            fields = list(section.model_fields)
        except (AttributeError, KeyError):
            return f"unknown config key {key!r}"
        hint = did_you_mean(loc[-1], fields)
        return f"unknown config key {key!r}{hint}; valid keys here: {', '.join(fields)}"
    if err["type"] == "literal_error":
        return f"bad value for {key!r}: {err['msg'].lower()}"
    if err["type"] == "invalid_key":
        return f"bad config key {key!r}: keys must be names (text), e.g. 'seed' or 'local'"
    if err["type"] == "finite_number":
        return f"bad value for {key!r} ({short(err.get('input'))}): must be a finite number"
    return f"bad value for {key!r} ({short(err.get('input'))}): {err['msg']}"
