"""The worked examples of docs/adding-an-algorithm.md, built from the guide's own code blocks.

Each marked block (``<!-- example: NAME -->`` before a ```` ```python title="NAME.py" ```` fence) is
imported as a module, as the newcomer's file in src/fedpcd/algorithms/ would be, and so registers its
algorithm; it runs a small federation through the public entry point (``load_config`` + ``run_experiment``)
and is checked against the library's own implementation of the same method: guide_prox against FedAvg and
FedProx, guide_nova against FedNova, guide_per against FedPer. The examples are registered for this
module's tests only and removed afterwards, so the suite's other tests never see them.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from conftest import run_records
from fedpcd.algorithms import ALGORITHMS, Algorithm
from fedpcd.algorithms.common import local_steps
from fedpcd.algorithms.statedict import clone_state, tensor_bytes
from fedpcd.backends import run_experiment
from fedpcd.cli import main
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import build_federation
from fedpcd.engine.rundir import RunDir
from fedpcd.engine.tasks import payloads_for
from fedpcd.engine.vectorized import blocker
from fedpcd.models import backbone_keys, head_keys
from fedpcd.resolve import load_config

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "adding-an-algorithm.md"
NAMES = ("guide_prox", "guide_nova", "guide_per")
# a marked block: the marker comment, then a python fence whose title is the module's file name
EXAMPLE = re.compile(
    r"^<!-- example: (?P<name>\w+) -->\n```python title=\"(?P<file>[\w.]+)\"\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
# three clients, two rounds, every round evaluated
BASE = [
    "dataset.name=synthetic16",
    "dataset.train_fraction=0.5",
    "model.name=simplecnn",
    "clients=3",
    "rounds=2",
    "local.batch_size=16",
]
SMALL = [*BASE, "partition.scheme=dirichlet", "partition.beta=0.5"]  # clients of unequal size


def guide_examples() -> dict[str, tuple[str, str]]:
    """name -> (file name, code) of every marked code block of the guide, in page order."""
    return {m["name"]: (m["file"], m["code"]) for m in EXAMPLE.finditer(GUIDE.read_text(encoding="utf-8"))}


def guide_hooks() -> set[str]:
    """The hook names of the guide's hook table (every backticked `name(` of a row's hook cell)."""
    section = GUIDE.read_text(encoding="utf-8").split("\n## The hooks", 1)[1].split("\n## ", 1)[0]
    hooks = set()
    for row in section.splitlines():
        cells = row.split("|")
        if len(cells) > 3 and cells[1].strip() in ("client", "server", "both"):
            hooks |= set(re.findall(r"`(\w+)\(", cells[2]))
    return hooks


@pytest.fixture(scope="module")
def guide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModuleType]]:
    """The three examples imported from files holding the guide's blocks (registered until the end)."""
    folder = tmp_path_factory.mktemp("guide_examples")
    modules: dict[str, ModuleType] = {}
    try:
        for name, (file, code) in guide_examples().items():
            path = folder / file
            path.write_text(code, encoding="utf-8")
            spec = importlib.util.spec_from_file_location(f"guide_example_{name}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and the parameter check resolve annotations here
            modules[name] = module
            spec.loader.exec_module(module)
        yield modules
    finally:
        for name, module in modules.items():
            ALGORITHMS.unregister(name)
            sys.modules.pop(module.__name__, None)


def _run(out: Path, *overrides: str, base: list[str] = SMALL) -> tuple[list[dict], dict[str, Any]]:
    """metrics.jsonl records (no wall_s) and the final checkpoint of one run through the public API."""
    run_experiment(load_config(None, [*base, *overrides, f"output_dir={out}"]), progress=False)
    return run_records(out), RunDir(out).load_checkpoint()


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("fedavg") / "run", "algorithm.name=fedavg")


def _equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----- the guide holds the three examples, and they are what the guide says -------------------------------


def test_the_guide_marks_the_three_examples():
    examples = guide_examples()
    assert tuple(examples) == NAMES
    for name, (file, code) in examples.items():
        assert file == f"{name}.py"
        assert f'@ALGORITHMS.register("{name}")' in code
        assert code.startswith('"""')  # a module docstring citing the paper


def test_each_example_registers_its_algorithm(guide, capsys):
    for name in NAMES:
        assert ALGORITHMS.get(name).__module__ == guide[name].__name__
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in NAMES)


def test_the_examples_override_only_hooks_of_the_guides_table(guide):
    hooks = guide_hooks()
    assert {"loss", "end_local", "aggregate", "private_keys", "personal_predictor"} <= hooks
    for name in NAMES:
        cls = ALGORITHMS.get(name)
        own = {k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")}
        assert own, name
        assert own <= hooks, f"{name} overrides {sorted(own - hooks)}, which the hook table lacks"


def test_the_hook_table_is_the_whole_contract():
    """Every public method of the contract (``Algorithm``) is a hook of the guide's table and every hook of
    the table is one: the table and the class cannot drift apart, and the contract stays small."""
    public = {k for k, v in vars(Algorithm).items() if callable(v) and not k.startswith("_")}
    assert public == guide_hooks()
    assert len(public) <= 18


def test_the_hook_table_names_who_calls_each_hook():
    section = GUIDE.read_text(encoding="utf-8").split("\n## The hooks", 1)[1].split("\n## ", 1)[0]
    rows = [r.split("|") for r in section.splitlines() if r.startswith("| ") and "`" in r]
    assert len(rows) == len(guide_hooks())  # one row per hook
    callers = (
        "server loop",
        "client update",
        "evaluation",
        "report",
        "Federation.new_algorithm",
        "the contract's",
    )
    for cells in rows:
        assert any(c in cells[3] for c in callers), cells[2]
        assert cells[4].strip(), cells[2]  # a default


def test_the_example_blocks_are_ruff_clean(tmp_path):
    pytest.importorskip("ruff")
    folder = tmp_path / "blocks"
    folder.mkdir()
    for file, code in guide_examples().values():
        (folder / file).write_text(code, encoding="utf-8")
    config = str(ROOT / "pyproject.toml")
    for args in (["check"], ["format", "--check", "--diff"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *args, "--config", config, str(folder)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr


# ----- guide_prox: FedAvg at mu = 0, the library's FedProx otherwise -------------------------------------


def test_guide_prox_with_mu_zero_is_fedavg_bit_for_bit(guide, tmp_path, fedavg_run):
    rows, ckpt = _run(tmp_path, "algorithm.name=guide_prox", "algorithm.mu=0")
    ref_rows, ref_ckpt = fedavg_run
    assert rows == ref_rows
    assert _equal_states(ckpt["server"]["model"], ref_ckpt["server"]["model"])


def test_guide_prox_is_the_librarys_fedprox(guide, tmp_path, fedavg_run):
    rows, ckpt = _run(tmp_path / "guide", "algorithm.name=guide_prox", "algorithm.mu=0.1")
    ref_rows, ref_ckpt = _run(tmp_path / "lib", "algorithm.name=fedprox", "algorithm.mu=0.1")
    assert rows == ref_rows
    assert _equal_states(ckpt["server"]["model"], ref_ckpt["server"]["model"])
    # and the proximal term does something: not FedAvg
    assert not _equal_states(ckpt["server"]["model"], fedavg_run[1]["server"]["model"])


def test_guide_prox_default_mu_is_fedprox_default(guide):
    assert ALGORITHMS.get("guide_prox")().mu == ALGORITHMS.get("fedprox")().mu


def test_a_bad_mu_is_one_line_and_exit_code_2(guide, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--quiet", "algorithm.name=guide_prox", "algorithm.mu=-1", f"output_dir={out}"])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert lines == [
        "fedpcd: error: bad value for 'algorithm.mu' of algorithm 'guide_prox' (-1): "
        "expected a finite number >= 0"
    ]
    assert lines[0] in GUIDE.read_text(encoding="utf-8")  # the guide quotes the real message
    assert not out.exists()


# ----- guide_nova: the library's FedNova with plain-SGD normalisation ------------------------------------


def test_the_clients_run_different_numbers_of_steps():
    fed = build_federation(load_config(None, [*SMALL, "output_dir=unused"]))
    steps = {local_steps(client, fed.context.local) for client in fed.clients}
    assert len(steps) > 1, [c.num_samples for c in fed.clients]


@pytest.mark.parametrize(
    ("extra", "library"),
    [
        ([], ["algorithm.momentum_aware=false"]),  # a_i = tau_i whatever the momentum
        (["local.momentum=0"], []),  # without momentum the paper's ||a_i||_1 is tau_i
    ],
    ids=["momentum_aware_false", "no_momentum"],
)
def test_guide_nova_is_the_librarys_fednova(guide, tmp_path, fedavg_run, extra, library):
    rows, ckpt = _run(tmp_path / "guide", "algorithm.name=guide_nova", *extra)
    ref_rows, ref_ckpt = _run(tmp_path / "lib", "algorithm.name=fednova", *library, *extra)
    assert rows == ref_rows
    assert _equal_states(ckpt["server"]["model"], ref_ckpt["server"]["model"])


def test_guide_nova_changes_the_aggregation(guide, tmp_path, fedavg_run):
    rows, ckpt = _run(tmp_path, "algorithm.name=guide_nova")
    ref_rows, ref_ckpt = fedavg_run
    # round 1 trains from the same model on the same batches: the same local losses and bytes ...
    assert rows[0]["train_loss"] == ref_rows[0]["train_loss"]
    assert [r["bytes_up"] for r in rows] == [r["bytes_up"] for r in ref_rows]
    # ... but the server combines the updates differently
    assert not _equal_states(ckpt["server"]["model"], ref_ckpt["server"]["model"])


def test_guide_nova_with_equal_steps_is_fedavg(guide, tmp_path):
    """Equal tau_i (the pathological partition with equal client sizes): x - tau sum_i p_i (x - y_i) / tau =
    sum_i p_i y_i, FedAvg up to float rounding."""
    equal = [*BASE, "partition.scheme=pathological", "partition.classes_per_client=2"]
    fed = build_federation(load_config(None, [*equal, "output_dir=unused"]))
    assert len({c.num_samples for c in fed.clients}) == 1
    _, ckpt = _run(tmp_path / "guide", "algorithm.name=guide_nova", base=equal)
    _, ref = _run(tmp_path / "fedavg", "algorithm.name=fedavg", base=equal)
    for key, value in ref["server"]["model"].items():
        torch.testing.assert_close(ckpt["server"]["model"][key], value, rtol=1e-4, atol=1e-6)


# ----- guide_per: the head never leaves the client; the library's FedPer ---------------------------------


def test_guide_per_keeps_the_head_on_the_client(guide, tmp_path):
    cfg = load_config(None, [*SMALL, "algorithm.name=guide_per", f"output_dir={tmp_path}"])
    fed = build_federation(cfg)
    algorithm = fed.new_algorithm()
    model = fed.model_for(0, fresh=True)
    head, body = set(head_keys(model)), set(backbone_keys(model))
    initial_head = clone_state(model, sorted(head))
    server = algorithm.init_server(model)
    assert set(server["model"]) == body
    states: dict[int, Any] = {}
    for rnd in (1, 2):
        for k in range(3):
            assert set(algorithm.payload_for(server, k)["model"]) == body  # nothing of a head goes down
        results = LocalExecutor(fed, states=states).train(
            algorithm, payloads_for(algorithm, server, [0, 1, 2]), rnd, evaluate=True
        )
        for r in results:
            assert r.error is None, r.error
            assert set(r.update["model"]) == body  # nor up
            assert set(states[r.client]) == head  # the client keeps its own head ...
            assert not _equal_states(states[r.client], initial_head)  # ... trained
        server = algorithm.aggregate(server, [r.update for r in results])
        assert set(server["model"]) == body
        assert _equal_states(server["initial"], initial_head)  # no client's head reached the server
    assert not _equal_states(states[0], states[1])  # personal: each client has its own


def test_guide_per_is_the_librarys_fedper(guide, tmp_path, fedavg_run):
    rows, ckpt = _run(tmp_path / "guide", "algorithm.name=guide_per")
    ref_rows, ref_ckpt = _run(tmp_path / "lib", "algorithm.name=fedper")
    assert rows == ref_rows
    assert _equal_states(ckpt["server"]["model"], ref_ckpt["server"]["model"])
    assert ckpt["client_states"].keys() == ref_ckpt["client_states"].keys() == {0, 1, 2}
    for k, state in ckpt["client_states"].items():
        assert _equal_states(state, ref_ckpt["client_states"][k])
    # the byte counters see FedAvg's traffic less one head per client each way
    model = build_federation(load_config(None, [*SMALL, "output_dir=unused"])).model_for(0)
    head_bytes = tensor_bytes(clone_state(model, head_keys(model)))
    for row, ref in zip(rows, fedavg_run[0], strict=True):
        assert row["bytes_up"] == ref["bytes_up"] - 3 * head_bytes
        assert row["bytes_down"] == ref["bytes_down"] - 3 * head_bytes


# ----- both executors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "library", "params"),
    [
        ("guide_prox", "fedprox", ["algorithm.mu=0.1"]),
        ("guide_nova", "fednova", ["local.momentum=0"]),
        ("guide_per", "fedper", []),
    ],
)
def test_the_vectorized_executor_runs_each_example_as_the_library(guide, tmp_path, name, library, params):
    vec = "engine.executor=vectorized"
    cfg = load_config(None, [*SMALL, f"algorithm.name={name}", *params, "output_dir=unused"])
    fed = build_federation(cfg)
    assert blocker(fed.new_algorithm(), fed, [0, 1, 2]) is None  # covered: no sequential fall-back
    rows, ckpt = _run(tmp_path / "guide", f"algorithm.name={name}", *params, vec)
    ref_rows, ref_ckpt = _run(tmp_path / "lib", f"algorithm.name={library}", *params, vec)
    assert rows == ref_rows
    assert _equal_states(ckpt["server"]["model"], ref_ckpt["server"]["model"])
