"""One parameter mechanism (fedpcd.params) for algorithms, models and partition schemes: declared types and
ranges, one-line errors naming the parameter, the value and the valid range or choices, checked once per
config load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pytest
from pydantic import Field

from fedpcd.algorithms import ALGORITHMS, build_algorithm
from fedpcd.algorithms.fedgela import FedGELA
from fedpcd.cli import main
from fedpcd.data.partition import PARTITIONERS, make_partition, resolve_params
from fedpcd.errors import UserError
from fedpcd.models import MODELS, build_model
from fedpcd.params import (
    ParamSpec,
    Section,
    declared_params,
    expected,
    field_type,
    param_description,
    validate_params,
)
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "clients=3", "rounds=1"]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(kind, name) of every parameter validation, in order."""
    seen: list[tuple[str, str]] = []
    original = ParamSpec.validate

    def counting(self: ParamSpec, given: Any, prefix: str | None = None) -> dict[str, Any]:
        seen.append((self.kind, self.name))
        return original(self, given, prefix)

    monkeypatch.setattr(ParamSpec, "validate", counting)
    return seen


# ------------------------------------------------------------------------------- one-line errors, all kinds


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.name=fedgela", "algorithm.softmax=some"],
            "bad value for 'algorithm.softmax' of algorithm 'fedgela' ('some'): valid choices: local, all",
        ),
        (
            ["algorithm.name=fedprox", "algorithm.mu=-1"],
            "bad value for 'algorithm.mu' of algorithm 'fedprox' (-1): expected a finite number >= 0",
        ),
        (
            ["algorithm.name=fedrs", "algorithm.alpha=1.5"],
            "bad value for 'algorithm.alpha' of algorithm 'fedrs' (1.5): expected a finite number in [0, 1]",
        ),
        (
            ["algorithm.name=creff", "algorithm.real_batch=0"],
            "bad value for 'algorithm.real_batch' of algorithm 'creff' (0): "
            "expected an integer >= 1, or null",
        ),
        (
            ["model.name=mlp", "model.hidden=0"],
            "bad value for 'model.hidden' of model 'mlp' (0): expected an integer in [1, 8192]",
        ),
        (
            ["model.name=simplecnn", "model.feature_relu=3"],
            "bad value for 'model.feature_relu' of model 'simplecnn' (3): expected true or false",
        ),
        (
            ["partition.scheme=dirichlet", "partition.beta=0"],
            "bad value for 'partition.beta' of partition scheme 'dirichlet' (0): "
            "expected a finite number > 0",
        ),
        (
            ["partition.scheme=fedssa", "partition.rule=other"],
            "bad value for 'partition.rule' of partition scheme 'fedssa' ('other'): "
            "valid choices: distinct, official",
        ),
        (
            ["partition.scheme=longtail", "partition.then.beta=-2"],
            "bad value for 'partition.then.beta' of partition scheme 'dirichlet' (-2): "
            "expected a finite number > 0",
        ),
    ],
)
def test_bad_value_is_one_line_naming_parameter_value_and_valid_range(overrides, message) -> None:
    with pytest.raises(UserError) as info:
        load_config(None, [*SMALL, *overrides])
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["algorithm.name=fedgela", "algorithm.scale=0"], "'algorithm.scale' of algorithm 'fedgela' (0)"),
        (["model.name=mlp", "model.hidden=x"], "'model.hidden' of model 'mlp' ('x')"),
        (["partition.scheme=shards", "partition.shards_per_client=0"], "'partition.shards_per_client'"),
    ],
)
def test_cli_exits_2_with_one_line(overrides, needle, capsys) -> None:
    assert main(["run", *SMALL, *overrides]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]


def test_long_bad_values_are_clipped() -> None:
    with pytest.raises(UserError) as info:
        validate_params("algorithm", "fedgela", FedGELA, {"softmax": "x" * 100_000})
    text = str(info.value)
    assert len(text) < 250 and "..." in text and text.endswith("valid choices: local, all")


def test_unknown_parameter_lists_the_valid_ones() -> None:
    with pytest.raises(
        UserError,
        match=r"unknown parameter 'sale' for algorithm 'fedgela' \(did you mean 'scale'\?\); valid ",
    ):
        build_algorithm("fedgela", {"sale": 2.0})
    with pytest.raises(
        UserError, match=r"unknown parameter 'width' for model 'mlp'; valid parameters: hidden$"
    ):
        load_config(None, [*SMALL, "model.name=mlp", "model.width=3"])
    with pytest.raises(
        UserError, match=r"unknown parameter 1 for partition scheme 'iid'; valid parameters: \("
    ):
        resolve_params("iid", {1: 2})


# ------------------------------------------------------------------------------------ checked once per load


def test_validation_runs_once_per_load_config(calls) -> None:
    load_config(
        None,
        [*SMALL, "partition.scheme=dirichlet", "model.name=mlp", "model.hidden=16", "algorithm.name=fedgela"],
    )
    assert calls == [("partition scheme", "dirichlet"), ("model", "mlp"), ("algorithm", "fedgela")]


def test_validation_once_per_architecture_and_nested_scheme(calls) -> None:
    load_config(
        None,
        [
            *SMALL,
            "partition.scheme=longtail",
            "partition.then.scheme=pathological",
            "model.name=[cnn1, cnn2]",
            "algorithm.name=fedssa",
        ],
    )
    assert calls == [
        ("partition scheme", "longtail"),
        ("partition scheme", "pathological"),  # longtail's then
        ("model", "cnn1"),
        ("model", "cnn2"),
        ("algorithm", "fedssa"),
    ]


def test_one_mechanism_serves_all_three_kinds(calls) -> None:
    build_algorithm("fedavg")
    build_model("mlp", 1, 10, 8, hidden=4)
    y = np.repeat(np.arange(4), 10)
    make_partition(y, y, 2, "iid", {}, 0)
    assert calls == [("algorithm", "fedavg"), ("model", "mlp"), ("partition scheme", "iid")]
    # and the registries' own entries are what it reads
    assert validate_params("algorithm", "fedgela", ALGORITHMS.get("fedgela"), {"scale": 3}) == {
        **validate_params("algorithm", "fedgela", FedGELA),
        "scale": 3.0,
    }
    assert validate_params("model", "mlp", MODELS.get("mlp"), {}) == {"hidden": 200}
    assert validate_params("partition scheme", "pathological", PARTITIONERS.get("pathological"), {}) == {
        "classes_per_client": 2,
        "legacy_duplicate": False,
    }


def test_resolved_config_holds_the_checked_values() -> None:
    cfg = load_config(
        None,
        [
            *SMALL,
            "algorithm.name=fedgela",
            "algorithm.scale=3",
            "partition.scheme=dirichlet",
            "partition.beta=1",
        ],
    )
    assert cfg.algorithm.params()["scale"] == 3.0 and isinstance(cfg.algorithm.params()["scale"], float)
    assert cfg.partition.params()["beta"] == 1.0 and isinstance(cfg.partition.params()["beta"], float)
    assert cfg.model.params() == {"feature_relu": True}  # simplecnn's default, written out


# ------------------------------------------------------------------------------------- the mechanism itself


def test_expected_names_ranges_and_choices() -> None:
    assert expected(Annotated[float, Field(gt=0.0)]) == "expected a finite number > 0"
    assert expected(Annotated[float, Field(gt=0.0, le=1.0)]) == "expected a finite number in (0, 1]"
    assert expected(Annotated[int, Field(ge=1)] | None) == "expected an integer >= 1, or null"
    assert expected(Literal["a", "b"]) == "valid choices: a, b"
    assert expected(Literal["a", "b"] | None) == "valid choices: a, b, null"
    assert expected(bool) == "expected true or false"
    assert expected(dict[str, Any]) == "expected a mapping"


@dataclass
class _Toy:
    n: Annotated[int, Field(ge=1)] = 2
    x: float = 0.5
    flag: bool = False
    mode: Literal["a", "b"] = "a"
    path: str = ""

    @staticmethod
    def check_combination(values: dict[str, Any]) -> str | None:
        return "mode b needs flag" if values["mode"] == "b" and not values["flag"] else None


def _toy(**given: Any) -> dict[str, Any]:
    return validate_params("algorithm", "toy", _Toy, given)


def test_coercion_and_strict_booleans() -> None:
    assert _toy(x=1) == {"n": 2, "x": 1.0, "flag": False, "mode": "a", "path": ""}
    assert _toy(x="1e-3")["x"] == 1e-3  # YAML 1.1 reads 1e-3 as text
    assert _toy(n=np.int64(3), x=np.float32(0.5), flag=np.bool_(True)) == {
        "n": 3,
        "x": 0.5,
        "flag": True,
        "mode": "a",
        "path": "",
    }
    assert type(_toy(flag=np.bool_(True))["flag"]) is bool
    for bad in (
        {"n": True},
        {"x": False},
        {"flag": 1},
        {"flag": "yes"},
        {"n": 0},
        {"n": 2.5},
        {"x": float("nan")},
    ):
        with pytest.raises(UserError, match=f"'algorithm.{next(iter(bad))}' of algorithm 'toy'"):
            _toy(**bad)


def test_combination_hook() -> None:
    assert _toy(mode="b", flag=True)["mode"] == "b"
    with pytest.raises(UserError, match="^bad parameters for algorithm 'toy': mode b needs flag$"):
        _toy(mode="b")
    with pytest.raises(UserError, match=r"proj_dim \(16\) needs projection fc or mlp"):
        build_algorithm("fedgela", {"proj_dim": 16, "projection": "none"})


def test_declared_params_of_a_dataclass_and_a_function() -> None:
    annotations, defaults = declared_params(PARTITIONERS.get("dirichlet"))
    assert list(defaults) == ["beta", "min_size", "cap_fair_share", "max_retries"]  # positional ones skipped
    assert expected(annotations["min_size"]) == "expected an integer >= 0"
    annotations, defaults = declared_params(MODELS.get("mlp"))  # read through the registry's wrapper
    assert defaults == {"hidden": 200}
    _, defaults = declared_params(FedGELA)
    assert defaults["scale"] == 2.0 and defaults["proj_dim"] is None


def test_path_parameters_take_paths(tmp_path: Path) -> None:
    path = tmp_path / "clients.json"
    path.write_text('{"clients": [[0, 1], [2]]}')
    assert resolve_params("explicit", {"path": path}) == {"path": str(path)}


def test_fedgela_accepts_what_it_did() -> None:
    algo = build_algorithm("fedgela", {"scale": 1e-3, "proj_dim": 1, "projection": "mlp"})
    assert (algo.scale, algo.proj_dim, algo.projection) == (1e-3, 1, "mlp")
    assert build_algorithm("fedgela", {"proj_dim": None, "projection": "none"}).proj_dim is None
    for bad in ({"scale": 0.0}, {"scale": float("inf")}, {"proj_dim": 0}, {"q": "log"}):
        with pytest.raises(UserError, match=f"'algorithm.{next(iter(bad))}' of algorithm 'fedgela'"):
            build_algorithm("fedgela", bad)


@pytest.mark.parametrize(
    ("annotation", "text"),
    [
        (Annotated[int, Field(ge=1, description="Hidden units.")], "Hidden units."),
        (Annotated[int, Field(ge=1, description="Width.")] | None, "Width."),  # inside a union member
        (Annotated[Annotated[float, Field(gt=0)], Field(description="Nested.")], "Nested."),
        (Annotated[int, Field(ge=1)], ""),
        (Literal["a", "b"], ""),
        (int, ""),
    ],
)
def test_param_description_is_the_declared_fields(annotation, text) -> None:
    assert param_description(annotation) == text


def test_a_sections_docstring_lists_its_fields_with_type_default_and_description() -> None:
    class Toy(Section):
        """A toy section."""

        size: int = Field(3, ge=1, description="How many.")
        mode: Literal["a", "b"] | None = Field(None, description="Which one.")
        items: list[int] = Field(default_factory=list, description="Some numbers.")

    assert field_type(Toy.model_fields["size"]) == "int >= 1"
    assert Toy.__doc__ == (
        "A toy section.\n\nAttributes:\n"
        "    size (int >= 1): How many. Default: 3.\n"
        "    mode (one of: a, b, null): Which one. Default: None.\n"
        "    items (list): Some numbers."
    )
