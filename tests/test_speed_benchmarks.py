"""Smoke tests of the speed and scale benchmarks (benchmarks/speed.py, benchmarks/scale.py,
benchmarks/report_speed.py) at tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_speed_quick_runs_and_reports(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # speed.py reads the machine with demo_time.py beside it
    speed = _load("speed")
    out = tmp_path / "speed.json"
    assert speed.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "overall: PASS" in text or "overall: FAIL" in text
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["model"] for r in rows} == {"simplecnn", "resnet18"}
    e2e = [r for r in rows if r.get("e2e")]
    assert len(e2e) == 1 and "against a plain loop that also evaluates:" in text
    assert e2e[0]["sequential_ratio_eval"] > e2e[0]["sequential_ratio"] > 0  # the plain loop pays too
    for r in rows:
        assert r["plain_sps"] > 0 and r["sequential_sps"] > 0 and r["peak_rss_mb"] > 0
        assert r["sequential_ratio"] == r["sequential_sps"] / r["plain_sps"]


def test_convolution_floor_is_part_of_a_plain_step():
    """The Amdahl bound's two times: the convolution kernels are strictly less work than the whole step."""
    floor = _load("speed").convolution_floor(batch_size=16, repeats=5)
    assert set(floor) == {"step_ms", "conv_ms"}
    assert 0 < floor["conv_ms"] < floor["step_ms"]


def test_speed_targets_logic():
    speed = _load("speed")
    row = {
        "model": "simplecnn",
        "clients": 50,
        "per_round": 50,
        "sequential_ratio": 0.95,
        "vectorized_ratio": None,
    }
    ok, misses = speed.check([row])
    assert not ok and misses == ["simplecnn 50/50: vectorized n/a < 3.0x"]
    ok, _ = speed.check([{**row, "vectorized_ratio": 3.2}])
    assert ok
    ok, misses = speed.check([{**row, "per_round": 10, "vectorized_ratio": 1.7}])
    assert misses == ["simplecnn 10/50: vectorized 1.70x < 1.8x"]


def test_scale_quick_keeps_only_personal_parts(tmp_path, capsys):
    scale = _load("scale")
    out = tmp_path / "scale.json"
    argv = ["--quick", "--clients", "12", "--per-round", "4", "--algorithms", "fedavg", "fedper", "scaffold"]
    assert scale.main([*argv, "--json", str(out)]) == 0
    rows = {(r["algorithm"], r["backend"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("fedavg", "memory")]["states"] == 0  # FedAvg keeps nothing
    for backend in ("memory", "disk"):
        fedper, scaffold = rows[("fedper", backend)], rows[("scaffold", backend)]
        assert fedper["states"] == scaffold["states"] == 12  # the fill phase gave every client a state
        assert fedper["state_keys"] == "head.weight,head.bias" and fedper["state_share"] < 0.2
        assert scaffold["state_keys"] == "control"
    # the benchmark reports its memory target; whether it is met is a property of the benchmark's own
    # process (run alone), not of a pytest process that holds every earlier test's memory
    assert "target: FedAvg peak RSS < 2048 MB with 12 clients, 4 per round" in capsys.readouterr().out


def test_side_by_side_amdahl_model_is_fitted_to_the_two_process_speedup():
    amdahl = _load("speed").amdahl
    perfect, none = amdahl(1.0, 2.0), amdahl(1.0, 1.0)
    assert perfect["serial"] == 0.0 and perfect[16] == 16.0
    assert amdahl(1.0, 2.0, clients_per_round=10)[16] == 10  # no more tasks than clients
    assert none["serial"] == 1.0 and none[4] == none[16] == 1.0
    quarter = amdahl(0.5, 0.8)  # a speed-up of 1.6 = 1 / (s + (1 - s) / 2) for s = 0.25
    assert abs(quarter["serial"] - 0.25) < 1e-12 and abs(quarter[4] - 1 / (0.25 + 0.75 / 4)) < 1e-12


def test_plain_parallel_runs_the_plain_loop_in_processes_begun_together(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned processes import speed.py by its name
    speed = importlib.import_module("speed")
    per_round = speed.plain_parallel(0.05, 2)  # two processes, 5% of Fashion-MNIST, 2 rounds
    assert len(per_round) == 2 and all(t > 0 for t in per_round)


def test_report_speed_times_the_report_against_reading_the_archive(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it reads the machine with demo_time.py beside it
    folder = BENCHMARKS.parent / "docs/results/runs/fedgela-fmnist-p5c2-code"  # three small archived runs
    out = tmp_path / "report_speed.json"
    _load("report_speed").main(["--folder", str(folder), "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["runs"] == 3 and report["count"] == len(report["rows"]) == 3
    reference, printed, written = report["rows"]
    assert reference["command"].startswith("reading the archive") and reference["ratio"] == 1.0
    assert all(row["ratio"] == row["seconds"] / reference["seconds"] > 0 for row in report["rows"])
    assert "--out" in written["command"] and "the printed report:" in capsys.readouterr().out
