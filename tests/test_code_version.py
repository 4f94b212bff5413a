"""Every run records the code that made it, and a paired comparison of runs made by different code says so."""

from __future__ import annotations

import json
import re

from fedpcd.config import load_config
from fedpcd.engine.simulation import run_local
from fedpcd.report.document import write_report
from fedpcd.run_format import CODE, RESULTS_VERSION, code_version, same_code

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "clients=3", "rounds=2"]


def test_same_code_needs_the_same_commit_and_results_number():
    a = {"fedpcd": "0.1.0", "commit": "abc", "results": 1}
    assert same_code(a, dict(a)) and same_code({**a, "fedpcd": "0.2.0"}, a)  # the version string is a label
    assert not same_code(a, {**a, "commit": "abd"}) and not same_code(a, {**a, "results": 2})
    assert not same_code(None, a) and not same_code(None, None)  # unrecorded matches nothing


def test_a_run_records_its_code_and_the_report_flags_pairs_made_by_different_code(tmp_path):
    for name in ("fedavg", "fedprox"):
        args = [*SMALL, f"algorithm.name={name}", f"output_dir={tmp_path / name}"]
        run_local(load_config(None, args), progress=False)
    code = json.loads((tmp_path / "fedavg" / "summary.json").read_text())[CODE]
    assert code == code_version() and code["results"] == RESULTS_VERSION
    assert code["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", code["commit"])
    assert "made by different code" not in write_report(tmp_path, paired_with="fedavg")

    path = tmp_path / "fedprox" / "summary.json"
    summary = json.loads(path.read_text())
    summary[CODE] = {**summary[CODE], "results": RESULTS_VERSION + 1}
    path.write_text(json.dumps(summary))
    text = write_report(tmp_path, paired_with="fedavg")
    assert "**Paired runs made by different code** (1;" in text
    assert f"`fedprox` (results {RESULTS_VERSION + 1}, " in text
    assert f"`fedavg` (results {RESULTS_VERSION}, " in text
