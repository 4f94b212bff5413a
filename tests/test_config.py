"""Config schema: defaults filled and written back, dotted overrides, one-line errors, described fields."""

from __future__ import annotations

import pydoc
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

import fedpcd
from fedpcd.config import Config, EngineConfig
from fedpcd.config_input import parse_overrides
from fedpcd.errors import UserError
from fedpcd.params import LocalTraining
from fedpcd.resolve import config_from_dict, load_config


def test_defaults_are_resolved():
    cfg = load_config()
    d = cfg.to_dict()
    assert d["dataset"]["name"] == "fmnist"
    assert d["partition"] == {"scheme": "pathological", "classes_per_client": 2, "legacy_duplicate": False}
    assert d["local"]["batch_size"] == 64 and d["engine"]["executor"] == "auto"
    assert d["algorithm"] == {"name": "fedavg"}


def test_example_config_states_every_key_with_its_default():
    """configs/example.yaml is the reference of every key, each commented out (so that it pins none of the
    keys a preset sets): it sets nothing, and with every '#' before a key deleted it resolves to the defaults
    and leaves none out."""
    path = Path(__file__).resolve().parents[1] / "configs" / "example.yaml"
    text, defaults = path.read_text(), load_config(None).to_dict()
    assert yaml.safe_load(text) is None and load_config(path).to_dict() == defaults
    raw = yaml.safe_load(re.sub(r"^#(?=[a-z_]+:)", "", text, flags=re.MULTILINE))
    assert config_from_dict(raw).to_dict() == defaults
    assert list(raw) == list(defaults)
    for key, section in defaults.items():
        if isinstance(section, dict):
            assert set(raw[key]) == set(section), key


def test_overrides_parse_types_and_nesting():
    tree = parse_overrides(["partition.beta=0.1", "rounds=3", "dataset.root=/x/y", "local.grad_clip=null"])
    assert tree == {
        "partition": {"beta": 0.1},
        "rounds": 3,
        "dataset": {"root": "/x/y"},
        "local": {"grad_clip": None},
    }


def test_file_plus_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"clients": 4, "partition": {"scheme": "dirichlet", "beta": 0.3}}))
    cfg = load_config(path, ["partition.beta=0.1", "seed=3"])
    assert cfg.clients == 4 and cfg.seed == 3
    assert cfg.partition.params()["beta"] == 0.1
    assert cfg.partition.params()["min_size"] == 10  # default filled


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["colour=red"], "unknown config key 'colour'"),
        (["local.lr=-1"], "local.lr"),
        (["dataset.name=imagenet"], "valid choices"),
        (["partition.scheme=zigzag"], "valid choices"),
        (["partition.scheme=dirichlet", "partition.classes_per_client=2"], "valid parameters"),
        (["model.name=vgg"], "valid choices"),
        (["algorithm.name=fedfoo"], "valid choices"),
        (["algorithm.mu=0.1"], "unknown parameter 'mu'"),
        (["backend=cloud"], "backend"),
        (["rounds"], "KEY=VALUE"),
    ],
)
def test_bad_input_is_one_line_user_error(overrides, needle):
    with pytest.raises(UserError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_switching_scheme_or_algorithm_drops_the_files_old_parameters(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "partition": {"scheme": "pathological", "classes_per_client": 3},
                "algorithm": {"name": "fedprox"},
            }
        )
    )
    cfg = load_config(path, ["partition.scheme=dirichlet", "partition.beta=0.1", "algorithm.name=fedavg"])
    assert cfg.partition.params()["beta"] == 0.1 and "classes_per_client" not in cfg.partition.params()
    assert cfg.algorithm.name == "fedavg"
    same = load_config(path, ["partition.classes_per_client=4"])  # no switch: file keys kept and merged
    assert same.partition.scheme == "pathological" and same.partition.params()["classes_per_client"] == 4


def test_secagg_with_fewer_than_two_clients_per_round_is_refused_when_the_config_loads():
    for args in (["clients=1"], ["clients=4", "participation=0.2"]):
        with pytest.raises(UserError, match=r"privacy.secagg needs at least 2 clients per round, 1 sampled"):
            load_config(None, ["backend=flower", "privacy.secagg=true", *args])
    two = load_config(None, ["backend=flower", "privacy.secagg=true", "clients=2"])
    assert two.privacy.secagg is not None


def _sections(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and every config section below it (``X | None`` sections included), each once."""
    found = [model]
    for info in model.model_fields.values():
        for inner in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in found:
                found.extend(s for s in _sections(inner) if s not in found)
    return found


def test_every_field_of_every_section_has_a_description():
    sections = _sections(Config)
    names = {s.__name__ for s in sections}
    assert names >= {
        "Config",
        "DatasetConfig",
        "PartitionConfig",
        "ModelConfig",
        "LocalTraining",
        "AlgorithmConfig",
        "EngineConfig",
        "AggregationConfig",
        "PrivacyConfig",
        "SecAggConfig",
        "TrackingConfig",
    }
    for section in sections:
        for name, info in section.model_fields.items():
            text = info.description or ""
            assert len(text) > 10 and text.endswith(".") and "\n" not in text, f"{section.__name__}.{name}"


def test_help_shows_the_configs_own_docstring_and_each_key_with_its_description():
    text = pydoc.render_doc(fedpcd.Config, renderer=pydoc.plaintext).split("Method resolution order")[0]
    assert "An experiment: every key of a config file" in text
    assert "A base class for creating Pydantic models" not in text  # pydantic's BaseModel docstring
    assert "    seed (int >= 0): Seed of every random draw" in text and "Default: 0." in text
    assert "    participation (float in (0, 1]): Fraction of the clients sampled each round" in text
    for name, info in Config.model_fields.items():
        assert f"    {name} (" in text and info.description in " ".join(text.split())
    engine = pydoc.render_doc(EngineConfig, renderer=pydoc.plaintext)
    assert "    workers (one of: auto, or int): Processes training a round's clients" in engine
    assert "Default: 'auto'." in engine
    local = pydoc.render_doc(LocalTraining, renderer=pydoc.plaintext)
    assert "    grad_clip (float > 0, or null): Clip each step's gradient to this L2 norm" in local
