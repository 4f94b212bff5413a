"""FedKD: the adaptive mutual distillation losses by hand and their gradient coupling, the energy threshold
schedule, the truncated SVD (smallest rank, error within the discarded energy), what leaves a client, the
server's reconstruction and average, and model-heterogeneous / homogeneous end-to-end runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import CNN5_SYNTHETIC16, HETERO_MODELS, seeded, tiny_client
from fedpcd.algorithms import Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.fedkd import (
    adaptive_mutual_losses,
    compress_update,
    energy_rank,
    energy_threshold,
    reconstruct_update,
    svd_compress,
    svd_reconstruct,
)
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.backends import run_experiment
from fedpcd.engine.rundir import RunDir
from fedpcd.errors import UserError
from fedpcd.models import build_model
from fedpcd.resolve import load_config

S = 3
LN2, LN3 = math.log(2.0), math.log(3.0)


def _alg(rounds: int = 4, **params):
    alg = build_algorithm("fedkd", {"shared_model": "mlp", **params})
    local = LocalTraining(epochs=1, batch_size=4, lr=0.1)
    alg.setup(Context(3, S, rounds, 0, local, heterogeneous=True, input_shape=(1, 2, 2)))
    return alg


def _teacher(hidden: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    return build_model("mlp", 1, S, 2, hidden=hidden)


def _data():
    return tiny_client(torch.tensor([0, 1, 2, 1, 0, 2, 1, 1]), S, seed=3)


# ----- adaptive mutual distillation, by hand -----

TEACHER = torch.tensor([[0.0, LN3]])  # p_t = (1/4, 3/4)
STUDENT = torch.tensor([[0.0, 0.0]])  # p_s = (1/2, 1/2)
H_T, H_S = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]])  # MSE = (0 + 4) / 2 = 2
Y = torch.tensor([1])
CE_T, CE_S = math.log(4 / 3), LN2
KL_S_T = 0.5 * math.log(4 / 3)  # KL(p_s || p_t), the teacher's distillation loss
KL_T_S = 0.75 * LN3 - LN2  # KL(p_t || p_s), the student's


def _inputs():
    return [t.clone().requires_grad_() for t in (TEACHER, STUDENT, H_T, H_S)]


@pytest.mark.parametrize("coupling", ["joint", "detached"])
def test_adaptive_losses_by_hand(coupling):
    scale = CE_T + CE_S  # distillation and hidden losses are divided by the sum of the two task losses
    lt, ls = adaptive_mutual_losses(*_inputs(), Y, coupling)
    assert float(lt.detach()) == pytest.approx(CE_T + (KL_S_T + 2.0) / scale, abs=1e-6)
    assert float(ls.detach()) == pytest.approx(CE_S + (KL_T_S + 2.0) / scale, abs=1e-6)
    lt, ls = adaptive_mutual_losses(*_inputs(), Y, coupling, kl_reduction="mean")  # KL / C as well
    assert float(lt.detach()) == pytest.approx(CE_T + (KL_S_T / 2 + 2.0) / scale, abs=1e-6)
    assert float(ls.detach()) == pytest.approx(CE_S + (KL_T_S / 2 + 2.0) / scale, abs=1e-6)


def test_adaptive_weight_grows_as_both_models_get_it_right():
    confident = torch.tensor([[0.0, 5.0]])
    for teacher, student in ((TEACHER, STUDENT), (confident, confident + 0.5)):
        ce = float(
            torch.nn.functional.cross_entropy(teacher, Y) + torch.nn.functional.cross_entropy(student, Y)
        )
        lt, _ = adaptive_mutual_losses(teacher, student, H_T, H_S, Y)
        distill = float(lt) - float(torch.nn.functional.cross_entropy(teacher, Y))
        kl = float(
            torch.nn.functional.kl_div(teacher.log_softmax(1), student.softmax(1), reduction="batchmean")
        )
        assert distill == pytest.approx((kl + 2.0) / ce, rel=1e-5)
    assert 1 / ce > 10  # near-correct predictions: the distillation terms weigh > 10x


def test_joint_coupling_sends_gradient_everywhere_detached_only_to_its_own_model():
    t, s, ht, hs = _inputs()
    lt, _ = adaptive_mutual_losses(t, s, ht, hs, Y, "joint")
    lt.backward()
    assert s.grad.abs().sum() > 0 and hs.grad.abs().sum() > 0  # official code: no stop-gradient at all
    t, s, ht, hs = _inputs()
    lt, ls = adaptive_mutual_losses(t, s, ht, hs, Y, "detached")
    lt.backward()
    assert s.grad is None and hs.grad is None and t.grad is not None
    t.grad = ht.grad = None
    ls.backward()
    assert t.grad is None and ht.grad is None and s.grad is not None
    # detached: 1/(CE_t + CE_s) is a constant, so the teacher's logit gradient is CE's + KL's / scale
    t2 = TEACHER.clone().requires_grad_()
    p_t, p_s = t2.softmax(1), STUDENT.softmax(1)
    expected = torch.autograd.grad(
        torch.nn.functional.cross_entropy(t2, Y) + (p_s * (p_s.log() - p_t.log())).sum() / (CE_T + CE_S), t2
    )[0]
    t, s, ht, hs = _inputs()
    lt, _ = adaptive_mutual_losses(t, s, ht, hs, Y, "detached")
    assert torch.allclose(torch.autograd.grad(lt, t)[0], expected, atol=1e-6)


# ----- dynamic gradient approximation -----


def test_threshold_schedule_rises_linearly_to_t_end():
    assert [energy_threshold(t, 3, 0.95, 0.98) for t in (1, 2, 3)] == pytest.approx([0.96, 0.97, 0.98])
    assert energy_threshold(0, 3, 0.95, 0.98) == pytest.approx(0.95)
    alg = _alg(rounds=10)
    assert alg.t_start == 0.95 and alg.t_end == 0.98
    assert alg.threshold(10) == pytest.approx(0.98) and alg.threshold(5) == pytest.approx(0.965)


def test_energy_rank_is_the_smallest_rank_reaching_the_threshold():
    s = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert energy_rank(s, 0.9) == 2  # 13/14 = 0.929 >= 0.9 > 9/14
    assert energy_rank(s, 0.95) == 3
    assert energy_rank(s, 13 / 14) == 2  # reaching the threshold exactly is enough
    assert energy_rank(s, 9 / 14) == 1 and energy_rank(s, 0.0) == 1
    assert energy_rank(s, 1.0) == 3
    assert energy_rank(torch.zeros(4), 0.95) == 1  # a zero update still sends one (zero) triple


def test_svd_truncation_error_is_the_discarded_energy():
    g = torch.Generator().manual_seed(0)
    update = torch.randn(20, 8, generator=g) @ torch.randn(8, 30, generator=g) + 0.01 * torch.randn(
        20, 30, generator=g
    )
    sigma = torch.linalg.svdvals(update).double()
    energy = sigma.square()
    for threshold in (0.5, 0.9, 0.95, 0.98):
        factors = svd_compress(update, threshold)
        k = len(factors["s"])
        assert factors["u"].shape == (20, k) and factors["v"].shape == (k, 30)
        assert energy[:k].sum() >= threshold * energy.sum() > energy[: k - 1].sum()  # smallest such k
        error = (update - svd_reconstruct(factors, update.shape)).double().square().sum()
        assert float(error) == pytest.approx(float(energy[k:].sum()), rel=1e-3, abs=1e-6)
        assert error <= (1 - threshold) * energy.sum() + 1e-6
    assert len(svd_compress(update, 0.95)["s"]) <= 8  # the rank-8 structure, not the noise
    kernel = torch.randn(4, 2, 3, 3, generator=g)  # conv kernels go as out x (in k k)
    assert torch.allclose(svd_reconstruct(svd_compress(kernel, 1.0), kernel.shape), kernel, atol=1e-5)


def test_compressed_update_holds_factors_for_matrices_and_is_smaller():
    g = torch.Generator().manual_seed(1)
    update = {
        "fc.weight": torch.randn(50, 2, generator=g) @ torch.randn(2, 40, generator=g),
        "fc.bias": torch.randn(50, generator=g),
        "bn.num_batches_tracked": torch.tensor(3),
    }
    packed = compress_update(update, 0.95)
    assert set(packed["fc.weight"]) == {"u", "s", "v"} and len(packed["fc.weight"]["s"]) <= 2
    assert torch.equal(packed["fc.bias"], update["fc.bias"]) and packed["bn.num_batches_tracked"] == 3
    assert tensor_bytes(packed) < tensor_bytes(update)
    back = reconstruct_update(packed, update)
    assert torch.allclose(back["fc.weight"], update["fc.weight"], atol=1e-4)


# ----- the client -----


def test_reply_carries_only_the_compressed_student_update():
    alg = _alg()
    teacher = _teacher()
    payload = alg.payload_for(alg.init_server(teacher), 0)
    assert set(payload) == {"model"}  # the download is the student only
    work = LocalWork(payload, None, seeded())
    reply, state = alg.local_update(teacher, _data(), work)
    assert set(reply) == {"update", "num_samples", "train_loss"}
    update = reply["update"]
    assert set(update) == set(payload["model"])  # the student's keys; nothing of the teacher
    for key, w in payload["model"].items():
        assert isinstance(update[key], dict) == (w.dim() >= 2)
    trained = work.shared.state_dict()
    delta = {k: trained[k] - w for k, w in payload["model"].items()}
    assert tensor_bytes(reply) < tensor_bytes(delta)  # the factors are smaller than the dense update
    back = reconstruct_update(update, payload["model"])
    t = alg.threshold(1)
    for key in delta:  # each matrix within its discarded energy; vectors exact
        err = (back[key] - delta[key]).square().sum()
        assert err <= (1 - t) * delta[key].square().sum() + 1e-9
    assert set(state) == {"model", "projection"}
    assert state["projection"].shape == (8, 200)  # W^h: student width (200) -> teacher width (8)
    assert not torch.equal(state["projection"], torch.eye(8, 200))  # learnt from the identity
    assert all(torch.equal(state["model"][k], v) for k, v in teacher.state_dict().items())


def test_projection_comes_from_the_state_and_can_be_switched_off():
    alg = _alg()
    payload = alg.payload_for(alg.init_server(_teacher()), 0)
    _, state = alg.local_update(_teacher(), _data(), LocalWork(payload, None, seeded()))
    first = LocalWork(payload, None, seeded())
    alg.begin_local(_teacher(), _data(), first)  # first participation: the identity
    assert torch.equal(first.projection, torch.eye(8, 200)) and first.projection.requires_grad
    later = LocalWork(payload, state, seeded())
    alg.begin_local(_teacher(), _data(), later)
    assert torch.equal(later.projection, state["projection"]) and later.projection is not state["projection"]
    off = _alg(hidden_projection=False)
    with pytest.raises(UserError, match="equal feature widths"):
        off.local_update(_teacher(hidden=8), _data(), LocalWork(payload, None, seeded()))
    _, state = off.local_update(_teacher(hidden=200), _data(), LocalWork(payload, None, seeded()))
    assert set(state) == {"model"}


def test_lossless_threshold_reproduces_the_trained_student():
    alg = _alg(t_start=1.0, t_end=1.0)
    server = alg.init_server(_teacher())
    work = LocalWork(alg.payload_for(server, 0), None, seeded())
    reply, _ = alg.local_update(_teacher(), _data(), work)
    server = alg.aggregate(server, [reply])
    assert server["round"] == 1
    assert all(torch.allclose(server["model"][k], v, atol=1e-5) for k, v in work.shared.state_dict().items())


# ----- the server -----


def test_aggregate_reconstructs_averages_and_truncates():
    g = torch.Generator().manual_seed(2)
    w = {"fc.weight": torch.randn(6, 5, generator=g), "fc.bias": torch.zeros(6)}
    decay = torch.tensor([4.0, 2.0, 1.0, 0.1, 0.05])  # column scales: a fast-decaying spectrum
    ups = [torch.randn(6, 5, generator=g) * decay for _ in range(2)]
    replies = [
        {
            "update": compress_update({"fc.weight": u, "fc.bias": torch.full((6,), float(i))}, 1.0),
            "num_samples": n,
        }
        for i, (u, n) in enumerate(zip(ups, [1, 3], strict=True))
    ]
    exact = _alg(compress_aggregate=False).aggregate({"model": dict(w), "round": 0}, replies)
    mean = (ups[0] + 3 * ups[1]) / 4
    assert torch.allclose(exact["model"]["fc.weight"], w["fc.weight"] + mean, atol=1e-5)
    assert torch.allclose(exact["model"]["fc.bias"], torch.full((6,), 0.75))
    uniform = _alg(compress_aggregate=False, weighting="uniform").aggregate(
        {"model": dict(w), "round": 0}, replies
    )
    assert torch.allclose(uniform["model"]["fc.weight"], w["fc.weight"] + (ups[0] + ups[1]) / 2, atol=1e-5)
    alg = _alg(rounds=4)
    server = alg.aggregate({"model": dict(w), "round": 3}, replies)  # round 4 of 4: T = 0.98
    factors = svd_compress(mean, 0.98)
    assert len(factors["s"]) < 5  # the average is truncated too
    truncated = svd_reconstruct(factors, mean.shape)
    assert server["round"] == 4
    assert torch.allclose(server["model"]["fc.weight"], w["fc.weight"] + truncated, atol=1e-5)
    assert not torch.allclose(server["model"]["fc.weight"], exact["model"]["fc.weight"], atol=1e-3)


# ----- end to end -----

HETERO = [*HETERO_MODELS, "clients=5", "rounds=2"]


def _run(tmp_path, *overrides: str):
    out = tmp_path / "run"
    run_experiment(
        load_config(None, [*overrides, "algorithm.name=fedkd", f"output_dir={out}"]), progress=False
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, RunDir(out).load_checkpoint()


def test_model_heterogeneous_run(tmp_path):
    rows, ck = _run(tmp_path, *HETERO)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(0.0 <= r["global_acc"] <= 1.0 and 0.0 <= r["personal_acc"] <= 1.0 for r in rows)
    assert all(r["bytes_down"] == 5 * 4 * CNN5_SYNTHETIC16 for r in rows)
    assert all(0 < r["bytes_up"] < r["bytes_down"] for r in rows)  # the SVD factors, not the dense update
    assert ck["server"]["round"] == 2 and ck["server"]["model"]["fc1.weight"].shape == (500, 32)
    states = ck["client_states"]
    assert states[0]["model"]["fc1.weight"].shape == (2000, 32) and states[0]["projection"].shape == (
        500,
        500,
    )


def test_homogeneous_run_with_an_mlp_student(tmp_path):
    rows, ck = _run(
        tmp_path,
        "dataset.name=synthetic",
        "model.name=mlp",
        "model.hidden=16",
        *HETERO[2:],
        "algorithm.shared_model=mlp",
    )
    assert all(r["global_acc"] is not None and r["bytes_up"] < r["bytes_down"] for r in rows)
    assert ck["client_states"][1]["projection"].shape == (16, 200)
