"""The documentation site builds, and the tutorial notebook runs (the ``docs`` extra: mkdocs, nbclient).

``mkdocs build --strict`` fails on any warning: a nav entry without its page, a broken link or anchor, a
docstring mkdocstrings cannot render. Links that leave the site (``../configs/example.yaml``: repository
files outside docs/, or files the site excludes) are reported by mkdocs as info (mkdocs.yml, ``validation``);
each of them must name a file that exists in the repository. The notebook runs with nbclient on this
interpreter in a temporary folder, and what it computed is checked against the run directories it wrote.
"""

from __future__ import annotations

import json
import os
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

requires_mkdocs = pytest.mark.skipif(
    find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install -e '.[docs]')"
)
requires_nbclient = pytest.mark.skipif(
    find_spec("nbclient") is None or find_spec("ipykernel") is None,
    reason="nbclient / ipykernel are not installed (pip install -e '.[docs]')",
)

# mkdocs' messages for a link to what is not in the site: a file, a folder, an excluded file
OFF_SITE = [
    re.compile(
        r"Doc file '([^']+)' contains a link '([^']+)', but the target(?: '[^']*')? is not found among "
        r"documentation files"
    ),
    re.compile(r"Doc file '([^']+)' contains an unrecognized relative link '([^']+)', it was left as is"),
    re.compile(r"Doc file '([^']+)' contains a link to '([^']+)' which is excluded from the built site"),
]
ARCHIVE = DOCS / "results" / "runs"  # exclude_docs in mkdocs.yml


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


@requires_mkdocs
def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    build = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    done = subprocess.run(
        [*build, "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]

    # a link the site cannot serve must name a file or folder of the repository that the site leaves out:
    # outside docs/, or in the archive of runs
    bad = []
    for message in OFF_SITE:
        for page, link in message.findall(log):
            relative = unquote(urlsplit(link).path)
            target = Path(os.path.normpath((DOCS / page).parent / relative))
            if message is OFF_SITE[2]:  # mkdocs names the excluded file relative to docs/
                target = DOCS / relative
            off_site = not target.is_relative_to(DOCS) or target.is_relative_to(ARCHIVE)
            if not (off_site and target.exists()):
                bad.append(f"{page}: {link}")
    assert not bad, "links to what is neither in the site nor in the repository:\n" + "\n".join(bad)

    # every nav page was built, and the API reference rendered the Python API from its docstrings
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    for page in _nav_pages(config["nav"]):
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), page
    api = (site / "api" / "index.html").read_text()
    for name in ("fedpcd.api.run", "fedpcd.api.load_runs", "fedpcd.api.partition", "fedpcd.api.RunResult"):
        assert f'id="{name}"' in api, name
    assert not (site / ARCHIVE.relative_to(DOCS)).exists()  # the archive of runs stays out of the site


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

    # the layout it expects (it runs in notebooks/, the configs one level up), and a kernel on this
    # interpreter whatever kernels the machine has registered; its temporary run folder lands in tmp_path
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "example.yaml", tmp_path / "configs")
    (tmp_path / "notebooks").mkdir()
    kernel = tmp_path / "jupyter" / "kernels" / "fedpcd-test"
    kernel.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (kernel / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "fedpcd", "language": "python"})
    )
    for var, folder in [
        ("JUPYTER_PATH", "jupyter"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
        ("TMPDIR", "tmp"),
    ]:
        (tmp_path / folder).mkdir(exist_ok=True)
        monkeypatch.setenv(var, str(tmp_path / folder))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    NotebookClient(
        nb,
        kernel_name="fedpcd-test",
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
