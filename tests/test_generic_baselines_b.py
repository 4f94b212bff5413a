"""MOON, FedRS, FedLC, FedProc, FedETF, FedNTD: hand-computed formulas, FedAvg reductions, end-to-end runs.

The "reduces to FedAvg" tests compare whole engine runs bit for bit (metrics and the final global model): with
the coefficient at its neutral value every method performs exactly FedAvg's floating-point operations (the
extra term is skipped, or multiplies by 1.0 / subtracts 0.0, which is exact), so no tolerance is needed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import local_work
from fedpcd.algorithms import Context, build_algorithm
from fedpcd.algorithms.common import balanced_softmax_loss, frozen_forward, log_prior, raw_class_means
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.fedetf import FedETF, etf_logits
from fedpcd.algorithms.fedlc import FedLC, calibrated_loss, calibration_margins
from fedpcd.algorithms.fedntd import FedNTD, not_true_logits, ntd_loss
from fedpcd.algorithms.fedproc import FedProc, prototype_contrastive_loss
from fedpcd.algorithms.fedrs import FedRS, class_scales
from fedpcd.algorithms.moon import MOON, model_contrastive_loss
from fedpcd.backends import run_experiment
from fedpcd.errors import UserError
from fedpcd.models import FedModel, build_model
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]
FIXED = ["clients=4", "partition.classes_per_client=3"]


class Direct(FedModel):
    """features(x) = g * x with one trainable scalar g (so z is chosen by hand) and a linear head."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.feature_dim = dim
        self.gain = nn.Parameter(torch.ones(()))
        self.head = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x


class WithBatchNorm(FedModel):
    """A model with BatchNorm buffers, to check that frozen forwards never write running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.feature_dim = 3
        self.lin = nn.Linear(2, 3)
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _setup(algo, num_classes: int = 3):
    algo.setup(Context(num_clients=2, num_classes=num_classes, rounds=2, seed=0))
    return algo


def _client(x: torch.Tensor, y: torch.Tensor, num_classes: int = 3) -> ClientData:
    idx = torch.arange(len(y))
    return ClientData(
        id=0,
        x=x,
        y=y,
        train_idx=idx,
        test_x=x,
        test_y=y,
        local_test_idx=idx,
        num_classes=num_classes,
    )


def _run(tmp_path, name: str, *extra: str, rounds: int = 2) -> tuple[list[dict], dict]:
    out = tmp_path / name
    cfg = load_config(None, SMALL + FIXED + [f"rounds={rounds}", *extra, f"output_dir={out}"])
    run_experiment(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    server = torch.load(out / "checkpoint" / "state.pt", weights_only=False)["server"]
    return rows, server


VOLATILE = {"wall_s", "bytes_up", "bytes_down"}


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fedavg"), "fedavg", "algorithm.name=fedavg")


# ------------------------------------------------------------------------------------------ FedAvg reductions


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("moon", ["algorithm.mu=0"]),
        ("fedrs", ["algorithm.alpha=1"]),
        ("fedlc", ["algorithm.tau=0", "algorithm.denominator=all"]),
        ("fedntd", ["algorithm.beta=0"]),
        ("fedproc", ["algorithm.weight=0"]),
    ],
)
def test_neutral_coefficient_is_exactly_fedavg(tmp_path, fedavg_run, name, params):
    rows, server = _run(tmp_path, name, f"algorithm.name={name}", *params)
    ref_rows, ref_server = fedavg_run
    for row, ref in zip(rows, ref_rows, strict=True):
        assert {k: v for k, v in row.items() if k not in VOLATILE} == {
            k: v for k, v in ref.items() if k not in VOLATILE
        }
    assert server["model"].keys() == ref_server["model"].keys()
    for key, value in ref_server["model"].items():
        assert torch.equal(server["model"][key], value), key


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("moon", ["algorithm.mu=1"]),
        ("fedrs", []),
        ("fedlc", []),
        ("fedlc", ["algorithm.denominator=all"]),
        ("fedntd", []),
        ("fedproc", ["algorithm.weight=1"]),
        ("fedetf", ["algorithm.finetune_rounds=1", "algorithm.finetune_epochs=1"]),
    ],
)
def test_one_round_end_to_end(tmp_path, name, params):
    rows, server = _run(tmp_path, name, f"algorithm.name={name}", *params, rounds=1)
    (row,) = rows
    for key in ("global_acc", "pa_l", "pa_v", "train_loss"):
        assert row[key] is not None and math.isfinite(row[key]), key
    assert all(torch.isfinite(v.float()).all() for v in server["model"].values())


def test_active_coefficients_change_training(tmp_path, fedavg_run):
    """The distinctive terms are wired in: with a non-neutral coefficient the global model differs."""
    ref_server = fedavg_run[1]["model"]
    for name, params in [("moon", ["algorithm.mu=1"]), ("fedntd", []), ("fedproc", ["algorithm.weight=1"])]:
        _, server = _run(tmp_path, name, f"algorithm.name={name}", *params)
        assert any(not torch.equal(server["model"][k], v) for k, v in ref_server.items()), name


# ----------------------------------------------------------------------------------------------------- MOON


def test_moon_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    z_glob = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    z_prev = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    # sample 1: cos(z, g) = 1/sqrt2, cos(z, p) = 0; sample 2: cos = 1 and -1; tau = 0.5
    l1 = -math.log(math.exp(math.sqrt(2)) / (math.exp(math.sqrt(2)) + 1.0))
    l2 = -math.log(math.exp(2.0) / (math.exp(2.0) + math.exp(-2.0)))
    got = model_contrastive_loss(z, z_glob, z_prev, tau=0.5)
    assert got.item() == pytest.approx((l1 + l2) / 2, rel=1e-6)


def test_frozen_forward_uses_the_given_weights_and_leaves_model_and_state_alone():
    torch.manual_seed(0)
    model = WithBatchNorm()
    other = WithBatchNorm()
    other.bn.running_mean.fill_(0.5)
    other.bn.running_var.fill_(2.0)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 2)
    model.train()
    z, logits = frozen_forward(model, state, x)
    other.eval()
    torch.testing.assert_close(z, other.features(x))
    torch.testing.assert_close(logits, other(x))
    assert not z.requires_grad and not logits.requires_grad
    assert model.training  # mode restored
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_model[k]), k
    for k, v in other.state_dict().items():
        assert torch.equal(state[k], v), k  # eval mode: running statistics not written


def test_moon_first_round_is_ce_then_adds_mu_lcon():
    torch.manual_seed(1)
    algo = _setup(MOON(mu=2.0, tau=0.5))
    model = Direct(2, 3)
    x = torch.randn(6, 2)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    payload = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    ce = F.cross_entropy(model(x), y)
    torch.testing.assert_close(algo.loss(model, (x, y), local_work(payload)), ce)

    reply, state = algo.local_update(model, _client(x, y), local_work(payload, seed=0))
    assert set(state) == {"prev"} and state["prev"].keys() == model.state_dict().keys()
    for k, v in reply["model"].items():
        assert torch.equal(state["prev"][k], v)

    # Next round: global = the payload weights (gain 1), previous local = gain g_prev; current gain g.
    g_prev = float(state["prev"]["gain"])
    with torch.no_grad():
        model.gain.fill_(0.7)
    z = 0.7 * x
    lcon = model_contrastive_loss(z, 1.0 * x, g_prev * x, 0.5)
    expected = F.cross_entropy(model(x), y) + 2.0 * lcon
    torch.testing.assert_close(algo.loss(model, (x, y), local_work(payload, state)), expected)


# ---------------------------------------------------------------------------------------------------- FedRS


def test_fedrs_restricted_softmax_by_hand():
    algo = _setup(FedRS(alpha=0.5))
    model = Direct(2, 3)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        model.head.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    scales = class_scales(torch.tensor([5, 0, 3]), 0.5)
    assert scales.tolist() == [1.0, 0.5, 1.0]
    x = torch.tensor([[1.0, 2.0]])
    y = torch.tensor([0])
    logits = [1.1, 0.5 * 2.0 + 0.2, 3.3]  # alpha_c w_c^T h + b_c
    expected = -logits[0] + math.log(sum(math.exp(v) for v in logits))
    loss = algo.loss(model, (x, y), local_work({}, class_scales=scales))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # dL/dw_1 = alpha * p_1 * h for the missing class 1
    p1 = math.exp(logits[1]) / sum(math.exp(v) for v in logits)
    torch.testing.assert_close(model.head.weight.grad[1], torch.tensor([0.5 * p1 * 1.0, 0.5 * p1 * 2.0]))


def test_fedrs_scales_come_from_the_client_counts():
    algo = _setup(FedRS(alpha=0.25))
    model = Direct(2, 3)
    x = torch.randn(4, 2)
    y = torch.tensor([0, 0, 2, 2])
    payload = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    work = local_work(payload, seed=0)
    algo.local_update(model, _client(x, y), work)
    assert work.class_scales.tolist() == [1.0, 0.25, 1.0]


# ---------------------------------------------------------------------------------------------------- FedLC


def test_fedlc_margins_by_hand():
    margins = calibration_margins(torch.tensor([16, 1, 81, 0]), tau=2.0, count_floor=1e-8)
    torch.testing.assert_close(margins, torch.tensor([2.0 * 0.5, 2.0, 2.0 / 3.0, 2.0 * 100.0]))


def test_fedlc_calibrated_loss_by_hand_both_denominators():
    logits = torch.tensor([[2.0, 1.0, 0.0]], requires_grad=True)
    y = torch.tensor([0])
    margins = calibration_margins(torch.tensor([16, 1, 81]), tau=1.0, count_floor=1e-8)  # 0.5, 1, 1/3
    cal = [1.5, 0.0, -1.0 / 3.0]
    paper = -cal[0] + math.log(math.exp(cal[1]) + math.exp(cal[2]))  # true class not in the denominator
    full = -cal[0] + math.log(sum(math.exp(v) for v in cal))
    loss = calibrated_loss(logits, y, margins, "paper")
    assert loss.item() == pytest.approx(paper, rel=1e-6)
    assert calibrated_loss(logits, y, margins, "all").item() == pytest.approx(full, rel=1e-6)
    loss.backward()
    assert logits.grad[0, 0].item() == pytest.approx(
        -1.0
    )  # the paper's form: constant pull on the true logit


def test_fedlc_loss_uses_client_margins():
    algo = _setup(FedLC(tau=1.0, denominator="paper"))
    model = Direct(2, 3)
    x = torch.randn(5, 2)
    y = torch.tensor([0, 0, 0, 1, 1])
    payload = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    work = local_work(payload, seed=0)
    algo.local_update(model, _client(x, y), work)
    expected_margins = torch.tensor([3.0**-0.25, 2.0**-0.25, 1e-8**-0.25])
    torch.testing.assert_close(work.margins, expected_margins)
    torch.testing.assert_close(
        algo.loss(model, (x, y), work), calibrated_loss(model(x), y, expected_margins, "paper")
    )


# --------------------------------------------------------------------------------------------------- FedNTD


def test_not_true_logits_drop_the_target_in_order():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert not_true_logits(logits, torch.tensor([1, 2])).tolist() == [[1.0, 3.0], [4.0, 5.0]]


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_ntd_loss_by_hand(tau):
    s = torch.tensor([[1.0, 2.0, 3.0]])
    t = torch.tensor([[3.0, 1.0, 0.0]])
    y = torch.tensor([1])

    def softmax(v):
        e = [math.exp(a / tau) for a in v]
        return [a / sum(e) for a in e]

    q, qg = softmax([1.0, 3.0]), softmax([3.0, 0.0])
    expected = sum(g * math.log(g / p) for g, p in zip(qg, q, strict=True))
    assert ntd_loss(s, t, y, tau).item() == pytest.approx(expected, rel=1e-6)


def test_fedntd_loss_is_ce_plus_beta_ntd_against_the_payload_model():
    torch.manual_seed(2)
    algo = _setup(FedNTD(beta=0.5, tau=2.0))
    model = Direct(2, 3)
    teacher = Direct(2, 3)
    x = torch.randn(4, 2)
    y = torch.tensor([0, 1, 2, 1])
    payload = {"model": teacher.state_dict()}
    expected = F.cross_entropy(model(x), y) + 0.5 * ntd_loss(model(x), teacher(x).detach(), y, 2.0)
    torch.testing.assert_close(algo.loss(model, (x, y), local_work(payload)), expected)
    # a student equal to its teacher has L_NTD = 0
    own = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    torch.testing.assert_close(algo.loss(model, (x, y), local_work(own)), F.cross_entropy(model(x), y))


# -------------------------------------------------------------------------------------------------- FedProc


def test_prototype_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    y = torch.tensor([0, 2])  # class 2 has no prototype yet: the second sample adds nothing
    protos = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    known = torch.tensor([True, True, False])
    expected = -2.0 + math.log(math.exp(2.0) + math.exp(0.0))  # cos 1 and 0, tau 0.5; class 2 left out
    got = prototype_contrastive_loss(z, y, protos, known, tau=0.5)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert prototype_contrastive_loss(z[1:], y[1:], protos, known, 0.5).item() == 0.0


def test_fedproc_class_means_and_count_weighted_aggregation():
    algo = _setup(FedProc())
    model = Direct(2, 3)
    x = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0]])
    y = torch.tensor([0, 0, 2])
    classes, counts, means = raw_class_means(model, _client(x, y))
    assert classes.tolist() == [0, 2] and counts.tolist() == [2, 1]
    torch.testing.assert_close(means, torch.tensor([[2.0, 1.0], [0.0, 4.0]]))

    server = algo.init_server(model)
    assert server["prototypes"].shape == (3, 2) and not server["known"].any()
    server["prototypes"][1] = torch.tensor([7.0, 7.0])  # an old prototype nobody reports this round
    state = model.state_dict()
    replies = [
        {"model": state, "num_samples": 3, "classes": torch.tensor([0, 2]),
         "class_counts": torch.tensor([2, 1]), "class_means": torch.tensor([[2.0, 1.0], [0.0, 4.0]])},
        {"model": state, "num_samples": 6, "classes": torch.tensor([0]),
         "class_counts": torch.tensor([6]), "class_means": torch.tensor([[6.0, 5.0]])},
    ]  # fmt: skip
    out = algo.aggregate(server, replies)
    expected = torch.tensor([[(2 * 2.0 + 6 * 6.0) / 8, (2 * 1.0 + 6 * 5.0) / 8], [7.0, 7.0], [0.0, 4.0]])
    torch.testing.assert_close(out["prototypes"], expected)
    assert out["known"].tolist() == [True, False, True]


def test_fedproc_loss_is_ce_plus_weight_lpc():
    algo = _setup(FedProc(weight=0.3, tau=0.5))
    model = Direct(2, 3)
    x = torch.tensor([[1.0, 0.5], [0.2, 1.0]])
    y = torch.tensor([0, 1])
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    payload = {"model": model.state_dict(), "prototypes": protos, "known": torch.ones(3, dtype=torch.bool)}
    expected = F.cross_entropy(model(x), y) + 0.3 * prototype_contrastive_loss(
        model.features(x), y, protos, payload["known"], 0.5
    )
    torch.testing.assert_close(algo.loss(model, (x, y), local_work(payload)), expected)
    none_known = {**payload, "known": torch.zeros(3, dtype=torch.bool)}
    torch.testing.assert_close(algo.loss(model, (x, y), local_work(none_known)), F.cross_entropy(model(x), y))


# --------------------------------------------------------------------------------------------------- FedETF


def test_etf_logits_and_balanced_feature_loss_by_hand():
    z = torch.tensor([[3.0, 4.0]])
    proj = {"weight": torch.eye(2), "bias": torch.zeros(2)}
    etf = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    logits = etf_logits(z, proj, etf, torch.tensor(2.0))  # h = (0.6, 0.8)
    torch.testing.assert_close(logits, torch.tensor([[1.2, 1.6, -1.2]]))
    counts = torch.tensor([3, 1, 0])
    adj = [1.2 + math.log(3.0), 1.6]  # class 2 (no sample) drops out: log 0 = -inf
    expected = -adj[0] + math.log(sum(math.exp(v) for v in adj))
    got = balanced_softmax_loss(logits, torch.tensor([0]), log_prior(counts))
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_fedetf_server_state_and_training_touch_only_what_they_should():
    torch.manual_seed(3)
    algo = _setup(FedETF(finetune_rounds=2, finetune_epochs=1), num_classes=3)
    model = Direct(4, 3)
    server = algo.init_server(model)
    etf = server["etf"]
    assert etf.shape == (3, 3)  # d = C by default
    gram = etf.T @ etf
    torch.testing.assert_close(gram.diagonal(), torch.ones(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(gram[0, 1], torch.tensor(-0.5), atol=1e-5, rtol=0)
    assert not any(k.startswith("head.") for k in server["model"])
    assert server["proj"]["weight"].shape == (3, 4) and float(server["scale"]) == 1.0

    payload = algo.payload_for(server, 0)
    frozen = {"etf": etf.clone(), "proj": {k: v.clone() for k, v in payload["proj"].items()}}
    x = torch.randn(12, 4)
    y = torch.tensor([0, 1] * 6)
    work = local_work(payload, seed=0)
    reply, state = algo.local_update(model, _client(x, y), work)
    assert state is None
    assert set(reply) == {"model", "proj", "scale", "num_samples", "train_loss"}
    assert float(reply["scale"]) != 1.0  # beta is learned
    assert not torch.equal(reply["proj"]["weight"], frozen["proj"]["weight"])
    predict = algo.personal_predictor(model, work)
    assert torch.equal(payload["etf"], frozen["etf"])  # fine-tuning works on copies
    assert torch.equal(payload["proj"]["weight"], frozen["proj"]["weight"])
    assert predict(x).shape == (12, 3)
    # the fine-tuned personal classifier differs from the global one
    glob = etf_logits(model.features(x), reply["proj"], etf, reply["scale"])
    assert not torch.allclose(predict(x), glob)

    new = algo.aggregate(server, [reply, {**reply, "scale": torch.tensor(3.0), "num_samples": 36}])
    assert float(new["scale"]) == pytest.approx((12 * float(reply["scale"]) + 36 * 3.0) / 48)
    assert torch.equal(new["etf"], frozen["etf"])


def test_fedetf_etf_dimension_option():
    algo = _setup(FedETF(proj_dim=6), num_classes=3)
    server = algo.init_server(Direct(4, 3))
    assert server["etf"].shape == (6, 3) and server["proj"]["weight"].shape == (6, 4)
    algo = _setup(FedETF(proj_dim=2), num_classes=3)
    with pytest.raises(UserError, match="d >= classes"):
        algo.init_server(Direct(4, 3))


def test_registered_with_typed_defaults():
    assert build_algorithm("moon").mu == 1e-4 and build_algorithm("moon").tau == 0.5
    assert build_algorithm("fedrs").alpha == 0.5
    assert build_algorithm("fedlc").denominator == "all"  # the printed form collapses
    assert build_algorithm("fedproc").weight == 1e-3
    assert build_algorithm("fedntd").beta == 1.0 and build_algorithm("fedntd").tau == 1.0
    assert build_algorithm("fedetf").finetune_rounds == 20
    with pytest.raises(UserError):
        build_algorithm("fedrs", {"alpha": 1.5})
    assert isinstance(build_model("mlp", 1, 10, 8, hidden=32), FedModel)
