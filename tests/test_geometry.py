"""Class-mean geometry: class means and centred angles (by hand and on an ETF), the feature hooks, the angles
a run records with ``geometry: true`` and those ``fedpcd.report.geometry`` rebuilds from a checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedpcd.algorithms.fedgela import simplex_etf
from fedpcd.algorithms.readout import feature_map
from fedpcd.backends import run_experiment
from fedpcd.cli import main
from fedpcd.engine.federation import build_federation
from fedpcd.engine.metrics import (
    CLASS_MEANS,
    class_means,
    feature_means,
    held_missing_angles,
    mean_angle,
    personal_evaluation,
    personal_evaluation_with_means,
)
from fedpcd.errors import UserError
from fedpcd.report.geometry import run_geometry
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
    from fedpcd.engine import metrics
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
    monkeypatch.setattr(metrics, "class_means", counted_means)
    assert run_geometry(out) == pytest.approx(expected, abs=1e-4)  # other batches: rounding at most
    tests = len(build_federation(load_config(None, SMALL)).test_y)
    per_pass = [min(64, tests - start) for start in range(0, tests, 64)]
    assert len(loads) == 1
    assert means == [tests] * 5  # the global model and 4 clients' personal models
    assert batches == per_pass * 5


def test_held_missing_angles_by_hand():
    means = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], dtype=torch.float64)
    assert held_missing_angles(means, torch.tensor([5, 3, 0, 0])) == pytest.approx((180.0, 180.0))
    held, missing = held_missing_angles(means, torch.tensor([5, 0, 2, 1]))
    assert held == pytest.approx(120.0) and missing is None  # one class missing: no pair


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["fedavg", "fedgela"])
def test_geometry_true_records_the_angles_and_changes_no_metric(tmp_path, name):
    """The last record gets the three angles; every other number is the run's without ``geometry``; the global
    angle is the one run_geometry takes from the same final state (the same pass, bit for bit); the personal
    angles are the participants' in round R (run_geometry rebuilds round R + 1's), so only their range is
    checked, and that they differ from the global model's where the personal models are personal."""
    args = [*SMALL, "rounds=2", f"algorithm.name={name}"]
    run_experiment(load_config(None, [*args, f"output_dir={tmp_path / 'plain'}"]), progress=False)
    out = tmp_path / "geometry"
    run_experiment(load_config(None, [*args, "geometry=true", f"output_dir={out}"]), progress=False)
    plain, with_angles = _metrics(tmp_path / "plain"), _metrics(out)
    angles = {k: with_angles[-1].pop(k) for k in ("angle_all", "angle_held", "angle_missing")}
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in plain]
    assert [{k: v for k, v in r.items() if k != "wall_s"} for r in with_angles] == strip
    assert all(0.0 < angles[k] < 180.0 for k in ("angle_all", "angle_held"))
    assert angles["angle_all"] == run_geometry(out)["angle_all"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["angle_held"] == angles["angle_held"]


def test_report_geometry_reads_recorded_angles_without_a_checkpoint(tmp_path, capsys, monkeypatch):
    from fedpcd.report import geometry

    out = tmp_path / "run"
    args = [*SMALL, "rounds=1", "geometry=true", "engine.checkpoint_every=0", f"output_dir={out}"]
    run_experiment(load_config(None, args), progress=False)
    monkeypatch.setattr(geometry, "run_geometry", None)  # nothing to rebuild: a call would fail
    assert main(["report", str(tmp_path), "--geometry"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    recorded = _metrics(out)[-1]
    assert f"{recorded['angle_all']:.2f}" in row and f"{recorded['angle_held']:.2f}" in row


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["engine.executor=vectorized"], "engine.executor=vectorized"),
        (["model.name=[mlp, mlp_bn]", "algorithm.name=fedssa"], "one feature space"),
    ],
)
def test_geometry_refuses_what_it_cannot_measure(extra, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [*SMALL, "geometry=true", *extra])


@pytest.mark.slow
def test_geometry_in_the_worker_pool_is_the_in_process_one(tmp_path):
    """The class means travel back from the workers with the personal metrics: the same last record."""
    records = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        args = [*SMALL, "rounds=2", "geometry=true", f"engine.workers={workers}", f"output_dir={out}"]
        run_experiment(load_config(None, args), progress=False)
        records.append({k: v for k, v in _metrics(out)[-1].items() if k != "wall_s"})
    assert records[0] == records[1] and records[0]["angle_held"] is not None


@pytest.mark.parametrize(("dataset", "model_name"), [("synthetic", "mlp"), ("synthetic16", "simplecnn")])
def test_the_evaluation_pass_gives_the_class_means_of_a_features_pass(dataset, model_name):
    """A personal model that is its own predictor: its class means come from its head's inputs in the
    evaluation pass (ConvNet's faster inference kernel included), equal to those of a pass of
    ``model.features``, and its metrics are personal_evaluation's."""
    args = [f"dataset.name={dataset}", f"model.name={model_name}", "clients=4"]
    fed = build_federation(load_config(None, args))
    model, data, classes = fed.model_for(0, fresh=True), fed.clients[0], fed.dataset.num_classes
    shared = personal_evaluation_with_means(model, model, data, True, classes)
    second_pass = personal_evaluation_with_means(lambda x: model(x), model, data, True, classes)
    torch.testing.assert_close(
        shared.pop(CLASS_MEANS), second_pass.pop(CLASS_MEANS), rtol=0, atol=0, equal_nan=True
    )
    assert shared == second_pass == personal_evaluation(model, data, True)


@pytest.mark.parametrize("name", ["fedgela", "fednh"])
def test_a_readout_with_a_head_gives_its_predictions_and_class_means_in_one_pass(name):
    """FedGELA's and FedNH's readouts: their logits are their head on their features, so the one-pass
    predictions are predict's and the class means those of a pass of the readout's features."""
    fed = build_federation(load_config(None, [*SMALL, f"algorithm.name={name}"]))
    algo, model, data = fed.new_algorithm(), fed.model_for(0, fresh=True), fed.clients[0]
    readout = algo.global_predictor(model, algo.init_server(model))
    assert readout.head is not None
    shared = personal_evaluation_with_means(readout, model, data, True, fed.dataset.num_classes)
    means = feature_means(feature_map(readout, model), data.test_x, data.test_y, fed.dataset.num_classes)
    torch.testing.assert_close(shared.pop(CLASS_MEANS), means, rtol=0, atol=0, equal_nan=True)
    assert shared == personal_evaluation(readout, data, True)
