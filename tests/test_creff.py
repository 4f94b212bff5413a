"""CReFF (Shang et al., IJCAI 2022): the per-class classifier gradients, the matching distance, the server's
feature matching and classifier re-training, FedAvg left untouched, and short end-to-end runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import local_work, seeded, tiny_client
from fedpcd import seeds
from fedpcd.algorithms import Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.creff import (
    aggregate_class_gradients,
    class_head_gradients,
    linear_init,
    match_features,
    matching_distance,
    matching_loss,
    retrain_classifier,
)
from fedpcd.algorithms.statedict import weighted_average
from fedpcd.backends import run_experiment
from fedpcd.models import backbone_keys, build_model, head_keys
from fedpcd.resolve import config_from_dict

FAST = {"feats_per_class": 5, "match_steps": 3, "retrain_epochs": 2}  # small server work for tests
CTX = Context(
    num_clients=3,
    num_classes=3,
    rounds=2,
    seed=0,
    local=LocalTraining(epochs=1, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0),
)


def _alg(name: str = "creff", **params):
    alg = build_algorithm(name, {**FAST, **params} if name == "creff" else params)
    alg.setup(CTX)
    return alg


def _model(bias: bool = True):
    torch.manual_seed(0)
    model = build_model("mlp", 1, 3, 2, hidden=8)
    if not bias:
        model.head = nn.Linear(8, 3, bias=False)
    return model


def _client(labels: list[int], seed: int = 7, cid: int = 0):
    return tiny_client(torch.tensor(labels), 3, seed=seed, cid=cid)


def _autograd_class_grads(z, c, weight, bias):
    """grad of the mean cross-entropy of F.linear(z, W, b) with every label c, by autograd."""
    w = weight.detach().clone().requires_grad_(True)
    params = [w] if bias is None else [w, bias.detach().clone().requires_grad_(True)]
    loss = F.cross_entropy(F.linear(z, *params), torch.full((len(z),), c))
    return torch.autograd.grad(loss, params)


# ----- formulas ----------------------------------------------------------------------------------------


def test_per_class_head_gradient_by_hand():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    # W = 0, b = 0: p = 1/3 everywhere, so p - e_1 = (1/3, -2/3, 1/3) for both samples
    gw, gb = class_head_gradients(z[None], torch.tensor([1]), torch.zeros(3, 2), torch.zeros(3))
    r = torch.tensor([1 / 3, -2 / 3, 1 / 3])
    torch.testing.assert_close(gw[0], torch.outer(r, torch.tensor([2.0, 3.0])))  # r (mean z)^T
    torch.testing.assert_close(gb[0], r)
    # W = [[1, 0], [0, 1], [0, 0]], no bias: logits (1, 2, 0) and (3, 4, 0), label 0
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    gw, gb = class_head_gradients(z[None], torch.tensor([0]), w, None)
    assert gb is None
    p1 = torch.tensor([math.e, math.e**2, 1.0]) / (math.e + math.e**2 + 1.0)
    p2 = torch.tensor([math.e**3, math.e**4, 1.0]) / (math.e**3 + math.e**4 + 1.0)
    e0 = torch.tensor([1.0, 0.0, 0.0])
    expect = (torch.outer(p1 - e0, z[0]) + torch.outer(p2 - e0, z[1])) / 2
    torch.testing.assert_close(gw[0], expect)


def test_class_head_gradients_equal_autograd_per_group():
    g = seeded(3)
    z = torch.randn(2, 4, 3, generator=g)
    w, b = torch.randn(5, 3, generator=g), torch.randn(5, generator=g)
    labels = torch.tensor([4, 0])
    gw, gb = class_head_gradients(z, labels, w, b)
    for k in range(2):
        aw, ab = _autograd_class_grads(z[k], int(labels[k]), w, b)
        torch.testing.assert_close(gw[k], aw)
        torch.testing.assert_close(gb[k], ab)


def test_matching_distance_on_hand_made_gradients():
    syn_w = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    real_w = torch.tensor([[[2.0, 0.0], [3.0, 0.0]]])  # row 0: same direction; row 1: orthogonal
    syn_b, real_b = torch.tensor([[1.0, 0.0]]), torch.tensor([[-1.0, 0.0]])  # opposite: 1 - (-1) = 2
    eps = 1e-6
    weight_part = (1 - 2 / (2 + eps)) + 1.0
    torch.testing.assert_close(matching_distance(syn_w, real_w), torch.tensor(weight_part))
    torch.testing.assert_close(
        matching_distance(syn_w, real_w, syn_b, real_b), torch.tensor(weight_part + 1 + 1 / (1 + eps))
    )
    # a sum over classes, one 1 - cos per output row; blind to the gradients' scale
    both = matching_distance(torch.cat([syn_w, 5 * syn_w]), torch.cat([real_w, real_w]))
    torch.testing.assert_close(both, torch.tensor(2 * weight_part), atol=1e-5, rtol=0)


def test_aggregation_of_class_gradients_by_clients_or_by_counts():
    g = seeded(4)
    a, b, c = (torch.randn(3, 2, generator=g) for _ in range(3))
    ab, ac = torch.randn(3, generator=g), torch.randn(3, generator=g)
    replies = [
        {
            "classes": torch.tensor([0, 1]),
            "class_counts": torch.tensor([1, 3]),
            "grad_weight": torch.stack([a, b]),
        },
        {"classes": torch.tensor([1]), "class_counts": torch.tensor([1]), "grad_weight": c[None]},
    ]
    gw, gb, reported = aggregate_class_gradients(replies, 3, "clients")
    assert gb is None and reported.tolist() == [True, True, False]
    torch.testing.assert_close(gw[0], a)
    torch.testing.assert_close(gw[1], (b + c) / 2)
    assert (gw[2] == 0).all()
    replies[0]["grad_bias"], replies[1]["grad_bias"] = torch.stack([ab, ab]), ac[None]
    gw, gb, _ = aggregate_class_gradients(replies, 3, "samples")
    torch.testing.assert_close(gw[1], (3 * b + c) / 4)
    torch.testing.assert_close(gb[1], (3 * ab + ac) / 4)


def test_gradient_matching_reduces_the_distance_and_leaves_unreported_classes():
    g = seeded(5)
    real = torch.randn(3, 20, 4, generator=g) + 3 * torch.eye(3, 4)[:, None, :]
    w, b = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    real_w, real_b = class_head_gradients(real, torch.arange(3), w, b)
    classes = torch.tensor([0, 2])
    feats = torch.randn(3, 5, 4, generator=g)
    before = matching_loss(feats, w, b, real_w, real_b, classes)
    new = match_features(feats, w, b, real_w, real_b, classes, steps=30, lr=0.1)
    after = matching_loss(new, w, b, real_w, real_b, classes)
    assert after < 0.5 * before
    assert torch.equal(new[1], feats[1]) and not torch.equal(new[0], feats[0])
    assert torch.equal(match_features(feats, w, b, real_w, real_b, classes, steps=0, lr=0.1), feats)


def test_retraining_fits_separable_features_from_a_seeded_init():
    g = seeded(6)
    feats = 5 * torch.eye(3, 4)[:, None, :] + 0.1 * torch.randn(3, 10, 4, generator=g)
    w0, b0 = linear_init(3, 4, True, seeded(7))
    assert w0.abs().max() <= 0.5 and b0.abs().max() <= 0.5  # U(-1/sqrt(d), 1/sqrt(d))
    kwargs = {"epochs": 20, "lr": 0.5, "batch_size": 8}
    w, b = retrain_classifier(feats, w0, b0, generator=seeded(8), **kwargs)
    pred = (feats.reshape(30, 4) @ w.T + b).argmax(1)
    assert torch.equal(pred, torch.arange(3).repeat_interleave(10))
    w2, b2 = retrain_classifier(feats, w0, b0, generator=seeded(8), **kwargs)
    assert torch.equal(w, w2) and torch.equal(b, b2)
    w3, _ = retrain_classifier(feats, w0, b0, generator=seeded(9), **kwargs)
    assert not torch.equal(w, w3)  # mini-batches shuffled by the generator
    assert torch.equal(w0, linear_init(3, 4, True, seeded(7))[0])  # the init is copied, not trained in place
    # one full-batch epoch = one SGD step on the mean cross-entropy, as autograd computes it
    w1, b1 = retrain_classifier(feats, w0, b0, epochs=1, lr=0.5, batch_size=30, generator=seeded(8))
    params = [w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)]
    loss = F.cross_entropy(F.linear(feats.reshape(30, 4), *params), torch.arange(3).repeat_interleave(10))
    aw, ab = torch.autograd.grad(loss, params)
    torch.testing.assert_close(w1, w0 - 0.5 * aw)
    torch.testing.assert_close(b1, b0 - 0.5 * ab)
    w_nb, b_nb = retrain_classifier(feats, w0, None, epochs=1, lr=0.5, batch_size=30, generator=seeded(8))
    (aw_nb,) = torch.autograd.grad(
        F.cross_entropy(feats.reshape(30, 4) @ params[0].T, torch.arange(3).repeat_interleave(10)), params[0]
    )
    assert b_nb is None
    torch.testing.assert_close(w_nb, w0 - 0.5 * aw_nb)


# ----- the client --------------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_head", ["retrained", "aggregated"])
def test_reply_carries_gradients_only_for_held_classes_and_fedavg_training_is_untouched(grad_head):
    alg, model = _alg(grad_head=grad_head), _model()
    server = alg.init_server(model)
    server["head"] = {k: v + 0.5 for k, v in server["head"].items()}  # as if re-trained: unlike the model's
    payload = alg.payload_for(server, 0)
    assert set(payload) == ({"model", "head"} if grad_head == "retrained" else {"model"})
    data = _client([0, 0, 2, 2, 2])
    reply, state = alg.local_update(model, data, LocalWork(payload, None, seeded()))
    assert reply["classes"].tolist() == [0, 2] and reply["class_counts"].tolist() == [2, 3]
    assert reply["grad_weight"].shape == (2, 3, 8) and reply["grad_bias"].shape == (2, 3)
    # by autograd, on the received model's features, under the head the gradients are defined with
    head = payload["head"] if grad_head == "retrained" else payload["model"]
    ref = _model()
    ref.load_state_dict(payload["model"])
    ref.eval()
    with torch.no_grad():
        z = ref.features(data.x)
    for i, c in enumerate([0, 2]):
        aw, ab = _autograd_class_grads(z[data.y == c], c, head["head.weight"], head["head.bias"])
        torch.testing.assert_close(reply["grad_weight"][i], aw)
        torch.testing.assert_close(reply["grad_bias"][i], ab)
    # FedAvg's local update, reply and personal model, bit for bit (same generator)
    fedavg = _alg("fedavg")
    fed_reply, _ = fedavg.local_update(_model(), data, LocalWork({"model": payload["model"]}, None, seeded()))
    assert fed_reply.keys() <= reply.keys() and fed_reply["train_loss"] == reply["train_loss"]
    assert all(torch.equal(fed_reply["model"][k], v) for k, v in reply["model"].items())
    personal = alg.personal_predictor(model, local_work(payload, state))
    assert state is None and all(torch.equal(personal.state_dict()[k], v) for k, v in reply["model"].items())


def test_sampled_real_batches_are_seeded_and_cover_the_class_when_large():
    data, rng_seed = _client([0, 0, 1, 1, 1, 2]), 3
    full_alg, model = _alg(), _model()
    payload = full_alg.payload_for(full_alg.init_server(model), 0)
    full, _ = full_alg.local_update(_model(), data, LocalWork(payload, None, seeded(rng_seed)))
    whole, _ = _alg(real_batch=10, real_repeats=2).local_update(
        _model(), data, LocalWork(payload, None, seeded(rng_seed))
    )
    torch.testing.assert_close(whole["grad_weight"], full["grad_weight"])  # every draw = the whole class
    one = [
        _alg(real_batch=1).local_update(_model(), data, LocalWork(payload, None, seeded(rng_seed)))[0]
        for _ in range(2)
    ]
    assert torch.equal(one[0]["grad_weight"], one[1]["grad_weight"])
    assert not torch.allclose(one[0]["grad_weight"], full["grad_weight"])
    assert all(torch.equal(one[0]["model"][k], v) for k, v in full["model"].items())  # rng left to FedAvg


# ----- the server --------------------------------------------------------------------------------------


def _round(alg, model, labels=([0, 0, 2, 2], [2, 0, 0])):
    """One server round from a state as if after earlier rounds: features matched, head re-trained."""
    server = alg.init_server(model)
    server["features"] = 2 * server["features"] + 1  # they persist across rounds
    server["head"] = {k: v + 0.5 for k, v in server["head"].items()}
    received = (
        server["head"] if alg.grad_head == "retrained" else {k: server["model"][k] for k in server["head"]}
    )
    start = {"features": server["features"].clone(), **{k: v.clone() for k, v in received.items()}}
    replies = [
        alg.local_update(
            model, _client(y, seed=7 + k, cid=k), LocalWork(alg.payload_for(server, k), None, seeded(k))
        )[0]
        for k, y in enumerate(labels)
    ]
    return alg.aggregate(server, replies), replies, start


@pytest.mark.parametrize(
    ("bias", "grad_head"), [(True, "retrained"), (False, "retrained"), (True, "aggregated")]
)
def test_aggregate_keeps_fedavg_model_matches_features_retrains_and_gm_uses_the_retrained_head(
    bias, grad_head
):
    alg, model = _alg(grad_head=grad_head), _model(bias)
    server, replies, start = _round(alg, model)
    fedavg = weighted_average([r["model"] for r in replies], [r["num_samples"] for r in replies])
    assert server["model"].keys() == fedavg.keys()
    assert all(torch.equal(server["model"][k], v) for k, v in fedavg.items())  # FedAvg's aggregate
    # matching from the kept features, under the head the clients' gradients were taken with
    real_w, real_b, reported = aggregate_class_gradients(replies, 3, "clients")
    assert reported.tolist() == [True, False, True]
    w_used, b_used = start["head.weight"], start.get("head.bias")
    matched = match_features(start["features"], w_used, b_used, real_w, real_b, torch.tensor([0, 2]), 3, 0.01)
    assert torch.equal(server["features"], matched) and server["retrained"] == 1
    assert torch.equal(server["features"][1], start["features"][1])  # class 1: nobody holds it
    assert not torch.equal(server["features"][0], start["features"][0])
    # re-training on the matched features from a fresh seeded init (generator: init, then shuffles)
    g = seeds.generator(seeds.creff_retrain(0, 1))
    w0, b0 = linear_init(3, 8, bias, g)
    w, b = retrain_classifier(matched, w0, b0, epochs=2, lr=0.01, batch_size=4, generator=g)
    assert set(server["head"]) == set(head_keys(model)) and torch.equal(server["head"]["head.weight"], w)
    assert not bias or torch.equal(server["head"]["head.bias"], b)
    # GM = averaged backbone + re-trained head
    gm = alg.global_predictor(model, server)
    state = gm.state_dict()
    assert all(torch.equal(state[k], server["head"][k]) for k in head_keys(model))
    assert all(torch.equal(state[k], server["model"][k]) for k in backbone_keys(model))
    x = _client([0, 1, 2]).x
    with torch.no_grad():
        torch.testing.assert_close(gm(x), F.linear(gm.features(x), *server["head"].values()))
    if grad_head == "retrained":  # next round's gradients are taken under the new re-trained head
        assert alg.payload_for(server, 1)["head"] is server["head"]


def test_retraining_starts_from_the_aggregated_head_when_asked():
    server, _, _ = _round(_alg(retrain_epochs=0, retrain_init="aggregated"), _model())
    assert all(torch.equal(v, server["model"][k]) for k, v in server["head"].items())


# ----- end to end --------------------------------------------------------------------------------------


def _run(tmp_path, name: str, **algorithm) -> tuple[list[dict], dict]:
    raw = {
        "dataset": {"name": "synthetic"},
        "model": {"name": "mlp", "hidden": 32},
        "local": {"batch_size": 32},
        "clients": 3,
        "rounds": 2,
        "seed": 3,
        "algorithm": {"name": name, **algorithm},
        "output_dir": str(tmp_path / name),
    }
    run_experiment(config_from_dict(raw), progress=False)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    server = torch.load(tmp_path / name / "checkpoint" / "state.pt", weights_only=False)["server"]
    return rows, server


def test_two_rounds_leave_the_fedavg_model_and_personal_metrics_identical_to_fedavg(tmp_path):
    creff_rows, creff = _run(tmp_path, "creff", **FAST, grad_weighting="samples")
    fedavg_rows, fedavg = _run(tmp_path, "fedavg")
    assert creff["model"].keys() == fedavg["model"].keys()
    assert all(torch.equal(creff["model"][k], v) for k, v in fedavg["model"].items())
    assert not torch.equal(creff["head"]["head.weight"], creff["model"]["head.weight"])  # GM's own head
    assert [r["round"] for r in creff_rows] == [1, 2]
    for c, f in zip(creff_rows, fedavg_rows, strict=True):
        assert all(c[k] == f[k] for k in ["personal_acc", "pa_l", "pa_v", "train_loss"])  # PM = FedAvg's
        assert 0.0 <= c["global_acc"] <= 1.0 and math.isfinite(c["global_acc"])
        assert c["bytes_up"] > f["bytes_up"] and c["bytes_down"] > f["bytes_down"]
