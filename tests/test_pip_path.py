"""What a user of the installed package meets without the repository: the configs it ships (one copy, which
the repository's configs/ links to), `fedpcd init`, `fedpcd config show`, `fedpcd list configs`, --config
taking a shipped config's name, and the -v/-q verbosity of every command."""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

import fedpcd.api
import fedpcd.backends
import fedpcd.logs
import fedpcd.sweep
import fedpcd.sweep.run
from fedpcd.cli import main
from fedpcd.cli_args import INIT_FILE
from fedpcd.config_identity import config_yaml
from fedpcd.config_input import config_path, shipped_configs
from fedpcd.errors import UserError
from fedpcd.listing import LIST_WIDTH
from fedpcd.resolve import load_config
from fedpcd.sweep.grid import expand_sweep

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_CONFIGS = resources.files("fedpcd") / "configs"
EXAMPLE = PACKAGE_CONFIGS / "example.yaml"


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_the_package_holds_the_configs_and_the_repository_links_to_them():
    paper = {p.name for p in (PACKAGE_CONFIGS / "paper").iterdir()}
    assert EXAMPLE.is_file() and (PACKAGE_CONFIGS / "demo.yaml").is_file()
    assert {"fedgela-cifar10-full.yaml", "fedmr-fmnist-p5c2.yaml", "fednh-cifar10.yaml"} <= paper
    assert {"fedsc-cifar10.yaml", "fedssa-cifar100-n50.yaml"} <= paper and len(paper) >= 40
    assert (PACKAGE_CONFIGS / "headline" / "fedsc-fmnist.yaml").is_file()
    assert (PACKAGE_CONFIGS / "repro" / "fednh-fmnist.yaml").is_file()
    # one copy in the repository: configs/ is a relative link to the package's folder
    link = ROOT / "configs"
    assert link.is_symlink() and os.readlink(link) == "src/fedpcd/configs"
    assert link.resolve() == Path(str(PACKAGE_CONFIGS)).resolve()


def test_the_wheel_takes_every_shipped_yaml():
    """pyproject's package data for fedpcd matches every .yaml below configs/ (setuptools globs it as
    Path.glob does: ``**`` is any number of folders, none included)."""
    table = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    patterns = re.search(r"^fedpcd = \[(.*)\]$", table, re.MULTILINE)[1]
    package = Path(str(resources.files("fedpcd")))
    taken = {p for pattern in re.findall(r'"([^"]+)"', patterns) for p in package.glob(pattern)}
    shipped = set((package / "configs").rglob("*.yaml"))
    assert shipped <= taken and len(shipped) == len(shipped_configs()) >= 70


def test_shipped_configs_are_named_by_their_path_without_yaml():
    shipped = shipped_configs()
    assert list(shipped) == sorted(shipped)
    assert shipped["example"] == EXAMPLE
    assert shipped["paper/fedgela-cifar10-full"] == PACKAGE_CONFIGS / "paper" / "fedgela-cifar10-full.yaml"
    assert all(p.suffix == ".yaml" and p.is_file() for p in shipped.values())


def test_config_takes_a_shipped_name_where_no_such_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("example", "example.yaml"):
        assert config_path(name) == str(EXAMPLE)
    assert config_path("headline/fedsc-fmnist") == str(PACKAGE_CONFIGS / "headline" / "fedsc-fmnist.yaml")
    assert config_path("paper/fedgela-cifar10-full.yaml").endswith("configs/paper/fedgela-cifar10-full.yaml")
    # a path that exists wins, whatever it holds
    Path("example").write_text("rounds: 3\n")
    assert config_path("example") == "example"
    assert load_config(config_path("example")).rounds == 3
    # neither a file nor a name: one line naming it and where the names are
    with pytest.raises(UserError, match=r"^config file not found: exampel; .*`fedpcd list configs`"):
        config_path("exampel")
    Path("paper").mkdir()  # a folder is no config: the shipped name would be paper/...
    with pytest.raises(UserError, match=r"^--config paper is a folder, not a config file; "):
        config_path("paper")
    with pytest.raises(
        UserError, match=r"^config file not found: configs/example.yaml; .* --config example$"
    ):
        config_path("configs/example.yaml")  # the docs' path outside a clone
    with pytest.raises(UserError, match=r"^config file not found: \.\./example; "):
        config_path("../example")  # no name reaches outside the shipped folder


def test_every_command_with_a_config_takes_a_shipped_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", "--config", "example", "rounds=4"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rounds"] == 4
    out = tmp_path / "grid"
    assert main(["sweep", "--config", "repro/fedmr-fmnist", "--dry-run", f"output_dir={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = expand_sweep(PACKAGE_CONFIGS / "repro" / "fedmr-fmnist.yaml", [f"output_dir={out}"])
    assert lines == [f"new     {c.output_dir}" for c in runs]
    seen = []

    def run_experiment(config, progress):
        seen.append(config)
        return {"final": {}, "best": {}, "wall_s": 0.0}

    monkeypatch.setattr(fedpcd.backends, "run_experiment", run_experiment)
    assert main(["run", "--config", "example", "rounds=2"]) == 0
    assert seen[0].rounds == 2 and seen[0].output_dir == "runs/example"
    for command in (["run"], ["partition"], ["sweep"], ["config", "show"]):
        assert main([*command, "--config", "no-such-config"]) == 2
        line = _error_line(capsys)
        assert line.startswith("fedpcd: error: config file not found: no-such-config;")
        assert line.endswith("(`fedpcd list configs` shows them)")


def test_the_api_takes_a_shipped_name_as_the_command_line_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here: a pip user's working folder
    assert fedpcd.load_config("example") == load_config(str(EXAMPLE))
    assert fedpcd.load_config("demo.yaml", ["seed=1"]).seed == 1
    with pytest.raises(UserError, match=r"^config file not found: configs/example.yaml; .* --config example"):
        fedpcd.load_config("configs/example.yaml")
    small = {"dataset__name": "digits", "model__name": "mlp", "model__hidden": 4, "clients": 2}
    result = fedpcd.run("example", rounds=1, output_dir="runs/api", **small)
    assert result.config.rounds == 1 and result.config.local.lr == load_config(str(EXAMPLE)).local.lr
    swept = []
    monkeypatch.setattr(fedpcd.sweep.run, "run_sweep", lambda path, items, jobs: swept.append((path, items)))
    with pytest.raises(UserError, match="no sweep index"):  # nothing ran: no index to return
        fedpcd.api.sweep("repro/fedmr-fmnist", overrides={"rounds": 1})
    assert swept == [(str(PACKAGE_CONFIGS / "repro" / "fedmr-fmnist.yaml"), ["rounds=1"])]


def test_init_writes_the_example_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    written = tmp_path / INIT_FILE
    assert written.read_text() == EXAMPLE.read_text()
    said = (
        "wrote fedpcd.yaml: every config key with its default; run it with: fedpcd run --config fedpcd.yaml"
    )
    assert capsys.readouterr().out == said + "\n"
    # the example holds every key at its default: the config it makes is the default config
    assert config_yaml(load_config(written)) == config_yaml(load_config())
    written.write_text("rounds: 7\n")
    assert main(["init", "."]) == 2
    assert _error_line(capsys) == (
        "fedpcd: error: fedpcd.yaml already exists; fedpcd init leaves it as it is (remove it, or give "
        "another DIR)"
    )
    assert written.read_text() == "rounds: 7\n"
    assert main(["init", "new/folder"]) == 0  # made where missing
    assert (tmp_path / "new" / "folder" / INIT_FILE).read_text() == EXAMPLE.read_text()
    (tmp_path / "file").write_text("")
    assert main(["init", "file"]) == 2  # a file where the folder should be: one line, nothing written
    assert "file is a file, not a folder" in _error_line(capsys)


def test_config_show_prints_what_a_run_writes_as_config_yaml(tmp_path, capsys):
    assert main(["config", "show"]) == 0
    assert capsys.readouterr().out == config_yaml(load_config())
    argv = ["--config", str(EXAMPLE), "rounds=3", "algorithm.name=fednh"]
    assert main(["config", "show", *argv]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == load_config(str(EXAMPLE), argv[2:]).to_dict()
    assert shown["rounds"] == 3 and shown["algorithm"]["name"] == "fednh" and shown["algorithm"]["rho"] == 0.9
    # a sweep file: each run's config, one YAML document each, in the grid's order
    assert main(["config", "show", "--config", "repro/fedmr-fmnist", "rounds=2"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    runs = expand_sweep(PACKAGE_CONFIGS / "repro" / "fedmr-fmnist.yaml", ["rounds=2"])
    assert docs == [c.to_dict() for c in runs] and len(docs) > 1
    assert main(["config", "show", "colour=red"]) == 2
    assert "unknown config key 'colour'" in _error_line(capsys)


def test_list_configs_names_each_shipped_config_with_its_first_sentence(capsys):
    assert main(["list", "configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shipped = shipped_configs()
    width = max(map(len, shipped)) + 2
    assert [line[:width].rstrip() for line in lines] == list(shipped)
    assert (
        f"{'example':<{width}}Every key of a fedpcd config with its default (docs/design.md section 7)."
        in lines
    )
    assert all(len(line) <= LIST_WIDTH and len(line) > width for line in lines)


@pytest.fixture
def verbosity(monkeypatch) -> list[int]:
    """The verbosities the command line sets up its log with."""
    seen: list[int] = []
    monkeypatch.setattr(fedpcd.logs, "setup", seen.append)
    return seen


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["list", "configs"], 0),
        (["-v", "list", "configs"], 1),
        (["list", "configs", "-vv"], 2),
        (["-v", "list", "-v", "configs", "--verbose"], 3),
        (["-q", "list", "configs"], -1),
        (["-vv", "list", "configs", "--quiet"], 1),
        (["config", "show", "-q", "-q"], -2),
    ],
)
def test_verbosity_is_the_count_of_v_less_q_before_or_after_the_command(argv, level, verbosity, capsys):
    assert main(argv) == 0
    assert verbosity == [level]


def test_quiet_still_hides_the_progress_bar_of_run_and_demo(monkeypatch, verbosity, capsys):
    shown: list[bool] = []  # whether each command shows its progress bar

    def run_experiment(config, progress: bool) -> dict:
        shown.append(progress)
        return {"final": {}, "best": {}, "wall_s": 0.0}

    def run_demo(root, overrides, progress: bool) -> str:
        shown.append(progress)
        return ""

    monkeypatch.setattr(fedpcd.backends, "run_experiment", run_experiment)
    monkeypatch.setattr("fedpcd.demo.run_demo", run_demo)

    for argv in (["run", "--quiet"], ["-q", "run"], ["run"], ["-v", "run"], ["demo", "-q"], ["demo"]):
        assert main([*argv, "dataset.name=synthetic"]) == 0
    assert shown == [False, False, True, True, False, True]
    assert verbosity == [-1, -1, 0, 1, -1, 0]
