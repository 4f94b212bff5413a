"""Personalised baselines: Local, FedPer, FedRep, FedBABU, FedRoD, LG-FedAvg.

Formulas on tiny tensors, what replies may carry (never the private part), FedBABU's frozen head, and a
short end-to-end run of each on synthetic data.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL_EVERY_METRIC, local_work, seeded, spy_sgd, tiny_client, tiny_mlp
from fedpcd.algorithms import ClientData, Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms import fedrep as fedrep_module
from fedpcd.algorithms.common import balanced_softmax_loss, log_prior
from fedpcd.algorithms.contract import train_loop
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.backends import run_experiment
from fedpcd.models import backbone_keys, head_keys
from fedpcd.resolve import load_config

SMALL = SMALL_EVERY_METRIC
NAMES = ["local", "fedper", "fedrep", "fedbabu", "fedrod", "lgfedavg"]


def _alg(name: str, epochs: int = 1, rounds: int = 1, **params):
    alg = build_algorithm(name, params)
    alg.setup(
        Context(
            num_clients=3,
            num_classes=3,
            rounds=rounds,
            seed=0,
            local=LocalTraining(epochs=epochs, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0),
        )
    )
    return alg


def _client(k: int = 0, labels: list[int] | None = None) -> ClientData:
    y = torch.tensor(labels if labels is not None else [0, 1, 1, 2, 2, 2, 0, 1])
    return tiny_client(y, 3, seed=7 + k, cid=k, local_test=True)


def _stepped(loops: list[dict]) -> list[set[int]]:
    return [_ids(loop["params"]) for loop in loops]


def _ids(params) -> set[int]:
    return {id(p) for p in params}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----- the shared split-model protocol (FedPer, FedRep, FedBABU, LG-FedAvg, Local) -----


@pytest.mark.parametrize(
    ("name", "private"),
    [("fedper", "head"), ("fedrep", "head"), ("fedbabu", "head"), ("lgfedavg", "body"), ("local", "all")],
)
def test_replies_never_carry_the_private_part_and_state_holds_it(name, private):
    alg, model = _alg(name, finetune_epochs=1) if name == "fedbabu" else _alg(name), tiny_mlp()
    keys = {"head": head_keys(model), "body": backbone_keys(model), "all": list(model.state_dict())}[private]
    server = alg.init_server(model)
    payload = alg.payload_for(server, 0)
    reply, state = alg.local_update(model, _client(), LocalWork(payload, None, seeded()))
    assert set(reply["model"]).isdisjoint(keys)
    assert set(reply["model"]) | set(keys) == set(model.state_dict())
    assert set(state) == set(keys)
    assert {"num_samples", "train_loss"} <= set(reply) and set(reply) <= {
        "model",
        "num_samples",
        "train_loss",
    }
    assert set(server["model"]) == set(reply["model"])  # the server never holds a client's private part


@pytest.mark.parametrize("name", ["fedper", "fedrep", "fedbabu", "lgfedavg", "local"])
def test_private_part_never_travels_and_a_new_client_starts_from_its_fresh_model(name):
    alg, model = _alg(name), tiny_mlp()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    server = alg.init_server(model)
    shared = set(model.state_dict()) - set(alg.private_keys(model))
    payloads = [alg.payload_for(server, k) for k in range(3)]
    assert all(set(p) == {"model"} and set(p["model"]) == shared for p in payloads)
    # a client without state starts from the private part of the model it is handed (the engine resets it
    # to the architecture's seeded initial weights), whatever the previous client left in that object
    _, s0 = alg.local_update(model, _client(0), LocalWork(payloads[0], None, seeded()))
    model.load_state_dict(initial)
    _, s1 = alg.local_update(model, _client(1), LocalWork(payloads[1], None, seeded()))
    model2 = tiny_mlp()
    payload2 = alg.payload_for(alg.init_server(model2), 1)
    _, s1_fresh = alg.local_update(model2, _client(1), LocalWork(payload2, None, seeded()))
    assert _equal(s1, s1_fresh)


def test_fedper_trains_head_and_body_and_keeps_the_head_across_rounds():
    alg, model = _alg("fedper"), tiny_mlp()
    server = alg.init_server(model)
    p0 = alg.payload_for(server, 0)
    reply, state = alg.local_update(model, _client(), LocalWork(p0, None, seeded()))
    assert not torch.equal(state["head.weight"], server["initial"]["head.weight"])
    server = alg.aggregate(server, [reply])
    p1 = alg.payload_for(server, 0)
    alg.begin_local(model, _client(), LocalWork(p1, state, seeded()))
    assert torch.equal(model.head.weight, state["head.weight"])  # private head restored from the state
    assert all(torch.equal(model.state_dict()[k], v) for k, v in server["model"].items())


@pytest.mark.parametrize("name", ["fedper", "fedrep", "fedbabu"])
def test_global_model_is_averaged_body_with_the_initial_head(name):
    alg, model = _alg(name), tiny_mlp()
    server = alg.init_server(model)
    replies = []
    for k in range(2):
        reply, _ = alg.local_update(model, _client(k), LocalWork(alg.payload_for(server, k), None, seeded(k)))
        replies.append(reply)
    n = [r["num_samples"] for r in replies]
    server = alg.aggregate(server, replies)
    for key in backbone_keys(model):
        expect = (n[0] * replies[0]["model"][key] + n[1] * replies[1]["model"][key]) / sum(n)
        torch.testing.assert_close(server["model"][key], expect)
    gm = alg.global_predictor(model, server)
    assert torch.equal(gm.head.weight, tiny_mlp().head.weight)


def test_lgfedavg_averages_only_the_head_and_has_no_global_model():
    alg, model = _alg("lgfedavg"), tiny_mlp()
    server = alg.init_server(model)
    assert set(server["model"]) == set(head_keys(model))
    r0, s0 = alg.local_update(model, _client(0), LocalWork(alg.payload_for(server, 0), None, seeded(0)))
    r1, _ = alg.local_update(
        model, _client(1, [0, 0, 1]), LocalWork(alg.payload_for(server, 1), None, seeded(1))
    )
    server = alg.aggregate(server, [r0, r1])
    torch.testing.assert_close(
        server["model"]["head.bias"], (8 * r0["model"]["head.bias"] + 3 * r1["model"]["head.bias"]) / 11
    )
    assert alg.global_predictor(model, server) is None
    # own body, the new global head
    alg.begin_local(model, _client(0), LocalWork(alg.payload_for(server, 0), s0, seeded()))
    assert torch.equal(model.head.bias, server["model"]["head.bias"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in s0.items())


def test_local_communicates_nothing_and_has_no_global_model():
    alg, model = _alg("local"), tiny_mlp()
    server = alg.init_server(model)
    first = alg.payload_for(server, 0)
    assert tensor_bytes(first) == 0  # the client builds its own initial model
    reply, state = alg.local_update(model, _client(), LocalWork(first, None, seeded()))
    assert tensor_bytes(reply) == 0
    assert tensor_bytes(alg.payload_for(server, 0)) == 0
    assert alg.aggregate(server, [reply]) is server
    assert alg.global_predictor(model, server) is None
    reply2, state2 = alg.local_update(
        model, _client(), LocalWork(alg.payload_for(server, 0), state, seeded(2))
    )
    assert not _equal(state, state2)  # continues from its own model


# ----- FedRep -----


def test_fedrep_trains_the_head_then_the_body(monkeypatch):
    alg, model = _alg("fedrep", head_epochs=2, body_epochs=1), tiny_mlp()
    seen = spy_sgd(monkeypatch)
    server = alg.init_server(model)
    reply, state = alg.local_update(model, _client(), LocalWork(alg.payload_for(server, 0), None, seeded()))
    head = _ids(model.head.parameters())
    assert _stepped(seen) == [head, _ids(model.parameters()) - head]
    assert not torch.equal(state["head.weight"], server["initial"]["head.weight"])


def test_fedrep_head_phase_leaves_the_body_and_body_phase_leaves_the_head():
    alg, model = _alg("fedrep", head_epochs=1), tiny_mlp()
    server = alg.init_server(model)
    payload = alg.payload_for(server, 0)
    state = server["initial"]
    alg.begin_local(model, _client(), LocalWork(payload, state, seeded()))
    train_loop(alg, model, _client(), LocalWork(payload, state, seeded(), phase="head"), epochs=1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in server["model"].items())
    head = {k: v.clone() for k, v in model.head.state_dict().items()}
    train_loop(alg, model, _client(), LocalWork(payload, state, seeded(), phase="body"), epochs=1)
    assert _equal(head, model.head.state_dict())
    assert not torch.equal(model.state_dict()["fc1.weight"], server["model"]["fc1.weight"])


def test_fedrep_head_epochs_compute_no_body_gradient_and_train_the_same_head():
    """train_loop freezes what it does not train: the head epochs leave no gradient on the body, restore its
    requires_grad, and give bitwise the head of a loop that back-propagates through the whole model."""
    alg, model = _alg("fedrep"), tiny_mlp()
    server = alg.init_server(model)
    payload, state = alg.payload_for(server, 0), server["initial"]
    alg.begin_local(model, _client(), LocalWork(payload, state, seeded()))
    reference = copy.deepcopy(model)
    train_loop(alg, model, _client(), LocalWork(payload, state, seeded(), phase="head"), epochs=3)
    body = [p for p in model.parameters() if id(p) not in _ids(model.head.parameters())]
    assert body and all(p.grad is None and p.requires_grad for p in body)

    work = LocalWork(payload, state, seeded(), phase="head")
    opt = torch.optim.SGD(reference.head.parameters(), lr=alg.ctx.local.lr)
    reference.train()
    for _ in range(3):
        for batch in _client().batches(alg.ctx.local.batch_size, work.rng):
            opt.zero_grad(set_to_none=True)
            alg.loss(reference, batch, work).backward()
            opt.step()
    assert reference.fc1.weight.grad is not None  # the reference did go through the body
    assert _equal(model.state_dict(), reference.state_dict())


def test_fedrep_default_body_epochs_are_local_epochs(monkeypatch):
    alg, model = _alg("fedrep", epochs=3, head_epochs=0), tiny_mlp()
    calls: list[int | None] = []
    real = fedrep_module.train_loop

    def count(*args, epochs=None, lr=None):
        calls.append(epochs)
        return real(*args, epochs=epochs, lr=lr)

    monkeypatch.setattr(fedrep_module, "train_loop", count)
    alg.local_update(model, _client(), LocalWork(alg.payload_for(alg.init_server(model), 0), None, seeded()))
    assert calls == [0, None]  # head phase of 0 epochs, then the body for local.epochs (3)


# ----- FedBABU -----


def test_fedbabu_head_never_in_the_optimiser_and_unchanged_during_fl(monkeypatch):
    alg, model = _alg("fedbabu", epochs=2, finetune_epochs=1), tiny_mlp()
    seen = spy_sgd(monkeypatch)
    server = alg.init_server(model)
    initial = {k: v.clone() for k, v in server["initial"].items()}
    state = None
    for rnd in (1, 2):
        work = LocalWork(alg.payload_for(server, 0), state, seeded(rnd), round=rnd)
        reply, state = alg.local_update(model, _client(), work)
        server = alg.aggregate(server, [reply])
        assert _equal(state, initial)  # the head the client keeps is the initial one, always
    assert _equal(server["initial"], initial)
    head, body = _ids(model.head.parameters()), _ids(model.parameters()) - _ids(model.head.parameters())
    assert _stepped(seen) == [body, head | body] * 2  # FL: body only; fine-tuning: the whole net
    assert not torch.equal(model.head.weight, initial["head.weight"])  # the personal model is fine-tuned


def test_fedbabu_finetunes_from_the_global_body_by_default():
    alg, model = _alg("fedbabu", finetune_epochs=0), tiny_mlp()
    server = alg.init_server(model)
    payload = alg.payload_for(server, 0)
    reply, _ = alg.local_update(model, _client(), LocalWork(payload, None, seeded()))
    personal = alg.personal_predictor(model, local_work(payload))
    assert _equal({k: personal.state_dict()[k] for k in server["model"]}, server["model"])  # not local
    assert not _equal(reply["model"], server["model"])


def test_fedbabu_last_round_option_skips_finetuning_before_round_r():
    alg, model = _alg("fedbabu", rounds=2, finetune_when="last_round", finetune_lr=0.5), tiny_mlp()
    server = alg.init_server(model)
    reply, state = alg.local_update(model, _client(), LocalWork(alg.payload_for(server, 0), None, seeded()))
    assert _equal({k: model.state_dict()[k] for k in reply["model"]}, reply["model"])
    assert torch.equal(model.head.weight, state["head.weight"])
    alg.local_update(model, _client(), LocalWork(alg.payload_for(server, 0), state, seeded(), round=2))
    assert not torch.equal(model.head.weight, state["head.weight"])


# ----- FedRoD -----


def test_log_prior_and_balanced_softmax_by_hand():
    lp = log_prior(torch.tensor([1, 3, 0]))
    torch.testing.assert_close(lp[:2], torch.tensor([math.log(0.25), math.log(0.75)]))
    assert lp[2] == -math.inf
    logits = torch.tensor([[1.0, 2.0, 5.0], [0.0, -1.0, 3.0]])
    y = torch.tensor([0, 1])
    loss = balanced_softmax_loss(logits, y, lp)
    # class 2 is absent: it drops out of the softmax; the others are shifted by log p
    a = torch.tensor(
        [[1.0 + math.log(0.25), 2.0 + math.log(0.75)], [0.0 + math.log(0.25), -1.0 + math.log(0.75)]]
    )
    expect = -(torch.log_softmax(a, dim=1)[0, 0] + torch.log_softmax(a, dim=1)[1, 1]) / 2
    torch.testing.assert_close(loss, expect)
    loss_full = balanced_softmax_loss(logits, y, log_prior(torch.tensor([1, 1, 1])))
    torch.testing.assert_close(loss_full, F.cross_entropy(logits, y))  # uniform prior = plain CE
    logits.requires_grad_(True)
    balanced_softmax_loss(logits, y, lp).backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[:, 2] == 0).all()


def test_fedrod_loss_gradients_go_where_the_paper_says():
    alg, model = _alg("fedrod"), tiny_mlp()
    data = _client(labels=[0, 0, 0, 1])
    h_p = {
        "weight": torch.randn(3, model.feature_dim, generator=seeded()).requires_grad_(True),
        "bias": torch.randn(3, generator=seeded(2)).requires_grad_(True),
    }
    x, y = data.x, data.y
    alg.loss(
        model, (x, y), local_work({}, log_prior=log_prior(data.label_counts), personal_head=h_p)
    ).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    got_p = h_p["weight"].grad.clone()
    # by hand: body + generic head only from BSM; personal head only from CE(g.detach + p(z.detach))
    model.zero_grad()
    z = model.features(x)
    g = model.head(z)
    F.cross_entropy(g + torch.log(torch.tensor([0.75, 0.25, 0.0])), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad)
    w = h_p["weight"].detach().clone().requires_grad_(True)
    with torch.no_grad():
        zd, gd = model.features(x), model.head(model.features(x))
    F.cross_entropy(gd + F.linear(zd, w, h_p["bias"].detach()), y).backward()
    torch.testing.assert_close(got_p, w.grad)


def test_fedrod_personal_head_is_private_zero_initialised_and_added_to_generic_logits():
    alg, model = _alg("fedrod"), tiny_mlp()
    server = alg.init_server(model)
    payload = alg.payload_for(server, 0)
    assert set(payload["model"]) == set(model.state_dict())  # body + generic head are shared
    alg.ctx = Context(
        3,
        3,
        1,
        0,
        LocalTraining.model_construct(epochs=1, batch_size=4, lr=0.0, momentum=0.0, weight_decay=0.0),
    )
    _, state0 = alg.local_update(model, _client(), LocalWork(payload, None, seeded()))
    assert all((v == 0).all() for v in state0.values()) and set(state0) == {"weight", "bias"}
    alg.ctx = _alg("fedrod").ctx
    work = LocalWork(payload, None, seeded())
    reply, state = alg.local_update(model, _client(), work)
    assert set(reply["model"]) == set(model.state_dict())  # no personal-head tensor in the reply
    assert not (state["weight"] == 0).all()
    x = _client().x
    with torch.no_grad():
        z = model.features(x)
        expect = model.head(z) + F.linear(z, state["weight"], state["bias"])
        torch.testing.assert_close(alg.personal_predictor(model, work)(x), expect)
        gm = alg.global_predictor(model, alg.aggregate(server, [reply]))
        torch.testing.assert_close(gm(x), model.head(model.features(x)))


def test_fedrod_personal_head_has_a_bias_where_the_generic_head_has_none(tmp_path):
    """FedNH's conv2cifar has a bias-free head: FedRoD's personal head h_p keeps its own (zero) bias."""
    out = tmp_path / "run"
    args = ["dataset.name=synthetic16", "model.name=conv2cifar", "clients=3", "rounds=1", f"output_dir={out}"]
    run_experiment(load_config(None, ["algorithm.name=fedrod", *args]), progress=False)
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=False)["client_states"][0]
    assert state["bias"].shape == (10,) and state["weight"].shape[0] == 10


# ----- end to end -----


@pytest.mark.parametrize("name", NAMES)
def test_end_to_end_synthetic(tmp_path, name):
    extra = ["algorithm.finetune_epochs=1"] if name == "fedbabu" else []
    extra += ["algorithm.head_epochs=1"] if name == "fedrep" else []
    args = SMALL + ["clients=3", "rounds=2", "participation=0.67", f"algorithm.name={name}", *extra]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'run'}"]), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[k]) and 0.0 <= r[k] <= 1.0 for k in ["pa_l", "pa_v"])
        if name in ("local", "lgfedavg"):
            assert r["global_acc"] is None
        else:
            assert 0.0 <= r["global_acc"] <= 1.0
        if name == "local":
            assert r["bytes_up"] == 0
