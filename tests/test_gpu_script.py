"""benchmarks/gpu.py --smoke: every part runs on the CPU and its JSON holds every figure with its reference,
the CUDA parts "no CUDA device" (never a figure) where the smoke run leaves CUDA out."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedpcd.algorithms import ALGORITHMS
from fedpcd.procs_guard import usable_cores

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_smoke_writes_every_part(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # gpu.py imports speed.py and demo_time.py beside it
    import gpu

    out = tmp_path / "gpu.json"
    assert gpu.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"machine", "torch", "device", "date", "parity", "throughput", "memory", "pool"} <= set(data)
    assert data["smoke"] is True and data["machine"]["usable_cores"] == usable_cores()

    assert [row["algorithm"] for row in data["parity"]] == ALGORITHMS.names()
    for row in data["parity"]:
        assert set(row["cpu"]) == {"ga", "pa"}, row  # no error: every algorithm runs on the CPU
        assert all(value is None or 0 <= value <= 100 for value in row["cpu"].values())
        assert row["cuda"] == gpu.NO_CUDA and "gap" not in row

    assert data["throughput"]["cuda"] == data["memory"] == gpu.NO_CUDA
    for row in data["throughput"]["cpu"]:
        assert row["device"] == "cpu" and row["plain_sps"] > 0
        for executor in ("sequential", "vectorized"):
            assert row[f"{executor}_ratio"] == row[f"{executor}_sps"] / row["plain_sps"]

    pool = data["pool"]
    assert [row["workers"] for row in pool] == [n for n in (1, 2) if n <= usable_cores()]
    for row in pool:
        assert row["speedup"] == row["samples_per_s"] / pool[0]["samples_per_s"]


def test_the_gap_is_cuda_minus_cpu_and_errors_are_one_line(monkeypatch):
    """The parity row of an algorithm: CUDA's GA and PA less the CPU's, none where a side failed."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu

    def fail(*args, **kwargs):
        raise RuntimeError("Expected all tensors\nto be on the same device")

    monkeypatch.setattr(gpu, "run_experiment", fail)
    assert gpu.one_run(["rounds=1"], "cpu") == {
        "error": "RuntimeError: Expected all tensors to be on the same device"
    }
    runs = {"cpu": {"ga": 50.0, "pa": None}, "cuda": {"ga": 52.5, "pa": 70.0}}
    monkeypatch.setattr(gpu, "ALGORITHMS", SimpleNamespace(names=lambda: ["fedavg"]))
    monkeypatch.setattr(gpu, "one_run", lambda overrides, device: runs[device])
    assert gpu.parity([], cuda=True) == [{"algorithm": "fedavg", **runs, "gap": {"ga": 2.5, "pa": None}}]
    runs["cuda"] = {"error": "RuntimeError: Expected all tensors to be on the same device"}
    assert "gap" not in gpu.parity([], cuda=True)[0]
