"""DP over every upload of the five paper methods (engine/privacy.py): the declared class statistics are
bounded exactly as stated, noised with the stated std, every released quantity enters one accountant
composition per round, and a DP run of each method reports its epsilon in summary.json and the CLI's table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import TINY_SYNTHETIC
from fedpcd.algorithms import ALGORITHMS, build_algorithm
from fedpcd.algorithms.context import Upload
from fedpcd.engine.privacy import (
    add_noise,
    bound_uploads,
    clip_update,
    coverage_table,
    epsilon,
    mechanisms,
    noise_uploads,
    stat_bounds,
)
from fedpcd.resolve import load_config

PAPER = ["fedgela", "fedmr", "fednh", "fedsc", "fedssa"]
TINY = [
    *TINY_SYNTHETIC,
    "clients=4",
    "participation=0.75",
    "rounds=2",
]
DP = ["privacy.clip=1.0", "privacy.noise_multiplier=1.3", "privacy.delta=0.01"]


@pytest.mark.parametrize("name", PAPER)
def test_a_dp_run_of_each_paper_method_reports_its_epsilon_in_the_summary_and_the_cli_table(
    name, tmp_path, capsys
):
    from fedpcd.cli import main

    out = tmp_path / name
    assert main(["run", "--quiet", *TINY, *DP, f"algorithm.name={name}", f"output_dir={out}"]) == 0
    config = load_config(None, [*TINY, *DP, f"algorithm.name={name}"])
    count = mechanisms(build_algorithm(name, config.algorithm.params()))
    # model, class means, counts; FedGELA: the model (projection joined); FedSSA: weight and bias rows
    assert count == {"fedgela": 1, "fedssa": 2}.get(name, 3)
    want = epsilon(4, 3, 1.3, 2, 0.01, count)
    final = json.loads(Path(out, "summary.json").read_text())["final"]
    assert final["dp_epsilon"] == want
    printed = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["DP", "epsilon", f"{want:.4g}", "-"] in printed


def test_fednh_counts_its_released_statistics_per_hyperparameters():
    """The uniform_paper weighting uploads no counts; a fixed scale is public (sent back as received); FedMR
    without prototypes (mu2 0) uploads no class statistics."""
    assert mechanisms(build_algorithm("fednh", {"proto_weighting": "count_code"})) == 3
    assert mechanisms(build_algorithm("fednh", {"proto_weighting": "uniform_paper"})) == 2
    fixed = build_algorithm("fednh", {"learn_scale": False}).upload_bounds()
    assert [u.kind for u in fixed if u.key == "scale"] == ["public"]
    assert mechanisms(build_algorithm("fedmr", {"mu2": 0.0})) == 1


def test_epsilon_is_dp_accountings_for_the_composition_of_every_released_quantity():
    """The round's k Gaussian mechanisms (noise multiplier sigma/2 each) composed inside one sampling event,
    computed here with dp-accounting directly; and the composition equals one Gaussian of multiplier
    sigma/(2 sqrt(k)), the analytic identity of composed Gaussians."""
    dpa = pytest.importorskip("dp_accounting")
    clients, sampled, sigma, rounds, delta = 20, 5, 1.7, 7, 1e-4
    for k in (1, 2, 3):
        acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        inner = dpa.ComposedDpEvent([dpa.GaussianDpEvent(sigma / 2)] * k)
        acc.compose(dpa.SampledWithoutReplacementDpEvent(clients, sampled, inner), rounds)
        direct = acc.get_epsilon(delta)
        assert epsilon(clients, sampled, sigma, rounds, delta, k) == pytest.approx(direct, rel=1e-9)
        single = epsilon(clients, sampled, sigma / math.sqrt(k), rounds, delta)
        assert epsilon(clients, sampled, sigma, rounds, delta, k) == pytest.approx(single, rel=1e-9)
    assert epsilon(clients, sampled, sigma, rounds, delta, 3) > epsilon(
        clients, sampled, sigma, rounds, delta, 2
    )


def _bounds(stats: float = 1.0, counts: float = 1.0, classes: int = 3):
    config = load_config(None, [f"privacy.stats_clip={stats}", f"privacy.count_clip={counts}"])
    return stat_bounds(config, classes)


def test_class_statistics_are_written_for_every_class_and_clipped_per_row_on_tiny_inputs():
    uploads = (
        Upload("classes", "classes", ""),
        Upload("class_counts", "counts", ""),
        Upload("class_means", "rows", ""),
        Upload("weight", "fixed", ""),
    )
    reply = {
        "classes": torch.tensor([2, 0]),
        "class_counts": torch.tensor([3, 4]),
        "class_means": torch.tensor([[0.3, 0.4], [6.0, 8.0]]),  # norms 0.5 (kept) and 10 (to 1)
        "weight": 17.0,
    }
    out, clipped = bound_uploads(reply, uploads, _bounds())
    assert clipped
    assert torch.equal(out["classes"], torch.arange(3))
    assert torch.allclose(out["class_means"], torch.tensor([[0.6, 0.8], [0.0, 0.0], [0.3, 0.4]]))
    assert torch.allclose(out["class_counts"], torch.tensor([4.0, 0.0, 3.0]) / 5.0)  # L2 5 -> 1
    assert out["weight"] == 1
    mask = {"mask": torch.tensor([True, False, False]), "w": torch.tensor([[0.1], [0.0], [0.0]])}
    kinds = (Upload("mask", "classes", ""), Upload("w", "rows", ""))
    masked, clipped = bound_uploads(mask, kinds, _bounds())
    assert not clipped and torch.equal(masked["mask"], torch.ones(3, dtype=torch.bool))
    assert torch.equal(masked["w"], mask["w"])


def test_a_model_kind_upload_is_clipped_together_with_the_model():
    """FedNH's scale shares the model's bound: the update (3, 0 | 4) of norm 5 is scaled to norm 1."""
    reply = {
        "model": {"w": torch.tensor([3.0, 0.0])},
        "scale": torch.tensor(5.0),
        "classes": torch.tensor([1]),
        "class_means": torch.tensor([[0.0, 2.0]]),
        "class_counts": torch.tensor([9]),
        "num_samples": 9,
        "train_loss": 0.5,
    }
    payload = {"model": {"w": torch.zeros(2)}, "scale": torch.tensor(1.0)}
    out, clipped = clip_update(reply, payload, 1.0, "fednh", _bounds(stats=0.5, counts=3.0, classes=2))
    assert clipped and out["num_samples"] == 1
    assert torch.allclose(out["model"]["w"], torch.tensor([0.6, 0.0]))
    assert torch.allclose(out["scale"], torch.tensor(1.8))
    assert torch.allclose(out["class_means"], torch.tensor([[0.0, 0.0], [0.0, 0.5]]))
    assert torch.allclose(out["class_counts"], torch.tensor([0.0, 3.0]))


def test_the_noise_on_each_statistic_has_its_stated_std():
    """rows: sigma * stats_clip * sqrt(C); counts: sigma * count_clip (away from the clamp at 0); the
    model-kind server value: sigma * C / m like the model. Empirical std over many draws, within 3%."""
    classes, dim = 4, 5000
    config = load_config(
        None,
        [
            "privacy.clip=2.0",
            "privacy.noise_multiplier=1.5",
            "privacy.stats_clip=0.5",
            "privacy.count_clip=3",
        ],
    )
    uploads = (Upload("means", "rows", ""), Upload("counts", "counts", ""))
    reply = {"means": torch.zeros(classes, dim), "counts": torch.full((20000,), 1000.0)}
    noisy = noise_uploads(reply, uploads, config, rnd=1, client=2, num_classes=classes)
    assert noisy["means"].std().item() == pytest.approx(1.5 * 0.5 * math.sqrt(classes), rel=0.03)
    assert noisy["counts"].std().item() == pytest.approx(1.5 * 3.0, rel=0.03)
    again = noise_uploads(reply, uploads, config, rnd=1, client=2, num_classes=classes)
    assert torch.equal(again["means"], noisy["means"])  # seeded by (seed, round, client)
    other = noise_uploads(reply, uploads, config, rnd=1, client=3, num_classes=classes)
    assert not torch.equal(other["means"], noisy["means"])
    low = noise_uploads({"counts": torch.zeros(100)}, uploads, config, rnd=1, client=0, num_classes=classes)
    assert (low["counts"] >= 0).all()  # clamped: a count is never negative
    server = {"model": {"w": torch.zeros(10)}, "scale": torch.zeros(40000)}
    joined = add_noise(server, config, rnd=1, kept=4, joined=["scale"])
    assert joined["scale"].std().item() == pytest.approx(1.5 * 2.0 / 4, rel=0.03)


def test_privacy_doc_table_is_generated_from_the_declarations():
    """docs/privacy.md holds the table coverage_table() writes, and every paper method is covered in it."""
    doc = (Path(__file__).parents[1] / "docs" / "privacy.md").read_text()
    table = coverage_table()
    assert table in doc
    for name in PAPER:
        assert f"| {name} | - | - | refused" not in table
        assert all(f"| {name} | {u.key} |" in table for u in ALGORITHMS.get(name).uploads)


def test_client_and_server_clipping_give_the_same_fednh_run(tmp_path):
    """The class statistics are bounded by the same function wherever the clipping happens, and noised on
    the server either way: the two runs are bitwise equal but for the bytes uploaded."""
    from conftest import run_records
    from fedpcd.backends import run_experiment

    for where in ("client", "server"):
        args = [
            *TINY,
            *DP,
            "algorithm.name=fednh",
            f"privacy.clipping={where}",
            f"output_dir={tmp_path / where}",
        ]
        run_experiment(load_config(None, args), progress=False)
    client, server = run_records(tmp_path / "client"), run_records(tmp_path / "server")
    # a clipping client sends its statistics for all C classes, the server-clipped one as it computed them
    assert all(c.pop("bytes_up") > s.pop("bytes_up") for c, s in zip(client, server, strict=True))
    assert client == server
