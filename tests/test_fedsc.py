"""FedSC (Wang et al., KDD 2025): the server's prototypes (Eqs. 7-12), the client losses (Eqs. 13-15), the
degenerate cases (FedAvg), the official-code compatibility mode and the NID2 partition."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import local_work
from fedpcd.algorithms import ClientData, Context, LocalTraining, build_algorithm
from fedpcd.algorithms.fedsc import (
    angle_scores,
    consistent_prototype,
    cpdr_loss,
    discrepancy,
    discrepancy_weights,
    official_rpcl_loss,
    relational_prototypes,
    rpcl_loss,
    select_neighbors,
    u_normaliser,
)
from fedpcd.backends import run_experiment
from fedpcd.data.partition import make_partition, nid2
from fedpcd.errors import UserError
from fedpcd.models import build_model
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]


def _fedsc(num_classes: int = 3, **params):
    alg = build_algorithm("fedsc", params)
    alg.setup(
        Context(
            num_clients=3,
            num_classes=num_classes,
            rounds=2,
            seed=0,
            local=LocalTraining(epochs=2, batch_size=4, lr=0.1, momentum=0.9, weight_decay=0.0),
        )
    )
    return alg


def _reply(classes, counts, means, n=None):
    counts = torch.tensor(counts)
    return {
        "classes": torch.tensor(classes),
        "class_counts": counts,
        "class_means": torch.tensor(means, dtype=torch.float32),
        "num_samples": int(counts.sum()) if n is None else n,
    }


# ----- relational prototypes (Eqs. 7-9) -----


def test_neighbour_selection_on_a_hand_made_score_vector():
    phi = torch.tensor([0.9, 0.1, 0.85, 0.5, 0.2])
    nbrs = select_neighbors(phi, 2)
    assert nbrs == [[2, 3], [4, 3], [0, 3], [4, 2], [1, 3]]
    # A^j is not symmetric: 3 is a neighbour of 1, but 1 is not one of 3's
    assert 3 in nbrs[1] and 1 not in nbrs[3]
    assert select_neighbors(phi, 10) == [
        sorted(set(range(5)) - {k}, key=lambda q: (abs(phi[q] - phi[k]), q)) for k in range(5)
    ]


def test_angle_nearest_differs_from_l2_nearest_and_the_angle_wins():
    c = torch.tensor([[1.0, 0.0], [5.0, 0.0], [0.8, 0.8], [0.0, 1.0]], dtype=torch.float64)
    g = c.mean(dim=0)
    expected = torch.stack([(g @ ck) / (g.norm() * ck.norm()) for ck in c])
    torch.testing.assert_close(angle_scores(c), expected)
    l2 = (c - c[0]).norm(dim=1)
    l2[0] = math.inf
    assert int(l2.argmin()) == 2  # Euclidean nearest of client 0
    assert select_neighbors(angle_scores(c), 1)[0] == [1]  # angle-wise nearest: same direction
    torch.testing.assert_close(relational_prototypes(c, 1)[0], (c[0] + c[1]) / 2)


def test_relational_prototypes_m0_identity_full_m_mean_and_shrinking():
    c = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(relational_prototypes(c, 0), c)
    torch.testing.assert_close(relational_prototypes(c, 3), c.mean(0).expand(4, 3))
    torch.testing.assert_close(relational_prototypes(c, 7), c.mean(0).expand(4, 3))  # |S|-1 < M: shrink
    r = relational_prototypes(c, 2)
    for k, nb in enumerate(select_neighbors(angle_scores(c), 2)):
        torch.testing.assert_close(r[k], (c[k] + c[nb].sum(0)) / 3)


# ----- discrepancy and weights (Eqs. 10-11) -----


def test_discrepancy_closed_forms():
    counts = torch.zeros(3, 10)
    counts[0] = 7  # uniform
    counts[1, 4] = 30  # one class
    counts[2, :2] = 5  # [0.5, 0.5, 0, ...]
    d = discrepancy(counts)
    torch.testing.assert_close(
        d, torch.tensor([0.0, math.sqrt(9 / 20), math.sqrt(0.5 * (2 * 0.16 + 8 * 0.01))], dtype=torch.float64)
    )
    assert abs(float(d[1]) - 0.6708) < 1e-4 and abs(float(d[2]) - 0.4472) < 1e-4


def test_discrepancy_weights_closed_form_and_monotonicity():
    n = torch.tensor([100.0, 200.0, 300.0])
    d = torch.tensor([0.2, 0.5, 0.3])
    raw = [1 / (1 + math.exp(-(n[k].item() / 600 - d[k].item() / 1.0))) for k in range(3)]
    expected = torch.tensor([v / sum(raw) for v in raw], dtype=torch.float64)
    e = discrepancy_weights(n, d)
    torch.testing.assert_close(e, expected)
    assert abs(float(e.sum()) - 1) < 1e-12
    torch.testing.assert_close(
        discrepancy_weights(torch.full((4,), 50.0), torch.full((4,), 0.3)),
        torch.full((4,), 0.25, dtype=torch.float64),
    )
    torch.testing.assert_close(
        discrepancy_weights(torch.full((3,), 50.0), torch.zeros(3)),
        torch.full((3,), 1 / 3, dtype=torch.float64),
    )  # all uniform clients
    e_n = discrepancy_weights(torch.tensor([100.0, 150.0, 200.0]), torch.full((3,), 0.3))
    assert e_n[0] < e_n[1] < e_n[2]
    e_d = discrepancy_weights(torch.full((3,), 100.0), torch.tensor([0.1, 0.3, 0.6]))
    assert e_d[0] > e_d[1] > e_d[2]


# ----- consistent prototypes (Eq. 12) via the server -----


def test_each_consistent_prototype_is_a_convex_combination_of_relational_prototypes():
    alg = _fedsc(num_classes=3, num_neighbors=1)
    g = torch.Generator().manual_seed(1)
    replies = [
        _reply([0, 1], [5, 3], torch.rand(2, 4, generator=g).tolist()),
        _reply([0, 1, 2], [2, 2, 9], torch.rand(3, 4, generator=g).tolist()),
        _reply([0, 2], [1, 6], torch.rand(2, 4, generator=g).tolist()),
        _reply([1], [4], torch.rand(1, 4, generator=g).tolist()),
    ]
    out = alg.build_prototypes(replies, torch.Size([3, 4]))
    counts = torch.zeros(4, 3)
    for k, r in enumerate(replies):
        counts[k, r["classes"]] = r["class_counts"].float()
    e = discrepancy_weights(torch.tensor([8.0, 13.0, 7.0, 4.0]), discrepancy(counts))
    assert out["known"].tolist() == [True, True, True]
    assert out["bank"].shape == (8, 4)  # one row per (client, held class) <= |A| C
    for j in range(3):
        rel = out["bank"][out["bank_labels"] == j].double()
        holders = torch.nonzero(counts[:, j] > 0).flatten()
        coef = e[holders] / e[holders].sum()
        assert bool((coef >= 0).all()) and abs(float(coef.sum()) - 1) < 1e-12
        torch.testing.assert_close(out["consistent"][j].double(), coef @ rel, atol=1e-6, rtol=0)
        assert bool((out["consistent"][j] >= rel.min(0).values - 1e-6).all())
        assert bool((out["consistent"][j] <= rel.max(0).values + 1e-6).all())
    # relational prototypes of class 0 (holders 0, 1, 2; M = 1) follow Eqs. 7-9
    c0 = torch.stack([replies[k]["class_means"][0] for k in range(3)]).double()
    torch.testing.assert_close(
        out["bank"][out["bank_labels"] == 0].double(), relational_prototypes(c0, 1), atol=1e-6, rtol=0
    )


def test_consistent_prototype_of_equal_relational_prototypes_is_that_prototype():
    r = torch.tensor([[1.0, 2.0]]).expand(3, 2)
    torch.testing.assert_close(
        consistent_prototype(r, torch.tensor([0.2, 0.5, 0.3])), torch.tensor([1.0, 2.0])
    )


def test_missing_class_only_changes_the_renormalisation():
    alg = _fedsc(num_classes=2, num_neighbors=0)
    replies = [_reply([0, 1], [4, 4], [[1.0, 0.0], [0.0, 1.0]]), _reply([0], [6], [[3.0, 0.0]])]
    out = alg.build_prototypes(replies, torch.Size([2, 2]))
    torch.testing.assert_close(out["consistent"][1], torch.tensor([0.0, 1.0]))  # only holder: weight 1
    e = discrepancy_weights(torch.tensor([8.0, 6.0]), torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(
        out["consistent"][0].double(), torch.tensor([e[0] + 3 * e[1], 0.0], dtype=torch.float64)
    )


# ----- RPCL (Eqs. 13-14) -----


def test_rpcl_by_hand_on_a_2d_toy():
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0])
    tau = 0.5
    pos = math.exp(1 / tau) + math.exp(math.sqrt(0.5) / tau)
    expected = -math.log(pos / (pos + math.exp(0.0)))
    got = rpcl_loss(z, torch.tensor([0]), bank, labels, tau)
    assert abs(float(got[0]) - expected) < 1e-12
    # with U: a two-sample batch, U(r) = mean_q ||z_q - r||
    zz = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    u = u_normaliser(zz, bank)
    u_hand = [(0 + math.sqrt(5)) / 2, (math.sqrt(2) + 1) / 2, (1 + math.sqrt(2)) / 2]
    torch.testing.assert_close(u, torch.tensor(u_hand, dtype=torch.float64))
    s = [[1 / u_hand[0], 0.0, math.sqrt(0.5) / u_hand[2]], [0.0, 1 / u_hand[1], math.sqrt(0.5) / u_hand[2]]]
    hand = []
    for i, y in enumerate([0, 1]):
        ex = [math.exp(v / tau) for v in s[i]]
        p = sum(ex[r] for r in range(3) if labels[r] == y)
        hand.append(-math.log(p / sum(ex)))
    torch.testing.assert_close(
        rpcl_loss(zz, torch.tensor([0, 1]), bank, labels, tau, u), torch.tensor(hand, dtype=torch.float64)
    )


def test_rpcl_one_positive_is_cross_entropy_and_equal_cosines_give_log_one_plus_ratio():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, 4, generator=g, dtype=torch.float64)
    bank = torch.randn(4, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3])
    y = torch.tensor([0, 1, 2, 3, 0])
    cos = F.cosine_similarity(z[:, None], bank[None], dim=2)
    torch.testing.assert_close(
        rpcl_loss(z, y, bank, labels, 0.07), F.cross_entropy(cos / 0.07, y, reduction="none")
    )
    same = torch.ones(5, 4, dtype=torch.float64)  # all cosines 1: loss = log(1 + P_neg / P_pos)
    bank2 = torch.ones(5, 4, dtype=torch.float64)
    out = rpcl_loss(same[:1], torch.tensor([0]), bank2, torch.tensor([0, 0, 1, 1, 1]), 0.05)
    assert abs(float(out[0]) - math.log(1 + 3 / 2)) < 1e-12


def test_rpcl_is_finite_for_single_class_batches_and_gradchecks():
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1])
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    y = torch.zeros(3, dtype=torch.long)  # one class; z[0] sits on its prototype
    loss = rpcl_loss(z, y, bank, labels, 0.05, u_normaliser(z, bank)).mean()
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(z.grad).all())
    z1 = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)  # batch of one on a prototype
    loss1 = rpcl_loss(z1, y[:1], bank, labels, 0.05, u_normaliser(z1, bank)).mean()
    loss1.backward()
    assert math.isfinite(loss1.item()) and bool(torch.isfinite(z1.grad).all())
    only_pos = rpcl_loss(z, y, bank[:1], labels[:1], 0.05)  # no negatives at all: 0
    torch.testing.assert_close(only_pos, torch.zeros(3, dtype=torch.float64))
    zg = torch.randn(
        3, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64, requires_grad=True
    )
    u = u_normaliser(zg, bank)
    assert torch.autograd.gradcheck(lambda t: rpcl_loss(t, y, bank, labels, 0.1, u), (zg,))


def test_rpcl_prototype_scale_matters_only_through_u():
    z = torch.tensor([[1.0, 0.5], [0.2, 1.0]], dtype=torch.float64)
    bank = torch.tensor([[1.0, 0.2], [0.1, 1.0]], dtype=torch.float64)
    labels, y = torch.tensor([0, 1]), torch.tensor([0, 1])
    scaled = bank * torch.tensor([[3.0], [1.0]], dtype=torch.float64)
    torch.testing.assert_close(rpcl_loss(z, y, bank, labels, 0.05), rpcl_loss(z, y, scaled, labels, 0.05))
    with_u = rpcl_loss(z, y, bank, labels, 0.05, u_normaliser(z, bank))
    assert not torch.allclose(with_u, rpcl_loss(z, y, scaled, labels, 0.05, u_normaliser(z, scaled)))


# ----- CPDR (Eq. 15) -----


def test_cpdr_l1_and_mse_forms_and_no_gradient_to_prototypes():
    z = torch.tensor([[1.0, -2.0, 0.5]], requires_grad=True)
    o = torch.tensor([[0.0, 1.0, 0.5]], requires_grad=True)
    assert cpdr_loss(z, o, "l1_sum")[0].item() == pytest.approx(4.0)
    assert cpdr_loss(z, o, "mse_mean")[0].item() == pytest.approx(10.0 / 3)
    assert float(cpdr_loss(o.detach(), o, "l1_sum")[0]) == 0.0
    cpdr_loss(z, o, "l1_sum").sum().backward()
    assert o.grad is None and z.grad is not None


# ----- the local loss -----


def _client(num_classes: int = 3, labels: list[int] | None = None) -> ClientData:
    g = torch.Generator().manual_seed(7)
    y = torch.tensor(labels) if labels is not None else torch.arange(12) % num_classes
    x = torch.randn(len(y), 1, 2, 2, generator=g) + y[:, None, None, None].float()
    return ClientData(0, x, y, torch.arange(len(y)), x, y, torch.arange(0), num_classes)


def test_samples_of_classes_without_prototypes_get_cross_entropy_only():
    alg = _fedsc(num_classes=3)
    model = build_model("mlp", 1, 3, 2, hidden=8)
    data = _client()
    g = torch.Generator().manual_seed(2)
    d = model.feature_dim
    payload = {
        "model": model.state_dict(),
        "bank": torch.rand(3, d, generator=g),
        "bank_labels": torch.tensor([0, 0, 1]),
        "consistent": torch.rand(3, d, generator=g),
        "known": torch.tensor([True, True, False]),
    }
    x, y = data.x, data.y
    loss = alg.loss(model, (x, y), local_work(payload))
    with torch.no_grad():
        z = model.features(x)
        ce = F.cross_entropy(model.head(z), y)
        v = y < 2
        rp = rpcl_loss(
            z[v], y[v], payload["bank"], payload["bank_labels"], 0.05, u_normaliser(z, payload["bank"])
        )
        cp = cpdr_loss(z[v], payload["consistent"][y[v]], "l1_sum")
    torch.testing.assert_close(loss.detach(), ce + (rp.sum() + cp.sum()) / len(y))
    payload["bank_labels"] = torch.zeros(0, dtype=torch.long)
    payload["bank"] = torch.zeros(0, d)
    torch.testing.assert_close(alg.loss(model, (x, y), local_work(payload)).detach(), ce)  # round 1: CE only


def test_compat_official_cpdr_is_zero_and_positive_logit_is_one_over_tau():
    g = torch.Generator().manual_seed(4)
    z = torch.rand(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 2])
    bank = torch.rand(4, 3, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 2])
    tau = 0.05
    got = official_rpcl_loss(z, y, bank, labels, tau)
    # copies of each prototype in the pool: #{b : y_b != label}
    mult = torch.tensor([2.0, 3.0, 3.0, 3.0], dtype=torch.float64)
    cos = F.cosine_similarity(z[:, None], bank[None], dim=2).detach()
    hand = torch.log(math.exp(1 / tau) + (mult * torch.exp(cos / tau)).sum(1)) - 1 / tau
    torch.testing.assert_close(got.detach(), hand)
    alg = _fedsc(num_classes=3, compat_official=True, rpcl_weight=0.0)
    model = build_model("mlp", 1, 3, 2, hidden=8)
    data = _client()
    payload = {
        "model": model.state_dict(),
        "bank": torch.rand(3, model.feature_dim, generator=g),
        "bank_labels": torch.tensor([0, 1, 2]),
        "consistent": torch.rand(3, model.feature_dim),
        "known": torch.ones(3, dtype=torch.bool),
    }
    loss = alg.loss(model, (data.x, data.y), local_work(payload))
    with torch.no_grad():
        ce = F.cross_entropy(model(data.x), data.y)
    assert (loss - ce).item() == 0.0  # CPDR contributes exactly 0


def test_compat_official_server_keeps_raw_prototypes_and_positional_weights():
    alg = _fedsc(num_classes=2, compat_official=True)
    replies = [_reply([1], [4], [[0.0, 1.0]]), _reply([0, 1], [3, 3], [[1.0, 0.0], [0.0, 3.0]])]
    out = alg.build_prototypes(replies, torch.Size([2, 2]))
    torch.testing.assert_close(out["bank"], torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 3.0]]))
    e = discrepancy_weights(torch.tensor([4.0, 6.0]), discrepancy(torch.tensor([[0.0, 4.0], [3.0, 3.0]])))
    torch.testing.assert_close(out["consistent"][0].double(), torch.tensor([e[0], 0.0], dtype=torch.float64))


# ----- end to end (synthetic) -----


def _run(tmp_path, name, extra):
    cfg = load_config(
        None, SMALL + ["clients=4", "partition.classes_per_client=3", f"output_dir={tmp_path / name}"] + extra
    )
    run_experiment(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    state = torch.load(tmp_path / name / "checkpoint" / "state.pt", weights_only=False)["server"]
    return rows, state


def test_both_losses_off_equals_fedavg_exactly_and_round_one_is_fedavg(tmp_path):
    _, avg = _run(tmp_path, "avg", ["rounds=2", "algorithm.name=fedavg"])
    _, off = _run(
        tmp_path,
        "off",
        ["rounds=2", "algorithm.name=fedsc", "algorithm.rpcl_weight=0", "algorithm.cpdr_weight=0"],
    )
    for key, value in avg["model"].items():
        assert torch.equal(value, off["model"][key]), key
    _, avg1 = _run(tmp_path, "avg1", ["rounds=1", "algorithm.name=fedavg"])
    _, sc1 = _run(tmp_path, "sc1", ["rounds=1", "algorithm.name=fedsc"])
    for key, value in avg1["model"].items():
        assert torch.equal(value, sc1["model"][key]), key
    assert sc1["bank"].shape[0] <= 4 * 10 and sc1["bank"].shape[1] == 32


@pytest.mark.parametrize("extra", [[], ["algorithm.compat_official=true"], ["algorithm.cpdr_dist=mse_mean"]])
def test_end_to_end_synthetic_is_finite(tmp_path, extra):
    rows, state = _run(tmp_path, "run", ["rounds=3", "algorithm.name=fedsc", *extra])
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["global_acc"]) and 0.0 <= r["global_acc"] <= 1.0 for r in rows)
    assert bool(torch.isfinite(state["consistent"]).all()) and bool(state["known"].all())


# ----- NID2 partition -----


@pytest.mark.parametrize("num_classes", [10, 20])
def test_nid2_five_biased_clients_and_one_full_client(num_classes):
    rng = np.random.default_rng(0)
    labels = rng.permutation(np.repeat(np.arange(num_classes), 61))
    parts = nid2(labels, 6, num_classes, np.random.default_rng(1))
    assert len(parts) == 6
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # disjoint
    per = num_classes // 5
    for i in range(5):
        assert sorted(set(labels[parts[i]].tolist())) == list(range(i * per, (i + 1) * per))
    assert sorted(set(labels[parts[5]].tolist())) == list(range(num_classes))
    sizes = [len(p) for p in parts]
    assert sizes == [num_classes * 10] * 6  # floor(61 / 6) = 10 per shard: N/6 up to the dropped remainder
    assert abs(sizes[0] - len(labels) / 6) <= num_classes


def test_nid2_through_make_partition_and_bad_client_count():
    labels = np.repeat(np.arange(10), 30)
    part = make_partition(labels, labels, 6, "nid2", {}, seed=0)
    assert [len(p) for p in part.train] == [50] * 6
    with pytest.raises(UserError, match="nid2 needs exactly"):
        make_partition(labels, labels, 10, "nid2", {}, seed=0)


def test_self_mse_cpdr_is_the_official_codes_zero_term():
    """[C]'s CPDR target falls back to the features themselves: the term is 0 and has zero gradient, where
    mse_mean (its intended form) is the mean over dimensions of (z - o)^2."""
    z = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, -1.0]], requires_grad=True)
    target = torch.tensor([[0.0, 0.0, 0.0], [0.5, 1.0, 1.0]])
    zero = cpdr_loss(z, target, "self_mse")
    assert torch.equal(zero, torch.zeros(2))
    (grad,) = torch.autograd.grad(zero.sum(), z)
    assert torch.equal(grad, torch.zeros_like(z))
    torch.testing.assert_close(cpdr_loss(z, target, "mse_mean"), torch.tensor([14 / 3, 5 / 3]))
