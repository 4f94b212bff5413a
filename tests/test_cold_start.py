"""The command line answers help, input errors (a config's file, keys, values and component names; a folder
given to ``run --resume`` that holds no run; the demo's ``--out`` and overrides; a dataset's missing files),
`init` and the listings without importing torch.

Each command runs in one fresh interpreter (this test process has torch loaded already), which reports after
each command its exit code and whether torch is in ``sys.modules``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedpcd.catalog import HOMES, registry
from fedpcd.cli import main
from fedpcd.cli_args import build_parser
from fedpcd.components import describe, shipped_descriptions

ARCHIVED = Path(__file__).resolve().parents[1] / "docs" / "results" / "runs" / "fedssa-fmnist-n10"

# runs each argv of the JSON list in argv[1] through fedpcd's main, then prints [argv, exit code, torch?]
RUNNER = """
import json, sys
from fedpcd.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    try:
        code = main(argv)
    except SystemExit as exc:  # --help
        code = exc.code
    results.append([argv, code, "torch" in sys.modules])
print("RESULTS " + json.dumps(results))
"""


def _run(commands: list[list[str]], cwd) -> list[list]:
    env = {k: v for k, v in os.environ.items() if k != "FEDPCD_DATA"} | {"XDG_CACHE_HOME": str(cwd / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(commands)], cwd=cwd, capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return json.loads(done.stdout.rsplit("RESULTS ", 1)[1])


def _commands() -> list[str]:
    usage = build_parser().format_usage()
    return re.search(r"\{([\w,]+)\}", usage)[1].split(",")


@pytest.mark.slow
def test_help_bad_configs_init_and_the_listings_do_not_import_torch(tmp_path):
    (tmp_path / "bad.yaml").write_text("rounds: [1, 2\n")
    (tmp_path / "latin1.yaml").write_bytes(b"# caf\xe9\nrounds: 1\n")
    (tmp_path / "alias.yaml").write_text("a: &x 1\nb: *x\n")
    (tmp_path / "folder").mkdir()
    commands = _commands()
    assert {"run", "partition", "sweep", "report", "list", "demo", "init", "config"} <= set(commands)
    expected: list[tuple[list[str], int]] = [(["--help"], 0), (["-v", "--help"], 0)]
    expected += [([command, "--help"], 0) for command in commands] + [(["config", "show", "--help"], 0)]
    for bad in ("missing.yaml", "folder", "bad.yaml", "latin1.yaml", "alias.yaml"):
        for command in (["run"], ["partition"], ["sweep"], ["config", "show"]):
            expected.append(([*command, "--config", bad], 2))
    expected += [(["init"], 0), (["init"], 2), (["list", "configs"], 0), (["-q", "list", "configs", "-v"], 0)]
    expected += [
        (["list"], 0),
        (["list", "fedfoo"], 2),
        (["list", "dirichlet"], 0),
        (["list", "flwr:shard"], 0),
        (["list", "fedavg"], 0),
        (["list", "simplecnn"], 0),
    ]
    # a mistyped key, value or component name, and the checks that need no component (fedpcd.resolve); last,
    # as they import the partition schemes' module, after which `fedpcd list NAME` reads the registries
    mistakes = ["roundz=3", "local.lr=-1", "algorithm.name=fedfoo", "model.name=cnnn", "dataset.name=fmnistt"]
    mistakes += ["partition.scheme=dirichlett", "partition.beta=-1", "model.clients={12: cnn1}"]
    mistakes += ["engine.min_clients=50", "model.name=[]"]
    mistakes += ["algorithm.name=fedprox algorithm.mu=-1", "model.name=mlp model.hidden=0"]
    mistakes += ["algorithm.name=fedsc algorithm.preset=officiall", "dataset.name=hf:a/b/c"]
    for command in (["run"], ["partition"], ["config", "show"]):
        expected += [([*command, *mistake.split()], 2) for mistake in mistakes]
    # valid configs: the declarations of the shipped algorithms and models are read as rendered
    for config in (
        ["--config", "example"],
        ["--config", "headline/fednh-fmnist"],
        ["--config", "demo"],
        ["--config", "headline/fedgela-fmnist"],
    ):
        expected.append((["config", "show", *config], 0))
    expected.append((["config", "show", "algorithm.name=fedsc", "algorithm.preset=official"], 0))
    # a folder that holds no run (missing, empty, stopped before its config.yaml), and the demo's bad input
    (tmp_path / "empty").mkdir()
    (tmp_path / "starting").mkdir()
    (tmp_path / "starting" / ".lock").touch()
    expected += [(["run", "--resume", folder], 2) for folder in ("missing", "empty", "starting", "bad.yaml")]
    expected += [(["run", "--resume", "empty", "rounds=3"], 2), (["demo", "--out", "bad.yaml"], 2)]
    expected += [(["demo", "--out", "demo-out", mistake], 2) for mistake in ("roundz=3", "local.lr=-1")]
    expected += [(["report", str(ARCHIVED), "--rounds-to", "200"], 2)]  # before its runs are loaded
    expected += [(["report", str(ARCHIVED), "--paired-with", "fedfoo"], 2)]  # after: configs without torch
    (tmp_path / "grid.yaml").write_text("sweep:\n  seed: [0, 1]\nrounds: 1\n")
    for options in (["--launcher", "kube"], ["--address", "localhost:6379"], ["--slurm", "time=5"]):
        expected.append((["sweep", "--config", "grid.yaml", *options], 2))  # the launcher's options
    # a dataset whose files are missing and cannot be downloaded: the loader's line
    for missing in ("dataset.name=femnist", "dataset.name=cifar10 dataset.download=false"):
        for command in (["run"], ["partition"]):
            expected.append(([*command, *missing.split(), "dataset.root=folder"], 2))
    results = _run([argv for argv, _ in expected], tmp_path)
    assert [(argv, code) for argv, code, _ in results] == [(argv, code) for argv, code in expected]
    assert [argv for argv, _, torch in results if torch] == []
    assert (tmp_path / "fedpcd.yaml").is_file()
    assert not (tmp_path / "demo-out").exists()


# an algorithm with presets, a model, a dataset, a partition scheme, a config section
SHIPPED = ["fedavg", "fedgela", "simplecnn", "fmnist", "dirichlet", "privacy"]


@pytest.mark.slow
def test_list_name_of_a_shipped_component_says_what_the_registry_says_without_torch(tmp_path):
    """`fedpcd list NAME` prints the shipped description (descriptions.json) without importing torch, and it
    is what the imported component gives (here the registries are imported: ``describe`` reads them)."""
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps([["list", name] for name in SHIPPED])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    printed, results = done.stdout.rsplit("RESULTS ", 1)
    assert [(code, torch) for _, code, torch in json.loads(results)] == [(0, False)] * len(SHIPPED)
    assert printed == "".join(describe(name) + "\n" for name in SHIPPED)


# `fedpcd list` of an unknown name: its one line, then whether the config schema or torch was imported
UNKNOWN = """
import sys
from fedpcd.cli import main
main(["list", "fedavgg"])
print(sorted(m for m in ("fedpcd.config", "torch") if m in sys.modules))
"""


@pytest.mark.slow
def test_an_unknown_name_is_answered_without_the_schema_or_torch(tmp_path):
    done = subprocess.run([sys.executable, "-c", UNKNOWN], cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout == "[]\n"
    assert done.stderr.startswith("fedpcd: error: unknown name 'fedavgg'; did you mean algorithms: fedavg,")


# each kind's unknown-name line as fedpcd.catalog tells it from the source (no torch), then as the imported
# registry's own `get` raises it
NAME_LINES = """
import json, sys
from fedpcd.catalog import HOMES, check_name, registry
from fedpcd.errors import UserError
def line(check):
    try:
        check()
    except UserError as exc:
        return str(exc)
light = [line(lambda kind=kind: check_name(kind, "nosuch")) for kind in HOMES]
torch_loaded = "torch" in sys.modules
imported = [line(lambda kind=kind: registry(kind).get("nosuch")) for kind in HOMES]
print(json.dumps([light, torch_loaded, imported]))
"""


@pytest.mark.slow
def test_an_unknown_component_in_a_config_is_the_registrys_line_without_torch(tmp_path):
    done = subprocess.run([sys.executable, "-c", NAME_LINES], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    light, torch_loaded, registries = json.loads(done.stdout)
    assert not torch_loaded
    assert light == registries
    assert light[list(HOMES).index("dataset")].endswith(", or hf:<owner>/<name> (a Hugging Face dataset)")


# `fedpcd list fedavg` where descriptions.json is missing: the component is imported (torch with it)
WITHOUT_RENDERING = """
import sys
from pathlib import Path
from fedpcd import catalog
from fedpcd.cli import main
catalog.DESCRIPTIONS = Path("missing.json")
main(["list", "fedavg"])
print("torch" in sys.modules)
"""


@pytest.mark.slow
def test_without_the_rendered_descriptions_list_name_imports_the_component(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RENDERING], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == describe("fedavg") + "\nTrue\n"


def test_the_rendered_descriptions_are_those_of_the_shipped_components():
    """descriptions.json holds every component fedpcd defines and every config section, and no other name
    (tests may register more components)."""
    rendered = json.loads(shipped_descriptions())
    ours = {
        name
        for kind in HOMES
        for name in registry(kind).names()
        if registry(kind).get(name).__module__.startswith("fedpcd.")
    }
    sections = {name for name, text in rendered.items() if text.startswith(f"config section {name} (")}
    assert set(rendered) == ours | sections
    assert {"privacy", "aggregation", "server", "engine"} <= sections  # `local` is also an algorithm
    assert {"fedavg", "pfedme", "simplecnn", "fmnist", "dirichlet"} <= ours
    assert rendered["pfedme"] == describe("pfedme")


# prints what `fedpcd list` prints, then whether torch is in sys.modules
LISTING = """
import sys
from fedpcd.cli import main
main(["list"])
print("torch" in sys.modules)
"""


@pytest.mark.slow
def test_the_light_listing_is_the_registries_listing(tmp_path, capsys):
    """`fedpcd list` read from the source (a fresh process) prints what the imported registries give, line
    for line: every registered name of every kind, with its description."""
    done = subprocess.run([sys.executable, "-c", LISTING], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    light, torch_loaded = done.stdout.rsplit("\n", 2)[0] + "\n", done.stdout.splitlines()[-1]
    assert torch_loaded == "False"
    assert "torch" in sys.modules  # here the registries are imported: `fedpcd list` reads them
    assert main(["list"]) == 0
    assert light == capsys.readouterr().out
    listed = {(line.split()[0], line.split()[1]) for line in light.splitlines()}
    labels = {
        "algorithm": "algorithm",
        "model": "model",
        "dataset": "dataset",
        "partition scheme": "partition",
    }
    registered = {(labels[kind], name) for kind in HOMES for name in registry(kind).names()}
    assert listed == registered


@pytest.mark.slow
def test_the_cold_start_benchmark_reports_every_command_against_the_interpreter(tmp_path, monkeypatch):
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))  # cold_start.py reads the machine with demo_time.py beside it
    spec = importlib.util.spec_from_file_location("_bench_cold_start", bench / "cold_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "cold_start.json"
    module.main(["--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    rows = {row["command"]: row for row in report["rows"]}
    assert report["count"] == len(rows) and "fedpcd list fedavg" in rows and "fedpcd config show" in rows
    reference = report["rows"][0]
    assert reference["command"] == 'python -c "pass"' and reference["ratio"] == 1.0
    assert all(row["ratio"] == row["seconds"] / reference["seconds"] > 0 for row in report["rows"])


def test_the_algorithms_import_no_scipy_matplotlib_or_pandas():
    """Every run, pool worker and `config show` imports every algorithm module: the libraries only a few
    algorithms or the reports use load where they are used (SciPy's optimisers alone take 0.4 s)."""
    code = "import sys, json, fedpcd.algorithms, fedpcd.backends; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not loaded & {"scipy", "matplotlib", "pandas", "sklearn"}
