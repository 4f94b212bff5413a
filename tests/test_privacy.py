"""Differential privacy with fixed clipping (engine/privacy.py): exact clipping, the noise's distribution,
client- and server-side clipping agreeing, and what the run records."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from conftest import run_records
from fedpcd.config import load_config
from fedpcd.engine.privacy import add_noise, clip_update
from fedpcd.engine.simulation import run_local
from fedpcd.errors import UserError

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32", "clients=4"]


def test_clip_update_scales_a_long_update_to_the_bound_and_leaves_the_rest():
    payload = {"model": {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0]), "n": torch.tensor(3)}}
    reply = {"model": {"w": torch.tensor([4.0, 1.0]), "b": torch.tensor([4.0]), "n": torch.tensor(7)}, "k": 1}
    clipped, was_long = clip_update(reply, payload, clip=1.0)  # update (3, 0, 4): norm 5
    assert was_long
    assert torch.allclose(clipped["model"]["w"], torch.tensor([1.6, 1.0]))
    assert torch.allclose(clipped["model"]["b"], torch.tensor([0.8]))
    assert clipped["model"]["n"] == 7 and clipped["k"] == 1  # integer buffers and other keys as they were
    assert reply["model"]["w"][0] == 4.0  # the reply itself is not modified
    same, was_long = clip_update(reply, payload, clip=5.0)  # exactly at the bound: unchanged
    assert not was_long and same is reply


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


def test_clip_update_of_a_reply_without_a_model_is_one_line():
    with pytest.raises(UserError, match="privacy.clip needs an algorithm whose reply holds the model") as err:
        clip_update({"prototypes": torch.zeros(2)}, {"model": {}}, clip=1.0, algorithm="fedproto")
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
    run_local(load_config(None, args + [f"output_dir={tmp_path / 'clip'}"]), progress=False)
    noisy_cfg = load_config(None, args + ["privacy.noise_multiplier=1.5", f"output_dir={tmp_path / 'dp'}"])
    run_local(noisy_cfg, progress=False)
    clip_only, dp = _server_model(tmp_path / "clip"), _server_model(tmp_path / "dp")
    expected = add_noise({"model": clip_only}, noisy_cfg, rnd=1, kept=4)["model"]
    for k, v in dp.items():  # the same clipped aggregate, plus the round's noise draw
        assert torch.equal(v, expected[k])
    saved = yaml.safe_load((tmp_path / "dp" / "config.yaml").read_text())["privacy"]
    assert saved == {"clip": 0.5, "noise_multiplier": 1.5, "clipping": "client", "secagg": None}
    (record,) = run_records(tmp_path / "dp")
    assert 0 <= record["dp_clipped"] <= 4


def test_client_and_server_clipping_give_the_same_run_and_a_tight_bound_clips_every_update(tmp_path):
    args = SMALL + ["rounds=2", "privacy.clip=0.05", "privacy.noise_multiplier=0.3"]
    for side in ("client", "server"):
        run_local(
            load_config(None, args + [f"privacy.clipping={side}", f"output_dir={tmp_path / side}"]),
            progress=False,
        )
    client, server = run_records(tmp_path / "client"), run_records(tmp_path / "server")
    assert client == server
    assert [r["dp_clipped"] for r in client] == [4, 4]
    plain = tmp_path / "plain"
    run_local(load_config(None, SMALL + ["rounds=2", f"output_dir={plain}"]), progress=False)
    assert "dp_clipped" not in run_records(plain)[0]
    assert run_records(plain)[-1]["global_acc"] != client[-1]["global_acc"]


def test_noise_without_a_clipping_bound_is_refused_in_one_line():
    with pytest.raises(UserError, match="needs privacy.clip") as err:
        load_config(None, ["privacy.noise_multiplier=1"])
    assert "\n" not in str(err.value)
