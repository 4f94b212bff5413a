"""`fedpcd demo`: FedAvg and the five papers' methods on Fashion-MNIST P10C2, a table and a curve plot."""

from __future__ import annotations

from conftest import requires_fmnist
from fedpcd.cli import DEMO_METHODS, main


@requires_fmnist
def test_demo_compares_fedavg_and_the_five_methods(tmp_path, capsys):
    overrides = ["rounds=1", "dataset.train_fraction=0.02", "personal_test=split"]
    assert main(["demo", "--out", str(tmp_path), "--quiet", *overrides]) == 0
    out = capsys.readouterr().out
    names = [name for name, _ in DEMO_METHODS]
    assert names == ["fedavg", "fedgela", "fedmr", "fednh", "fedsc", "fedssa"]
    rows = [line.split()[0] for line in out.splitlines()[2:8]]
    assert rows == names
    assert "fedsc cpdr_weight=0.01" in out
    assert all((tmp_path / name / "summary.json").exists() for name in names)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
