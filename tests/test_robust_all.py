"""aggregation.robust over every quantity a server averages (engine/robust.py): FedNH's prototypes and
FedGELA's model stay in the honest clients' range under a poisoning client, Krum and Multi-Krum pick what
Blanchard et al. (2017) pick on a hand-made case, and what cannot apply is refused in one line."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import TINY_SYNTHETIC, run_records
from fedpcd.algorithms.statedict import coordinate_median, trimmed_mean
from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import build_federation
from fedpcd.engine.robust import krum_pick, krum_scores, robust_aggregate, robust_rows
from fedpcd.engine.tasks import payloads_for
from fedpcd.resolve import load_config

TINY = [
    *TINY_SYNTHETIC,
]


def _round(name: str, extra: list[str]):
    """(config, algorithm, server, the five clients' replies to round 1)."""
    config = load_config(None, [*TINY, "clients=5", f"algorithm.name={name}", *extra])
    fed = build_federation(config)
    algorithm = fed.new_algorithm()
    server = algorithm.init_server(fed.model_for(0, fresh=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = LocalExecutor(fed, states={}).train(
            algorithm, payloads_for(algorithm, dict(server), range(5)), 1, False
        )
    return config, algorithm, server, [r.update for r in results]


def _within(value: torch.Tensor, honest: torch.Tensor, slack: float = 1e-6) -> bool:
    """Each coordinate of ``value`` within the range of ``honest``'s (up to a mean's float rounding)."""
    return bool(
        (value <= honest.max(0).values + slack).all() and (value >= honest.min(0).values - slack).all()
    )


@pytest.mark.parametrize("robust", ["median", "trimmed_mean"])
def test_a_poisoning_client_does_not_move_fednh_prototypes_beyond_the_honest_range(robust):
    """Every holder's class mean becomes the per-class robust row, inside the honest holders' range per
    coordinate; the prototypes are FedNH's own update from those rows; the body and scale stay in range.
    The plain aggregate, with the poisoner's huge counts, follows the poisoner instead."""
    extra = [f"aggregation.robust={robust}", "aggregation.trim=0.2", "partition.classes_per_client=10"]
    config, algorithm, server, replies = _round("fednh", extra)
    poison = dict(replies[0])
    poison["class_means"] = -torch.ones_like(poison["class_means"])
    poison["class_counts"] = poison["class_counts"] * 10**6
    poison["scale"] = poison["scale"] * 1000
    poison["model"] = {k: v * 1000 for k, v in poison["model"].items()}
    bad = [poison, *replies[1:]]
    honest = replies[1:]
    reduce = coordinate_median if robust == "median" else lambda s: trimmed_mean(s, 0.2)
    screened = robust_rows(bad, "class_means", reduce, algorithm.ctx.num_classes)
    for c in range(algorithm.ctx.num_classes):
        rows = torch.stack([r["class_means"][r["classes"].tolist().index(c)] for r in honest])
        for r in screened:
            assert _within(r["class_means"][r["classes"].tolist().index(c)], rows)
    new = robust_aggregate(config, dict(server), bad, algorithm)
    plain = algorithm.aggregate(dict(server), bad)
    toward = torch.nn.functional.cosine_similarity(new["prototypes"], -torch.ones_like(new["prototypes"]))
    plain_toward = torch.nn.functional.cosine_similarity(
        plain["prototypes"], -torch.ones_like(new["prototypes"])
    )
    assert (toward < plain_toward).all()
    clean = robust_aggregate(config, dict(server), honest, algorithm)["prototypes"]
    assert (torch.nn.functional.cosine_similarity(new["prototypes"], clean) > 0.99).all()
    assert _within(new["scale"], torch.stack([r["scale"] for r in honest]))
    for key, value in new["model"].items():
        assert _within(value, torch.stack([r["model"][key] for r in honest]))


def test_fednh_prototypes_are_its_own_update_of_the_robust_rows():
    config, algorithm, server, replies = _round("fednh", ["aggregation.robust=median"])
    screened = robust_rows(replies, "class_means", coordinate_median, algorithm.ctx.num_classes)
    expected = algorithm.update_prototypes(server["prototypes"], screened)
    assert torch.equal(robust_aggregate(config, dict(server), replies, algorithm)["prototypes"], expected)


def test_a_poisoning_client_does_not_move_fedgela_model_beyond_the_honest_range():
    config, algorithm, server, replies = _round("fedgela", ["aggregation.robust=median"])
    poison = dict(replies[0])
    poison["model"] = {k: v * 1000 for k, v in poison["model"].items()}
    poison["proj"] = {k: v * 1000 for k, v in poison["proj"].items()}
    poison["weight"] = 10.0**9
    bad, honest = [poison, *replies[1:]], replies[1:]
    new = robust_aggregate(config, dict(server), bad, algorithm)
    plain = algorithm.aggregate(dict(server), bad)
    for part in ("model", "proj"):
        for key, value in new[part].items():
            values = torch.stack([r[part][key] for r in honest])
            assert _within(value, values)
            if part == "model" and value.is_floating_point():
                assert not _within(plain[part][key], values)


def test_krum_and_multi_krum_pick_by_hand():
    """Models w = 0, 1, 3, 10, 11, n = 5, f = 1: each score sums the n - f - 2 = 2 least squared distances:
    0: 1 + 9 = 10; 1: 1 + 4 = 5; 3: 4 + 9 = 13; 10: 1 + 49 = 50; 11: 1 + 64 = 65. Krum picks w = 1;
    Multi-Krum with m = 3 averages 1, 0, 3: 4/3."""
    values = [0.0, 1.0, 3.0, 10.0, 11.0]
    vectors = torch.tensor(values, dtype=torch.float64)[:, None]
    assert krum_scores(vectors, 1).tolist() == [10.0, 5.0, 13.0, 50.0, 65.0]
    assert krum_pick(vectors, 1) == [1]
    assert krum_pick(vectors, 1, 3) == [1, 0, 2]
    replies = [{"model": {"w": torch.tensor([v])}, "num_samples": 1 + i} for i, v in enumerate(values)]
    server = {"model": {"w": torch.zeros(1)}}
    krum = load_config(None, ["clients=5", "aggregation.robust=krum", "aggregation.byzantine=1"])
    assert robust_aggregate(krum, dict(server), replies)["model"]["w"].item() == 1.0
    multi = load_config(
        None,
        [
            "clients=5",
            "aggregation.robust=multi_krum",
            "aggregation.byzantine=1",
            "aggregation.krum_select=3",
        ],
    )
    assert robust_aggregate(multi, dict(server), replies)["model"]["w"].item() == pytest.approx(4 / 3)
    # the default m = n - f = 4: the four least scores 1, 0, 3, 10 (uniform, not by num_samples)
    default = load_config(None, ["clients=5", "aggregation.robust=multi_krum", "aggregation.byzantine=1"])
    assert robust_aggregate(default, dict(server), replies)["model"]["w"].item() == pytest.approx(14 / 4)


@pytest.mark.parametrize("name", ["fedgela", "fedmr", "fednh", "fedsc", "fedssa"])
def test_robust_runs_end_to_end_for_each_paper_method(name, tmp_path):
    from fedpcd.cli import main

    robust = "trimmed_mean" if name == "fedssa" else "krum"
    out = tmp_path / name
    args = [*TINY, "clients=4", "rounds=1", f"algorithm.name={name}", f"aggregation.robust={robust}"]
    assert main(["run", "--quiet", *args, f"output_dir={out}"]) == 0
    assert len(run_records(out)) == 1


def test_what_krum_cannot_apply_to_is_refused_in_one_line(capsys):
    from fedpcd.cli import main

    cases = [
        (
            ["clients=4", "aggregation.robust=krum", "aggregation.byzantine=1"],
            "needs more than 2f+2=4 clients",
        ),
        (
            ["clients=5", "aggregation.robust=multi_krum", "aggregation.krum_select=6"],
            "krum_select=6 is more",
        ),
        (["clients=5", "algorithm.name=fedssa", "aggregation.robust=krum"], "'fedssa' averages no model"),
        (["clients=5", "algorithm.name=scaffold", "aggregation.robust=median"], "aggregates its own way"),
    ]
    for args, message in cases:
        assert main(["run", *TINY, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_robust_rows_reduce_each_class_over_its_holders_in_both_upload_formats():
    """Class 0 is held by all three replies (rows 1, 2, 100: median 2), class 1 by the first two (rows 5, 7:
    median 6), class 2 by the third only (its own row 9); rows aligned with ``classes`` or, with a mask,
    one per class."""
    listed = [
        {"classes": torch.tensor([0, 1]), "w": torch.tensor([[1.0], [5.0]])},
        {"classes": torch.tensor([1, 0]), "w": torch.tensor([[7.0], [2.0]])},
        {"classes": torch.tensor([0, 2]), "w": torch.tensor([[100.0], [9.0]])},
    ]
    out = robust_rows(listed, "w", coordinate_median, 3)
    assert [r["w"].flatten().tolist() for r in out] == [[2.0, 6.0], [6.0, 2.0], [2.0, 9.0]]
    assert listed[0]["w"].flatten().tolist() == [1.0, 5.0]  # the replies themselves are untouched
    masked = [
        {"mask": torch.tensor([True, True, False]), "w": torch.tensor([[1.0], [5.0], [0.0]])},
        {"mask": torch.tensor([True, True, False]), "w": torch.tensor([[2.0], [7.0], [0.0]])},
        {"mask": torch.tensor([True, False, True]), "w": torch.tensor([[100.0], [0.0], [9.0]])},
    ]
    out = robust_rows(masked, "w", coordinate_median, 3)
    assert [r["w"].flatten().tolist() for r in out] == [[2.0, 6.0, 0.0], [2.0, 6.0, 0.0], [2.0, 0.0, 9.0]]
