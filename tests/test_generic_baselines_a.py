"""Generic FL baselines, part A: FedProx, SCAFFOLD, FedNova, FedDyn, FedDC.

Per method: its distinctive formula against a value computed by hand on tiny tensors, its reduction to FedAvg
where one holds, and a short end-to-end run on ``synthetic``. Equality with FedAvg is exact (``torch.equal``)
where the code path adds exact zeros (FedProx mu = 0, SCAFFOLD's zero variates with eta_g = 1) and within
float32 rounding where the algebra only cancels (FedNova: x - tau * sum p (x - y) / tau).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_client, tiny_mlp
from fedpcd.algorithms import ClientData, Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.common import local_steps
from fedpcd.algorithms.fednova import effective_steps
from fedpcd.algorithms.scaffold import Scaffold, option_two_control
from fedpcd.backends import run_experiment
from fedpcd.errors import UserError
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=32"]
NAMES = ["fedprox", "scaffold", "fednova", "feddyn", "feddc"]


def _alg(name: str, *, epochs: int = 1, momentum: float = 0.0, clients: int = 2, **params):
    alg = build_algorithm(name, params)
    local = LocalTraining(epochs=epochs, batch_size=4, lr=0.1, momentum=momentum, weight_decay=0.0)
    alg.setup(Context(num_clients=clients, num_classes=3, rounds=1, seed=0, local=local))
    return alg


def _client(n: int = 10, cid: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(7 + cid)
    y = torch.arange(n) % 3
    x = torch.randn(n, 1, 2, 2, generator=g) + y[:, None, None, None].float()
    return ClientData(
        id=cid,
        x=x,
        y=y,
        train_idx=torch.arange(n),
        test_x=x,
        test_y=y,
        local_test_idx=torch.arange(0),
        num_classes=3,
    )


def _update(alg, model, data, payload, state=None, seed: int = 1):
    return alg.local_update(model, data, LocalWork(payload, state, torch.Generator().manual_seed(seed)))


def _server_model(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)["server"]["model"]


def _run(tmp_path, tag: str, extra: list[str]):
    cfg = load_config(None, SMALL + extra + [f"output_dir={tmp_path / tag}"])
    run_experiment(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / tag / "metrics.jsonl").read_text().splitlines()]
    return rows, _server_model(tmp_path / tag)


def _set_grads(model, value: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


# ----- shared helpers -----


def test_local_steps_is_ceil_n_over_b_times_epochs():
    ten, eight = (tiny_client(torch.arange(n) % 3, 3, seed=0) for n in (10, 8))
    assert local_steps(ten, LocalTraining(epochs=2, batch_size=4)) == 6  # 3 batches (4, 4, 2) x 2 epochs
    assert local_steps(eight, LocalTraining(epochs=1, batch_size=4)) == 2


# ----- FedProx -----


def test_fedprox_loss_adds_half_mu_squared_distance():
    alg, model, data = _alg("fedprox", mu=0.3), tiny_mlp(hidden=4), _client()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # every parameter 0.5 away from w^t
    numel = sum(p.numel() for p in model.parameters())
    batch = (data.x[:4], data.y[:4])
    loss = alg.loss(model, batch, LocalWork({"model": ref}, None, torch.Generator()))
    ce = F.cross_entropy(model(batch[0]), batch[1])
    torch.testing.assert_close(loss - ce, torch.tensor(0.3 / 2 * 0.25 * numel))
    model.zero_grad()
    (loss - ce).backward()
    for p in model.parameters():  # d/dw (mu/2)||w - w^t||^2 = mu (w - w^t) = 0.15
        torch.testing.assert_close(p.grad, torch.full_like(p, 0.15))


def test_fedprox_mu_zero_equals_fedavg_exactly():
    data = _client()
    model = tiny_mlp(hidden=4)
    payload = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    a, _ = _update(_alg("fedavg", momentum=0.9), model, data, payload)
    b, _ = _update(_alg("fedprox", mu=0.0, momentum=0.9), model, data, payload)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])


# ----- SCAFFOLD -----


def test_scaffold_option_two_by_hand():
    c_i, c = {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.5, 2.0])}
    x, y = {"w": torch.tensor([2.0, 1.0])}, {"w": torch.tensor([1.0, 3.0])}
    # c_i - c + (x - y) / (K eta) with K = 4, eta = 0.25: [1 - 0.5 + 1, 0 - 2 - 2]
    out = option_two_control(c_i, c, x, y, steps=4, lr=0.25)
    torch.testing.assert_close(out["w"], torch.tensor([1.5, -4.0]))


def _corrected(alg, model, work) -> dict[str, torch.Tensor]:
    """``correct_grads`` of the model's gradients, as the shared loop calls it."""
    params = dict(model.named_parameters())
    return alg.correct_grads({k: p.grad for k, p in params.items()}, params, work)


def test_scaffold_correct_grads_adds_c_minus_c_i():
    alg, model = _alg("scaffold"), tiny_mlp(hidden=4)
    correction = {k: torch.full_like(v, 1.0 - 0.25) for k, v in model.named_parameters()}
    _set_grads(model, 2.0)
    grads = _corrected(alg, model, LocalWork({}, None, torch.Generator(), correction=correction))
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], torch.full_like(p, 2.75))


def test_scaffold_control_denominator_is_all_local_steps():
    """Plain SGD, zero variates: c_i^+ = (x - y)/(K eta) is the mean of the K = E ceil(n/B) gradients."""
    grads: list[dict[str, torch.Tensor]] = []

    class Recording(Scaffold):
        def correct_grads(self, grads_in, params, work):
            out = super().correct_grads(grads_in, params, work)
            grads.append({k: g.clone() for k, g in out.items()})
            return out

    alg = Recording()
    alg.setup(_alg("scaffold", epochs=2).ctx)
    model, data = tiny_mlp(hidden=4), _client(n=10)
    server = alg.init_server(model)
    reply, state = _update(alg, model, data, alg.payload_for(server, 0))
    assert len(grads) == 6  # 2 epochs x ceil(10 / 4)
    for k, c_new in state["control"].items():
        mean = torch.stack([g[k] for g in grads]).mean(0)
        torch.testing.assert_close(c_new, mean, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(reply["control_delta"][k], c_new)


def test_scaffold_momentum_aware_denominator_is_k_eta_over_one_minus_beta():
    """Same local training (zero variates); option II divided by K eta / (1 - beta) vs the literal K eta."""
    states = {}
    for aware in (True, False):
        alg, model, data = (
            _alg("scaffold", momentum=0.75, momentum_aware=aware),
            tiny_mlp(hidden=4),
            _client(n=10),
        )
        server = alg.init_server(model)
        reply, states[aware] = _update(alg, model, data, alg.payload_for(server, 0))
    for k, c in states[False]["control"].items():
        torch.testing.assert_close(states[True]["control"][k], 0.25 * c)
    alg = _alg("scaffold", momentum=0.0)
    assert alg.momentum_aware  # default; with momentum 0 both forms are Alg. 1's


def test_scaffold_server_update_by_hand():
    alg = _alg("scaffold", clients=4, server_lr=0.5)
    server = {"model": {"w": torch.tensor([1.0])}, "control": {"w": torch.tensor([0.2])}}
    replies = [
        {"model": {"w": torch.tensor([3.0])}, "control_delta": {"w": torch.tensor([1.0])}, "num_samples": 1},
        {"model": {"w": torch.tensor([5.0])}, "control_delta": {"w": torch.tensor([3.0])}, "num_samples": 3},
    ]
    out = alg.aggregate(server, replies)
    # x + eta_g (sum_k n_k y_k / n - x) = 1 + 0.5 (4.5 - 1); c + (1/N) sum Delta c = 0.2 + 4 / 4
    torch.testing.assert_close(out["model"]["w"], torch.tensor([2.75]))
    torch.testing.assert_close(out["control"]["w"], torch.tensor([1.2]))


def test_scaffold_first_round_with_full_participation_equals_fedavg(tmp_path):
    args = ["clients=3", "rounds=1", "partition.classes_per_client=4"]
    _, avg = _run(tmp_path, "fedavg", args)
    rows, sca = _run(tmp_path, "scaffold", args + ["algorithm.name=scaffold"])
    for k in avg:
        assert torch.equal(avg[k], sca[k]), k  # exact: the corrections are exact zeros, eta_g = 1
    assert math.isfinite(rows[0]["global_acc"])


# ----- FedNova -----


def test_fednova_effective_steps_by_hand():
    # sum_{j=1..3} (1 - 0.5^j) / 0.5 = (0.5 + 0.75 + 0.875) / 0.5
    assert effective_steps(3, 0.5) == pytest.approx(4.25)
    assert effective_steps(7, 0.0) == 7.0


def test_fednova_effective_steps_match_momentum_sgd_on_a_constant_gradient():
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    for _ in range(5):
        opt.zero_grad()
        (2.0 * w).sum().backward()  # gradient 2 at every step
        opt.step()
    torch.testing.assert_close(-w.detach(), torch.tensor([0.1 * 2.0 * effective_steps(5, 0.9)]))


def test_fednova_aggregate_by_hand():
    alg = _alg("fednova")
    server = {"model": {"w": torch.tensor([1.0])}}
    # y_1 = 0 with ||a_1|| = 2, n_1 = 1; y_2 = -3 with ||a_2|| = 4, n_2 = 3 (d_i = (x - y_i) / ||a_i||)
    replies = [
        {"normalized_update": {"w": torch.tensor([0.5])}, "a_norm": 2.0, "buffers": {}, "num_samples": 1},
        {"normalized_update": {"w": torch.tensor([1.0])}, "a_norm": 4.0, "buffers": {}, "num_samples": 3},
    ]
    # tau_eff = 0.25 * 2 + 0.75 * 4 = 3.5; sum p d = 0.125 + 0.75; x = 1 - 3.5 * 0.875 (FedAvg: -2.25)
    out = alg.aggregate(server, replies)
    torch.testing.assert_close(out["model"]["w"], torch.tensor([-2.0625]))


def test_fednova_client_normalises_by_its_momentum_steps():
    alg, model, data = _alg("fednova", momentum=0.9, epochs=2), tiny_mlp(hidden=4), _client(n=10)
    x = {k: v.clone() for k, v in model.state_dict().items()}
    reply, _ = _update(alg, model, data, {"model": x})
    a = effective_steps(6, 0.9)
    assert reply["a_norm"] == pytest.approx(a)
    for k, d in reply["normalized_update"].items():
        torch.testing.assert_close(d, (x[k] - model.state_dict()[k]) / a)


def test_fednova_equal_steps_without_momentum_equals_fedavg(tmp_path):
    # one batch per epoch on every client: tau_i = E for all, so FedNova's update is FedAvg's.
    args = ["clients=3", "rounds=2", "local.epochs=2", "local.momentum=0.0", "local.batch_size=100000"]
    _, avg = _run(tmp_path, "fedavg", args)
    _, nova = _run(tmp_path, "fednova", args + ["algorithm.name=fednova"])
    for k in avg:  # float32: x - tau * sum_i p_i (x - y_i) / tau only cancels up to rounding
        torch.testing.assert_close(nova[k], avg[k], rtol=1e-5, atol=1e-6)


# ----- FedDyn -----


def test_feddyn_correct_grads_adds_dynamic_regulariser_gradient():
    alg, model = _alg("feddyn", alpha=0.5), tiny_mlp(hidden=4)
    prev = {k: v.clone() - 1.0 for k, v in model.state_dict().items()}  # theta - theta^{t-1} = 1
    linear = {k: torch.full_like(p, -0.25) for k, p in model.named_parameters()}  # grad state 0.25
    _set_grads(model, 2.0)
    grads = _corrected(alg, model, LocalWork({"model": prev}, None, torch.Generator(), linear=linear))
    for k, p in model.named_parameters():  # 2 - 0.25 + 0.5 * 1
        torch.testing.assert_close(grads[k], torch.full_like(p, 2.25))


def test_feddyn_client_gradient_state_update():
    alg, model, data = _alg("feddyn", alpha=0.5), tiny_mlp(hidden=4), _client()
    x = {k: v.clone() for k, v in model.state_dict().items()}
    g0 = {k: torch.full_like(v, 0.1) for k, v in x.items()}
    reply, state = _update(alg, model, data, {"model": x}, {"grad": g0})
    for k, g in state["grad"].items():  # grad_k <- grad_k - alpha (theta_k - theta^{t-1})
        torch.testing.assert_close(g, 0.1 - 0.5 * (reply["model"][k] - x[k]))


def test_feddyn_server_update_by_hand():
    alg = _alg("feddyn", alpha=0.5, clients=4)
    server = {"model": {"w": torch.tensor([1.0])}, "h": {"w": torch.tensor([0.0])}}
    replies = [{"model": {"w": torch.tensor([v])}, "num_samples": n} for v, n in [(2.0, 1), (4.0, 3)]]
    out = alg.aggregate(server, replies)
    # h = 0 - (0.5 / 4) ((2 - 1) + (4 - 1)) = -0.5; theta = (2 + 4) / 2 - h / alpha = 3 + 1
    torch.testing.assert_close(out["h"]["w"], torch.tensor([-0.5]))
    torch.testing.assert_close(out["model"]["w"], torch.tensor([4.0]))


def test_feddyn_alpha_zero_is_rejected():
    """FedDyn has no FedAvg limit (theta^t carries -h^t/alpha), so alpha = 0 is a config error."""
    with pytest.raises(UserError):
        build_algorithm("feddyn", {"alpha": 0.0})


# ----- FedDC -----


def test_feddc_correct_grads_adds_correction_and_drift_penalty():
    alg, model = _alg("feddc", alpha=0.5), tiny_mlp(hidden=4)
    w = {k: v.clone() - 1.0 for k, v in model.state_dict().items()}  # theta - w = 1
    drift = {k: torch.full_like(p, 0.5) for k, p in model.named_parameters()}
    correction = {k: torch.full_like(p, 0.25) for k, p in model.named_parameters()}  # c - c_i
    _set_grads(model, 2.0)
    work = LocalWork({"model": w}, {"drift": drift}, torch.Generator(), correction=correction)
    grads = _corrected(alg, model, work)
    for k, p in model.named_parameters():  # 2 + 0.25 + 0.5 * (1 + 0.5)
        torch.testing.assert_close(grads[k], torch.full_like(p, 3.0))


def test_feddc_drift_update_and_corrected_upload():
    alg, model, data = _alg("feddc", alpha=0.1), tiny_mlp(hidden=4), _client()
    w = {k: v.clone() for k, v in model.state_dict().items()}
    server = alg.init_server(model)
    h0 = {k: torch.full_like(v, 0.3) for k, v in w.items()}
    state = {"control": {k: torch.zeros_like(v) for k, v in w.items()}, "drift": h0}
    reply, new_state = _update(alg, model, data, alg.payload_for(server, 0), state)
    theta = model.state_dict()
    for k in w:  # h_i <- h_i + (theta_i - w); upload theta_i + h_i
        torch.testing.assert_close(new_state["drift"][k], 0.3 + theta[k] - w[k])
        torch.testing.assert_close(reply["model"][k], theta[k] + new_state["drift"][k])
    assert "control_delta" in reply and set(new_state) == {"control", "drift"}


# ----- end to end -----


@pytest.mark.parametrize("name", NAMES)
def test_end_to_end_synthetic(tmp_path, name):
    """Two rounds with partial participation (client state reused), then a resumable checkpoint."""
    args = ["clients=3", "rounds=2", "participation=0.67", f"algorithm.name={name}"]
    rows, model = _run(tmp_path, name, args)
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["global_acc"]) and math.isfinite(r["train_loss"])
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())
    state = torch.load(tmp_path / name / "checkpoint" / "state.pt", weights_only=False)
    if name in {"scaffold", "feddyn", "feddc"}:
        assert state["client_states"]  # personal variates / gradient states / drifts were kept


def test_scaffold_sends_twice_fedavg_bytes(tmp_path):
    args = ["clients=2", "rounds=1"]
    avg, _ = _run(tmp_path, "fedavg", args)
    sca, _ = _run(tmp_path, "scaffold", args + ["algorithm.name=scaffold"])
    assert sca[0]["bytes_up"] == 2 * avg[0]["bytes_up"] and sca[0]["bytes_down"] == 2 * avg[0]["bytes_down"]


@pytest.mark.parametrize("name", NAMES)
def test_buffers_are_averaged_not_corrected(name):
    """BatchNorm statistics are no parameters: no variate, drift or normalisation; averaged as in FedAvg."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)
    )
    alg = _alg(name, clients=2)
    server = alg.init_server(model)
    replies, buffers = [], []
    for cid, n in enumerate([8, 12]):
        reply, _ = _update(alg, model, _client(n=n, cid=cid), alg.payload_for(server, cid))
        replies.append(reply)
        buffers.append({k: v.clone() for k, v in model.named_buffers()})  # BN running stats and counter
    weights = [0.5, 0.5] if getattr(alg, "weighting", "samples") == "uniform" else [8 / 20, 12 / 20]
    out = alg.aggregate(server, replies)["model"]
    for k in buffers[0]:
        if buffers[0][k].is_floating_point():
            torch.testing.assert_close(out[k], weights[0] * buffers[0][k] + weights[1] * buffers[1][k])
        else:
            assert out[k].dtype == buffers[0][k].dtype
