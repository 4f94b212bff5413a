"""FedGELA / FedGE (Fan et al., NeurIPS 2023): the ETF, phi, the Eq. 5 loss, what is trained, sent and
predicted."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import local_work
from fedpcd.algorithms import ALGORITHMS, Context, LocalWork, build_algorithm
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.fedgela import FedGE, FedGELA, adaptation, simplex_etf
from fedpcd.algorithms.statedict import weighted_average
from fedpcd.backends import run_experiment
from fedpcd.engine.federation import build_federation
from fedpcd.errors import UserError
from fedpcd.models import FedModel, backbone_keys, head_keys
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]


def _etf(d: int, c: int, seed: int = 0) -> torch.Tensor:
    return simplex_etf(d, c, torch.Generator().manual_seed(seed)).double()


class Identity(FedModel):
    """features(x) = x (so h is chosen by hand); a head that FedGELA must never use."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.feature_dim = dim
        self.scale = nn.Parameter(torch.ones(()))  # one backbone parameter, so there is something to train
        self.head = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _algorithm(cls: type = FedGELA, num_classes: int = 3, **params: object) -> FedGELA:
    """An algorithm on raw features (no projection, unless asked) so hand computations apply to x directly."""
    params.setdefault("projection", "none")
    algo = cls(**params)
    algo.setup(Context(num_clients=2, num_classes=num_classes, rounds=1, seed=0))
    return algo


def _federation(tmp_path, *extra: str):
    cfg = load_config(None, SMALL + ["clients=4", "algorithm.name=fedgela", f"output_dir={tmp_path}", *extra])
    fed = build_federation(cfg)
    return fed, fed.new_algorithm(), fed.new_model()


# ----------------------------------------------------------------------------------------------- the ETF


@pytest.mark.parametrize(("d", "c"), [(10, 10), (84, 10), (512, 100), (5, 2), (7, 3)])
def test_etf_geometry(d, c):
    m = _etf(d, c, seed=d + c)
    assert m.shape == (d, c)
    torch.testing.assert_close(m.norm(dim=0), torch.ones(c, dtype=torch.float64), atol=1e-6, rtol=0)
    gram = m.T @ m
    off = gram[~torch.eye(c, dtype=torch.bool)]
    torch.testing.assert_close(off, torch.full_like(off, -1.0 / (c - 1)), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.sum(dim=1), torch.zeros(d, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.linalg.matrix_rank(m, atol=1e-5) == c - 1
    expected = (c / (c - 1)) * (torch.eye(c, dtype=torch.float64) - 1.0 / c)
    torch.testing.assert_close(gram, expected, atol=1e-6, rtol=0)


def test_etf_is_seeded_and_needs_d_at_least_c():
    assert torch.equal(_etf(84, 10, seed=3), _etf(84, 10, seed=3))
    assert not torch.equal(_etf(84, 10, seed=3), _etf(84, 10, seed=4))
    with pytest.raises(UserError, match="d >= classes"):
        simplex_etf(9, 10, torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="at least 2 classes"):
        simplex_etf(4, 1, torch.Generator().manual_seed(0))


def test_server_builds_the_etf_from_the_run_seed_and_rejects_narrow_features(tmp_path):
    fed, algo, model = _federation(tmp_path / "a")
    server = algo.init_server(model)
    assert server["etf"].shape == (32, 10)
    assert torch.equal(server["etf"], algo.init_server(fed.new_model())["etf"])
    with pytest.raises(UserError, match="d >= classes"):
        run_experiment(
            load_config(
                None, SMALL + ["model.hidden=8", "algorithm.name=fedgela", f"output_dir={tmp_path / 'b'}"]
            ),
            progress=False,
        )


# ------------------------------------------------------------------------------------------------- phi


@pytest.mark.parametrize("q", ["x", "exp", "sqrt"])
def test_phi_sums_to_num_classes(q):
    counts = torch.tensor([30, 0, 10, 0, 60, 5, 0, 0, 1, 0])
    phi = adaptation(counts, q)
    assert math.isclose(float(phi.sum()), 10.0, rel_tol=1e-6)
    assert (phi >= 0).all()
    if q != "exp":
        assert torch.equal(phi == 0, counts == 0)  # exactly 0 iff the class is missing
    torch.testing.assert_close(adaptation(torch.full((10,), 7), q), torch.ones(10))  # IID client: phi = 1


def test_phi_is_eq4_for_q_x():
    counts = torch.tensor([3, 0, 1])
    torch.testing.assert_close(adaptation(counts, "x"), torch.tensor([3 * 3 / 4, 0.0, 3 * 1 / 4]))
    torch.testing.assert_close(adaptation(counts, "sqrt"), 3 * counts.sqrt() / counts.sqrt().sum())


def test_fedge_phi_is_ones_and_fedgela_is_not():
    counts = torch.tensor([5, 0, 3, 0])
    phi, present = FedGE().local_adaptation(counts)
    assert torch.equal(phi, torch.ones(4)) and present.all()
    phi, present = FedGELA().local_adaptation(counts)
    assert torch.equal(present, counts > 0) and not torch.equal(phi, torch.ones(4))
    assert ALGORITHMS.get("fedge") is FedGE and ALGORITHMS.get("fedgela") is FedGELA


def test_average_personal_classifier_is_the_etf_on_a_balanced_federation(tmp_path):
    # Two circulant blocks: every class has the same total (globally balanced), client sizes differ, and
    # every client misses classes.
    v = torch.tensor([40, 0, 25, 0, 0, 10, 5, 0, 20, 0])
    u = torch.tensor([0, 3, 0, 0, 9, 0, 0, 0, 0, 0])
    counts = torch.stack([torch.roll(v, k) for k in range(10)] + [torch.roll(u, k) for k in range(10)])
    assert (counts.sum(0) == counts.sum(0)[0]).all() and (counts == 0).any(dim=1).all()
    algo = _algorithm(num_classes=10)
    m = _etf(84, 10).float()
    p = counts.sum(1) / counts.sum()  # n_k / n
    avg = sum(float(w) * m * algo.local_adaptation(c)[0] for w, c in zip(p, counts, strict=True))
    torch.testing.assert_close(avg, m, atol=1e-6, rtol=0)
    # ... which needs the paper's Q(x) = x: sqrt breaks the rule (it is only normalised per client).
    small = torch.tensor([[3, 1, 0], [1, 1, 2], [0, 2, 2]])  # balanced: every class has 4 samples
    for q, ok in (("x", True), ("sqrt", False)):
        phis = torch.stack([_algorithm(q=q).local_adaptation(c)[0] for c in small])
        assert torch.allclose((small.sum(1, keepdim=True) / 12 * phis).sum(0), torch.ones(3)) is ok
    # The same on a real partition (synthetic data is balanced; pathological P4C3 leaves no class unheld),
    # with the weights the algorithm aggregates with.
    fed, algo, _ = _federation(tmp_path, "partition.classes_per_client=3")
    label_counts = [c.label_counts for c in fed.clients]
    assert all((lc == 0).any() for lc in label_counts)
    weights = torch.tensor([algo.aggregation_weight(c.num_samples) for c in fed.clients])
    phis = torch.stack([algo.local_adaptation(lc)[0] for lc in label_counts])
    torch.testing.assert_close((weights[:, None] / weights.sum() * phis).sum(0), torch.ones(10))


# ------------------------------------------------------------------------------------------------ loss


M_HAND = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])  # d = 2, C = 3 (any matrix works for the loss)


def _hand_loss(softmax: str, cls: type = FedGELA) -> float:
    algo = _algorithm(cls, scale=2.0, softmax=softmax)
    model = Identity(2, 3)
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # L2-normalised: (1, 0) and (0, 1)
    y = torch.tensor([1, 1])
    phi, present = algo.local_adaptation(torch.tensor([2, 2, 0]))
    state = {"phi": phi, "present": present}
    return float(algo.loss(model, (x, y), local_work({"etf": M_HAND, "proj": {}}, state)).detach())


def test_loss_matches_hand_computation_for_both_softmax_variants():
    # phi = 3 * (1/2, 1/2, 0) = (1.5, 1.5, 0); z = 2 * phi * M^T h: sample 1 (3, 0, 0), sample 2 (0, 3, 0).
    local = (math.log(1 + math.exp(3)) + math.log(1 + math.exp(-3))) / 2  # Eq. 5: classes {0, 1} only
    every = (math.log(math.exp(3) + 2) - 0 + math.log(math.exp(3) + 2) - 3) / 2  # code: class 2 logit 0
    assert math.isclose(_hand_loss("local"), local, rel_tol=1e-6)
    assert math.isclose(_hand_loss("all"), every, rel_tol=1e-6)


def test_fedge_loss_is_plain_cross_entropy_on_the_scaled_etf():
    # phi = 1, all classes: z = 2 * M^T h = (2, 0, -2) and (0, 2, 0).
    z = torch.tensor([[2.0, 0.0, -2.0], [0.0, 2.0, 0.0]])
    expected = float(F.cross_entropy(z, torch.tensor([1, 1])))
    assert math.isclose(_hand_loss("local", FedGE), expected, rel_tol=1e-6)
    assert math.isclose(_hand_loss("all", FedGE), expected, rel_tol=1e-6)


def test_local_and_all_softmax_agree_when_the_client_holds_every_class():
    m = _etf(4, 3)
    model = Identity(4, 3)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    state = dict(zip(("phi", "present"), FedGELA().local_adaptation(torch.tensor([5, 1, 2])), strict=True))
    losses = [
        float(
            _algorithm(softmax=s)
            .loss(model, (x, y), local_work({"etf": m.float(), "proj": {}}, state))
            .detach()
        )
        for s in ("local", "all")
    ]
    assert math.isclose(*losses, rel_tol=1e-6)


# ---------------------------------------------------------------------------- training, messages, inference


def test_classifier_is_fixed_and_no_head_weights_travel(tmp_path):
    fed, algo, model = _federation(tmp_path)
    server = algo.init_server(model)
    heads = set(head_keys(model))
    assert heads and not heads & set(server["model"])
    payload = algo.payload_for(server, 0)
    assert set(payload["model"]) == set(backbone_keys(model))
    etf_before = payload["etf"].clone()
    head_before = {k: v.clone() for k, v in model.state_dict().items() if k in heads}
    backbone_before = {k: v.clone() for k, v in payload["model"].items()}

    trainable = list(algo.trainable_parameters(model, local_work(payload)))
    assert all(p is not model.head.weight and p is not model.head.bias for p in trainable)
    assert all(p.data_ptr() != payload["etf"].data_ptr() for p in trainable)

    reply, state = algo.local_update(model, fed.clients[0], local_work(payload, seed=0))
    assert torch.equal(payload["etf"], etf_before) and not payload["etf"].requires_grad
    assert payload["etf"].grad is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in head_before.items())  # head untouched
    assert set(reply["model"]) == set(backbone_keys(model)) and not heads & set(reply["model"])
    assert any(not torch.equal(reply["model"][k], backbone_before[k]) for k in backbone_before)  # it trained
    assert torch.equal(payload["model"]["fc1.weight"], backbone_before["fc1.weight"])  # payload not mutated
    assert set(state) == {"phi", "present", "proj"}  # the default FC projection is the client's too

    server = algo.aggregate(server, [reply])
    assert torch.equal(server["etf"], etf_before)
    assert set(server["model"]) == set(backbone_keys(model))


@pytest.mark.parametrize("seed", range(5))
def test_relu_features_need_the_default_projection_to_reach_every_etf_column(tmp_path, seed):
    # The first ETF column is nearly all negative, so no non-negative unit h has a cosine with it above the
    # norm of its positive part; the default FC projection gives h of both signs.
    m = simplex_etf(84, 10, torch.Generator().manual_seed(seed))
    assert float(m[:, 0].clamp(min=0).norm()) < 0.2
    h = torch.rand(1000, 84)  # any non-negative features
    cos0 = (F.normalize(h, dim=1) @ m)[:, 0]
    assert float(cos0.max()) <= float(m[:, 0].clamp(min=0).norm()) + 1e-6
    fed, algo, model = _federation(tmp_path)
    server = algo.init_server(model)
    x = fed.clients[0].x[fed.clients[0].train_idx[:32]]
    z = model.features(x)
    assert algo.projection == "fc" and bool((z >= 0).all())
    assert bool((algo.embed(model, x, server["proj"]) < 0).any())


def test_begin_local_refuses_head_weights(tmp_path):
    fed, algo, model = _federation(tmp_path)
    payload = {**algo.payload_for(algo.init_server(model), 0), "model": model.state_dict()}
    with pytest.raises(ValueError, match="must not hold head weights"):
        algo.begin_local(model, fed.clients[0], LocalWork(payload, None, torch.Generator()))


def test_personal_prediction_never_picks_a_missing_class():
    # h points away from both present classes: their logits are negative, the missing classes' would be 0.
    algo = _algorithm(num_classes=4, softmax="all")
    m = _etf(6, 4).float()
    counts = torch.tensor([0, 7, 0, 3])
    phi, present = algo.local_adaptation(counts)
    model = Identity(6, 4)
    x = -(m[:, 1] + m[:, 3]).repeat(5, 1) + 0.01 * torch.randn(5, 6)
    z_code = algo.scale * (F.normalize(x, dim=1) @ m) * phi  # the official code's personal logits
    assert set(z_code.argmax(1).tolist()) & {0, 2}  # ... which do pick a missing class here
    predict = algo.personal_predictor(
        model, local_work({"etf": m, "proj": {}}, {"phi": phi, "present": present})
    )
    assert set(predict(x).argmax(1).tolist()) <= {1, 3}


def test_personal_and_global_prediction_after_training(tmp_path):
    fed, algo, model = _federation(tmp_path, "partition.classes_per_client=2")
    server = algo.init_server(model)
    client = fed.clients[1]
    _, state = algo.local_update(model, client, local_work(algo.payload_for(server, 1), seed=1))
    held = set(torch.nonzero(client.label_counts).flatten().tolist())
    assert len(held) == 2
    pred = algo.personal_predictor(model, local_work(algo.payload_for(server, 1), state))(
        client.test_x
    ).argmax(1)
    assert set(pred.tolist()) <= held
    glob = algo.global_predictor(model, server)(client.test_x)
    assert glob.shape == (len(client.test_x), 10) and torch.isfinite(glob).all()


def test_predictions_do_not_depend_on_the_scale(tmp_path):
    fed, algo, model = _federation(tmp_path)
    server = algo.init_server(model)
    x = fed.clients[0].test_x
    a = algo.global_predictor(model, server)(x).argmax(1)
    algo.scale = 123.0
    assert torch.equal(a, algo.global_predictor(model, server)(x).argmax(1))


def test_batch_weighting_is_floor_n_over_b(tmp_path):
    _, algo, _ = _federation(tmp_path, "algorithm.weighting=batches")
    assert algo.aggregation_weight(95) == 2.0 and algo.aggregation_weight(31) == 0.0
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])}]
    replies = [{"model": s, "proj": {}, "num_samples": 10, "weight": 0.0} for s in states]
    out = algo.aggregate(
        {"model": None, "proj": {}, "etf": torch.zeros(1)}, replies
    )  # all 0: fall back to n_k
    torch.testing.assert_close(out["model"]["w"], weighted_average(states, [1, 1])["w"])


def test_projection_and_batchnorm_are_trained_sent_and_averaged(tmp_path):
    fed, algo, model = _federation(
        tmp_path, "algorithm.projection=mlp", "algorithm.proj_dim=12", "algorithm.normalize=bn"
    )
    server = algo.init_server(model)
    assert server["etf"].shape == (12, 10)
    assert set(server["proj"]) == {
        "fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias",
        "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
    }  # fmt: skip
    payload = algo.payload_for(server, 0)
    before = {k: v.clone() for k, v in server["proj"].items()}
    reply, state = algo.local_update(model, fed.clients[0], local_work(payload, seed=0))
    assert all(not torch.equal(reply["proj"][k], before[k]) for k in before)  # all trained / updated
    assert all(torch.equal(payload["proj"][k], before[k]) for k in before)  # the payload is untouched
    assert torch.equal(state["proj"]["fc1.weight"], reply["proj"]["fc1.weight"])
    agg = algo.aggregate(server, [reply, reply])
    torch.testing.assert_close(agg["proj"]["fc1.weight"], reply["proj"]["fc1.weight"])


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="scale"):
        build_algorithm("fedgela", {"scale": -1.0})
    with pytest.raises(UserError, match="proj_dim"):
        build_algorithm("fedgela", {"proj_dim": 16, "projection": "none"})
    with pytest.raises(UserError, match="softmax"):
        build_algorithm("fedgela", {"softmax": "some"})


def test_empty_client_trains_nothing_and_weighs_nothing():
    algo = _algorithm(num_classes=3)
    phi, present = algo.local_adaptation(torch.zeros(3, dtype=torch.long))
    assert torch.equal(phi, torch.ones(3)) and present.all()
    data = ClientData(
        id=0,
        x=torch.zeros(4, 2),
        y=torch.zeros(4, dtype=torch.long),
        train_idx=torch.zeros(0, dtype=torch.long),
        test_x=torch.zeros(1, 2),
        test_y=torch.zeros(1, dtype=torch.long),
        local_test_idx=torch.zeros(0, dtype=torch.long),
        num_classes=3,
    )
    model = Identity(3, 3)
    payload = {"model": {"scale": torch.ones(())}, "etf": _etf(3, 3).float(), "proj": {}}
    reply, _ = algo.local_update(model, data, local_work(payload, seed=0))
    assert reply["num_samples"] == 0 and reply["weight"] == 0.0


@pytest.mark.parametrize("name", ["fedgela", "fedge"])
def test_end_to_end_on_synthetic_writes_finite_metrics(tmp_path, name):
    cfg = load_config(
        None,
        SMALL
        + ["clients=4", "rounds=2", f"algorithm.name={name}", "local.grad_clip=20", f"output_dir={tmp_path}"],
    )
    summary = run_experiment(cfg, progress=False)
    final = summary["final"]
    assert final["round"] == 2
    for key in ("global_acc", "personal_acc", "pa_l", "pa_v", "train_loss"):
        assert final[key] is not None and math.isfinite(final[key])
    assert (
        0 < final["bytes_up"] < final["bytes_down"]
    )  # the ETF goes down, nothing classifier-shaped comes up
    ckpt = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)
    assert not any(k.startswith("head.") for k in ckpt["server"]["model"])
