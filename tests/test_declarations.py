"""The shipped components' declarations as rendered (declarations.json) answer as the imported ones do: a
config loaded in a fresh process without torch resolves, warns and fails as in this process, where the
registries are imported."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from typing import Annotated, Any, Literal

import pytest
from pydantic import Field

from fedpcd import declarations
from fedpcd.catalog import from_source, registry
from fedpcd.config_identity import config_yaml
from fedpcd.config_input import read_yaml, shipped_configs
from fedpcd.declarations import _decode, _encode, _rebuilt, _render, shipped_declarations
from fedpcd.errors import UserError
from fedpcd.params import Needs, PathText
from fedpcd.resolve import load_config

# every shipped config, plus each preset of the paper methods and the mistakes the declarations answer
PRESETS = [
    [f"algorithm.name={name}", f"algorithm.preset={preset}"]
    for name in ("fedgela", "fedmr", "fednh", "fedsc", "fedssa", "fedavg")
    for preset in registry("algorithm").get(name).presets
]
MISTAKES = [
    ["algorithm.name=fedprox", "algorithm.mu=-1"],
    ["algorithm.name=fedprox", "algorithm.mue=1"],
    ["model.name=mlp", "model.hidden=0"],
    ["algorithm.name=fedsc", "algorithm.preset=officiall"],
    ["model.name=[cnn1,cnn2]"],
    ["backend=flower", "algorithm.name=fednh", "privacy.secagg.num_shares=3"],
    ["algorithm.name=fedgela", "algorithm.projection=none", "algorithm.proj_dim=8"],  # its pair check
]
SINGLE = [name for name, path in sorted(shipped_configs().items()) if "sweep" not in read_yaml(path)]
CASES = [[None, []]] + [[name, []] for name in SINGLE]
OVERRIDDEN = [["algorithm.name=fedgela", "algorithm.preset=official", "local.grad_clip=null"]]  # warns
CASES += [[None, overrides] for overrides in PRESETS + OVERRIDDEN + MISTAKES]

# loads each [config, overrides] of argv[1]; prints per case the YAML or the error, then the warnings, and
# last which of torch and fedgela's module (the one pair check) were imported
LOADER = """
import json, logging, sys
from fedpcd.config_identity import config_yaml
from fedpcd.errors import UserError
from fedpcd.resolve import load_config
said = []
handler = type("H", (logging.Handler,), {"emit": lambda s, r: said.append(r.getMessage())})
logging.getLogger("fedpcd").addHandler(handler())
out = []
for path, overrides in json.loads(sys.argv[1]):
    del said[:]
    try:
        out.append([config_yaml(load_config(path, overrides)), list(said)])
    except UserError as exc:
        out.append(["error: " + str(exc), list(said)])
print(json.dumps([out, sorted(m for m in ("torch", "fedpcd.algorithms.fedgela") if m in sys.modules)]))
"""


def _here(path: str | None, overrides: list[str]) -> list[Any]:
    said: list[str] = []
    handler = type("H", (logging.Handler,), {"emit": lambda s, r: said.append(r.getMessage())})()
    logger = logging.getLogger("fedpcd")
    logger.addHandler(handler)
    try:
        return [config_yaml(load_config(path, overrides)), said]
    except UserError as exc:
        return ["error: " + str(exc), said]
    finally:
        logger.removeHandler(handler)


@pytest.mark.slow
def test_configs_load_without_torch_as_with_the_registries_imported(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(CASES)], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    light, imported = json.loads(done.stdout)
    assert imported == []  # FedGELA's pair check included: it is declared as data (Needs)
    assert not from_source("algorithm")  # here the registries are imported: the declarations are read there
    for (path, overrides), got in zip(CASES, light, strict=True):
        assert got == _here(path, overrides), (path, overrides)
    errors = [text for text, _ in light if text.startswith("error: ")]
    assert len(errors) == len(MISTAKES)  # every mistake fails, every shipped config and preset loads
    assert [bool(warned) for _, warned in light].count(True) == len(OVERRIDDEN)


def _first_load_imports(overrides: list[str]) -> list[str]:
    code = (
        "import sys\nfrom fedpcd.resolve import load_config\nload_config(None, sys.argv[1:])\n"
        "print(sorted(m for m in ('torch', 'fedpcd.algorithms') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, *overrides], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.replace("'", '"'))


@pytest.mark.slow
def test_only_a_model_of_other_parameters_imports_torch():
    assert _first_load_imports(["algorithm.name=fedgela", "algorithm.preset=paper"]) == []
    assert _first_load_imports(["model.name=mlp", "model.hidden=64"]) == ["torch"]  # its size: built on meta


def test_the_rendering_holds_every_shipped_component():
    rendered = json.loads(shipped_declarations())
    for kind in declarations.KINDS:
        ours = {n for n in registry(kind).names() if registry(kind).get(n).__module__.startswith("fedpcd.")}
        assert set(rendered[kind]) == ours
    assert rendered["algorithm"]["fedgela"]["combination"] == {
        "key": "proj_dim",
        "other": "projection",
        "allowed": ["fc", "mlp"],
    }
    assert rendered["algorithm"]["fedssa"]["heterogeneous"] is True
    assert (
        rendered["algorithm"]["fedavg"]["plain_mean"] is True
        and not rendered["algorithm"]["fednh"]["plain_mean"]
    )
    assert rendered["model"]["mlp"]["weights"] > 0


@pytest.mark.parametrize(
    "annotation",
    [
        int,
        PathText,
        Literal["a", "b"],
        Annotated[float, Field(gt=0.0, le=1.0, description="d")],
        Annotated[int, Field(ge=1)] | None,
        float | None,
        Annotated[float | None, Field(gt=0.0, allow_inf_nan=False)],
    ],
)
def test_an_annotation_is_rebuilt_exactly(annotation):
    assert repr(_decode(json.loads(json.dumps(_encode(annotation))))) == repr(annotation)


@dataclasses.dataclass
class _Odd:
    sizes: tuple[int, ...] = (1, 2)


@dataclasses.dataclass
class _TupleDefault:
    sizes: Any = (1, 2)  # JSON would bring it back as a list


@dataclasses.dataclass
class _Pattern:
    text: Annotated[str, Field(pattern="^a")] = "a"


@pytest.mark.parametrize("target", [_Odd, _TupleDefault, _Pattern])
def test_the_rendering_refuses_what_it_would_not_rebuild(target):
    with pytest.raises(ValueError, match="rendering"):
        _render("model", "odd", target)


def test_a_declared_pair_check_says_what_is_wrong():
    needs = Needs("proj_dim", "projection", ("fc", "mlp"))
    assert (
        needs({"proj_dim": 8, "projection": "none"}) == "proj_dim (8) needs projection fc or mlp, not 'none'"
    )
    assert needs({"proj_dim": None, "projection": "none"}) is None
    assert needs({"proj_dim": 8, "projection": "mlp"}) is None


@dataclasses.dataclass
class _Paired:
    width: int | None = None
    kind: Literal["a", "b"] = "a"

    @staticmethod
    def check_combination(values: dict[str, Any]) -> str | None:
        return "width needs kind b" if values["width"] is not None and values["kind"] == "a" else None


def test_a_pair_check_that_is_code_runs_from_the_imported_component():
    """Rendered as true: the rebuilt declaration imports the component to run it."""
    algorithms = registry("algorithm")
    algorithms.register("_paired")(_Paired)
    try:
        data = _render("model", "_paired", _Paired)  # rendered as a model: no algorithm flags to read
        assert data["combination"] is True
        spec = _rebuilt("algorithm", "_paired", json.loads(json.dumps(data))).spec
        assert spec.validate({"width": 3, "kind": "b"}) == {"width": 3, "kind": "b"}
        with pytest.raises(UserError, match="width needs kind b"):
            spec.validate({"width": 3})
    finally:
        algorithms.unregister("_paired")
