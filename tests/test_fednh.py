"""FedNH (Dai et al., AAAI 2023): prototype init, cosine logits, frozen prototypes, server update, end to
end."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL_EVERY_METRIC, local_work, spy_sgd, tiny_client
from fedpcd.algorithms import ClientData, Context, LocalTraining, build_algorithm
from fedpcd.algorithms.fednh import (
    class_feature_means,
    cosine_logits,
    init_prototypes,
    max_pairwise_cosine,
)
from fedpcd.backends import run_experiment
from fedpcd.errors import UserError
from fedpcd.models import backbone_keys, build_model, head_keys
from fedpcd.resolve import load_config

SMALL = SMALL_EVERY_METRIC


def _fednh(num_classes: int = 3, seed: int = 0, epochs: int = 2, **params):
    alg = build_algorithm("fednh", params)
    alg.setup(
        Context(
            num_clients=2,
            num_classes=num_classes,
            rounds=1,
            seed=seed,
            local=LocalTraining(epochs=epochs, batch_size=4, lr=0.1, momentum=0.9, weight_decay=1e-2),
        )
    )
    return alg


def _client(num_classes: int = 3, n: int = 24, labels: list[int] | None = None) -> ClientData:
    """A tiny client of 1x2x2 "images" (use models built with image_size=2)."""
    y = torch.tensor(labels) if labels is not None else torch.arange(n) % num_classes
    return tiny_client(y, num_classes, seed=7)


def _gram_offdiag(w: torch.Tensor) -> torch.Tensor:
    g = w.double() @ w.double().T
    return g[~torch.eye(len(w), dtype=torch.bool)]


# ----- initialisation (Eq. 1) -----


@pytest.mark.parametrize(("c", "d"), [(10, 84), (10, 9), (100, 192), (4, 3), (2, 1)])
def test_simplex_init_unit_norm_and_cosine_minus_one_over_c_minus_one(c, d):
    w = init_prototypes("simplex", c, d, seed=3)
    assert w.shape == (c, d) and w.dtype == torch.float32
    torch.testing.assert_close(w.norm(dim=1), torch.ones(c), atol=1e-6, rtol=0)
    off = _gram_offdiag(w)
    assert off.sub(-1.0 / (c - 1)).abs().max() < 1e-6
    sq_dist = (2 - 2 * off).min()  # min_{i!=j} |w_i - w_j|^2 = 2C/(C-1), the optimum of Eq. (1)
    assert abs(float(sq_dist) - 2 * c / (c - 1)) < 1e-5


def test_simplex_init_is_seeded_and_rotated():
    a, b = init_prototypes("simplex", 10, 84, seed=1), init_prototypes("simplex", 10, 84, seed=1)
    assert torch.equal(a, b)
    assert not torch.allclose(a, init_prototypes("simplex", 10, 84, seed=2))


@pytest.mark.parametrize(
    ("c", "d", "best_max_cos"),
    [
        (6, 2, 0.5),  # regular hexagon: M^2 = 1
        (6, 3, 0.0),  # octahedron (Rankin: C <= 2d points reach cosine 0, no better)
        (12, 3, 1 / math.sqrt(5)),  # icosahedron
        (10, 3, math.cos(math.radians(66.1468))),  # Tammes' problem, N = 10
    ],
)
def test_init_below_simplex_dimension_reaches_the_known_max_separation(c, d, best_max_cos):
    w = init_prototypes("simplex", c, d, seed=0)  # d < C - 1: the numerical solution of Eq. (1)
    torch.testing.assert_close(w.norm(dim=1), torch.ones(c), atol=1e-6, rtol=0)
    assert max_pairwise_cosine(w) == pytest.approx(best_max_cos, abs=2e-4)


def test_optimize_init_finds_the_tetrahedron():
    w = init_prototypes("optimize", 4, 3, seed=5)
    assert _gram_offdiag(w).sub(-1 / 3).abs().max() < 1e-3


def test_orthogonal_init_is_codes_orthonormal_rows_and_needs_dim_ge_classes():
    w = init_prototypes("orthogonal", 10, 84, seed=0)
    torch.testing.assert_close(
        w.double() @ w.double().T, torch.eye(10, dtype=torch.float64), atol=1e-6, rtol=0
    )
    with pytest.raises(UserError, match="orthogonal"):
        init_prototypes("orthogonal", 10, 5, seed=0)


def test_server_initialises_from_the_run_seed_without_the_head():
    model = build_model("mlp", 1, 10, 8, hidden=32)
    alg = _fednh(num_classes=10, seed=4)
    s1, s2 = alg.init_server(model), alg.init_server(model)
    assert torch.equal(s1["prototypes"], s2["prototypes"])
    assert s1["prototypes"].shape == (10, 32) and float(s1["scale"]) == 1.0
    assert set(s1["model"]) == set(backbone_keys(model)) and not set(s1["model"]) & set(head_keys(model))
    other = _fednh(num_classes=10, seed=5).init_server(model)
    assert not torch.equal(s1["prototypes"], other["prototypes"])


# ----- forward (Eq. 2) -----


def test_cosine_logits_by_hand():
    z = torch.tensor([[3.0, 4.0], [0.0, 2.0]])  # normalised: (0.6, 0.8), (0, 1)
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, -1.0]])  # normalised: (1, 0), (0, 1), -(1, 1)/sqrt 2
    r2 = 1 / math.sqrt(2)
    expected = 2.5 * torch.tensor([[0.6, 0.8, -1.4 * r2], [0.0, 1.0, -r2]])
    torch.testing.assert_close(cosine_logits(z, p, torch.tensor(2.5)), expected)
    assert cosine_logits(torch.randn(50, 2), p, 2.5).abs().max() <= 2.5 + 1e-6  # |logit| <= s


# ----- client update (Eqs. 2-3) -----


def test_prototypes_are_not_in_the_optimizer_and_unchanged_by_local_training(monkeypatch):
    model = build_model("mlp", 1, 3, 2, hidden=8)
    alg = _fednh()
    server = alg.init_server(model)
    payload = alg.payload_for(server, 0)
    protos_before = payload["prototypes"].clone()
    body_before = {k: v.clone() for k, v in payload["model"].items()}

    loops = spy_sgd(monkeypatch)
    work = local_work(payload, seed=0)
    reply, _ = alg.local_update(model, _client(), work)

    (params,) = [loop["params"] for loop in loops]
    proto_ptr = payload["prototypes"].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() != proto_ptr for p in params)
    assert not payload["prototypes"].requires_grad
    body = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    assert {id(p) for p in params} == {id(p) for p in body} | {id(work.scale)}  # body + s, no head
    assert torch.equal(payload["prototypes"], protos_before)  # bit-identical after E epochs of SGD
    assert torch.equal(server["prototypes"], protos_before)
    assert any(not torch.equal(reply["model"][k], body_before[k]) for k in body_before)  # theta moved
    assert float(reply["scale"]) != 1.0  # s is trained (and sent back)
    assert set(reply["model"]) == set(backbone_keys(model))


def test_fixed_scale_is_not_trained():
    model = build_model("mlp", 1, 3, 2, hidden=8)
    alg = _fednh(learn_scale=False, scale_init=30.0)
    server = alg.init_server(model)
    work = local_work(alg.payload_for(server, 0))
    reply, _ = alg.local_update(model, _client(), work)
    params = list(alg.trainable_parameters(model, work))
    assert float(reply["scale"]) == 30.0 and all(p is not work.scale for p in params)


def test_class_means_of_normalised_features_only_for_held_classes():
    model = build_model("mlp", 1, 4, 2, hidden=6)
    data = _client(num_classes=4, labels=[0, 0, 2, 2, 2])
    held, counts, means = class_feature_means(model, data)
    assert held.tolist() == [0, 2] and counts.tolist() == [2, 3]
    with torch.no_grad():
        r = F.normalize(model.features(data.x), dim=1)
    torch.testing.assert_close(means, torch.stack([r[:2].mean(0), r[2:].mean(0)]))


def test_reply_carries_what_each_weighting_needs():
    model = build_model("mlp", 1, 4, 2, hidden=6)
    data = _client(num_classes=4, labels=[1, 1, 1, 3])
    for weighting, keys in [("count_code", {"class_counts"}), ("uniform_paper", set())]:
        alg = _fednh(num_classes=4, epochs=1, proto_weighting=weighting)
        payload = alg.payload_for(alg.init_server(model), 0)
        reply, _ = alg.local_update(model, data, local_work(payload))
        assert reply["classes"].tolist() == [1, 3]
        assert reply["class_means"].shape == (2, 6)
        assert {"class_counts"} & set(reply) == keys
        if weighting == "count_code":
            assert reply["class_counts"].tolist() == [3, 1]
            torch.testing.assert_close(reply["class_means"].norm(dim=1), torch.ones(2))


# ----- server update (Eq. 4) -----


def _replies():
    # Two clients, 3 classes, d = 2. Client a holds {0, 1}, client b holds {0}; nobody holds class 2.
    a = {"classes": torch.tensor([0, 1]), "class_means": torch.tensor([[0.6, 0.0], [0.0, 0.5]])}
    b = {"classes": torch.tensor([0]), "class_means": torch.tensor([[0.0, 0.8]])}
    return a, b


P0 = F.normalize(torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 0.0]]), dim=1)


def test_server_update_count_weighted_closed_form():
    a, b = _replies()
    a = {**a, "class_means": F.normalize(a["class_means"], dim=1), "class_counts": torch.tensor([1, 4])}
    b = {**b, "class_means": F.normalize(b["class_means"], dim=1), "class_counts": torch.tensor([3])}
    rho = 0.7
    new = _fednh(rho=rho).update_prototypes(P0.clone(), [a, b])
    m0 = F.normalize(torch.tensor([1 * 1.0 + 3 * 0.0, 1 * 0.0 + 3 * 1.0]) / 4, dim=0)  # (1, 3)/|.|
    m1 = torch.tensor([0.0, 1.0])
    expected0 = F.normalize(rho * P0[0] + (1 - rho) * m0, dim=0)
    expected1 = F.normalize(rho * P0[1] + (1 - rho) * m1, dim=0)
    torch.testing.assert_close(new[0], expected0)
    torch.testing.assert_close(new[1], expected1)
    assert torch.equal(new[2], P0[2])  # a class nobody holds keeps its prototype exactly
    torch.testing.assert_close(new.norm(dim=1), torch.ones(3))


def test_server_update_paper_uniform_closed_form():
    a, b = _replies()
    rho = 0.7
    new = _fednh(rho=rho, proto_weighting="uniform_paper").update_prototypes(P0.clone(), [a, b])
    agg0 = (torch.tensor([0.6, 0.0]) + torch.tensor([0.0, 0.8])) / 2  # alpha_k = 1/|S|, raw means
    agg1 = torch.tensor([0.0, 0.5]) / 2  # b lacks class 1: its zero mean still counts ([P]'s alpha_k = 1/|S|)
    torch.testing.assert_close(new[0], F.normalize(rho * P0[0] + (1 - rho) * agg0, dim=0))
    torch.testing.assert_close(new[1], F.normalize(rho * P0[1] + (1 - rho) * agg1, dim=0))
    assert torch.equal(new[2], P0[2])


def test_rho_zero_one_client_one_class_gives_its_normalised_mean():
    reply = {"classes": torch.tensor([1]), "class_means": torch.tensor([[3.0, 4.0]])}
    for weighting in ["uniform_paper", "count_code"]:
        r = {**reply, "class_counts": torch.tensor([5])} if weighting == "count_code" else reply
        new = _fednh(rho=0.0, proto_weighting=weighting).update_prototypes(P0.clone(), [r])
        torch.testing.assert_close(new[1], torch.tensor([0.6, 0.8]))


@pytest.mark.parametrize("weighting", ["count_code", "uniform_paper"])
def test_rho_one_keeps_prototypes_fixed(weighting):
    a, b = _replies()
    a, b = {**a, "class_counts": torch.tensor([1, 4])}, {**b, "class_counts": torch.tensor([3])}
    assert torch.equal(_fednh(rho=1.0, proto_weighting=weighting).update_prototypes(P0.clone(), [a, b]), P0)


def test_aggregate_averages_body_and_scale_unweighted_by_default():
    alg = _fednh()
    server = {"model": {"w": torch.zeros(2)}, "prototypes": P0.clone(), "scale": torch.tensor(1.0)}
    a, b = _replies()
    common = {"class_counts": torch.tensor([1, 1]), "train_loss": 0.0}
    replies = [
        {
            **a,
            **common,
            "model": {"w": torch.tensor([1.0, 2.0])},
            "scale": torch.tensor(2.0),
            "num_samples": 1,
        },
        {
            **b,
            **common,
            "class_counts": torch.tensor([1]),
            "model": {"w": torch.tensor([3.0, 6.0])},
            "scale": torch.tensor(4.0),
            "num_samples": 3,
        },
    ]
    out = alg.aggregate(dict(server), replies)
    assert out["model"]["w"].tolist() == [2.0, 4.0] and float(out["scale"]) == 3.0  # [P] Alg. 1 line 9
    out = _fednh(body_weighting="samples").aggregate(dict(server), replies)
    assert out["model"]["w"].tolist() == [2.5, 5.0] and float(out["scale"]) == 3.5


# ----- predictors (Sec. 4.1) and end to end -----


def test_personal_predictor_uses_the_prototypes_it_trained_against():
    model = build_model("mlp", 1, 3, 2, hidden=8)
    alg = _fednh()
    server = alg.init_server(model)
    payload = alg.payload_for(server, 0)
    data = _client()
    work = local_work(payload)
    reply, _ = alg.local_update(model, data, work)
    personal = alg.personal_predictor(model, work)
    server = alg.aggregate(server, [reply])
    assert not torch.equal(server["prototypes"], payload["prototypes"])
    with torch.no_grad():
        expected = cosine_logits(model.features(data.x), payload["prototypes"], reply["scale"])
        torch.testing.assert_close(personal(data.x), expected)
        glob = alg.global_predictor(model, server)
        expected = cosine_logits(model.features(data.x), server["prototypes"], server["scale"])
        torch.testing.assert_close(glob(data.x), expected)


def test_end_to_end_synthetic_writes_finite_ga_pa_l_pa_v(tmp_path):
    cfg = load_config(
        None,
        SMALL
        + [
            "clients=4",
            "rounds=2",
            "partition.classes_per_client=3",
            "algorithm.name=fednh",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    run_experiment(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for key in ["global_acc", "pa_l", "pa_v"]:
        assert all(math.isfinite(r[key]) and 0.0 <= r[key] <= 1.0 for r in rows)
    state = torch.load(tmp_path / "run" / "checkpoint" / "state.pt", weights_only=False)["server"]
    torch.testing.assert_close(state["prototypes"].norm(dim=1), torch.ones(10))


def test_end_to_end_rho_one_is_feduh(tmp_path):
    args = SMALL + ["clients=3", "rounds=2", "algorithm.name=fednh", "algorithm.rho=1.0"]
    cfg = load_config(None, args + [f"output_dir={tmp_path / 'run'}"])
    run_experiment(cfg, progress=False)
    state = torch.load(tmp_path / "run" / "checkpoint" / "state.pt", weights_only=False)["server"]
    model = build_model("mlp", 1, 10, 8, hidden=32)
    assert torch.equal(state["prototypes"], _fednh(num_classes=10).init_server(model)["prototypes"])
