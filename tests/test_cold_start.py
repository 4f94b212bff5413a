"""The command line answers help, input errors, `init` and the listings without importing torch.

Each command runs in one fresh interpreter (this test process has torch loaded already), which reports after
each command its exit code and whether torch is in ``sys.modules``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from fedpcd.catalog import HOMES, registry
from fedpcd.cli import main
from fedpcd.cli_args import build_parser

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
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(commands)], cwd=cwd, capture_output=True, text=True
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
    ]
    results = _run([argv for argv, _ in expected], tmp_path)
    assert [(argv, code) for argv, code, _ in results] == [(argv, code) for argv, code in expected]
    assert [argv for argv, _, torch in results if torch] == []
    assert (tmp_path / "fedpcd.yaml").is_file()


@pytest.mark.slow
def test_the_registries_still_load_after_a_light_start(tmp_path):
    """`fedpcd list NAME` of an algorithm imports what it describes (its module, torch with it)."""
    results = _run([["list", "configs"], ["list"], ["list", "fedavg"]], tmp_path)
    assert [(code, torch) for _, code, torch in results] == [(0, False), (0, False), (0, True)]


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
