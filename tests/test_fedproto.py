"""FedProto: the prototype term and the server's per-class mean on hand-made tensors, nearest-prototype
prediction by hand, what travels (prototypes of held classes only, never weights), the private model's
start, and end-to-end runs (one architecture, and the model-heterogeneous CNN zoo)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import HETERO_MODELS, local_work, seeded, tiny_client, tiny_mlp
from fedpcd.algorithms import ClientData, Context, FedAvg, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.fedproto import FedProto, NearestPrototype, prototype_mse
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.backends import run_experiment
from fedpcd.engine.metrics import predict
from fedpcd.engine.rundir import RunDir
from fedpcd.errors import UserError
from fedpcd.models import build_model
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]


def _alg(num_classes: int = 3, seed: int = 0, **params) -> FedProto:
    alg = build_algorithm("fedproto", params)
    local = LocalTraining(epochs=1, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0)
    alg.setup(Context(num_clients=3, num_classes=num_classes, rounds=2, seed=seed, local=local))
    return alg


def _client(labels: list[int] | None = None) -> ClientData:
    y = torch.tensor(labels if labels is not None else [0, 1, 1, 2, 2, 2, 0, 1])
    return tiny_client(y, 3, seed=7, local_test=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_defaults_and_heterogeneous_flag():
    alg = build_algorithm("fedproto")
    assert (alg.lam, alg.init, alg.weighting, alg.predict) == (0.1, "uniform", "uniform", "prototype")
    assert FedProto.heterogeneous and not FedAvg.heterogeneous


# ----- the local objective -----


def test_prototype_mse_value_and_gradient_by_hand():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]], requires_grad=True)
    protos = torch.tensor([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0]], requires_grad=True)
    known = torch.tensor([True, True, False])
    loss = prototype_mse(z, torch.tensor([0, 1, 2]), protos, known)
    torch.testing.assert_close(loss, torch.tensor((1 + 4 + 4 + 9) / 6))  # class 2 adds 0, counts in /(B d)
    loss.backward()
    torch.testing.assert_close(z.grad, torch.tensor([[2.0, 4.0], [4.0, 6.0], [0.0, 0.0]]) / 6)
    assert protos.grad is None  # prototypes are constants


def test_local_loss_is_ce_plus_lambda_mse_by_hand():
    alg, model, data = _alg(lam=0.3), tiny_mlp(), _client()
    protos = torch.rand(3, model.feature_dim, generator=seeded())
    payload = {"prototypes": protos, "known": torch.ones(3, dtype=torch.bool)}
    loss = alg.loss(model, (data.x, data.y), local_work(payload))
    z = model.features(data.x)
    expect = F.cross_entropy(model.head(z), data.y) + 0.3 * F.mse_loss(z, protos[data.y])
    torch.testing.assert_close(loss, expect)


def test_without_global_prototypes_the_loss_is_cross_entropy():
    alg, model, data = _alg(init="none"), tiny_mlp(), _client()
    payload = alg.payload_for(alg.init_server(model), 0)
    assert not payload["known"].any()
    torch.testing.assert_close(
        alg.loss(model, (data.x, data.y), local_work(payload)), F.cross_entropy(model(data.x), data.y)
    )


# ----- server -----


def _reply(classes: list[int], means: list[list[float]], counts: list[int]) -> dict:
    return {
        "classes": torch.tensor(classes),
        "class_means": torch.tensor(means),
        "class_counts": torch.tensor(counts),
        "num_samples": sum(counts),
        "train_loss": 0.0,
    }


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
@pytest.mark.parametrize("init", ["none", "uniform"])
def test_server_per_class_mean_by_hand(weighting, init):
    alg = _alg(num_classes=4, weighting=weighting, init=init)
    before = torch.rand(4, 2, generator=seeded()) if init == "uniform" else torch.zeros(4, 2)
    known = torch.full((4,), init == "uniform")
    server = {"prototypes": before.clone(), "known": known.clone()}
    replies = [
        _reply([0, 1], [[1.0, 1.0], [2.0, 2.0]], [1, 3]),
        _reply([1, 3], [[4.0, 4.0], [6.0, 0.0]], [1, 5]),
    ]  # class 2: held by no client
    server = alg.aggregate(server, replies)
    c1 = [3.0, 3.0] if weighting == "uniform" else [(3 * 2.0 + 4.0) / 4] * 2
    torch.testing.assert_close(server["prototypes"][[0, 1, 3]], torch.tensor([[1.0, 1.0], c1, [6.0, 0.0]]))
    assert torch.equal(server["prototypes"][2], before[2])  # unchanged
    assert server["known"].tolist() == [True, True, init == "uniform", True]


def test_uniform_initial_prototypes_are_seeded_u01():
    model = tiny_mlp(hidden=16)
    a, b = _alg().init_server(model), _alg().init_server(model)
    assert set(a) == {"prototypes", "known"} and a["prototypes"].shape == (3, 16) and a["known"].all()
    assert torch.equal(a["prototypes"], b["prototypes"])
    assert (a["prototypes"] >= 0).all() and (a["prototypes"] < 1).all()
    assert not torch.equal(a["prototypes"], _alg(seed=1).init_server(model)["prototypes"])
    none = _alg(init="none").init_server(model)
    assert not none["known"].any() and not none["prototypes"].any()
    assert _alg().global_predictor(model, a) is None


# ----- client -----


def test_reply_carries_only_held_classes_prototypes_and_no_weights():
    alg, model = _alg(), tiny_mlp()
    data = _client([0, 0, 2, 2, 2])
    payload = alg.payload_for(alg.init_server(model), 0)
    assert set(payload) == {"prototypes", "known"}
    reply, state = alg.local_update(model, data, LocalWork(payload, None, seeded()))
    assert set(reply) == {"classes", "class_counts", "class_means", "num_samples", "train_loss"}
    assert reply["classes"].tolist() == [0, 2] and reply["class_counts"].tolist() == [2, 3]
    assert reply["class_means"].shape == (2, model.feature_dim)
    assert tensor_bytes(reply) == 2 * 8 + 2 * 8 + 2 * model.feature_dim * 4  # ids, counts, prototypes
    # the prototypes are the final model's class means (eval mode, no augmentation)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        z = model.features(data.x)
    torch.testing.assert_close(reply["class_means"], torch.stack([z[:2].mean(0), z[2:].mean(0)]))
    assert set(state) == {"model", "classes"} and _equal(state["model"], model.state_dict())


def test_first_participation_trains_the_model_as_delivered_later_the_own_model():
    alg, data = _alg(), _client()
    payload = alg.payload_for(alg.init_server(tiny_mlp()), 0)
    delivered, other = tiny_mlp(), tiny_mlp()
    with torch.no_grad():
        other.fc1.weight.add_(0.5)  # e.g. another client's weights left in the shared object
    _, s_delivered = alg.local_update(delivered, data, LocalWork(payload, None, seeded()))
    _, s_other = alg.local_update(other, data, LocalWork(payload, None, seeded()))
    assert not _equal(s_delivered["model"], s_other["model"])
    _, a = alg.local_update(tiny_mlp(), data, LocalWork(payload, s_delivered, seeded(2)))
    _, b = alg.local_update(other, data, LocalWork(payload, s_delivered, seeded(2)))
    assert _equal(a["model"], b["model"])  # later rounds: the own model, whatever the object held


def test_a_different_feature_dim_is_a_user_error():
    alg = _alg()
    payload = alg.payload_for(alg.init_server(tiny_mlp(hidden=16)), 0)
    with pytest.raises(UserError, match="feature_dim=8"):
        alg.local_update(tiny_mlp(hidden=8), _client(), LocalWork(payload, None, seeded()))


# ----- personal prediction -----


def _identity_features_model():
    """An MLP whose features are relu(x) flattened (1x2x2 input, hidden 4, identity layers)."""
    model = build_model("mlp", 1, 3, 2, hidden=4)
    with torch.no_grad():
        for layer in (model.fc1, model.fc2):
            layer.weight.copy_(torch.eye(4))
            layer.bias.zero_()
    return model


X = torch.tensor([[0.2, 0, 0, 0], [1, 1, 1, 1.2], [2.9, 3, 3, 3], [2, 2, 2, 2.1]]).reshape(4, 1, 2, 2)
PROTOS = torch.tensor([[0.0] * 4, [1.0] * 4, [3.0] * 4])


@pytest.mark.parametrize(
    ("mode", "known", "own", "expect"),
    [
        ("prototype", [True, True, True], [0, 1, 2], [0, 1, 2, 2]),
        ("prototype", [True, True, False], [0, 1, 2], [0, 1, 1, 1]),  # no prototype: never predicted
        ("prototype_local", [True, True, True], [0, 2], [0, 0, 2, 2]),  # only the client's classes
    ],
)
def test_nearest_prototype_prediction_by_hand(mode, known, own, expect):
    alg, model = _alg(predict=mode), _identity_features_model()
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "classes": torch.tensor(own)}
    payload = {"prototypes": PROTOS, "known": torch.tensor(known)}
    predictor = alg.personal_predictor(_identity_features_model(), local_work(payload, state))
    assert isinstance(predictor, NearestPrototype)
    assert predict(predictor, X).tolist() == expect
    with torch.no_grad():
        scores = predictor(X[:1])
    allowed = torch.tensor(known) & torch.isin(torch.arange(3), torch.tensor(own))
    dist = (X[0].flatten() - PROTOS).norm(dim=1)
    torch.testing.assert_close(scores[0][allowed], -dist[allowed])
    assert (scores[0][~allowed] == -math.inf).all()


def test_head_prediction_and_fallback_before_any_prototype():
    model = _identity_features_model()
    state = {"model": dict(model.state_dict()), "classes": torch.tensor([0, 1])}
    payload = {"prototypes": PROTOS, "known": torch.ones(3, dtype=torch.bool)}
    assert _alg(predict="head").personal_predictor(model, local_work(payload, state)) is model
    nothing = {"prototypes": torch.zeros(3, 4), "known": torch.zeros(3, dtype=torch.bool)}
    assert _alg(init="none").personal_predictor(model, local_work(nothing, state)) is model


# ----- end to end -----


def test_end_to_end_synthetic(tmp_path):
    out = tmp_path / "run"
    args = SMALL + [
        "clients=4",
        "rounds=3",
        "participation=0.5",
        "algorithm.name=fedproto",
        "personal_full_every=1",
    ]
    run_experiment(load_config(None, args + [f"output_dir={out}"]), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    model_bytes = sum(p.numel() * 4 for p in build_model("mlp", 1, 10, 8, hidden=32).parameters())
    for r in rows:
        assert r["global_acc"] is None  # no global model; PA-G is the papers' "GA" of such methods
        assert all(
            math.isfinite(r[k]) and 0.0 <= r[k] <= 1.0 for k in ["personal_acc", "pa_l", "pa_v", "pa_global"]
        )
        assert 0 < r["bytes_up"] < model_bytes and r["bytes_down"] == 2 * (10 * 32 * 4 + 10)
    ckpt = RunDir(out).load_checkpoint()
    assert set(ckpt["server"]) == {"prototypes", "known"} and ckpt["server"]["prototypes"].shape == (10, 32)
    assert all(set(s) == {"model", "classes"} for s in ckpt["client_states"].values())


def test_model_heterogeneous_run(tmp_path):
    out = tmp_path / "hetero"
    args = HETERO_MODELS + ["clients=5", "rounds=2", "algorithm.name=fedproto", f"output_dir={out}"]
    run_experiment(load_config(None, args), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["global_acc"] is None for r in rows)
    assert all(0.0 <= r["personal_acc"] <= 1.0 for r in rows)
    ckpt = RunDir(out).load_checkpoint()
    fc1 = {k: s["model"]["fc1.weight"].shape for k, s in ckpt["client_states"].items()}
    assert fc1[0] == (2000, 32) and fc1[4] == (500, 32)  # each client keeps its own architecture
    assert ckpt["server"]["prototypes"].shape == (10, 500)
