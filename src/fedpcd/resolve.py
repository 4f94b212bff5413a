"""A config from what a user wrote to its resolved form: read, overridden, validated and resolved against the
registries and presets.

``load_config`` merges a YAML file with dotted ``KEY=VALUE`` overrides (``fedpcd.config_input``), applies
the algorithm's preset, validates the result against the schema (``fedpcd.config``) and resolves the
open-ended sections (the partition scheme's, model's and algorithm's own parameters) against their
registries, so the written ``config.yaml`` shows every value that was used. Those parameters are checked
here, once per load, against their declarations (``fedpcd.declarations``: types and ranges); the values
written are the checked ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from fedpcd.catalog import catalog, check_name
from fedpcd.config import Config
from fedpcd.config_identity import LEGACY_DEFAULTS
from fedpcd.config_input import apply_overrides, check_values, config_path, parse_overrides, read_yaml
from fedpcd.declarations import declaration, model_weights
from fedpcd.errors import UserError, clip, did_you_mean, short
from fedpcd.labels import warn_overrides
from fedpcd.presets import apply_preset

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

    The presets, the components' names and their parameters are known without importing the components
    (``fedpcd.declarations``): while only the shipped ones exist, a config is loaded without torch, except
    where a model is given other parameters than its defaults (its size is checked on torch's meta device)."""
    check_values(raw)
    raw = apply_preset(raw)
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_one_line(exc, Config)) from None
    return resolve(config)


def resolve_model_params(config: Config) -> dict[str, Any]:
    """The model parameters, checked against every architecture of the federation; defaults filled for the
    parameters all of them take (values from the first architecture)."""
    m = config.model
    archs = m.architectures(config.clients)
    checked = [declaration("model", arch).spec.validate(m.params()) for arch in archs]
    common = set.intersection(*(set(own) for own in checked))
    params = {k: v for k, v in checked[0].items() if k in common}
    _check_model_size(archs, params)
    return params


def _check_model_size(archs: list[str], params: dict[str, Any]) -> None:
    """Each architecture built for the largest built-in input, 3x32x32 with 100 classes
    (:func:`fedpcd.declarations.model_weights`): parameters of the wrong type or sign, or more than
    ``MAX_MODEL_PARAMS`` weights, are a UserError now, never an allocation failure later."""
    for arch in archs:
        weights = model_weights(arch, params)
        if isinstance(weights, str):
            raise UserError(weights)
        if weights is not None and weights > MAX_MODEL_PARAMS:
            raise UserError(
                f"model {arch!r} with {short(params)} has {weights:.3g} weights (for 3x32x32 inputs, 100 "
                f"classes), more than the limit of {MAX_MODEL_PARAMS:.0e}; choose a smaller width"
            )


def _check_min_clients(config: Config) -> None:
    per_round = config.clients_per_round
    if config.engine.min_clients > per_round:
        raise UserError(
            f"engine.min_clients={config.engine.min_clients} is more than the {per_round} client(s) sampled "
            f"per round (clients={config.clients}, participation={config.participation}); "
            "lower engine.min_clients"
        )


def _check_secagg(config: Config) -> None:
    """SecAgg+ hides each update: it needs Flower's separate parties and a server that takes only the
    sample-weighted mean of the client models (FedAvg's ``aggregate``)."""
    if config.privacy.secagg is None:
        return
    if config.backend != "flower":
        raise UserError(
            "privacy.secagg runs on the Flower backend (set backend=flower): in the local backend the server "
            "holds every client's update anyway"
        )
    if not declaration("algorithm", config.algorithm.name).plain_mean:
        able = [n for n in catalog("algorithm") if not n.startswith("_") and _declares(n, "plain_mean")]
        raise UserError(
            "privacy.secagg needs an algorithm whose server takes only the sample-weighted mean of the "
            f"client models; {config.algorithm.name!r} aggregates with its own rule. Choose one of: "
            f"{', '.join(able)}"
        )
    per_round = config.clients_per_round
    if per_round < 2:
        raise UserError(
            f"privacy.secagg needs at least 2 clients per round, {per_round} sampled (clients="
            f"{config.clients}, participation={config.participation:g}); raise participation or clients"
        )


def _declares(algorithm: str, flag: str) -> bool:
    return bool(getattr(declaration("algorithm", algorithm), flag))


def _check_names(config: Config) -> None:
    """The dataset, partition scheme, architectures (for clients that exist) and algorithm are components
    (``fedpcd.catalog``, which knows the shipped ones without importing them)."""
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
    model = resolve_model_params(config)
    name = config.algorithm.name
    if len(config.model.architectures(config.clients)) > 1 and not _declares(name, "heterogeneous"):
        able = ", ".join(n for n in catalog("algorithm") if _declares(n, "heterogeneous"))
        raise UserError(
            f"algorithm {name!r} needs one architecture for all clients, but model.name/"
            f"model.clients give several; model-heterogeneous algorithms: {able or '(none)'}"
        )
    algorithm = declaration("algorithm", name).spec.validate(config.algorithm.params())
    _check_secagg(config)
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
