"""Differential privacy with fixed clipping (engine/privacy.py): exact clipping, the noise's distribution,
client- and server-side clipping agreeing, what every algorithm uploads (covered or refused), the accountant's
epsilon against a published value, and what the run records."""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch
import yaml

from conftest import run_records, run_summary
from fedpcd.algorithms import ALGORITHMS, FedAvg, build_algorithm
from fedpcd.backends import run_experiment
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import build_federation
from fedpcd.engine.privacy import (
    COVERED,
    add_noise,
    check_privacy,
    clip_update,
    dp_epsilon,
    epsilon,
    mechanisms,
    uncovered,
)
from fedpcd.engine.tasks import payloads_for
from fedpcd.errors import UserError
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32", "clients=4"]


def test_clip_update_scales_a_long_update_to_the_bound_and_leaves_the_rest():
    payload = {"model": {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0]), "n": torch.tensor(3)}}
    model = {"w": torch.tensor([4.0, 1.0]), "b": torch.tensor([4.0]), "n": torch.tensor(7)}
    reply = {"model": model, "num_samples": 40, "train_loss": 0.5}
    clipped, was_long = clip_update(reply, payload, clip=1.0)  # update (3, 0, 4): norm 5
    assert was_long
    assert torch.allclose(clipped["model"]["w"], torch.tensor([1.6, 1.0]))
    assert torch.allclose(clipped["model"]["b"], torch.tensor([0.8]))
    assert (
        clipped["model"]["n"] == 7 and clipped["train_loss"] == 0.5
    )  # integer buffers, the loss as they were
    assert clipped["num_samples"] == 1  # fixed weights: n_k does not leave the client
    assert reply["model"]["w"][0] == 4.0 and reply["num_samples"] == 40  # the reply itself is not modified
    same, was_long = clip_update(reply, payload, clip=5.0)  # exactly at the bound: unchanged
    assert not was_long and same["model"] is model and same["num_samples"] == 1


def test_clipping_and_noise_scale_are_those_of_flowers_fixed_clipping_dp():
    """The same mechanism as Flower's fixed-clipping DP (``fixedclipping_mod`` and its server wrappers call
    ``compute_clip_model_update`` and ``compute_stdv``): in float64 the two clipped models agree to the
    rounding of a norm over n values (n * 2^-53 relative, n < 10^3 here)."""
    dp = pytest.importorskip("flwr.supercore.differential_privacy")
    gen = torch.Generator().manual_seed(0)
    old = {
        k: torch.randn(shape, generator=gen, dtype=torch.float64) for k, shape in [("w", (7, 5)), ("b", (5,))]
    }
    new = {k: v + torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in old.items()}
    for bound in (0.5, 2.0, 100.0):
        mine, _ = clip_update({"model": new}, {"model": old}, clip=bound)
        theirs = [v.numpy().copy() for v in new.values()]
        dp.compute_clip_model_update(theirs, [v.numpy() for v in old.values()], bound)
        for got, want in zip(mine["model"].values(), theirs, strict=True):
            assert torch.allclose(got, torch.from_numpy(want), rtol=1e-12, atol=1e-12)
    assert dp.compute_stdv(0.7, 2.0, 5) == 0.7 * 2.0 / 5  # add_noise's std: sigma * C / m


def test_clip_update_of_a_reply_without_a_model_or_with_more_is_one_line():
    with pytest.raises(UserError, match="privacy.clip needs an algorithm whose reply holds the model") as err:
        clip_update({"num_samples": 3}, {"model": {}}, clip=1.0, algorithm="a-plugin")
    assert "\n" not in str(err.value)
    reply = {"model": {"w": torch.zeros(2)}, "num_samples": 3, "prototypes": torch.zeros(2), "classes": [1]}
    with pytest.raises(
        UserError, match="'a-plugin' also uploads classes, prototypes beyond its model"
    ) as err:
        clip_update(reply, {"model": {"w": torch.zeros(2)}}, clip=1.0, algorithm="a-plugin")
    assert "\n" not in str(err.value)


def test_noise_has_the_configured_std_and_is_seeded_by_round():
    config = load_config(None, ["privacy.clip=0.5", "privacy.noise_multiplier=2", "seed=3"])
    zeros = {"model": {"w": torch.zeros(200, 100), "steps": torch.tensor(5)}}
    noisy = add_noise(zeros, config, rnd=1, kept=4)["model"]
    std = 2 * 0.5 / 4
    n = noisy["w"].numel()
    # the sample std of n normals is within a few 1/sqrt(2n) of the true one; 10% is > 10 such deviations
    assert abs(noisy["w"].std().item() / std - 1) < 0.1
    assert abs(noisy["w"].mean().item()) < 5 * std / math.sqrt(n)
    assert noisy["steps"] == 5  # integer tensors get no noise
    assert torch.equal(add_noise(zeros, config, rnd=1, kept=4)["model"]["w"], noisy["w"])  # seeded
    assert not torch.equal(add_noise(zeros, config, rnd=2, kept=4)["model"]["w"], noisy["w"])
    off = load_config(None, ["privacy.clip=0.5"])
    assert add_noise(zeros, off, rnd=1, kept=4) is zeros


def _server_model(run_dir):
    return torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)["server"]["model"]


def test_a_dp_run_adds_exactly_the_seeded_noise_to_the_aggregate_and_records_its_parameters(tmp_path):
    args = SMALL + ["rounds=1", "privacy.clip=0.5"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'clip'}"]), progress=False)
    noisy_cfg = load_config(None, args + ["privacy.noise_multiplier=1.5", f"output_dir={tmp_path / 'dp'}"])
    run_experiment(noisy_cfg, progress=False)
    clip_only, dp = _server_model(tmp_path / "clip"), _server_model(tmp_path / "dp")
    expected = add_noise({"model": clip_only}, noisy_cfg, rnd=1, kept=4)["model"]
    for k, v in dp.items():  # the same clipped aggregate, plus the round's noise draw
        assert torch.equal(v, expected[k])
    saved = yaml.safe_load((tmp_path / "dp" / "config.yaml").read_text())["privacy"]
    assert saved == {
        "clip": 0.5,
        "noise_multiplier": 1.5,
        "delta": 1e-5,
        "clipping": "client",
        "stats_clip": 1.0,
        "count_clip": 1.0,
        "secagg": None,
    }
    (record,) = run_records(tmp_path / "dp")
    assert 0 <= record["dp_clipped"] <= 4
    assert record["dp_epsilon"] == epsilon(4, 4, 1.5, 1, 1e-5)
    assert run_records(tmp_path / "clip")[0]["dp_epsilon"] is None  # clipping alone: no guarantee


def test_client_and_server_clipping_give_the_same_run_and_a_tight_bound_clips_every_update(tmp_path):
    args = SMALL + ["rounds=2", "privacy.clip=0.05", "privacy.noise_multiplier=0.3"]
    for side in ("client", "server"):
        run_experiment(
            load_config(None, args + [f"privacy.clipping={side}", f"output_dir={tmp_path / side}"]),
            progress=False,
        )
    client, server = run_records(tmp_path / "client"), run_records(tmp_path / "server")
    assert client == server
    assert [r["dp_clipped"] for r in client] == [4, 4]
    plain = tmp_path / "plain"
    run_experiment(load_config(None, SMALL + ["rounds=2", f"output_dir={plain}"]), progress=False)
    assert "dp_clipped" not in run_records(plain)[0]
    assert run_records(plain)[-1]["global_acc"] != client[-1]["global_acc"]


def test_noise_without_a_clipping_bound_is_refused_in_one_line():
    with pytest.raises(UserError, match="needs privacy.clip") as err:
        load_config(None, ["privacy.noise_multiplier=1"])
    assert "\n" not in str(err.value)


def test_the_server_averages_dp_updates_with_fixed_weights():
    """Under privacy.clip every reply reports 1 sample, so FedAvg's sample-weighted mean is the uniform mean
    that the noise sigma*C/m and the accounting assume (a client of 99 samples weighs as much as one of 1)."""
    payload = {"model": {"w": torch.zeros(2)}}
    replies = [
        clip_update({"model": {"w": torch.tensor([v, 0.0])}, "num_samples": n}, payload, clip=10.0)[0]
        for v, n in ((1.0, 1), (3.0, 99))
    ]
    server = FedAvg().aggregate(dict(payload), replies)
    assert torch.equal(server["model"]["w"], torch.tensor([2.0, 0.0]))


# ----- the accountant -------------------------------------------------------------------------------------


def test_epsilon_matches_the_published_gaussian_value():
    """Published value: dp-accounting's own test (google/differential-privacy, python/dp_accounting/
    dp_accounting/rdp/rdp_privacy_accountant_test.py, test_compute_epsilon_delta_gaussian) states that the
    Gaussian mechanism with noise multiplier 4.530877117 (noise std over sensitivity) is exactly
    (1, 1e-6)-DP. With every client in every round (q = 1) one round of DP-FedAvg is that mechanism on the
    sum of the clipped updates, whose sensitivity under replacing one client is 2C: so sigma = 2 * 4.530877117
    gives epsilon 1. r rounds compose like one Gaussian of noise multiplier sigma / sqrt(r)."""
    published = 4.530877117
    assert epsilon(10, 10, 2 * published, 1, 1e-6) == pytest.approx(1.0, rel=1e-4)
    assert epsilon(10, 10, 2 * published * math.sqrt(9), 9, 1e-6) == pytest.approx(1.0, rel=1e-4)


def test_epsilon_grows_with_rounds_and_shrinks_with_noise_and_sampling():
    full = [epsilon(100, 100, 1.0, r, 1e-5) for r in (1, 10, 100)]
    assert full[0] < full[1] < full[2]
    sampled = [epsilon(100, 10, 1.0, r, 1e-5) for r in (1, 10, 100)]
    assert all(s < f for s, f in zip(sampled, full, strict=True))  # privacy amplification by subsampling
    assert epsilon(100, 10, 2.0, 100, 1e-5) < sampled[2]
    assert epsilon(100, 10, 1.0, 100, 1e-3) < sampled[2]  # a larger delta buys a smaller epsilon
    # a noise multiplier whose square underflows: the library computes NaN or fails; no bound, never 0
    assert epsilon(10, 5, 1e-160, 1, 1e-5) == epsilon(10, 5, 1e-200, 1, 1e-5) == math.inf
    smallest = load_config(None, ["privacy.clip=1", "privacy.noise_multiplier=1.5e-45"])  # float32's
    # metrics.jsonl is strict JSON
    assert math.isfinite(dp_epsilon(smallest, 1000, smallest.clients, FedAvg()))


def test_a_dp_run_reports_an_increasing_epsilon_each_evaluated_round_and_in_the_summary(tmp_path):
    args = SMALL + ["rounds=3", "participation=0.5", "privacy.clip=0.5", "privacy.noise_multiplier=1"]
    run_experiment(load_config(None, args + ["privacy.delta=1e-4", f"output_dir={tmp_path}"]), progress=False)
    got = [r["dp_epsilon"] for r in run_records(tmp_path)]
    assert got == [epsilon(4, 2, 1.0, r, 1e-4) for r in (1, 2, 3)]
    assert 0 < got[0] < got[1] < got[2]
    assert run_summary(tmp_path)["final"]["dp_epsilon"] == got[-1]


def test_delta_must_be_below_one_over_the_clients():
    with pytest.raises(UserError, match=r"privacy.delta=0.3 is not below 1/clients=0.25") as err:
        check_privacy(
            load_config(None, SMALL + ["privacy.clip=1", "privacy.noise_multiplier=1", "privacy.delta=0.3"])
        )
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="privacy.delta"):
        load_config(None, ["privacy.delta=0"])


def test_noise_without_the_accountant_says_how_to_install_it(monkeypatch):
    config = load_config(None, SMALL + ["privacy.clip=1", "privacy.noise_multiplier=1"])
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting raises ImportError
    for call in (lambda: check_privacy(config), lambda: dp_epsilon(config, 1, 2, FedAvg())):
        with pytest.raises(UserError, match=r"pip install 'fedpcd\[privacy\]'") as err:
            call()
        assert "\n" not in str(err.value)
    check_privacy(load_config(None, SMALL + ["privacy.clip=1"]))  # clipping alone needs no accountant


# ----- coverage: every algorithm's uploads are covered, or it is refused -----------------------------------

FAST = {  # what an algorithm needs on this federation, and cuts of its long loops
    "creff": ["algorithm.retrain_epochs=1", "algorithm.match_steps=1", "algorithm.feats_per_class=2"],
    "fedetf": ["algorithm.finetune_rounds=0"],
    "fedkd": ["algorithm.shared_model=mlp"],
    "fml": ["algorithm.shared_model=mlp"],
    "fedbabu": ["algorithm.finetune_epochs=1"],
    "fedavg_ft": ["algorithm.finetune_epochs=1"],
    "fedbn": ["model.name=mlp_bn"],  # FedBN needs BatchNorm layers
}
TINY = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=64", "clients=3"]


def _args(name: str) -> list[str]:
    return [*TINY, f"algorithm.name={name}", *FAST.get(name, [])]


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_declares_what_it_uploads_and_keeps_beyond_the_model(name):
    """A round without DP: the reply keys beyond model/num_samples/train_loss are among the algorithm's
    ``extra_uploads`` (and there are some iff it declares some); without such uploads, the server state
    beyond the model is its ``extra_server_state`` (and the never-updated initial private part)."""
    fed = build_federation(load_config(None, _args(name)))
    algorithm = fed.new_algorithm()
    cls = type(algorithm)
    server = algorithm.init_server(fed.model_for(0, fresh=True))
    initial = dict(server.get("initial", {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = LocalExecutor(fed, states={}).train(
            algorithm, payloads_for(algorithm, server, [0, 1, 2]), 1, False
        )
    assert all(r.error is None for r in results), [r.error for r in results]
    extra = {k for r in results for k in r.update} - set(COVERED)
    assert extra <= set(cls.extra_uploads), f"{name} uploads {sorted(extra)}, declares {cls.extra_uploads}"
    assert bool(extra) == bool(cls.extra_uploads)
    server = algorithm.aggregate(server, [r.update for r in results])
    if not cls.extra_uploads:
        assert set(server) - {"model", "initial"} == set(cls.extra_server_state)
        assert all(torch.equal(v, server["initial"][k]) for k, v in initial.items())


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_under_dp_every_algorithm_runs_covered_or_is_refused_in_one_line(name, tmp_path):
    """Covered: a DP round runs, every reply holds only model/num_samples/train_loss, and it reports its
    epsilon. Refused: one line naming what the algorithm uploads (or keeps), from the config before any
    data is loaded (check_privacy) and again from the run itself (clip_update), with the algorithms that
    qualify."""
    dp = ["privacy.clip=1", "privacy.noise_multiplier=1", "rounds=1", f"output_dir={tmp_path / name}"]
    config = load_config(None, _args(name) + dp)
    why = uncovered(ALGORITHMS.get(name))
    if why is None:
        check_privacy(config)
        run_experiment(config, progress=False)
        (record,) = run_records(tmp_path / name)
        count = mechanisms(build_algorithm(name, config.algorithm.params()))
        assert record["dp_epsilon"] == epsilon(3, 3, 1.0, 1, 1e-5, count) and 0 <= record["dp_clipped"] <= 3
        return
    declared = ALGORITHMS.get(name).extra_uploads or ALGORITHMS.get(name).extra_server_state
    with pytest.raises(UserError, match=f"algorithm {name!r} (also uploads|keeps) ") as err:
        check_privacy(config)
    assert all(k in str(err.value) for k in declared)
    with pytest.raises(UserError, match=f"algorithm {name!r} (also uploads|keeps) ") as run_err:
        run_experiment(config, progress=False)  # what the run's first client sent
    for message in (str(err.value), str(run_err.value)):
        assert "\n" not in message and "choose one of: " in message and "fedavg" in message
