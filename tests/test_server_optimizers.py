"""server.optimizer (engine/server_opt.py): FedAvgM's and FedOpt's updates on tiny tensors against the papers'
equations computed by hand, the default unchanged, the state in the checkpoint (a resumed run equals an
uninterrupted one), and the algorithms it cannot apply to refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY_SYNTHETIC, run_records
from fedpcd.backends import run_experiment
from fedpcd.engine.rundir import RunDir
from fedpcd.engine.server_opt import STATE, server_step
from fedpcd.resolve import load_config

TINY = [
    *TINY_SYNTHETIC,
    "clients=3",
]


def _two_rounds(optimizer: str, extra: list[str]) -> list[float]:
    """w after two server steps from w = 1, the aggregates being 3 (Delta_1 = 2) and then w_1 - 1
    (Delta_2 = -1)."""
    config = load_config(None, [f"server.optimizer={optimizer}", *extra])
    server = {"model": {"w": torch.tensor([1.0], dtype=torch.float64), "n": torch.tensor([7])}}
    out = []
    for delta in (2.0, -1.0):
        before = server["model"]
        aggregated = {"w": before["w"] + delta, "n": torch.tensor([8])}
        server = server_step(config, before, {**server, "model": aggregated})
        assert torch.equal(server["model"]["n"], torch.tensor([8]))  # integer buffers: the aggregate's
        out.append(server["model"]["w"].item())
    return out


def test_sgd_is_a_scaled_step_and_plain_averaging_is_untouched():
    assert _two_rounds("sgd", ["server.lr=0.5"]) == [2.0, 1.5]  # 1 + 0.5 * 2; 2 + 0.5 * -1
    config = load_config(None, [])
    server = {"model": {"w": torch.ones(1)}}
    assert server_step(config, {"w": torch.zeros(1)}, server) is server  # defaults: nothing computed


def test_momentum_is_fedavgm():
    """Hsu et al. 2019: v <- beta v + Delta; w <- w + lr v (their Delta is the negative): beta 0.9, lr 0.5:
    v = 2, w = 2; v = 0.9 * 2 - 1 = 0.8, w = 2 + 0.4 = 2.4."""
    assert _two_rounds("momentum", ["server.lr=0.5", "server.momentum=0.9"]) == pytest.approx([2.0, 2.4])


# Reddi et al. 2021, Algorithm 2, with eta 0.1, beta1 0.9, beta2 0.99, tau 0.01 (v_{-1} = tau^2 = 1e-4):
# round 1 (Delta 2): m = 0.2; round 2 (Delta -1, w_1 from round 1): m = 0.9 * 0.2 - 0.1 = 0.08
ADAPTIVE = ["server.lr=0.1", "server.beta1=0.9", "server.beta2=0.99", "server.tau=0.01"]


def _expected(v1: float, v2: float) -> list[float]:
    w1 = 1.0 + 0.1 * 0.2 / (math.sqrt(v1) + 0.01)
    return [w1, w1 + 0.1 * 0.08 / (math.sqrt(v2) + 0.01)]


def test_fedadagrad():
    v1 = 1e-4 + 4.0  # v + Delta^2
    assert _two_rounds("adagrad", ADAPTIVE) == pytest.approx(_expected(v1, v1 + 1.0), rel=1e-12)


def test_fedadam():
    v1 = 0.99 * 1e-4 + 0.01 * 4.0  # beta2 v + (1 - beta2) Delta^2
    assert _two_rounds("adam", ADAPTIVE) == pytest.approx(_expected(v1, 0.99 * v1 + 0.01 * 1.0), rel=1e-12)


def test_fedyogi():
    # v - (1 - beta2) Delta^2 sign(v - Delta^2): v below Delta^2 both times (1e-4 < 4, 0.0401 < 1): it grows
    v1 = 1e-4 + 0.01 * 4.0
    v2 = v1 + 0.01 * 1.0
    assert _two_rounds("yogi", ADAPTIVE) == pytest.approx(_expected(v1, v2), rel=1e-12)


def test_the_optimizer_state_is_checkpointed_so_a_resumed_run_equals_an_uninterrupted_one(
    tmp_path, monkeypatch
):
    args = [*TINY, "rounds=3", "server.optimizer=adam", "server.lr=0.05"]
    run_experiment(load_config(None, [*args, f"output_dir={tmp_path / 'full'}"]), progress=False)
    original = RunDir.append

    def crash_in_round_3(self, record):
        if record["round"] == 3:
            raise KeyboardInterrupt
        original(self, record)

    monkeypatch.setattr(RunDir, "append", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_config(None, [*args, f"output_dir={tmp_path / 'cut'}"]), progress=False)
    monkeypatch.setattr(RunDir, "append", original)
    state = RunDir(tmp_path / "cut").load_checkpoint(torch.device("cpu"))
    assert state["round"] == 2 and set(state["server"][STATE]) <= set(state["server"]["model"])
    assert all(set(moments) == {"m", "v"} for moments in state["server"][STATE].values())

    from fedpcd.backends import resume_run

    resume_run(tmp_path / "cut", progress=False)
    assert run_records(tmp_path / "cut") == run_records(tmp_path / "full")
    plain = run_experiment(
        load_config(None, [*TINY, "rounds=3", f"output_dir={tmp_path / 'plain'}"]), progress=False
    )
    assert plain["final"]["global_acc"] is not None
    assert run_records(tmp_path / "plain") != run_records(tmp_path / "full")  # the optimiser did step


@pytest.mark.parametrize("name", ["fednh", "fedgela", "fedmr", "fedsc"])
def test_the_paper_methods_that_average_a_model_run_with_a_server_optimizer(name, tmp_path):
    args = [*TINY, "rounds=2", f"algorithm.name={name}", "server.optimizer=yogi", "server.lr=0.01"]
    run_experiment(load_config(None, [*args, f"output_dir={tmp_path / name}"]), progress=False)
    assert len(run_records(tmp_path / name)) == 2


def test_algorithms_without_a_mean_model_update_are_refused_in_one_line(capsys):
    from fedpcd.cli import main

    for name in ("fedssa", "scaffold", "feddyn"):
        assert main(["run", *TINY, f"algorithm.name={name}", "server.optimizer=momentum"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"algorithm {name!r} does not take its model as a mean" in err[0], err
        assert "fedavg" in err[0] and "fednh" in err[0]
    assert main(["run", *TINY, "server.optimizer=adam_w"]) == 2
    assert "server.optimizer" in capsys.readouterr().err


def test_fedpcd_list_shows_the_new_keys_with_their_descriptions(capsys):
    from fedpcd.cli import main

    for section, keys in {
        "server": ["optimizer", "lr", "momentum", "beta1", "beta2", "tau"],
        "aggregation": ["robust", "byzantine", "krum_select"],
        "privacy": ["stats_clip", "count_clip"],
    }.items():
        assert main(["list", section]) == 0
        out = capsys.readouterr().out
        for key in keys:
            (line,) = [row for row in out.splitlines() if row.startswith(f"{section}.{key} ")]
            assert len(line.split()) > 3  # key, type, default, then its description
