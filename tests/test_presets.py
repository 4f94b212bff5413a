"""algorithm.preset: each preset resolves to its documented values, a key the config sets wins, an unknown
name is one UserError line, the run's config.yaml records the preset and every resolved value, and
`fedpcd list` shows the presets."""

from __future__ import annotations

import pytest
import yaml

from fedpcd.algorithms.presets import apply_preset, presets_of
from fedpcd.api import describe
from fedpcd.config import config_from_dict, config_yaml, load_config
from fedpcd.errors import UserError

FIVE = ("fedgela", "fedmr", "fednh", "fedsc", "fedssa")


def _value(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


def _all_presets():
    return [(name, preset) for name in FIVE for preset in presets_of(name)]


def test_each_of_the_five_methods_has_a_paper_and_an_official_preset():
    for name in FIVE:
        assert {"paper", "official"} <= set(presets_of(name)), name
    assert set(presets_of("fedsc")) == {"paper", "official", "code_intended"}


@pytest.mark.parametrize(("name", "preset"), _all_presets())
def test_a_preset_resolves_to_its_values_and_is_recorded(name, preset):
    config = load_config(None, [f"algorithm.name={name}", f"algorithm.preset={preset}"])
    data = config.to_dict()
    assert data["algorithm"]["preset"] == preset
    for key, value in presets_of(name)[preset].values.items():
        assert _value(data, key) == value, key
    assert "preset" not in config.algorithm.params()  # never passed to the algorithm
    assert config_from_dict(yaml.safe_load(config_yaml(config))).to_dict() == data  # config.yaml reruns as is


def test_the_documented_settings():
    def resolved(name: str, preset: str) -> dict:
        return load_config(None, [f"algorithm.name={name}", f"algorithm.preset={preset}"]).to_dict()

    ssa = resolved("fedssa", "official")
    assert (ssa["clients"], ssa["participation"]) == (50, 0.2)
    assert ssa["algorithm"]["t_stable"] == 45 and ssa["algorithm"]["aggregation"] == "cached_all"
    local = ssa["local"]
    assert (local["lr"], local["weight_decay"], local["grad_clip"]) == (0.005, 5e-5, 50.0)
    assert resolved("fedssa", "paper")["algorithm"]["t_stable"] == 2
    sc = resolved("fedsc", "official")
    assert sc["algorithm"]["compat_official"] and sc["algorithm"]["cpdr_dist"] == "self_mse"
    assert (sc["local"]["lr"], sc["local"]["momentum"], sc["participation"]) == (0.1, 0.0, 0.5)
    intended = resolved("fedsc", "code_intended")["algorithm"]
    paper = resolved("fedsc", "paper")["algorithm"]
    assert intended == {**paper, "preset": "code_intended", "cpdr_dist": "mse_mean"}
    assert resolved("fedmr", "official")["algorithm"]["weighting"] == "batches"
    assert resolved("fedmr", "paper")["algorithm"]["weighting"] == "samples"
    assert 31.6 <= resolved("fedgela", "paper")["algorithm"]["scale"] <= 1000  # sqrt(E_W), E_W 1e3..1e6
    assert resolved("fedgela", "official")["local"]["grad_clip"] == 20.0


def test_a_key_the_config_sets_wins_over_the_preset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: {name: fedssa, preset: official, t_stable: 3}\nclients: 12\n")
    data = load_config(path, ["local.lr=0.02"]).to_dict()
    assert (data["algorithm"]["t_stable"], data["clients"], data["local"]["lr"]) == (3, 12, 0.02)
    assert (data["participation"], data["local"]["grad_clip"]) == (0.2, 50.0)  # the rest from the preset
    # without a preset nothing is filled in
    assert apply_preset({"algorithm": {"name": "fedssa"}}) == {"algorithm": {"name": "fedssa"}}
    assert load_config(None, ["algorithm.name=fedssa"]).to_dict()["local"]["lr"] == 0.01


def test_an_unknown_preset_is_one_line_naming_the_valid_ones():
    with pytest.raises(UserError) as err:
        load_config(None, ["algorithm.name=fedsc", "algorithm.preset=offical"])
    assert str(err.value) == (
        "unknown preset 'offical' for algorithm 'fedsc' (did you mean 'official'?); valid presets: "
        "code_intended, official, paper"
    )
    with pytest.raises(UserError, match="^unknown preset 'paper' for algorithm 'fedavg'; valid presets: "):
        load_config(None, ["algorithm.preset=paper"])


def test_list_shows_the_presets_and_what_each_sets():
    text = describe("fedsc")
    assert "presets (set as algorithm.preset=<name>" in text
    for preset in ("paper", "official", "code_intended"):
        assert f"\n  {preset}: " in text
    assert "algorithm.cpdr_dist=self_mse" in text and "participation=0.5" in text
    assert "presets" not in describe("fedavg")
