"""FedMR (Fan et al., TMLR 2023): intra loss (Eq. 3, both scales), inter hinge (Eq. 4), prototype protocol."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import local_work, tiny_client
from fedpcd.algorithms import ClientData, Context, LocalTraining, build_algorithm
from fedpcd.algorithms.common import aggregate_prototypes, raw_class_means
from fedpcd.algorithms.fedmr import inter_class_loss, intra_class_loss, negative_mask
from fedpcd.backends import run_experiment
from fedpcd.models import build_model
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=32"]
F64 = torch.float64


def _fedmr(num_classes: int = 3, num_clients: int = 2, **params):
    alg = build_algorithm("fedmr", params)
    alg.setup(
        Context(
            num_clients=num_clients,
            num_classes=num_classes,
            rounds=1,
            seed=0,
            local=LocalTraining(epochs=1, batch_size=4, lr=0.1),
        )
    )
    return alg


def _client(labels: list[int], num_classes: int = 3, cid: int = 0) -> ClientData:
    return tiny_client(torch.tensor(labels), num_classes, seed=11 + cid, cid=cid)


def _pearson_offdiag_sq(z: torch.Tensor) -> torch.Tensor:
    r = torch.corrcoef(z.T)
    return r.pow(2).sum() - torch.diagonal(r).pow(2).sum()


# ----- intra-class loss (Eq. 3; Sec. 3.3.1) -----


def test_intra_zero_for_identity_correlation_and_paper_value_d_n_over_n_minus_1_squared():
    g = torch.Generator().manual_seed(0)
    d, sizes = 4, [9, 12]
    zs = []
    for n in sizes:  # centred columns made orthogonal (QR): per-class correlation matrix = I
        a = torch.randn(n, d, generator=g, dtype=F64)
        q, _ = torch.linalg.qr(a - a.mean(0))
        zs.append(3.0 * q + torch.randn(d, generator=g, dtype=F64))
    z = torch.cat(zs)
    y = torch.tensor([0] * sizes[0] + [2] * sizes[1])
    for c in (0, 2):
        torch.testing.assert_close(torch.corrcoef(z[y == c].T), torch.eye(d, dtype=F64))
    assert abs(float(intra_class_loss(z, y, "code", eps=0.0))) < 1e-20
    assert abs(float(intra_class_loss(z, y, "code"))) < 1e-12
    expected = sum(d * (n / (n - 1)) ** 2 for n in sizes) / 2
    assert float(intra_class_loss(z, y, "paper", eps=0.0)) == pytest.approx(expected, rel=1e-12)


def test_intra_hand_computed_both_normalisations():
    # class 0: columns (0,1,2), (0,2,1): unbiased var 1 and 1, r = 0.5. class 1: (0,1), (0,3): r = 1.
    # class 2: a single sample, skipped by both.
    z = torch.tensor([[0, 0], [1, 2], [2, 1], [0, 0], [1, 3], [7, 7]], dtype=F64)
    y = torch.tensor([0, 0, 0, 1, 1, 2])
    # code: G_01 = (N-1) r -> L_0 = 1^2, L_1 = 1^2; divided by the 3 + 2 counted samples
    assert float(intra_class_loss(z, y, "code", eps=0.0)) == pytest.approx(2 / 5, rel=1e-12)
    # paper: M_0 = [[1.5, .75], [.75, 1.5]] -> 5.625; M_1 = [[2, 2], [2, 2]] -> 16; mean over 2 classes
    assert float(intra_class_loss(z, y, "paper", eps=0.0)) == pytest.approx((5.625 + 16) / 2, rel=1e-12)
    assert float(intra_class_loss(z, y, "code")) == pytest.approx(2 / 5, rel=1e-7)  # default eps 1e-8


def test_intra_code_closed_form_collapsed_and_degenerate_cases():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(20, 6, generator=g, dtype=F64)
    y = torch.tensor([0] * 8 + [1] * 12)
    d = 6
    closed = sum(
        (int((y == c).sum()) - 1) ** 2 / (d * (d - 1)) * _pearson_offdiag_sq(z[y == c]) for c in (0, 1)
    )
    torch.testing.assert_close(intra_class_loss(z, y, "code", eps=0.0), closed / 20)
    # every dimension an affine copy of one scalar: |R_ij| = 1
    s = torch.randn(20, 1, generator=g, dtype=F64)
    collapsed = s * torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=F64) + 1.0
    assert float(intra_class_loss(collapsed, y, "code", eps=0.0)) == pytest.approx((7**2 + 11**2) / 20)
    assert float(intra_class_loss(collapsed, y, "paper", eps=0.0)) == pytest.approx(
        ((8 / 7) ** 2 * 16 + (12 / 11) ** 2 * 16) / 2
    )
    # singletons only: 0 (and differentiable)
    z1 = torch.randn(3, 4, dtype=F64, requires_grad=True)
    loss = intra_class_loss(z1, torch.tensor([0, 1, 2]))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(z1.grad, torch.zeros_like(z1))


def test_intra_invariances():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(14, 5, generator=g, dtype=F64)
    y = torch.tensor([0, 1] * 7)
    a = torch.tensor([2.0, -0.5, 3.0, 1.5, -4.0], dtype=F64)
    b = torch.randn(5, generator=g, dtype=F64)
    perm_d, perm_n = torch.randperm(5, generator=g), torch.randperm(14, generator=g)
    for impl in ("code", "paper"):
        base = intra_class_loss(z, y, impl, eps=0.0)
        torch.testing.assert_close(intra_class_loss(z * a + b, y, impl, eps=0.0), base)
        torch.testing.assert_close(intra_class_loss(z[:, perm_d], y, impl, eps=0.0), base)
        torch.testing.assert_close(intra_class_loss(z[perm_n], y[perm_n], impl, eps=0.0), base)


@pytest.mark.parametrize("impl", ["code", "paper"])
def test_intra_gradcheck_float64(impl):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(7, 5, generator=g, dtype=F64, requires_grad=True)
    y = torch.tensor([0, 1, 0, 1, 0, 1, 0])
    assert torch.autograd.gradcheck(lambda t: intra_class_loss(t, y, impl), (z,))
    # per class, the gradient sums to 0 over samples (mean invariance)
    intra_class_loss(z, y, impl).backward()
    for c in (0, 1):
        torch.testing.assert_close(z.grad[y == c].sum(0), torch.zeros(5, dtype=F64), atol=1e-10, rtol=0)


# ----- inter-class hinge (Eq. 4; Sec. 3.3.2) -----

PROTOS_2D = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]], dtype=F64)


def test_inter_exact_values_on_2d_toy_local_and_all_negatives():
    z = torch.tensor([[2.0, 0.0], [-1.0, 0.0], [0.0, 1.0]], dtype=F64)
    y = torch.tensor([0, 0, 1])
    known = torch.ones(3, dtype=torch.bool)
    local = torch.tensor([True, True, False])  # C_k = {0, 1}
    # sample 1: d = (2, 1, sqrt 20) -> hinge vs 1: 1; sample 2: d = (1, 4, sqrt 17) -> 0;
    # sample 3 (class 1): d = (1, sqrt 10, 3) -> vs 0: sqrt10 - 1, vs 2: sqrt10 - 3
    r10 = math.sqrt(10.0)
    literal = inter_class_loss(z, y, PROTOS_2D, negative_mask(known, local, "local"))
    assert float(literal) == pytest.approx((0.5 + (r10 - 1)) / 2, rel=1e-10)  # 1/(|C_k|(|C_k|-1)) sum D
    every = inter_class_loss(z, y, PROTOS_2D, negative_mask(known, local, "all"))
    assert float(every) == pytest.approx((0.5 + 0.0 + (r10 - 1) + (r10 - 3)) / 4, rel=1e-10)
    # C_k = C: both negative sets agree
    full = torch.ones(3, dtype=torch.bool)
    a = inter_class_loss(z, y, PROTOS_2D, negative_mask(known, full, "local"))
    torch.testing.assert_close(a, inter_class_loss(z, y, PROTOS_2D, negative_mask(known, full, "all")))
    # a class without a prototype is neither anchor nor negative
    known0 = torch.tensor([True, False, True])
    only = inter_class_loss(z, y, PROTOS_2D, negative_mask(known0, None, "all"))
    assert float(only) == pytest.approx(0.0)  # class 0 vs 2 hinges are 0; class 1 has no prototype


def test_inter_single_pair_value_gradient_bound_and_zero_cases():
    z = torch.tensor([[2.0, 1.0]], dtype=F64, requires_grad=True)
    y = torch.tensor([0])
    protos = PROTOS_2D.clone().requires_grad_(True)
    neg = negative_mask(torch.ones(3, dtype=torch.bool), torch.tensor([True, True, False]), "local")
    loss = inter_class_loss(z, y, protos, neg)
    di, dj = (z - PROTOS_2D[0]).norm().detach(), (z - PROTOS_2D[1]).norm().detach()
    assert float(loss.detach()) == pytest.approx(float(di - dj), rel=1e-10)
    assert float(loss.detach()) <= float((PROTOS_2D[0] - PROTOS_2D[1]).norm())  # triangle inequality
    loss.backward()
    u = (z - PROTOS_2D[0]) / di - (z - PROTOS_2D[1]) / dj
    torch.testing.assert_close(z.grad, u.detach())
    assert protos.grad is None  # prototypes are constants
    # every sample nearer its own prototype: 0; one local class (|C_k| = 1): 0, not NaN
    near = torch.tensor([[0.1, 0.0], [3.1, 0.0]], dtype=F64)
    assert float(inter_class_loss(near, torch.tensor([0, 1]), PROTOS_2D, neg)) == 0.0
    solo = negative_mask(torch.ones(3, dtype=torch.bool), torch.tensor([True, False, False]), "local")
    assert float(inter_class_loss(z.detach(), y, PROTOS_2D, solo)) == 0.0


def test_inter_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(7, 5, generator=g, dtype=F64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    protos = torch.randn(3, 5, generator=g, dtype=F64) * 0.5
    neg = negative_mask(torch.ones(3, dtype=torch.bool), None, "all")
    assert torch.autograd.gradcheck(lambda t: inter_class_loss(t, y, protos, neg), (z,))


# ----- prototype protocol (Sec. 3.3, Alg. 1) -----


def test_aggregate_prototypes_weights_by_class_counts_and_keeps_stale():
    protos = torch.tensor([[0.0, 0.0], [5.0, 5.0], [0.0, 0.0]])
    known = torch.tensor([False, True, False])
    replies = [
        {"classes": torch.tensor([0, 2]), "class_counts": torch.tensor([1, 3]),
         "class_means": torch.tensor([[1.0, 1.0], [2.0, 0.0]])},
        {"classes": torch.tensor([2]), "class_counts": torch.tensor([1]),
         "class_means": torch.tensor([[6.0, 4.0]])},
        {"num_samples": 99},  # a non-submitter
    ]  # fmt: skip
    new, new_known = aggregate_prototypes(protos, known, replies)
    torch.testing.assert_close(new, torch.tensor([[1.0, 1.0], [5.0, 5.0], [3.0, 1.0]]))  # (3*(2,0)+(6,4))/4
    assert new_known.tolist() == [True, True, True]


def test_server_prototype_is_pooled_class_mean_under_a_shared_model():
    model = build_model("mlp", 1, 3, 2, hidden=8)
    clients = [_client([0, 0, 1, 2, 2, 2], cid=0), _client([0, 2, 2], cid=1)]
    replies = []
    for data in clients:
        cls, cnt, means = raw_class_means(model, data)
        replies.append({"classes": cls, "class_counts": cnt, "class_means": means})
    new, known = aggregate_prototypes(torch.zeros(3, 8), torch.zeros(3, dtype=torch.bool), replies)
    with torch.no_grad():
        model.eval()
        zs = torch.cat([model.features(c.x) for c in clients])
    ys = torch.cat([c.y for c in clients])
    for c in range(3):
        torch.testing.assert_close(new[c], zs[ys == c].mean(0))
    assert known.all()


def test_first_round_sends_no_prototypes_and_submitters_are_fixed():
    model = build_model("mlp", 1, 3, 2, hidden=8)
    alg = _fedmr(num_clients=10, submit_fraction=0.5)
    server = alg.init_server(model)
    assert int(server["submitters"].sum()) == 5
    assert torch.equal(
        server["submitters"], _fedmr(num_clients=10, submit_fraction=0.5).init_server(model)["submitters"]
    )
    payload = alg.payload_for(server, 0)
    assert "prototypes" not in payload and set(payload) == {"model", "submit"}
    data = _client([0, 0, 1, 1, 2, 2])
    replies = []
    for k in (int(server["submitters"].int().argmax()), int((~server["submitters"]).int().argmax())):
        reply, _ = alg.local_update(model, data, local_work(alg.payload_for(server, k), seed=k))
        replies.append(reply)
    assert "class_means" in replies[0] and "class_means" not in replies[1]
    assert replies[0]["class_means"].shape == (3, model.feature_dim)
    server = alg.aggregate(server, replies)
    assert server["known"].all()
    payload = alg.payload_for(server, 0)
    assert payload["prototypes"].shape == (3, model.feature_dim)
    # intra-only (mu2 = 0) and Lite 0 exchange no prototypes at all
    for params in ({"mu2": 0.0}, {"lite_samples": 0}):
        plain = _fedmr(**params)
        assert set(plain.init_server(model)) == {"model"}


def test_lite_uses_n_samples_per_batch():
    model = build_model("mlp", 1, 3, 2, hidden=8)
    data = _client([0, 1, 2, 0, 1, 2])
    protos, known = torch.randn(3, 8), torch.ones(3, dtype=torch.bool)
    payload = {"model": None, "prototypes": protos, "known": known, "submit": True}
    alg = _fedmr(mu1=0.0, mu2=1.0, lite_samples=2)
    local = data.label_counts > 0
    batch = (data.x, data.y)
    got = alg.loss(model, batch, local_work(payload, local=local, lite_rng=torch.Generator().manual_seed(5)))
    pick = torch.randperm(6, generator=torch.Generator().manual_seed(5))[:2]
    z = model.features(data.x)
    ce = torch.nn.functional.cross_entropy(model.head(z), data.y)
    neg = negative_mask(known, local, "local")
    torch.testing.assert_close(got, ce + inter_class_loss(z[pick], data.y[pick], protos, neg))
    big = _fedmr(mu1=0.0, mu2=1.0, lite_samples=64)  # n >= batch: all samples
    work = local_work(payload, local=local, lite_rng=torch.Generator())
    torch.testing.assert_close(big.loss(model, batch, work), ce + inter_class_loss(z, data.y, protos, neg))


# ----- end to end -----


def _run(tmp_path, name: str, extra: list[str]) -> list[dict]:
    args = SMALL + [
        "clients=4",
        "rounds=2",
        "partition.classes_per_client=3",
        f"output_dir={tmp_path / name}",
    ]
    run_experiment(load_config(None, args + extra), progress=False)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _server(tmp_path, name: str) -> dict:
    return torch.load(tmp_path / name / "checkpoint" / "state.pt", weights_only=False)["server"]


def test_mu_zero_is_fedavg_exactly_and_prototype_bytes(tmp_path):
    avg = _run(tmp_path, "avg", ["algorithm.name=fedavg"])
    zero = _run(tmp_path, "zero", ["algorithm.name=fedmr", "algorithm.mu1=0", "algorithm.mu2=0"])
    s_avg, s_zero = _server(tmp_path, "avg"), _server(tmp_path, "zero")
    assert set(s_zero) == {"model"}
    for k, v in s_avg["model"].items():
        assert torch.equal(v, s_zero["model"][k]), k
    for a, b in zip(avg, zero, strict=True):
        assert (a["global_acc"], a["bytes_up"], a["bytes_down"]) == (
            b["global_acc"],
            b["bytes_up"],
            b["bytes_down"],
        )
    # full FedMR: round 1 downloads only the model; afterwards + |C| d floats (+ |C| mask bytes) per client;
    # uploads + |C_k| (d floats + class id + count) per client
    mr = _run(tmp_path, "mr", ["algorithm.name=fedmr", "algorithm.mu1=0.01", "algorithm.mu2=0.01"])
    d, c, k, ck = 16, 10, 4, 3
    assert mr[0]["bytes_down"] == avg[0]["bytes_down"]
    assert mr[1]["bytes_down"] - avg[1]["bytes_down"] == k * (c * d * 4 + c)
    for rnd in range(2):
        assert mr[rnd]["bytes_up"] - avg[rnd]["bytes_up"] == k * ck * (d * 4 + 8 + 8)
    assert all(math.isfinite(r["global_acc"]) for r in mr)
    assert _server(tmp_path, "mr")["known"].sum() >= ck


def test_end_to_end_variants_run(tmp_path):
    rows = _run(
        tmp_path,
        "var",
        [
            "algorithm.name=fedmr",
            "algorithm.intra_impl=paper",
            "algorithm.mu1=0.0001",
            "algorithm.mu2=0.1",
            "algorithm.inter_negatives=all",
            "algorithm.lite_samples=8",
            "algorithm.submit_fraction=0.5",
        ],
    )
    assert all(math.isfinite(r["global_acc"]) and math.isfinite(r["train_loss"]) for r in rows)


@pytest.mark.parametrize(
    ("weighting", "counts", "expected"),
    [
        # B = 4: floor(n_k / 4) = 2 and 1 -> (2 * 1 + 1 * 4) / 3 = 2; n_k: (9 * 1 + 7 * 4) / 16 = 37 / 16
        ("batches", (9, 7), 2.0),
        ("samples", (9, 7), 37 / 16),
        ("batches", (3, 2), (3 * 1 + 2 * 4) / 5),  # every floor(n_k / B) is 0: n_k
    ],
)
def test_model_average_weights_by_samples_or_by_full_batches(weighting, counts, expected):
    alg = _fedmr(mu2=0.0, weighting=weighting)
    replies = [
        {"model": {"w": torch.full((2,), value, dtype=F64)}, "num_samples": n}
        for value, n in zip((1.0, 4.0), counts, strict=True)
    ]
    server = alg.aggregate({"model": {"w": torch.zeros(2, dtype=F64)}}, replies)
    torch.testing.assert_close(server["model"]["w"], torch.full((2,), expected, dtype=F64))
    assert alg.aggregation_weights(replies) == (
        [2.0, 1.0] if (weighting, counts) == ("batches", (9, 7)) else [float(n) for n in counts]
    )
