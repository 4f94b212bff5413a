"""fedpcd.report.geometry: class means, centred angles (by hand and on an ETF), the feature hooks, runs."""

from __future__ import annotations

import math

import pytest
import torch

from fedpcd.algorithms.fedgela import simplex_etf
from fedpcd.algorithms.readout import feature_map
from fedpcd.backends import run_experiment
from fedpcd.cli import main
from fedpcd.engine.federation import build_federation
from fedpcd.errors import UserError
from fedpcd.report.geometry import class_means, mean_angle, run_geometry
from fedpcd.report.read import load_runs
from fedpcd.report.tables import report_table
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32", "clients=4"]


def test_class_means_by_hand():
    feats = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0]])
    means = class_means(feats, torch.tensor([0, 0, 2]), 3)
    assert means[0].tolist() == [2.0, 1.0] and means[2].tolist() == [0.0, 4.0]
    assert torch.isnan(means[1]).all()  # no sample of class 1


def test_mean_angle_by_hand():
    # centre (0, 0): pairs at 180, 90, 90, 90, 90, 180 degrees
    means = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], dtype=torch.float64)
    assert mean_angle(means) == pytest.approx(120.0)
    assert mean_angle(means, torch.tensor([True, False, True, False])) == pytest.approx(90.0)
    assert mean_angle(means, torch.tensor([0, 1])) == pytest.approx(180.0)
    assert mean_angle(means, torch.tensor([2])) is None
    with_empty = torch.cat([means, torch.full((1, 2), float("nan"), dtype=torch.float64)])
    assert mean_angle(with_empty) == pytest.approx(120.0)  # a class without samples is left out
    assert mean_angle(with_empty, torch.tensor([0, 4])) is None
    # the subset keeps the centre of all classes: e1, e2, e3 centred are 120 degrees apart, not 180
    assert mean_angle(torch.eye(3, dtype=torch.float64), torch.tensor([0, 1])) == pytest.approx(120.0)


@pytest.mark.parametrize(("d", "c"), [(10, 10), (84, 10), (64, 20)])
def test_etf_features_have_the_simplex_angle(d, c):
    etf = simplex_etf(d, c, torch.Generator().manual_seed(1))
    labels = torch.arange(c).repeat_interleave(4)
    noise = 0.05 * torch.randn(4, d, generator=torch.Generator().manual_seed(2))
    feats = etf.T[labels] + noise.repeat(c, 1)  # the same noise for every class: it cancels when centred
    expected = math.degrees(math.acos(-1 / (c - 1)))
    assert mean_angle(class_means(feats, labels, c)) == pytest.approx(expected, abs=1e-4)


def test_fedgela_global_features_are_what_the_etf_classifies(tmp_path):
    cfg = load_config(None, SMALL + ["algorithm.name=fedgela", f"output_dir={tmp_path}"])
    fed = build_federation(cfg)
    algo, model = fed.new_algorithm(), fed.new_model()
    server = algo.init_server(model)
    x = fed.dataset.normalized("test")[:16]
    with torch.no_grad():
        logits = algo.global_predictor(model, server)(x)
        h = feature_map(algo.global_predictor(model, server), model)(x)
    assert h.shape == (16, server["etf"].shape[0])
    assert torch.allclose(h.norm(dim=1), torch.ones(16))  # L2-normalised h_hat
    assert torch.allclose(logits, algo.scale * h @ server["etf"], atol=1e-6)


@pytest.mark.parametrize("name", ["fedavg", "fedgela"])
def test_run_geometry_end_to_end(tmp_path, name):
    out = tmp_path / name
    run_experiment(
        load_config(None, SMALL + ["rounds=2", f"algorithm.name={name}", f"output_dir={out}"]), progress=False
    )
    angles = run_geometry(out)
    assert set(angles) == {"angle_all", "angle_held", "angle_missing"}
    assert all(0.0 < angles[k] < 180.0 for k in ("angle_all", "angle_held"))
    assert run_geometry(out) == angles  # the rebuilt personal models are seeded
    table = report_table(load_runs(tmp_path), geometry=True)
    assert "∠all°" in table.splitlines()[0] and f"{angles['angle_all']:.2f}" in table


def test_geometry_needs_a_checkpoint(tmp_path, capsys):
    with pytest.raises(UserError, match="no checkpoint"):
        run_geometry(tmp_path)
    out = tmp_path / "run"
    args = SMALL + ["rounds=1", "engine.checkpoint_every=0", f"output_dir={out}"]
    run_experiment(load_config(None, args), progress=False)
    assert main(["report", str(tmp_path), "--geometry"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert "| - | - | - |" in row  # a run without its final state gets no angles, and no crash


def test_run_geometry_loads_the_checkpoint_once_and_passes_over_the_test_set_once_per_model(
    tmp_path, monkeypatch
):
    """One checkpoint load per run, and per model (the global one, then each client's personal one) one pass
    over the test set in batches of ``geometry.BATCH``: no pass per class or per sample."""
    import fedpcd.algorithms.readout
    from fedpcd.engine.rundir import RunDir
    from fedpcd.report import geometry

    out = tmp_path / "run"
    run_experiment(load_config(None, [*SMALL, "rounds=1", f"output_dir={out}"]), progress=False)
    expected = run_geometry(out)
    loads, batches, means = [], [], []
    load_checkpoint, make_feature_map = RunDir.load_checkpoint, fedpcd.algorithms.readout.feature_map

    def counted_load(self, *args, **kwargs):
        loads.append(self)
        return load_checkpoint(self, *args, **kwargs)

    def counted_map(*args, **kwargs):
        features = make_feature_map(*args, **kwargs)
        return lambda x: batches.append(len(x)) or features(x)

    def counted_means(features, labels, num_classes):
        means.append(len(features))
        return class_means(features, labels, num_classes)

    monkeypatch.setattr(RunDir, "load_checkpoint", counted_load)
    monkeypatch.setattr(fedpcd.algorithms.readout, "feature_map", counted_map)
    monkeypatch.setattr(geometry, "BATCH", 64)
    monkeypatch.setattr(geometry, "class_means", counted_means)
    assert run_geometry(out) == pytest.approx(expected, abs=1e-4)  # other batches: rounding at most
    tests = len(build_federation(load_config(None, SMALL)).test_y)
    per_pass = [min(64, tests - start) for start in range(0, tests, 64)]
    assert len(loads) == 1
    assert means == [tests] * 5  # the global model and 4 clients' personal models
    assert batches == per_pass * 5
