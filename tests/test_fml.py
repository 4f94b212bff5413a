"""FML: the mutual (DML) losses by hand, the shared model object and its seeding, what leaves a client, the
meme aggregation, and model-heterogeneous / homogeneous end-to-end runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import CNN5_SYNTHETIC16, HETERO_MODELS, seeded, tiny_client
from fedpcd.algorithms import Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.fml import kl_divergence, mutual_losses
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.backends import run_experiment
from fedpcd.engine.rundir import RunDir
from fedpcd.errors import UserError
from fedpcd.models import build_model
from fedpcd.resolve import load_config

S = 3
LN2, LN3 = math.log(2.0), math.log(3.0)


def _ctx(seed: int = 0, rounds: int = 4) -> Context:
    local = LocalTraining(epochs=1, batch_size=4, lr=0.1)
    return Context(3, S, rounds, seed, local, heterogeneous=True, input_shape=(1, 2, 2))


def _alg(name: str = "fml", seed: int = 0, **params):
    alg = build_algorithm(name, {"shared_model": "mlp", **params})
    alg.setup(_ctx(seed))
    return alg


def _private(hidden: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    return build_model("mlp", 1, S, 2, hidden=hidden)


# ----- the losses, by hand -----

# teacher-like logits [0, ln 3] give p = (1/4, 3/4); zero logits give (1/2, 1/2)
SKEWED = torch.tensor([[0.0, LN3]])
FLAT = torch.tensor([[0.0, 0.0]])
KL_SKEWED_FLAT = 0.75 * LN3 - LN2  # KL((1/4, 3/4) || (1/2, 1/2))
KL_FLAT_SKEWED = 0.5 * math.log(4.0 / 3.0)  # KL((1/2, 1/2) || (1/4, 3/4))


def test_kl_divergence_by_hand():
    assert float(kl_divergence(SKEWED, FLAT)) == pytest.approx(KL_SKEWED_FLAT, abs=1e-6)
    assert float(kl_divergence(FLAT, SKEWED)) == pytest.approx(KL_FLAT_SKEWED, abs=1e-6)
    assert float(kl_divergence(SKEWED, SKEWED)) == pytest.approx(0.0, abs=1e-7)
    both_t, both = torch.cat([SKEWED, FLAT]), torch.cat([FLAT, FLAT])
    mean_of_two = (KL_SKEWED_FLAT + 0.0) / 2
    assert float(kl_divergence(both_t, both)) == pytest.approx(mean_of_two, abs=1e-6)  # batch mean
    assert float(kl_divergence(both_t, both, "mean")) == pytest.approx(mean_of_two / 2, abs=1e-6)  # / C too


def test_mutual_losses_by_hand_and_each_only_trains_its_own_model():
    private, meme = SKEWED.clone().requires_grad_(), FLAT.clone().requires_grad_()
    y = torch.tensor([1])
    local, meme_loss = mutual_losses(private, meme, y, alpha=0.3, beta=0.6)
    # L_local = 0.3 CE(private) + 0.7 KL(p_meme || p_local); L_meme = 0.6 CE(meme) + 0.4 KL(p_local || p_meme)
    assert float(local.detach()) == pytest.approx(0.3 * math.log(4 / 3) + 0.7 * KL_FLAT_SKEWED, abs=1e-6)
    assert float(meme_loss.detach()) == pytest.approx(0.6 * LN2 + 0.4 * KL_SKEWED_FLAT, abs=1e-6)
    local.backward()
    assert meme.grad is None and private.grad is not None  # the meme's distribution is a constant target
    private.grad = None
    meme_loss.backward()
    assert private.grad is None and meme.grad is not None


# ----- the shared model object -----


def test_shared_model_is_seeded_identically_everywhere_and_is_one_object():
    a, b, other = _alg(seed=0), _alg(seed=0), _alg(seed=1)
    sa, sb, so = (x.init_server(_private())["model"] for x in (a, b, other))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # server and clients agree on the initial weights
    assert not torch.equal(sa["fc1.weight"], so["fc1.weight"])  # from the run seed
    default = build_algorithm("fml")
    assert default.shared_model == "cnn5" and default.alpha == 0.5 and default.beta == 0.5
    assert type(default).heterogeneous

    shared = a.shared
    initial = {k: v.clone() for k, v in shared.state_dict().items()}
    payload = a.payload_for(a.init_server(_private()), 0)
    work = LocalWork(payload, None, seeded())
    a.local_update(_private(), tiny_client(torch.tensor([0, 1, 2, 1]), S, seed=3), work)
    assert work.shared is not shared  # the update trains its own copy ...
    assert a.shared is shared and all(torch.equal(v, initial[k]) for k, v in shared.state_dict().items())
    server = {"model": {k: v + 1 for k, v in sa.items()}}
    predictor = a.global_predictor(_private(), server)
    assert predictor is not shared and torch.equal(predictor.fc1.weight, server["model"]["fc1.weight"])
    assert all(torch.equal(v, initial[k]) for k, v in shared.state_dict().items())  # ... and so does GA


def test_a_shared_model_too_big_for_the_input_is_refused():
    alg = build_algorithm("fml")  # cnn5 needs 16x16 inputs
    with pytest.raises(UserError, match="too small for model 'cnn5'"):
        alg.setup(_ctx())


# ----- what leaves the client -----


def test_reply_is_the_meme_model_and_the_state_is_the_private_model():
    alg = _alg()
    private = _private(hidden=8)  # a different architecture from the shared mlp (hidden 200)
    payload = alg.payload_for(alg.init_server(private), 0)
    data = tiny_client(torch.tensor([0, 1, 2, 1, 0]), S, seed=4)
    work = LocalWork(payload, None, seeded())
    reply, state = alg.local_update(private, data, work)
    assert set(reply) == {"model", "num_samples", "train_loss"} and reply["num_samples"] == 5
    assert {k: v.shape for k, v in reply["model"].items()} == {
        k: v.shape for k, v in payload["model"].items()
    }
    assert all(torch.equal(reply["model"][k], v) for k, v in work.shared.state_dict().items())
    assert not torch.equal(reply["model"]["fc1.weight"], payload["model"]["fc1.weight"])  # it trained
    assert tensor_bytes(reply) == tensor_bytes(payload)  # up = down = the shared model
    assert set(state) == {"model"} and all(
        torch.equal(state["model"][k], v) for k, v in private.state_dict().items()
    )

    # next participation: the engine hands whatever weights the object holds; the private model is the state's
    after = []
    for seed in (9, 10):
        handed = _private(hidden=8, seed=seed)
        alg.local_update(handed, data, LocalWork(payload, state, seeded(2)))
        after.append(handed.state_dict())
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])


def test_with_alpha_beta_one_the_meme_trains_exactly_like_fedavg():
    data = tiny_client(torch.tensor([0, 1, 2, 1, 0, 2, 2]), S, seed=5)
    fml = _alg(alpha=1.0, beta=1.0)
    payload = fml.payload_for(fml.init_server(_private()), 0)
    reply, _ = fml.local_update(_private(), data, LocalWork(payload, None, seeded()))
    fedavg = build_algorithm("fedavg")
    fedavg.setup(_ctx())
    model = build_model("mlp", 1, S, 2)
    ref, _ = fedavg.local_update(model, data, LocalWork(payload, None, seeded()))
    assert all(torch.allclose(reply["model"][k], ref["model"][k], atol=1e-6) for k in ref["model"])


def test_aggregate_is_the_weighted_or_plain_mean_of_the_memes():
    replies = [
        {"model": {"w": torch.tensor([1.0, 2.0])}, "num_samples": 1},
        {"model": {"w": torch.tensor([4.0, 8.0])}, "num_samples": 3},
    ]
    assert torch.allclose(_alg().aggregate({}, replies)["model"]["w"], torch.tensor([3.25, 6.5]))
    assert torch.allclose(
        _alg(weighting="uniform").aggregate({}, replies)["model"]["w"], torch.tensor([2.5, 5.0])
    )


# ----- end to end -----

HETERO = [*HETERO_MODELS, "clients=5", "rounds=2"]


def _run(tmp_path, *overrides: str):
    out = tmp_path / "run"
    run_experiment(load_config(None, [*overrides, f"output_dir={out}"]), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, RunDir(out).load_checkpoint()


def test_model_heterogeneous_run(tmp_path):
    rows, ck = _run(tmp_path, *HETERO, "algorithm.name=fml")
    assert [r["round"] for r in rows] == [1, 2]
    assert all(0.0 <= r["global_acc"] <= 1.0 and 0.0 <= r["personal_acc"] <= 1.0 for r in rows)
    assert all(r["bytes_up"] == r["bytes_down"] == 5 * 4 * CNN5_SYNTHETIC16 for r in rows)
    states = ck["client_states"]
    assert states[0]["model"]["fc1.weight"].shape == (2000, 32) and states[4]["model"][
        "fc1.weight"
    ].shape == (500, 32)
    assert ck["server"]["model"]["fc1.weight"].shape == (500, 32)  # the server holds only CNN-5


def test_homogeneous_run(tmp_path):
    rows, ck = _run(tmp_path, *HETERO[:1], "model.name=cnn1", *HETERO[2:], "algorithm.name=fml")
    assert all(r["global_acc"] is not None for r in rows)
    assert ck["client_states"][3]["model"]["fc1.weight"].shape == (2000, 32)
