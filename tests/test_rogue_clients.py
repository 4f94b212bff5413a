"""A client whose reply the server cannot aggregate fails its round (left out as engine.min_clients allows),
it never stops the run nor weighs itself up: the server checks each reply against what it sent and knows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import run_records
from fedpcd.algorithms import ALGORITHMS, FedAvg
from fedpcd.backends import run_experiment
from fedpcd.engine.guard import reply_problem
from fedpcd.engine.tasks import payloads_for
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "clients=4", "rounds=3"]


@dataclass
class RogueFedAvg(FedAvg):
    """FedAvg whose client 1 sends, in round 2, the reply ``how`` names (``raise``: it fails honestly)."""

    how: str = "raise"

    def end_local(self, model, data, work, loss):
        reply, state = super().end_local(model, data, work, loss)
        if data.id != 1 or work.round != 2:
            return reply, state
        if self.how == "raise":
            raise ValueError("an honest failure")
        if self.how == "huge_weight":
            reply["num_samples"] = 10**12
            reply["model"] = {k: torch.zeros_like(v) for k, v in reply["model"].items()}
        elif self.how == "negative_weight":
            reply["num_samples"] = -(10**6)
        elif self.how == "wrong_shape":
            key = next(iter(reply["model"]))
            reply["model"][key] = torch.zeros(3, 3)
        elif self.how == "not_a_tensor":
            key = next(iter(reply["model"]))
            reply["model"][key] = "poison"
        elif self.how == "no_count":
            del reply["num_samples"]
        return reply, state


@pytest.fixture
def rogue():
    name = "_rogue_fedavg"
    ALGORITHMS.register(name)(RogueFedAvg)
    yield name
    ALGORITHMS.unregister(name)


def _run(tmp_path, name: str, how: str) -> list[dict]:
    out = tmp_path / how
    run_experiment(
        load_config(None, [*SMALL, f"algorithm.name={name}", f"algorithm.how={how}", f"output_dir={out}"])
    )
    return run_records(out)


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("huge_weight", "num_samples 1000000000000 is not the client's"),
        ("negative_weight", "num_samples -1000000 is not the client's"),
        ("wrong_shape", "is torch.float32 (3, 3), the server sent torch.float32"),
        ("not_a_tensor", "is a str, not a tensor"),
        ("no_count", "the reply has no 'num_samples'"),
    ],
)
def test_a_rogue_reply_is_a_failed_client_not_a_crash_nor_a_poison(tmp_path, rogue, capsys, how, reason):
    honest_failure = _run(tmp_path, rogue, "raise")
    capsys.readouterr()
    got = _run(tmp_path, rogue, how)
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "round 2: client 1 failed (InvalidReply: " in line)
    assert reason in line
    assert got[1]["left_out"] == [1]
    # the server aggregated exactly what it aggregates when client 1 fails: the rogue reply changed nothing
    for a, b in zip(got, honest_failure, strict=True):
        assert {k: v for k, v in a.items() if k != "bytes_up"} == {
            k: v for k, v in b.items() if k != "bytes_up"
        }


def test_reply_problem_on_tiny_inputs():
    sent = {"model": {"w": torch.zeros(2, 3), "n": torch.zeros((), dtype=torch.long)}}
    good = {"model": {"w": torch.ones(2, 3), "n": torch.ones((), dtype=torch.long)}, "num_samples": 5}
    assert reply_problem(good, sent, 5) is None
    assert reply_problem({**good, "num_samples": 5.0}, sent, 5) is None  # a number equal to the count
    assert "not the client's 5" in reply_problem({**good, "num_samples": 6}, sent, 5)
    assert "not the client's 5" in reply_problem({**good, "num_samples": True}, sent, 5)
    assert "torch.int32" in reply_problem(
        {**good, "model": {"n": torch.ones((), dtype=torch.int32)}}, sent, 5
    )
    assert "not a mapping" in reply_problem([1], sent, 5)
    assert "not a mapping of tensors" in reply_problem({**good, "model": [1]}, sent, 5)
    # a tensor the payload did not hold (an algorithm's own upload) is not the payload's to check
    assert reply_problem({**good, "model": {"extra": torch.ones(7)}}, sent, 5) is None


# ----- aggregation.robust: a well-formed poisoning update -------------------------------------------------


def test_coordinate_median_and_trimmed_mean_on_tiny_inputs():
    from fedpcd.algorithms.statedict import coordinate_median, trimmed_mean

    values = [(1.0, 0.0, 1), (2.0, 10.0, 2), (10.0, 3.0, 3), (100.0, -1.0, 7)]
    states = [{"w": torch.tensor([a, b]), "n": torch.tensor(n)} for a, b, n in values]
    median = coordinate_median(states)  # even count: the mean of the two middle values
    assert median["w"].tolist() == [6.0, 1.5] and median["n"].item() == 2  # round(2.5) = 2 (half to even)
    assert coordinate_median(states[:3])["w"].tolist() == [2.0, 3.0]
    trimmed = trimmed_mean(states, 0.25)  # drop 1 largest and 1 smallest per coordinate
    assert trimmed["w"].tolist() == [6.0, 1.5]
    assert trimmed_mean(states, 0.0)["w"].tolist() == [113.0 / 4, 12.0 / 4]  # no trim: the plain mean
    with pytest.raises(ValueError, match="needs more than 2 states"):
        trimmed_mean(states[:2], 0.5)


def test_a_poisoning_client_moves_the_mean_but_not_the_robust_aggregate():
    from fedpcd.engine.executor import LocalExecutor
    from fedpcd.engine.federation import build_federation
    from fedpcd.engine.robust import robust_aggregate

    config = load_config(None, [*SMALL, "clients=5", "aggregation.robust=median"])
    fed = build_federation(config)
    algorithm = fed.new_algorithm()
    server = algorithm.init_server(fed.model_for(0, fresh=True))
    replies = [
        r.update
        for r in LocalExecutor(fed, states={}).train(
            algorithm, payloads_for(algorithm, dict(server), range(5)), 1, False
        )
    ]
    honest = torch.stack([r["model"]["head.weight"] for r in replies[1:]])
    replies[0]["model"] = {k: v * 1000 for k, v in replies[0]["model"].items()}  # finite, well-formed
    mean = algorithm.aggregate(dict(server), replies)["model"]["head.weight"]
    robust = robust_aggregate(config, dict(server), replies)["model"]["head.weight"]
    assert (mean > honest.max(0).values).any() or (mean < honest.min(0).values).any()
    assert (robust <= honest.max(0).values).all() and (robust >= honest.min(0).values).all()


def test_robust_aggregation_runs_end_to_end_and_is_refused_where_it_does_not_apply(tmp_path, capsys):
    from fedpcd.cli import main

    out = tmp_path / "median"
    assert main(["run", "--quiet", *SMALL, "aggregation.robust=trimmed_mean", f"output_dir={out}"]) == 0
    assert len(run_records(out)) == 3
    capsys.readouterr()
    assert main(["run", *SMALL, "algorithm.name=scaffold", "aggregation.robust=median"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm 'scaffold' aggregates its own way; use it with one of: " in err[0]
    args = [*SMALL, "aggregation.robust=median", "privacy.clip=1.0", "privacy.noise_multiplier=1.0"]
    assert main(["run", *args, "privacy.delta=0.01", f"output_dir={tmp_path / 'dp'}"]) == 2
    assert "does not combine with privacy.secagg or privacy.noise_multiplier > 0" in capsys.readouterr().err
