"""Personalised baselines pFedMe, FedALA and FedPAC: their updates against the official code's numbers and
the papers' equations on tiny tensors, their invariants, and a 2-round Fashion-MNIST run of each.

Reference numbers marked "official" were computed by running the authors' released code on the same tiny
tensors (pFedMe: ``UserpFedMe.train`` of CharlieDinh/pFedMe; FedALA: ``ALA.adaptive_local_aggregation`` of
TsingZ0/FedALA; FedPAC: ``LocalUpdate_FedPAC.statistics_extraction`` of JianXu95/FedPAC), where this
module's implementation agreed with them to the last bit. FedPAC's quadratic program (cvxpy in its code) is
checked against closed forms computed by hand.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fedpcd
import fedpcd.engine.vectorized as vec
from conftest import requires_fmnist, seeded, tiny_client, tiny_mlp
from fedpcd.algorithms import Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.fedala import _settled, higher_layer_keys
from fedpcd.algorithms.fedpac import collaboration_weights, pac_statistics
from fedpcd.engine.federation import build_federation
from fedpcd.errors import UserError
from fedpcd.models import build_model, head_keys
from fedpcd.resolve import load_config

LABELS = torch.tensor([0, 1, 1, 2, 2, 2, 0, 1])


def _alg(name: str, local: LocalTraining | None = None, num_clients: int = 3, **params):
    alg = build_algorithm(name, params)
    local = local or LocalTraining(epochs=1, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0)
    alg.setup(Context(num_clients=num_clients, num_classes=3, rounds=3, seed=0, local=local))
    return alg


def _double_client(seed: int = 7):
    data = tiny_client(LABELS, 3, seed=seed)
    data.x = data.x.double()
    return data


def _double_mlp(seed: int):
    torch.manual_seed(seed)
    return build_model("mlp", 1, 3, 2, hidden=3).double()


# ----- pFedMe -----


def test_pfedme_local_update_equals_the_official_code():
    """3 local steps of one full batch, K = 5, from the model of seed 0: the official UserpFedMe.train gives
    this w (its head bias shown) on the same tensors (lr 0.005 -> 0.05, personal lr 0.01, mu 0.001)."""
    g = _double_mlp(0)
    local = LocalTraining(epochs=3, batch_size=8, lr=0.05, momentum=0.0, weight_decay=0.001)
    alg = _alg("pfedme", local, lam=15.0, inner_steps=5, personal_lr=0.01)
    model, work = copy.deepcopy(g), LocalWork({"model": g.state_dict()}, None, seeded(0))
    alg.fit(model, _double_client(), work)
    official = [-0.3343562579344292, 0.48890252955788044, 0.2623069683842265]
    torch.testing.assert_close(
        model.head.bias, torch.tensor(official, dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert work.steps == 15  # K steps per local step


def test_pfedme_one_step_is_the_moreau_update_of_algorithm_1():
    """K = 1 on one full batch: theta = w - nu grad f(w) (the proximal term is 0 at theta = w), then
    w' = w - eta lambda (w - theta) = w - eta lambda nu grad f(w)."""
    g, data = _double_mlp(0), _double_client()
    local = LocalTraining(epochs=1, batch_size=8, lr=0.05, momentum=0.0, weight_decay=0.0)
    alg = _alg("pfedme", local, lam=2.0, inner_steps=1, personal_lr=0.1)
    model, work = copy.deepcopy(g), LocalWork({"model": g.state_dict()}, None, seeded(0))
    loss = alg.fit(model, data, work)
    ref = copy.deepcopy(g)
    ce = F.cross_entropy(ref(data.x), data.y)
    grads = dict(
        zip(
            [n for n, _ in ref.named_parameters()],
            torch.autograd.grad(ce, list(ref.parameters())),
            strict=True,
        )
    )
    for name, w in g.named_parameters():
        torch.testing.assert_close(work.personal[name], w.detach() - 0.1 * grads[name])
        torch.testing.assert_close(
            dict(model.named_parameters())[name], w.detach() - 0.05 * 2.0 * 0.1 * grads[name]
        )
    assert loss == pytest.approx(float(ce.detach()))
    # the personal model theta is what personal_predictor scores, the model sent is w
    assert alg.personal_predictor(model, work) is model
    torch.testing.assert_close(model.head.bias, work.personal["head.bias"])


@pytest.mark.parametrize(
    ("beta", "weighting", "expect"), [(1.0, "samples", 2.5), (2.0, "samples", 4.0), (2.0, "uniform", 3.0)]
)
def test_pfedme_server_mixes_the_mean_with_beta(beta, weighting, expect):
    """w <- (1 - beta) w + beta * mean: w = 1, replies 1 (n=1) and 3 (n=3); their mean 2.5 by n, else 2."""
    alg = _alg("pfedme", beta=beta, weighting=weighting)
    server = {"model": {"w": torch.tensor(1.0), "count": torch.tensor(4)}}
    replies = [
        {"model": {"w": torch.tensor(1.0), "count": torch.tensor(2)}, "num_samples": 1},
        {"model": {"w": torch.tensor(3.0), "count": torch.tensor(6)}, "num_samples": 3},
    ]
    server = alg.aggregate(server, replies)
    torch.testing.assert_close(server["model"]["w"], torch.tensor(expect))
    assert server["model"]["count"].dtype == torch.int64  # an integer buffer takes the mean, not the mix


# ----- FedALA -----

# official: TsingZ0/FedALA's ALA (layer_idx 2, eta 1, rand_percent 100, batch 16) on the models of seeds 0
# (global) and 1 (local): W of head.weight and head.bias after the first ALA (trained until converged, 11
# passes) and after a later one (one pass from W = 0.5)
OFFICIAL_W = {
    None: (
        [[1.0, 1.0, 0.8836238659302541], [1.0, 0.9981929391728389, 1.0], [1.0, 0.9929439752841035, 1.0]],
        [0.9341382968852934, 0.6710902381040312, 1.0],
    ),
    0.5: (
        [
            [0.503025807721506, 0.49970393416028447, 0.5152142859312091],
            [0.5014852659445845, 0.49975488023074505, 0.48746706451729627],
            [0.5019277624639282, 0.4994835047263457, 0.49643617576519683],
        ],
        [0.5724641826909186, 0.5051954880045012, 0.5008126521255103],
    ),
}


@pytest.mark.parametrize("w0", [None, 0.5], ids=["first-until-converged", "later-one-pass"])
def test_fedala_weight_learning_equals_the_official_code(w0):
    glob, local = _double_mlp(0), _double_mlp(1)
    alg = _alg("fedala", LocalTraining(batch_size=16), sample_percent=100.0, layers=1)
    state = {"model": copy.deepcopy(local.state_dict())}
    if w0 is not None:
        state["weights"] = {k: torch.full_like(state["model"][k], w0) for k in head_keys(local)}
    work = LocalWork({"model": glob.state_dict()}, state, seeded(0))
    model = copy.deepcopy(glob)
    alg.adaptive_local_aggregation(model, _double_client(), work)
    weight, bias = OFFICIAL_W[w0]
    exact = {"rtol": 0, "atol": 1e-12}
    torch.testing.assert_close(
        work.ala_weights["head.weight"], torch.tensor(weight, dtype=torch.float64), **exact
    )
    torch.testing.assert_close(
        work.ala_weights["head.bias"], torch.tensor(bias, dtype=torch.float64), **exact
    )
    # Eqs. 4-5: the lower layers are the global model's, the head local + (global - local) * W
    for name, p in model.named_parameters():
        if name in work.ala_weights:
            want = (
                local.state_dict()[name]
                + (glob.state_dict()[name] - local.state_dict()[name]) * work.ala_weights[name]
            )
        else:
            want = glob.state_dict()[name]
        torch.testing.assert_close(p.detach(), want, **exact)


def test_fedala_first_participation_is_fedavg_and_later_ones_keep_w_in_the_state():
    alg, fedavg = _alg("fedala"), _alg("fedavg")
    model, data = tiny_mlp(), tiny_client(LABELS, 3, seed=7)
    payload = {"model": copy.deepcopy(model.state_dict())}
    reply, state = alg.local_update(model, data, LocalWork(payload, None, seeded(3)))
    ref, _ = fedavg.local_update(tiny_mlp(), data, LocalWork(payload, None, seeded(3)))
    assert all(
        torch.equal(reply["model"][k], v) for k, v in ref["model"].items()
    )  # no ALA without a local model
    assert set(state) == {"model"} and all(
        torch.equal(state["model"][k], v) for k, v in reply["model"].items()
    )
    reply2, state2 = alg.local_update(model, data, LocalWork(payload, state, seeded(4)))
    assert set(state2) == {"model", "weights"} and set(state2["weights"]) == set(head_keys(model))
    assert all(bool(((w >= 0) & (w <= 1)).all()) for w in state2["weights"].values())
    assert set(reply2) == {"model", "num_samples", "train_loss"}  # the server is FedAvg's


def test_fedala_layers_count_modules_from_the_top_and_too_many_is_one_line():
    model = tiny_mlp()
    assert higher_layer_keys(model, 1) == ["head.weight", "head.bias"]
    assert higher_layer_keys(model, 2) == ["fc2.weight", "fc2.bias", "head.weight", "head.bias"]
    with pytest.raises(
        UserError, match=r"layers=4 exceeds the model's 3 layers with parameters; choose 1\.\.3"
    ):
        higher_layer_keys(model, 4)
    with pytest.raises(UserError, match="layers=4 exceeds"):  # before any training
        _alg("fedala", layers=4).init_server(model)


def test_fedala_convergence_test_needs_more_than_window_losses_with_small_std():
    assert not _settled([1.0] * 3, 3, 0.1)  # exactly `window` losses: not yet
    assert _settled([5.0, 1.0, 1.0, 1.0], 3, 0.1)  # the last 3 have std 0
    assert not _settled([5.0, 1.0, 1.3, 1.0], 3, 0.1)  # std of (1, 1.3, 1) = 0.141 >= 0.1


# ----- FedPAC -----


def test_fedpac_statistics_equal_the_official_code_and_the_formula():
    """z of 5 samples, classes 0 (2) and 2 (3): p = (0.4, 0, 0.6), E||f||^2 = 7.5 and 8.5, means (2, 0.5)
    and (0.5, 13/6); V = (0.4 * 7.5 - 0.16 * 4.25 + 0.6 * 8.5 - 0.36 * (0.25 + 169/36)) / 5 = 1.128, the
    official statistics_extraction's value on the same features."""
    z = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5], [2.0, 2.0], [-1.0, 4.0]], dtype=torch.float64)
    variance, h, means = pac_statistics(z, torch.tensor([0, 0, 2, 2, 2]), 3)
    assert float(variance) == pytest.approx(1.128, abs=1e-12)
    torch.testing.assert_close(h, torch.tensor([[0.8, 0.2], [0.0, 0.0], [0.3, 1.3]], dtype=torch.float64))
    torch.testing.assert_close(means[2], torch.tensor([0.5, 13 / 6], dtype=torch.float64))


def test_fedpac_combination_weights_solve_the_quadratic_program():
    """Eqs. 10-12 on hand-made cases: alpha_i = argmin alpha^T (diag(V) + D_i) alpha on the simplex."""
    same = torch.ones(3, 1, 1)
    # equal h: D_i = 0, alpha_j proportional to 1 / V_j, for every client
    alpha = collaboration_weights(torch.tensor([1.0, 2.0, 4.0]), same)
    torch.testing.assert_close(alpha, torch.tensor([[4 / 7, 2 / 7, 1 / 7]] * 3, dtype=torch.float64))
    # client 0's h at 0, the others at +-1 without variance: their average matches it exactly
    h = torch.tensor([[[0.0]], [[1.0]], [[-1.0]]])
    alpha = collaboration_weights(torch.tensor([1.0, 0.0, 0.0]), h)
    torch.testing.assert_close(
        alpha[0], torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64), atol=1e-9, rtol=0
    )
    # the bias term: V = 1 each, client 1 one unit away from clients 0 and 2 (same h): for client 0,
    # P = diag(1, 2, 1), alpha proportional to (1, 1/2, 1)
    h = torch.tensor([[[0.0]], [[1.0]], [[0.0]]])
    alpha = collaboration_weights(torch.ones(3), h)
    torch.testing.assert_close(alpha[0], torch.tensor([0.4, 0.2, 0.4], dtype=torch.float64))
    assert bool((alpha >= 0).all()) and torch.allclose(alpha.sum(1), torch.ones(3, dtype=torch.float64))
    # weights below 1e-3 are dropped and the rest renormalised
    alpha = collaboration_weights(torch.tensor([1.0, 2000.0]), torch.ones(2, 1, 1))
    torch.testing.assert_close(alpha[0], torch.tensor([1.0, 0.0], dtype=torch.float64))


def test_fedpac_alignment_loss_targets_global_prototypes_then_own_class_means():
    alg, model, data = _alg("fedpac", lam=0.5), tiny_mlp(), tiny_client(LABELS, 3, seed=7)
    server = alg.init_server(model)
    server["prototypes"][0] = torch.tensor([1.0] * model.feature_dim)
    server["known"][0] = True  # classes 1 and 2 fall back to the client's own means before training
    work = LocalWork(alg.payload_for(server, 0), None, seeded(), round=2)
    alg.begin_local(model, data, work)
    with torch.no_grad():
        z = model.features(data.x)
    own = torch.stack([z[data.y == c].mean(0) for c in range(3)])
    torch.testing.assert_close(work.targets[0], server["prototypes"][0])
    torch.testing.assert_close(work.targets[1:], own[1:])
    batch = (data.x, data.y)
    ce = F.cross_entropy(model(data.x), data.y)
    work.phase = "body"
    mse = (z - work.targets[data.y]).pow(2).mean()
    torch.testing.assert_close(alg.loss(model, batch, work).detach(), ce.detach() + 0.5 * mse)
    work.phase = "head"
    torch.testing.assert_close(alg.loss(model, batch, work).detach(), ce.detach())
    first = LocalWork(alg.payload_for(server, 0), None, seeded(), round=1, phase="body", targets=work.targets)
    torch.testing.assert_close(alg.loss(model, batch, first).detach(), ce.detach())  # off in round 1


def test_fedpac_server_combines_heads_per_client_and_sends_each_its_own():
    alg, model = _alg("fedpac", num_clients=3), tiny_mlp()
    server = alg.init_server(model)
    replies = []
    for k in (0, 2):
        data = tiny_client(LABELS, 3, seed=7 + k, cid=k)
        reply, state = alg.local_update(model, data, LocalWork(alg.payload_for(server, k), None, seeded(k)))
        assert set(state) == set(head_keys(model))  # the head stays the client's state
        replies.append(reply)
    server = alg.aggregate(server, replies)
    alpha = collaboration_weights(
        torch.stack([r["variance"] for r in replies]), torch.stack([r["h_ref"] for r in replies])
    )
    for i, k in enumerate((0, 2)):
        payload = alg.payload_for(server, k)
        for key in head_keys(model):
            want = sum(float(alpha[i, j]) * replies[j]["head"][key] for j in range(2))
            torch.testing.assert_close(payload["head"][key], want)
    assert "head" not in alg.payload_for(server, 1)  # client 1 took part in no round yet
    assert server["collaborated"].tolist() == [True, False, True] and bool(server["known"].all())
    counts = [r["class_counts"] for r in replies]  # prototypes: class means weighted by the counts
    means = [r["class_means"] for r in replies]
    torch.testing.assert_close(
        server["prototypes"][1],
        (counts[0][1] * means[0][1] + counts[1][1] * means[1][1]) / (counts[0][1] + counts[1][1]),
    )
    # a new round's client starts from its combined head
    work = LocalWork(alg.payload_for(server, 2), None, seeded())
    alg.begin_local(model, tiny_client(LABELS, 3, seed=9, cid=2), work)
    assert torch.equal(model.head.weight, server["heads"]["head.weight"][2])


# ----- end to end -----


@pytest.mark.parametrize("name", ["pfedme", "fedala", "fedpac"])
def test_the_vectorized_executor_leaves_them_to_the_sequential_one(name):
    """Each has its own local loop (``fit``), which the vectorized executor does not replay."""
    fed = build_federation(
        load_config(None, ["dataset.name=synthetic", "model.name=mlp", f"algorithm.name={name}"])
    )
    reason = vec.blocker(fed.new_algorithm(), fed, [0, 1])
    assert reason is not None and "not covered by the vectorized executor (it overrides fit)" in reason


@requires_fmnist
@pytest.mark.parametrize("name", ["pfedme", "fedala", "fedpac"])
def test_two_rounds_on_fashion_mnist_give_finite_generic_and_personal_accuracy(name, tmp_path):
    result = fedpcd.run(
        {"dataset": {"name": "fmnist", "train_fraction": 0.01}, "model": {"name": "mlp", "hidden": 32}},
        clients=3,
        rounds=2,
        algorithm__name=name,
        output_dir=str(tmp_path / name),
    )
    metrics = result.metrics
    assert metrics["round"].tolist() == [1, 2]
    for column in ("global_acc", "personal_acc"):
        assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in metrics[column]), (column, metrics[column])
