"""The wheel that `python -m build` makes, installed alone into a fresh environment, and plugins.

The slow tests build the wheel from a copy of the project's packaging inputs (pyproject.toml, README.md,
LICENSE, src/), check what it holds and `twine check` it, then make ONE virtual environment with the system
Python (module-scoped fixture ``venv``) holding torch and the wheel, nothing of this checkout: there they
run `fedpcd --version`, a short `fedpcd demo`, README's and getting-started's blocks in a fresh folder
(tests/doc_blocks.py), the tutorial notebook, and the plugin of docs/plugins.md (built from the page's own
blocks and installed as a package), seen by `fedpcd list` and by the worker processes of
`fedpcd sweep --jobs 2`. They are marked `release` (they install from the network): `make check-release`
runs them, not `make test`. The fast tests load entry points in-process through a replaced
``importlib.metadata.entry_points``: once and lazily, and a broken or clashing plugin as one line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import fedpcd.registry
from conftest import requires_fmnist
from doc_blocks import PAGES, block_code, blocks
from fedpcd.algorithms import ALGORITHMS, FedAvg
from fedpcd.cli import main
from fedpcd.data.datasets import DATASETS
from fedpcd.data.partition import PARTITIONERS
from fedpcd.declarations import declaration
from fedpcd.demo import DEMO_METHODS
from fedpcd.errors import UserError
from fedpcd.models import MODELS
from install_helpers import (
    INSTALL_TIMEOUT,
    ROOT,
    SYSTEM_PYTHON,
    clean_env,
    needs_system_python,
    torch_requirement,
)

PACKAGING_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "src")
# pyproject's [tool.setuptools.package-data] for fedpcd
PACKAGE_DATA = ("py.typed", "configs/**/*.yaml", "descriptions.json", "declarations.json")
PLUGIN_PAGE = ROOT / "docs" / "plugins.md"
# a marked block of the plugin page: the marker comment, then a fence whose title is the file's path
PLUGIN_BLOCK = re.compile(
    r"^<!-- plugin: (?P<path>[\w./]+) -->\n```\w+ title=\"(?P=path)\"\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
REGISTRIES = (ALGORITHMS, MODELS, DATASETS, PARTITIONERS)
PLUGIN_MODULES = ("fedpcd_acme", "fedpcd_test_")  # the plugins that the in-process tests import


def project_version() -> str:
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert found, "pyproject.toml sets [project] version"
    return found[1]


def write_plugin(folder: Path) -> Path:
    """The plugin package of docs/plugins.md, its files written from the page's marked blocks."""
    blocks = {m["path"]: m["code"] for m in PLUGIN_BLOCK.finditer(PLUGIN_PAGE.read_text(encoding="utf-8"))}
    assert {"pyproject.toml", "fedpcd_acme/algorithms.py", "fedpcd_acme/models.py"} <= set(blocks)
    for path, code in blocks.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(code, encoding="utf-8")
    return folder


# ---------------------------------------------------------------------------------------------------------
# The wheel and a fresh environment holding it


@dataclass(frozen=True)
class Built:
    wheel: Path
    tree: Path  # the copy of the packaging inputs it was built from


@dataclass(frozen=True)
class Venv:
    """A virtual environment made with the system Python; its commands run in ``cwd``, outside the
    checkout, with only the environment's bin/ and the system's on PATH and one torch thread."""

    root: Path
    cwd: Path

    def env(self) -> dict[str, str]:
        env = {**clean_env(self.root / "bin"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["VIRTUAL_ENV"] = str(self.root)  # as `source bin/activate` sets it
        env["MPLBACKEND"] = "Agg"
        # pip installs without compiling; the first process that imports a module caches its bytecode
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return env

    def run(
        self, program: str, *args: object, timeout: float = INSTALL_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.root / "bin" / program), *map(str, args)],
            cwd=self.cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, program: str, *args: object, timeout: float = INSTALL_TIMEOUT) -> str:
        """stdout of a command that must succeed (its output's end in the failure message)."""
        done = self.run(program, *args, timeout=timeout)
        assert done.returncode == 0, f"{program} {args}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        return done.stdout

    def pip_install(self, *what: object) -> None:
        self.ok("python", "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", *what)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """`python -m build --wheel` of a clean copy of the packaging inputs (no build/ or egg-info of this
    checkout can leak into it, and the checkout gets none)."""
    tree = tmp_path_factory.mktemp("source")
    for name in PACKAGING_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, tree / name)
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(tree)],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = dist.glob("*.whl")
    return Built(wheel, tree)


@pytest.fixture(scope="module")
def venv(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    """ONE fresh environment for this file: the system Python's venv holding torch, installed as `make
    install` installs it (`make torch`: the CPU build where PyTorch's CPU index answers), and the wheel (not
    the source tree, not editable). A test that needs more in it (e.g. to execute the notebook) installs
    that with ``venv.pip_install`` and runs it with ``venv.ok``."""
    root = tmp_path_factory.mktemp("venv")
    try:
        subprocess.run(
            [str(SYSTEM_PYTHON), "-m", "venv", str(root)],
            check=True,
            env=clean_env(),
            timeout=INSTALL_TIMEOUT,
        )
        env = Venv(root, tmp_path_factory.mktemp("cwd"))
        if shutil.which("make"):
            done = subprocess.run(
                ["make", "-s", "--no-print-directory", "torch", f"VIRTUAL_ENV={root}"],
                cwd=ROOT,
                env=clean_env(),
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT,
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        else:
            env.pip_install(torch_requirement())
        env.pip_install(built.wheel)
        yield env
    finally:
        # ~25000 files: deleting them can take minutes (a disk mounted with online discard), so a thread
        # does it while the session goes on (the interpreter waits for it at exit), not a later session's
        # clean-up of old temp dirs
        threading.Thread(target=shutil.rmtree, args=(root,), kwargs={"ignore_errors": True}).start()


@pytest.mark.slow
@pytest.mark.release
def test_the_wheel_holds_every_module_its_data_and_no_tests(built: Built):
    package = built.tree / "src" / "fedpcd"
    data = {p for pattern in PACKAGE_DATA for p in package.glob(pattern)}  # glob's ** spans 0+ folders
    expected = {
        f"fedpcd/{p.relative_to(package).as_posix()}"
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and (p.suffix == ".py" or p in data)
    }
    assert {
        "fedpcd/py.typed", "fedpcd/configs/demo.yaml", "fedpcd/configs/example.yaml", "fedpcd/cli.py",
        "fedpcd/configs/paper/fedgela-cifar10-full.yaml",
    } <= expected  # fmt: skip
    names = zipfile.ZipFile(built.wheel).namelist()
    info = f"fedpcd-{project_version()}.dist-info/"
    assert {n for n in names if n.startswith("fedpcd/")} == expected  # every subpackage found, no stray file
    elsewhere = [n for n in names if not n.startswith(("fedpcd/", info))]
    assert not elsewhere, elsewhere  # nothing from tests/ (or any other folder of the checkout)
    entry = zipfile.ZipFile(built.wheel).read(f"{info}entry_points.txt").decode()
    assert "fedpcd = fedpcd.cli:main" in entry.splitlines()


@pytest.mark.slow
@pytest.mark.release
def test_twine_check_passes(built: Built):
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(built.wheel)],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
    )
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.release
@needs_system_python
def test_the_fresh_environment_runs_fedpcd_from_the_wheel(venv: Venv):
    where = venv.ok(
        "python", "-c", "import fedpcd, sysconfig; print(fedpcd.__file__, sysconfig.get_paths()['purelib'])"
    ).split()
    module, site = Path(where[0]).resolve(), Path(where[1]).resolve()
    assert site.is_relative_to(venv.root.resolve()) and module == site / "fedpcd" / "__init__.py"
    assert venv.ok("fedpcd", "--version") == f"fedpcd {project_version()}\n"


@pytest.mark.slow
@pytest.mark.release
@needs_system_python
def test_the_demo_runs_from_the_packaged_config(venv: Venv):
    out = venv.cwd / "demo"
    small = ["rounds=1", "clients=4", "dataset.name=digits", "model.name=mlp", "model.hidden=16"]
    text = venv.ok("fedpcd", "demo", "--quiet", "--out", out, *small)
    summaries = sorted(out.glob("*/summary.json"))
    assert len(summaries) == len(DEMO_METHODS) and (out / "curves.png").is_file(), text
    assert all(json.loads(s.read_text())["rounds"] == 1 for s in summaries)


@pytest.mark.slow
@pytest.mark.release
@needs_system_python
def test_a_plugin_package_is_seen_by_list_and_by_sweep_workers(venv: Venv):
    venv.pip_install(write_plugin(venv.cwd / "plugin"))
    listed = venv.ok("fedpcd", "list").splitlines()
    assert [line.split()[:2] for line in listed if "plugin_" in line] == [
        ["algorithm", "plugin_avg"],
        ["model", "plugin_linear"],
    ]
    sweep = venv.cwd / "sweep.yaml"
    sweep.write_text(
        "dataset: {name: digits}\nmodel: {name: plugin_linear}\nalgorithm: {name: plugin_avg}\n"
        f"clients: 3\nrounds: 1\noutput_dir: {venv.cwd / 'sweep'}\nsweep:\n  seed: [0, 1]\n"
    )
    text = venv.ok("fedpcd", "sweep", "--config", sweep, "--jobs", 2)
    assert "sweep: all 2 runs finished" in text, text
    runs = sorted((venv.cwd / "sweep").glob("*/summary.json"))
    assert len(runs) == 2 and all(json.loads(s.read_text())["rounds"] == 1 for s in runs)
    for summary in runs:
        config = (summary.parent / "config.yaml").read_text()
        assert "name: plugin_avg" in config and "name: plugin_linear" in config


NOTEBOOK_CHECK = """
import os, nbformat
from nbclient import NotebookClient
folders = {"JUPYTER_PATH": "jupyter", "JUPYTER_RUNTIME_DIR": "runtime", "IPYTHONDIR": "ipython"}
for var, folder in folders.items():
    os.makedirs(folder, exist_ok=True)
    os.environ[var] = os.path.abspath(folder)  # Jupyter's files in the working folder, not in $HOME
nb = nbformat.read("notebooks/tutorial.ipynb", as_version=4)
nb.cells.append(nbformat.v4.new_code_cell("import fedpcd; print(fedpcd.__file__, len(comparison))"))
client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": "notebooks"}})
client.execute()
print("".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream"))
"""


@pytest.mark.slow
@pytest.mark.release
@needs_system_python
@requires_fmnist
def test_the_tutorial_notebook_runs_in_the_fresh_environment(venv: Venv):
    """The docs' notebook, executed by the wheel environment's own python3 kernel (not this checkout's)."""
    venv.pip_install("nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29")
    (venv.cwd / "notebooks").mkdir(exist_ok=True)
    shutil.copy(ROOT / "notebooks" / "tutorial.ipynb", venv.cwd / "notebooks")  # alone: no configs/ here
    (venv.cwd / "run_notebook.py").write_text(NOTEBOOK_CHECK)
    module, rows = venv.ok("python", "run_notebook.py").split()[-2:]
    assert Path(module).resolve().is_relative_to(venv.root.resolve())  # the wheel's fedpcd ran it
    assert int(rows) > 0  # the notebook's GA / PA-split comparison has rows


@pytest.mark.slow
@pytest.mark.release
@needs_system_python
@requires_fmnist
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_blocks_run_from_the_wheel_in_a_fresh_folder(venv: Venv, page: str):
    """What a reader of the page runs after `pip install` (every bash and python block but those marked
    `skip` or `clone`), as written (shortened where a `with` directive says so), in order, in an empty
    folder, with the wheel environment's bin/ first on PATH: no file of this checkout is there."""
    folder = venv.cwd / "pages" / page.replace("/", "-")
    folder.mkdir(parents=True)
    ran = 0
    for block in blocks(page):
        if block.lang == "yaml" and block.save_as:
            (folder / block.save_as).write_text(block.code, encoding="utf-8")
        elif block.runs and not block.in_clone:
            code = block_code(block)
            cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
            if block.lang == "python":
                cmd = [str(venv.root / "bin" / "python"), "-c", code]
            done = subprocess.run(
                cmd, cwd=folder, env=venv.env(), capture_output=True, text=True, timeout=INSTALL_TIMEOUT
            )
            output = f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
            assert done.returncode == 0, f"{block} failed:\n{code}\n--- output ---\n{output}"
            ran += 1
    assert ran >= 2
    assert not (folder / "configs").exists()  # the commands took the shipped configs by name


# ---------------------------------------------------------------------------------------------------------
# Entry-point loading, in-process


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[dict, list[str]]]:
    """(entry points by group, the groups asked for): the registries start afresh (restored afterwards),
    ``entry_points`` returns what a test puts in the dict, and ``tmp_path`` is importable (the plugin
    modules imported from there are forgotten afterwards)."""
    for registry in REGISTRIES:
        monkeypatch.setattr(registry, "_items", dict(registry._items))
        monkeypatch.setattr(registry, "_plugins_loaded", False)
        monkeypatch.setattr(registry, "_plugin_error", None)
    by_group: dict[str, list[EntryPoint]] = {}
    asked: list[str] = []

    def entry_points(*, group: str) -> list[EntryPoint]:
        asked.append(group)
        return by_group.get(group, [])

    monkeypatch.setattr(fedpcd.registry, "entry_points", entry_points)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield by_group, asked
    for name in set(sys.modules) - before:
        if name.startswith(PLUGIN_MODULES):
            del sys.modules[name]


def test_plugins_are_imported_once_on_the_first_lookup_and_listed(plugins, tmp_path, capsys):
    by_group, asked = plugins
    write_plugin(tmp_path)
    by_group["fedpcd.algorithms"] = [EntryPoint("acme", "fedpcd_acme.algorithms", "fedpcd.algorithms")]
    assert "fedpcd_acme.algorithms" not in sys.modules  # nothing imported before a registry is queried
    assert main(["list"]) == 0
    assert sorted(asked) == ["fedpcd.algorithms", "fedpcd.datasets", "fedpcd.models", "fedpcd.partitions"]
    cls = ALGORITHMS.get("plugin_avg")
    assert cls.__module__ == "fedpcd_acme.algorithms" and issubclass(cls, FedAvg)
    doc = cls.__doc__.splitlines()[0]
    assert f"{'algorithm':<10} {'plugin_avg':<14} {doc}" in capsys.readouterr().out.splitlines()
    plugin, fedavg = declaration("algorithm", "plugin_avg"), declaration("algorithm", "fedavg")
    assert plugin.spec.defaults == fedavg.spec.defaults  # FedAvg's hyperparameters, read from the plugin
    ALGORITHMS.names()
    assert len(asked) == 4  # once per registry and process


@pytest.mark.parametrize(
    ("module", "code", "raised"),
    [
        ("fedpcd_test_missing", None, "ModuleNotFoundError: No module named 'fedpcd_test_missing'"),
        (
            "fedpcd_test_raises",
            "raise RuntimeError('first line\\n  second line')",
            "RuntimeError: first line second line",
        ),
        (  # registers a built-in's name (after a lookup of its own while it loads)
            "fedpcd_test_clash",
            "from fedpcd.algorithms import ALGORITHMS\n"
            "ALGORITHMS.register('fedavg')(ALGORITHMS.get('fedprox'))",
            "ValueError: algorithm 'fedavg' is already registered by fedpcd.algorithms.fedavg",
        ),
    ],
)
def test_a_broken_plugin_is_one_line_naming_it(plugins, tmp_path, capsys, module, code, raised):
    by_group, _ = plugins
    if code is not None:
        (tmp_path / f"{module}.py").write_text(code + "\n")
    by_group["fedpcd.algorithms"] = [EntryPoint("broken", module, "fedpcd.algorithms")]
    message = f"plugin 'broken' (fedpcd.algorithms = {module}) failed to load: {raised}"
    with pytest.raises(UserError) as first:
        ALGORITHMS.get("fedavg")
    assert str(first.value) == message
    assert main(["list"]) == 2  # every later lookup says the same
    assert capsys.readouterr().err == f"fedpcd: error: {message}\n"
