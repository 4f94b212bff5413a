"""The vectorized executor (engine.vectorized): the sequential executor's numbers up to float rounding."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedpcd.engine.vectorized as vec
from fedpcd.algorithms import Algorithm, FedAvg, LocalWork
from fedpcd.algorithms.fedclassavg import supcon_loss
from fedpcd.algorithms.fedmr import (
    inter_class_loss,
    inter_class_loss_masked,
    intra_class_loss,
    intra_class_loss_masked,
    negative_mask,
)
from fedpcd.algorithms.fedproc import prototype_contrastive_loss
from fedpcd.algorithms.fedsc import rpcl_loss
from fedpcd.algorithms.vectorizable import Vectorizable
from fedpcd.backends import run_experiment
from fedpcd.data.datasets import load_dataset
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import build_federation
from fedpcd.engine.metrics import predict
from fedpcd.engine.tasks import payloads_for
from fedpcd.models import FedModel, build_model
from fedpcd.models.fast_convnet import convnet_logits, pool_relu_backward, pool_relu_masks
from fedpcd.resolve import load_config

BASE = [
    "dataset.name=synthetic16",
    "dataset.train_fraction=0.5",
    "model.name=simplecnn",
    "clients=3",
    "rounds=2",
    "partition.scheme=dirichlet",
    "partition.beta=0.5",
    "local.batch_size=16",
]
# The two executors sum the same terms in different orders (one client at a time vs vmap-batched kernels),
# so they agree up to float32 rounding, never bit for bit, and by how much depends on the CPU's kernels.
# A reduction of n terms rounds to about sqrt(n) * 6e-8 of their magnitude (n <= a few thousand here: ~1e-6);
# two rounds of well-conditioned SGD carry that without large amplification. Tensors and losses may thus
# differ by REL = 1e-4 of their scale (the tensor's largest magnitude): 100x the expected rounding, while a
# defect (a missing term, a wrong coefficient or client weight) moves them by a percent or more
# (test_the_comparison_catches_a_one_percent_change). Accuracies are decisions: rounding can flip a
# prediction whose two best logits tie within rounding, which moves a per-class accuracy by 1 / (that
# class's test samples) and any mean of accuracies by at most that; ACCURACY_FLIPS such flips are allowed.
REL = 1e-4
ACCURACY_FLIPS = 1


def _run(tmp_path, executor: str, extra: list[str]) -> tuple[list[dict], dict]:
    out = tmp_path / executor
    cfg = load_config(None, [*BASE, *extra, f"engine.executor={executor}", f"output_dir={out}"])
    run_experiment(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, torch.load(out / "checkpoint" / "state.pt", weights_only=False)


def _accuracy_tol() -> float:
    test_y = load_dataset("synthetic16").test_y
    return ACCURACY_FLIPS / int(torch.bincount(test_y).min()) + 1e-6


def _is_accuracy(path: str) -> bool:
    key = path.split("/")[1] if path.startswith("round") else ""
    return "acc" in key or key.startswith("pa_")


def _assert_close(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        if a.is_floating_point():
            scale = float(a.abs().max()) if a.numel() else 0.0
            torch.testing.assert_close(a, b, rtol=REL, atol=REL * scale, msg=path)
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _assert_close(u, v, f"{path}/{i}")
    elif isinstance(a, float) and b is not None:
        tol = _accuracy_tol() if _is_accuracy(path) else REL * abs(a)
        assert math.isclose(a, b, rel_tol=0.0, abs_tol=tol), (path, a, b)
    else:
        assert a == b, path


def _compare(tmp_path, extra: list[str], monkeypatch) -> int:
    """Run sequential and vectorized, assert they agree; returns the number of vectorized rounds."""
    calls = []
    real = vec.train_vectorized

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(vec, "train_vectorized", spy)
    seq_rows, seq_state = _run(tmp_path, "sequential", extra)
    assert not calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        vec_rows, vec_state = _run(tmp_path, "vectorized", extra)
    assert len(calls) == 2  # both rounds vectorized
    for a, b in zip(seq_rows, vec_rows, strict=True):
        a.pop("wall_s"), b.pop("wall_s")
        _assert_close(a, b, f"round {a['round']}")
    _assert_close(seq_state["server"], vec_state["server"], "server")
    _assert_close(seq_state["client_states"], vec_state["client_states"], "client_states")
    return len(calls)


# FedNH on a ReLU feature and FedMR with the default 1e-8 variance guard amplify rounding: a unit whose
# pre-activation is within float rounding of 0, or a class dimension with near-zero variance, flips, and
# the runs drift apart by ~1e-4 after a few dozen steps (sequential runs with an equivalent loss formula
# drift the same). The settings below keep both well-conditioned.
COVERED = {
    "fedavg": [],
    "fedprox": ["algorithm.mu=0.1"],
    "fedrs": ["algorithm.alpha=0.3"],
    "fedlc": ["algorithm.denominator=paper"],
    "fedmr": ["algorithm.intra_eps=0.01", "partition.beta=2.0"],
    "fednh": ["model.feature_relu=false"],
    "fedgela": ["personal_test=split"],
    "fedge": [],
    "scaffold": ["algorithm.grad_clip=0.5"],  # SCAFFOLD's own clip, active at 0.5
    "feddyn": ["algorithm.alpha=0.1", "clients=4", "participation=0.75"],  # first and later participations
    "feddc": ["algorithm.alpha=0.1", "local.grad_clip=0.5"],
    "fedntd": [],
    "fednova": [],
    "fedper": [],
    "fedbabu": ["algorithm.finetune_epochs=1"],
    "lgfedavg": [],
    "local": [],
    "fedavg_ft": ["algorithm.finetune_epochs=1"],
    "fedproto": [],
    "fd": ["algorithm.distill=kl", "personal_test=split"],
    "fedrod": [],
    "fedetf": ["algorithm.finetune_rounds=1"],
    "fedproc": ["algorithm.weight=0.1"],
    "fedclassavg": [],
    "fedssa": ["algorithm.t_stable=2"],  # Eq. 4 fusion in round 2, plain in later ones
    # round 2 trains against round 1's prototypes. RPCL's temperature 0.05 multiplies cosine logits by 20 and
    # makes these two tiny rounds chaotic (rounding differences grow ~1e3x, more on some CPUs' kernels); at
    # 0.5 the same code runs well-conditioned.
    "fedsc": ["algorithm.cpdr_weight=0.01", "algorithm.tau=0.5"],
    "creff": ["algorithm.match_steps=10", "algorithm.retrain_epochs=30"],  # the server's part at a tenth
    "fedbn": ["model.name=simplecnn_bn"],  # per-client BatchNorm layers under vmap
}


@pytest.mark.parametrize("name", sorted(COVERED))
def test_vectorized_matches_sequential(tmp_path, monkeypatch, name):
    assert _compare(tmp_path, [f"algorithm.name={name}", *COVERED[name]], monkeypatch) == 2


def test_the_comparison_catches_a_one_percent_change(tmp_path):
    """The tolerances above separate rounding from defects: a 1% larger step size fails the comparison."""
    _, state = _run(tmp_path / "a", "sequential", [])
    _, nudged = _run(tmp_path / "b", "sequential", ["local.lr=0.0101"])
    with pytest.raises(AssertionError):
        _assert_close(state["server"], nudged["server"], "server")


def test_moon_first_and_returning_clients_train_in_separate_groups(tmp_path, monkeypatch):
    groups = []
    real = vec.train_steps

    def spy(algorithm, model, clients):
        groups.append([c.k for c in clients])
        return real(algorithm, model, clients)

    monkeypatch.setattr(vec, "train_steps", spy)
    extra = ["algorithm.name=moon", "algorithm.mu=1.0", "clients=5", "participation=0.6"]
    assert _compare(tmp_path, extra, monkeypatch) == 2
    # round 2: clients 0 and 4 have a previous model (the contrastive term), client 2 not yet
    assert groups == [[0, 1, 4], [0, 4], [2]]


def test_grad_clip_partial_participation_and_two_epochs(tmp_path, monkeypatch):
    vectorized_rounds = _compare(
        tmp_path,
        ["clients=6", "participation=0.5", "local.grad_clip=0.5", "local.epochs=2", "personal_test=split"],
        monkeypatch,
    )
    assert vectorized_rounds == 2


def _federation(*extra: str):
    cfg = load_config(None, [*BASE, "output_dir=unused", *extra])
    fed = build_federation(cfg)
    return fed, fed.new_algorithm()


def test_where_the_vectorized_executor_applies_and_auto_stays_sequential(monkeypatch):
    fed, fedavg = _federation()
    assert vec.blocker(fedavg, fed, [0, 1]) is None
    assert vec.blocker(fedavg, fed, [0]) == "fewer than 2 participants"
    ditto_fed, ditto = _federation("algorithm.name=ditto")
    assert "not covered" in vec.blocker(ditto, ditto_fed, [0, 1])
    lite_fed, lite = _federation("algorithm.name=fedmr", "algorithm.lite_samples=4")
    assert "Lite" in vec.blocker(lite, lite_fed, [0, 1])
    audit_fed, audit = _federation("algorithm.name=fedsc", "algorithm.compat_official=true")
    assert "compat_official" in vec.blocker(audit, audit_fed, [0, 1])
    res_fed, res = _federation("model.name=resnet18")
    assert vec.blocker(res, res_fed, [0, 1]) is None  # any architecture runs when asked for

    class Plain(Algorithm):  # the contract without the declared capability
        pass

    assert "not Vectorizable" in vec.blocker(Plain(), fed, [0, 1])

    def refuse(*args, **kwargs):
        raise AssertionError("auto must not call the vectorized executor")

    monkeypatch.setattr(vec, "train_or_none", refuse)
    auto_fed, auto = _federation("engine.executor=auto")
    server = auto.init_server(auto_fed.model_for(0, fresh=True))
    assert (
        len(
            LocalExecutor(auto_fed, states={}).train(
                auto, payloads_for(auto, server, [0, 1]), 1, evaluate=False
            )
        )
        == 2
    )


def test_vectorization_is_declared_outside_the_contract():
    """The contract names nothing of the vectorized executor: its two methods are the mixin's, and the work a
    loss gets has no executor field."""
    assert not {"vectorize_blocker", "traceable_loss"} & set(dir(Algorithm))
    assert {"vectorize_blocker", "traceable_loss"} <= set(vars(Vectorizable))
    assert "traceable" not in LocalWork.FIELDS
    assert issubclass(FedAvg, Vectorizable)


def test_uncovered_algorithm_falls_back_to_sequential_with_a_warning():
    fed, ditto = _federation("algorithm.name=ditto", "engine.executor=vectorized")
    server = ditto.init_server(fed.model_for(0, fresh=True))
    vec._WARNED.clear()
    with pytest.warns(UserWarning, match="vectorized executor not used.*not covered"):
        got = LocalExecutor(fed, states={}).train(
            ditto, payloads_for(ditto, server, [0, 1]), 1, evaluate=True
        )
    ref_fed, ref_ditto = _federation("algorithm.name=ditto")
    want = LocalExecutor(ref_fed, states={}).train(
        ref_ditto, payloads_for(ref_ditto, server, [0, 1]), 1, evaluate=True
    )
    for a, b in zip(got, want, strict=True):
        assert a.metrics == b.metrics and a.update["train_loss"] == b.update["train_loss"]


class _TinyBN(FedModel):
    """conv -> BatchNorm -> ReLU -> pool -> head: BatchNorm's running statistics under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.feature_dim = 4
        self.head = nn.Linear(4, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(F.relu(self.bn(self.conv(x))), 1).flatten(1)


def test_batchnorm_running_statistics_per_client():
    results = []
    for executor in ("sequential", "vectorized"):
        fed, alg = _federation(f"engine.executor={executor}", "local.batch_size=64", "partition.beta=100")
        torch.manual_seed(0)
        model = _TinyBN()
        fed._models["simplecnn"] = (model, {k: v.clone() for k, v in model.state_dict().items()})
        server = alg.init_server(fed.model_for(0, fresh=True))
        results.append(
            LocalExecutor(fed, states={}).train(alg, payloads_for(alg, server, [0, 1, 2]), 1, evaluate=True)
        )
    for a, b in zip(*results, strict=True):
        _assert_close(a.update, b.update)
        _assert_close(a.metrics, b.metrics)
    assert not torch.equal(results[1][0].update["model"]["bn.running_mean"], torch.zeros(4))


# ----- the kernels of the ConvNet fast path ------------------------------------------------------------


def test_pool_relu_matches_max_pool2d_with_ties_and_odd_sizes():
    torch.manual_seed(0)
    a = torch.randn(3, 2, 9, 7).round()  # many ties, odd sizes
    out, masks = pool_relu_masks(a, masks=True)
    ref_in = a.clone().requires_grad_()
    ref = F.max_pool2d(F.relu(ref_in), 2)
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    assert torch.equal(pool_relu_backward(g, masks, a.shape), ref_in.grad)


@pytest.mark.parametrize(
    ("arch", "channels", "side"),
    [("simplecnn", 1, 16), ("simplecnn", 1, 19), ("conv2cifar", 3, 32), ("cnn1", 1, 28)],  # 19: odd maps
)
def test_fast_convnet_forward_and_gradients(arch, channels, side):
    torch.manual_seed(0)
    model = build_model(arch, channels, 10, side)
    x = torch.randn(5, channels, side, side)
    model.eval()
    assert torch.equal(predict(model, x), model(x).argmax(1))
    with torch.no_grad():
        assert torch.equal(convnet_logits(model, x), model(x))  # bit for bit
        assert torch.equal(model.inference_features()(x), model.features(x))
    twin = model.vmap_copy()
    twin.load_state_dict(model.state_dict())
    params = list(model.parameters())
    grads = torch.autograd.grad(model.features(x).square().sum(), params[:-2])
    fast = torch.autograd.grad(twin.features(x).square().sum(), list(twin.parameters())[:-2])
    for g, h in zip(grads, fast, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)


def test_a_readout_with_a_head_predicts_through_the_fast_features_bit_for_bit(monkeypatch):
    """FedNH's personal predictor (prototypes and a scale over the body): the same logits as its
    ``logits(model, x, tensors)``, through ``inference_features`` when no gradient is taken."""
    from fedpcd.algorithms.fednh import prototype_head, prototype_logits
    from fedpcd.algorithms.readout import Readout

    torch.manual_seed(0)
    model = build_model("simplecnn", 1, 10, 28)
    x = torch.randn(7, 1, 28, 28)
    tensors = {
        "prototypes": torch.nn.functional.normalize(torch.randn(10, 84), dim=1),
        "scale": torch.tensor(3.0),
    }
    readout = Readout(model, prototype_logits, tensors, head=prototype_head)
    with torch.no_grad():
        want = prototype_logits(model.eval(), x, tensors)
        monkeypatch.setattr(model, "features", lambda _: pytest.fail("the plain features ran"))
        assert torch.equal(readout(x), want)
    monkeypatch.undo()
    assert torch.equal(readout(x), want)  # with gradients on: the algorithm's own logits


def test_only_the_convnet_class_itself_takes_the_fast_path():
    from fedpcd.models.cnn import ConvNet

    class Custom(ConvNet):  # may change features or forward: plain paths
        pass

    model = Custom(1, 10, 16, 6, 16, 120, 84)
    assert model.inference_forward() is model
    assert model.inference_features() == model.features
    assert "features" not in vars(model.vmap_copy())
    assert "features" in vars(build_model("simplecnn", 1, 10, 16).vmap_copy())  # the batched kernel
    mlp = build_model("mlp", 1, 10, 16)
    assert mlp.inference_forward() is mlp


def test_fedmr_masked_losses_equal_the_loops():
    torch.manual_seed(0)
    y = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 5, 5, 5, 5, 5, 7])
    for impl in ("code", "paper"):
        z = torch.relu(torch.randn(16, 12, dtype=torch.float64)).requires_grad_()
        a, b = intra_class_loss(z, y, impl), intra_class_loss_masked(z, y, 10, impl)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(torch.autograd.grad(a, z)[0], torch.autograd.grad(b, z)[0])
    known = torch.ones(10, dtype=torch.bool)
    known[4] = False
    neg = negative_mask(known, torch.bincount(y, minlength=10) > 0, "local")
    z = torch.randn(16, 12, dtype=torch.float64, requires_grad=True)
    protos = torch.randn(10, 12, dtype=torch.float64)
    a, b = inter_class_loss(z, y, protos, neg), inter_class_loss_masked(z, y, protos, neg)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.autograd.grad(a, z)[0], torch.autograd.grad(b, z)[0])


@pytest.mark.parametrize("known_classes", [[0, 1, 3, 5], [9], []])  # some, none of the batch's, none
def test_fedproc_traceable_loss_equals_the_indexed_one(known_classes):
    torch.manual_seed(1)
    y = torch.tensor([0, 0, 1, 3, 3, 3, 5, 7])
    z = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    protos = torch.randn(10, 6, dtype=torch.float64)
    known = torch.zeros(10, dtype=torch.bool)
    known[known_classes] = True
    a = prototype_contrastive_loss(z, y, protos, known, 0.5)
    b = prototype_contrastive_loss(z, y, protos, known, 0.5, traceable=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.autograd.grad(a, z)[0], torch.autograd.grad(b, z)[0])


@pytest.mark.parametrize("labels", [[0, 0, 1, 2, 2, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])  # no anchor: 0
def test_supcon_traceable_loss_equals_the_indexed_one(labels):
    torch.manual_seed(2)
    y = torch.tensor(labels)
    z = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    for normalize in (True, False):
        a = supcon_loss(z, y, 0.1, normalize)
        b = supcon_loss(z, y, 0.1, normalize, traceable=True)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(torch.autograd.grad(a, z)[0], torch.autograd.grad(b, z)[0])


def test_rpcl_rows_mask_equals_indexing_out():
    """Samples outside ``rows`` add exactly 0 and no gradient; the rest as if indexed out (FedSC)."""
    torch.manual_seed(3)
    y = torch.tensor([0, 1, 1, 2, 4, 4, 6, 9])
    bank = torch.randn(7, 5, dtype=torch.float64)
    bank_labels = torch.tensor([0, 0, 1, 2, 2, 4, 7])  # classes 6 and 9: no positive
    rows = (bank_labels[None, :] == y[:, None]).any(1)
    z = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    u = torch.rand(7, dtype=torch.float64) + 0.5
    masked = rpcl_loss(z, y, bank, bank_labels, 0.1, u, rows)
    assert torch.equal(masked[~rows], torch.zeros(2, dtype=torch.float64))
    indexed = rpcl_loss(z[rows], y[rows], bank, bank_labels, 0.1, u)
    torch.testing.assert_close(masked[rows], indexed)
    g_masked = torch.autograd.grad(masked.sum(), z)[0]
    torch.testing.assert_close(g_masked, torch.autograd.grad(indexed.sum(), z)[0])
    assert torch.equal(g_masked[~rows], torch.zeros(2, 5, dtype=torch.float64))
