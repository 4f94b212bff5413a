"""benchmarks/chaos.py's short version: 5 random faults (signals at random moments of a run, a run with
engine.workers=2 and a sweep with --jobs 2; a file size limit as a full disk), each followed by the documented
recovery and checked against an uninterrupted reference run. The Flower faults (a Ray start-up each) are left
to the full benchmark."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedpcd

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(fedpcd.__file__).resolve().parents[1])


@pytest.mark.slow
def test_five_random_faults_are_survived_without_data_loss(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "chaos.py"),
            "--faults",
            "5",
            "--seed",
            "0",
            "--dataset",
            "synthetic",
            "--kinds",
            "run,workers,sweep,disk",  # the Flower faults (a Ray start-up each) are the full benchmark's
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
        timeout=1800,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counted = [line for line in lines if line.startswith("fault ") and "drawn again" not in line]
    assert len(counted) == 5
    assert lines[-1] == "faults injected: 5, survived: 5, data lost: 0"
