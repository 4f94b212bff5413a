"""The documentation site builds, with the tutorial notebook executed, and links to nothing it lacks (the
``docs`` extra: mkdocs, mkdocs-jupyter, nbclient).

``mkdocs build --strict`` fails on any warning: a nav entry without its page, a link to what the site lacks,
a broken anchor, a docstring mkdocstrings cannot render; and on a notebook cell that raises. docs/hooks.py
gives the pages' links into the rest of the repository (archived runs, repository files, the notebook) pages
of the site: checked on a small site built here, then on the real one, where every relative link of every
built page must name a file of the site, the API reference must show parameter sections and no reST
markup, and the notebook page its outputs. The notebook also runs with nbclient on this interpreter in a
temporary folder, and what it computed is checked against the run directories it wrote.
"""

from __future__ import annotations

import html
import inspect
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
import yaml

from conftest import requires_fmnist

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOK = ROOT / "notebooks" / "tutorial.ipynb"
ARCHIVED = DOCS / "results" / "runs" / "fedgela-fmnist-p5c2-code"  # three small archived runs

requires_mkdocs = pytest.mark.skipif(
    find_spec("mkdocs") is None or find_spec("mkdocs_jupyter") is None,
    reason="mkdocs / mkdocs-jupyter are not installed (pip install -e '.[docs]')",
)
requires_nbclient = pytest.mark.skipif(
    find_spec("nbclient") is None or find_spec("ipykernel") is None,
    reason="nbclient / ipykernel are not installed (pip install -e '.[docs]')",
)


def _jupyter_env(tmp_path: Path) -> dict[str, str]:
    """Variables that make the kernel `python3` this interpreter, whatever kernels the machine has
    registered, and keep Jupyter's files and the notebook's temporary run folder in tmp_path."""
    kernel = tmp_path / "jupyter" / "kernels" / "python3"
    kernel.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (kernel / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "fedpcd", "language": "python"})
    )
    env = {"OMP_NUM_THREADS": "1"}
    for var, folder in [
        ("JUPYTER_PATH", "jupyter"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
        ("TMPDIR", "tmp"),
    ]:
        (tmp_path / folder).mkdir(exist_ok=True)
        env[var] = str(tmp_path / folder)
    return env


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _dead_links(site: Path) -> list[str]:
    """'page: link' for every relative link and image of the built pages that names no file of the site."""
    dead = []
    for page in sorted(site.rglob("*.html")):
        for link in re.findall(r'(?:href|src)="([^"]*)"', page.read_text(encoding="utf-8")):
            parts = urlsplit(html.unescape(link))
            if parts.scheme or parts.netloc or not parts.path:
                continue
            base = site if parts.path.startswith("/") else page.parent
            target = base / unquote(parts.path).lstrip("/")
            if not (target / "index.html" if target.is_dir() else target).is_file():
                dead.append(f"{page.relative_to(site)}: {link}")
    return dead


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


# ----- docs/hooks.py, on a small site ---------------------------------------------------------------------


def _small_project(tmp_path: Path, links: str) -> Path:
    """A repository with a results page holding ``links``, two archived run folders (one with a committed
    report), the leaderboard's archive, a config file, and mkdocs.yml's exclusions and validation."""
    project = tmp_path / "project"
    results = project / "docs" / "results"
    for name in ("fresh", "reported"):
        shutil.copytree(ARCHIVED, results / "runs" / name)
    (results / "runs" / "leaderboard-fmnist").mkdir()
    (results / "reported-report").mkdir()
    (results / "reported-report" / "report.md").write_text("# Reported\n\n## Curves\n")
    (results / "page.md").write_text(f"# Page\n\n{links}\n")
    (project / "docs" / "index.md").write_text("# Home\n")
    (project / "docs" / "leaderboard.md").write_text("# Leaderboard\n")
    (project / "configs").mkdir()
    (project / "configs" / "small.yaml").write_text("rounds: 3  # <b>\n")
    real = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config = {key: real[key] for key in ("strict", "exclude_docs", "not_in_nav", "validation")}
    config |= {
        "site_name": "small",
        "hooks": [str(DOCS / "hooks.py")],
        "nav": ["index.md", "leaderboard.md", "results/page.md"],
    }
    (project / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return project


def _build(project: Path) -> Path:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    site = project / "site"
    build(load_config(str(project / "mkdocs.yml"), site_dir=str(site)))
    return site


@requires_mkdocs
def test_links_into_the_repository_get_pages_of_the_site(tmp_path):
    from fedpcd.report.document import write_report

    links = (
        "[fresh](runs/fresh) [reported](runs/reported#curves) [board](runs/leaderboard-fmnist) "
        "[config](../../configs/small.yaml)"
    )
    project = _small_project(tmp_path, links)
    site = _build(project)
    page = (site / "results" / "page" / "index.html").read_text()
    for href in [
        "../fresh-report/report/",
        "../reported-report/report/#curves",
        "../../leaderboard/",
        "../../repository/configs/small.yaml/",
    ]:
        assert f'href="{href}"' in page, href
    assert _dead_links(site) == []

    # an archive without a committed report: the report fedpcd report prints, made from it during the build
    fresh = (site / "results" / "fresh-report" / "report" / "index.html").read_text()
    assert "Runs below docs/results/runs/fresh: metrics in %" in _text(fresh)
    table = write_report(project / "docs" / "results" / "runs" / "fresh", None, 5).splitlines()
    row = [line for line in table if line.startswith("| ")][-1]  # its one setting
    for cell in row.strip("|").split("|"):
        assert f"<td>{html.escape(cell.strip(), quote=False)}</td>" in fresh, cell
    # a repository file: its text, escaped, in a code block
    config = (site / "repository" / "configs" / "small.yaml" / "index.html").read_text()
    assert "rounds: 3  # &lt;b&gt;" in config
    assert not (site / "results" / "runs").exists()


@requires_mkdocs
@pytest.mark.parametrize("link", ["runs/missing", "../../configs/missing.yaml", "runs/fresh/seed0.json"])
def test_a_link_to_what_the_site_lacks_fails_the_build(tmp_path, link):
    from mkdocs.exceptions import Abort

    project = _small_project(tmp_path, f"[gone]({link})")
    with pytest.raises(Abort):
        _build(project)


# ----- the site ---------------------------------------------------------------------------------------------


STARS = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}


def _undocumented_parameters(api: str) -> list[str]:
    """'object: parameter' for each parameter of a function or method on the API page without a row in its
    Parameters table."""
    headings = [
        (m.start(), m.group(1))
        for m in re.finditer(r'<h\d id="(fedpcd\.[\w.]+)" class="doc doc-heading">', api)
    ]
    missing = []
    for k, (start, name) in enumerate(headings):
        block = api[start : headings[k + 1][0] if k + 1 < len(headings) else len(api)]
        obj = pkgutil.resolve_name(name)
        if not (inspect.isfunction(obj) or inspect.ismethod(obj)):
            continue
        rows = {
            _text(row).strip()
            for row in re.findall(r'<tr class="doc-section-item">\s*<td>(.*?)</td>', block, re.S)
        }
        for parameter in inspect.signature(obj).parameters.values():
            shown = STARS.get(parameter.kind, "") + parameter.name  # as the table shows it: **values
            if parameter.name not in ("self", "cls") and shown not in rows:
                missing.append(f"{name}: {parameter.name}")
    return missing


def _split_returns(api: str) -> list[str]:
    """The objects on the API page whose Returns or Yields section has several items: a return value
    described over several lines whose later lines are not indented (Google style) renders as one item per
    line."""
    split = []
    for name, section in re.findall(
        r'<h\d id="(fedpcd\.[\w.]+)" class="doc doc-heading">(?:(?!<h\d id=").)*?'
        r'doc-section-title">(?:Returns|Yields):</span>((?:(?!<h\d id=").)*?)</table>',
        api,
        re.S,
    ):
        if section.count('<tr class="doc-section-item">') > 1:
            split.append(name)
    return split


@pytest.mark.slow
@requires_mkdocs
@requires_nbclient
@requires_fmnist
def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **_jupyter_env(tmp_path), "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]

    # every nav page was built, every link of the site resolves, the archive of runs stays out
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    for page in _nav_pages(config["nav"]):
        built = site / ("index.html" if page == "index.md" else page.rsplit(".", 1)[0] + "/index.html")
        assert built.is_file(), page
    assert _dead_links(site) == []
    assert not (site / "results" / "runs").exists()
    fedgela = (site / "results" / "fedgela" / "index.html").read_text()
    assert 'href="../fedgela-fmnist-report/report/"' in fedgela  # the archived runs' report

    # the API reference: the Python API, parameter sections, no reST roles or literal blocks left raw
    api = (site / "api" / "index.html").read_text()
    for name in ("fedpcd.api.run", "fedpcd.api.load_runs", "fedpcd.api.partition", "fedpcd.api.RunResult"):
        assert f'id="{name}"' in api, name
    assert _undocumented_parameters(api) == []
    assert _split_returns(api) == []
    text = _text(api[api.index("<article") :])
    assert not re.findall(r"[\s\S]{0,40}:(?:class|func|meth|data|attr|mod|exc|obj):[\s\S]{0,40}", text)
    assert not re.findall(r"[\s\S]{0,40}::[\s\S]{0,40}", text)

    # the notebook, executed: the config it printed, the runs' DataFrame, the heat-maps
    notebook = (site / "notebooks" / "tutorial" / "index.html").read_text()
    assert "partition:" in _text(notebook) and 'class="dataframe"' in notebook
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', notebook)) == 1
    assert list((tmp_path / "tmp").glob("fedpcd-tutorial-*/fednh/summary.json"))  # its runs, in TMPDIR


# Appended to the notebook in memory: what it computed, as one JSON line.
PROBE = """\
import json
print(json.dumps({
    "out": str(OUT),
    "comparison": comparison.to_dict(orient="records"),
    "heatmaps": {title: counts.tolist() for title, counts in heatmaps.items()},
}))"""


@pytest.mark.slow
@requires_nbclient
@requires_fmnist
def test_tutorial_notebook_runs(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    from fedpcd.data.datasets import load_dataset

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), (
        "commit it without outputs"
    )

    # an empty folder (its config is the shipped example, by name), and a kernel on this interpreter whatever
    # kernels the machine has registered; its temporary run folder lands in tmp_path
    (tmp_path / "notebooks").mkdir()
    for var, value in _jupyter_env(tmp_path).items():
        monkeypatch.setenv(var, value)

    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(tmp_path / "notebooks")}},
    ).execute()
    printed = "".join(out.get("text", "") for out in nb.cells[-1].outputs if out.output_type == "stream")
    seen = json.loads(printed)
    out = Path(seen["out"])
    assert out.parent == tmp_path / "tmp"

    # GA and PA-split of both algorithms at both rounds, exactly as the runs recorded them
    rows = seen["comparison"]
    assert sorted((r["algorithm"], r["round"]) for r in rows) == [
        ("fedavg", 1),
        ("fedavg", 2),
        ("fednh", 1),
        ("fednh", 2),
    ]
    for r in rows:
        records = [
            json.loads(line) for line in (out / r["algorithm"] / "metrics.jsonl").read_text().splitlines()
        ]
        record = next(rec for rec in records if rec["round"] == r["round"])
        assert (r["GA"], r["PA-split"]) == (record["global_acc"], record["personal_acc"])
        assert 0 <= r["GA"] <= 1 and 0 <= r["PA-split"] <= 1

    # the runs used the notebook's overrides: P5C2 on the 2% stratified subset, client k holding 2k, 2k+1
    labels = load_dataset("fmnist").train_y.numpy()
    class_sizes = np.bincount(labels, minlength=10)
    for name in ("fedavg", "fednh"):
        config = yaml.safe_load((out / name / "config.yaml").read_text())
        assert (config["algorithm"]["name"], config["clients"], config["rounds"]) == (name, 5, 2)
        assert (config["dataset"]["train_fraction"], config["local"]["lr"]) == (0.02, 0.05)
        clients = json.loads((out / name / "partition.json").read_text())["clients"]
        for k, client in enumerate(clients):
            expected = [round(n * 0.02) if c in (2 * k, 2 * k + 1) else 0 for c, n in enumerate(class_sizes)]
            assert client["train_counts"] == expected

    # the heat-maps: every training sample once; Dirichlet's min_size; P10C2's classes in order, even shares
    maps = {title: np.array(counts) for title, counts in seen["heatmaps"].items()}
    assert list(maps) == ["Dir(0.5)", "Dir(0.1)", "P10C2"]
    for title, counts in maps.items():
        assert counts.shape == (10, 10) and (counts.sum(axis=0) == class_sizes).all(), title
    assert (maps["Dir(0.5)"].sum(axis=1) >= 10).all() and (maps["Dir(0.1)"].sum(axis=1) >= 10).all()
    held = maps["P10C2"] > 0
    assert (held.sum(axis=1) == 2).all()
    assert [set(np.flatnonzero(row)) for row in held[:5]] == [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}]
    for c in range(10):
        shares = maps["P10C2"][held[:, c], c]
        assert shares.max() - shares.min() <= 1  # np.array_split among the class's holders
