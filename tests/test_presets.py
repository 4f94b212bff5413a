"""algorithm.preset: each preset resolves to its documented values, a key the config sets wins, an unknown
name is one UserError line, the run's config.yaml records the preset and every resolved value, and
`fedpcd list` shows the presets."""

from __future__ import annotations

import json

import pytest
import yaml

from fedpcd.api import describe
from fedpcd.config_identity import config_yaml
from fedpcd.errors import UserError
from fedpcd.presets import apply_preset, presets_of
from fedpcd.resolve import config_from_dict, load_config

FIVE = ("fedgela", "fedmr", "fednh", "fedsc", "fedssa")


def _value(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


def _all_presets():
    from fedpcd.algorithms import ALGORITHMS

    return [(name, preset) for name in ALGORITHMS.names() for preset in presets_of(name)]


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
    assert "presets" not in describe("fedprox")  # FedAvg's presets are not its subclasses'
    assert "\n  fedadam: FedAdam: server Adam" in describe("fedavg")


# ----- precedence, the warning, the record and the label (config files and the command line) ---------------

TINY = [
    "dataset.name=synthetic",
    "model.name=mlp",
    "model.hidden=16",
    "clients=3",
    "rounds=1",
    "local.epochs=1",
]


def _warnings(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("fedpcd: warning: preset ")]


def test_the_example_and_inits_file_leave_every_preset_key_to_the_preset(tmp_path, monkeypatch, capsys):
    """`--config example` (and the file `fedpcd init` writes) + a preset resolve to the preset's values,
    with no warning: the example's keys are commented out."""
    from fedpcd.cli import main
    from fedpcd.cli_args import INIT_FILE

    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    capsys.readouterr()
    for source in ("example", INIT_FILE):
        for name, preset in (("fedgela", "official"), ("fednh", "official"), ("fedssa", "official_hetero")):
            argv = ["--config", source, f"algorithm.name={name}", f"algorithm.preset={preset}"]
            assert main(["config", "show", *argv]) == 0
            out = capsys.readouterr()
            assert "warning" not in out.err
            shown = yaml.safe_load(out.out)
            for key, value in presets_of(name)[preset].values.items():
                assert _value(shown, key) == value, (source, name, key)


def test_a_file_or_override_that_pins_preset_keys_is_one_warning_line_naming_each(tmp_path, capsys):
    """The four layers, lowest first: defaults < preset < config file < command line; each preset key given
    another value is named with the preset's value, the one used and where it came from (through the CLI)."""
    from fedpcd.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(
        "algorithm: {name: fedgela, preset: official}\n"
        "local: {weight_decay: 0.001, grad_clip: 3.0, lr_decay: 0.5}\n"
        "seed: 4\n"
    )
    argv = ["--config", str(path), "local.grad_clip=7", "local.batch_size=64"]
    assert main(["config", "show", *argv]) == 0
    out = capsys.readouterr()
    shown = yaml.safe_load(out.out)
    assert shown["local"]["momentum"] == 0.9 and shown["personal_full_every"] == 5  # defaults
    assert shown["algorithm"]["scale"] == 5.0 and shown["rounds"] == 400  # the preset's (defaults 2.0, 20)
    assert (shown["seed"], shown["local"]["lr_decay"], shown["local"]["weight_decay"]) == (
        4,
        0.5,
        0.001,
    )  # file
    assert shown["local"]["grad_clip"] == 7.0  # the command line's, over the file's 3 and the preset's 20
    # batch_size 64 is the preset's value: not an override; lr_decay and seed are no preset keys
    assert out.err.splitlines() == [
        "fedpcd: warning: preset fedgela/official: local.weight_decay=0.0001 overridden by 0.001 (config "
        "file), local.grad_clip=20.0 overridden by 7.0 (command line)"
    ]
    argv = [
        "--config",
        "example",
        "algorithm.name=fedgela",
        "algorithm.preset=official",
        "local.grad_clip=null",
    ]
    assert main(["config", "show", *argv]) == 0
    assert _warnings(capsys) == [
        "fedpcd: warning: preset fedgela/official: local.grad_clip=20.0 overridden by null (command line)"
    ]


def test_a_sweep_warns_once_per_distinct_set_of_overrides(tmp_path, capsys):
    from fedpcd.sweep.grid import expand_sweep

    path = tmp_path / "s.yaml"
    path.write_text(
        "local: {weight_decay: 0.001}\n"
        f"output_dir: {tmp_path / 'runs'}\n"
        "sweep:\n"
        "  algorithm: [{name: fedgela, preset: official}, {name: fedgela, preset: paper}, {name: fedavg}]\n"
        "  seed: [0, 1, 2]\n"
    )
    assert len(expand_sweep(path, ["local.epochs=2"])) == 9
    assert _warnings(capsys) == [
        "fedpcd: warning: preset fedgela/official: local.weight_decay=0.0001 overridden by 0.001 (config "
        "file), local.epochs=10 overridden by 2 (command line)",
        "fedpcd: warning: preset fedgela/paper: local.weight_decay=0.0001 overridden by 0.001 (config file), "
        "local.epochs=10 overridden by 2 (command line)",
    ]


def test_preset_overrides_and_the_label_of_old_and_new_runs():
    from fedpcd.labels import method_overrides, preset_overrides, run_label

    def resolved(*overrides: str) -> dict:
        return load_config(
            None, ["algorithm.name=fedgela", "algorithm.preset=official", *overrides]
        ).to_dict()

    assert preset_overrides(resolved()) == {} and run_label(resolved()) == "fedgela preset=official"
    config = resolved("rounds=3", "local.grad_clip=null", "algorithm.scale=8")
    assert preset_overrides(config) == {
        "algorithm.scale": (5.0, 8.0),
        "local.grad_clip": (20.0, None),
        "rounds": (400, 3),
    }
    assert method_overrides(config) == ["algorithm.scale", "local.grad_clip"]  # rounds: the protocol's
    assert run_label(config) == "fedgela preset=official (overrides algorithm.scale, local.grad_clip)"
    assert run_label(resolved("rounds=3", "clients=4")) == "fedgela preset=official"
    assert run_label(load_config(None, ["algorithm.name=fedgela"]).to_dict()) == "fedgela"
    # an archived run's config.yaml, written before the presets set rounds: the same computation
    archived = yaml.safe_load(config_yaml(load_config(None, ["algorithm.name=fedgela"])))
    archived["algorithm"] = {**archived["algorithm"], "preset": "official"}
    assert set(preset_overrides(archived)) >= {"algorithm.scale", "local.grad_clip", "rounds"}


def test_a_run_records_its_preset_and_logs_the_warning_and_the_report_names_the_override(tmp_path, capsys):
    from fedpcd.cli import main
    from fedpcd.report.grid import build_grid
    from fedpcd.report.read import load_runs

    common = [*TINY, "algorithm.name=fedgela", "algorithm.preset=official", "engine.workers=1"]
    assert main(["-q", "run", *common, f"output_dir={tmp_path / 'a'}"]) == 0
    assert main(["-q", "run", *common, "local.grad_clip=null", f"output_dir={tmp_path / 'b'}"]) == 0
    warned = _warnings(capsys)
    assert len(warned) == 2 and "local.grad_clip=20.0 overridden by null (command line)" in warned[1]
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["preset"]["name"] == "official"
    assert summary["preset"]["sets"] == presets_of("fedgela")["official"].values
    assert summary["preset"]["overridden"]["local.grad_clip"] == [20.0, None]
    assert summary["preset"]["overridden"]["clients"] == [10, 3]
    log = (tmp_path / "b" / "run.log").read_text()
    assert "WARNING " + warned[1].removeprefix("fedpcd: warning: ") in log
    assert "local.grad_clip" not in (tmp_path / "a" / "run.log").read_text()
    grid = build_grid(load_runs(tmp_path))
    assert grid.methods == ["fedgela preset=official", "fedgela preset=official (overrides local.grad_clip)"]
    assert main(["-q", "run", *TINY, "engine.workers=1", f"output_dir={tmp_path / 'fedavg'}"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    labels = [
        "| fedavg",
        "| fedgela preset=official",
        "| fedgela preset=official (overrides local.grad_clip)",
    ]
    assert set(labels) <= set(rows)  # the overriding run has a row of its own, named so


def test_fedssa_official_hetero_carries_its_model_list_and_list_says_why_keys_are_unset():
    hetero = load_config(None, ["algorithm.name=fedssa", "algorithm.preset=official_hetero"])
    assert hetero.model.name == ["cnn1", "cnn2", "cnn3", "cnn4", "cnn5"]  # client k: CNN-((k mod 5) + 1)
    assert (hetero.rounds, hetero.clients, hetero.participation) == (500, 10, 1.0)
    text = describe("fedssa")
    assert "\n    leaves rounds unset: " in text and "\n    leaves model.name unset: " in text
    readme = load_config(None, ["algorithm.name=fedgela", "algorithm.preset=official_readme"]).to_dict()
    assert readme["algorithm"]["scale"] == 1.0e5 and (readme["rounds"], readme["clients"]) == (100, 50)


@pytest.mark.parametrize(("name", "preset"), _all_presets())
def test_every_preset_sets_its_protocol_or_says_why_not(name, preset):
    from fedpcd.presets import PROTOCOL

    spec = presets_of(name)[preset]
    for key in PROTOCOL:
        assert (key in spec.values) != (key in spec.unset), (name, preset, key)  # one or the other
    assert all(why.strip() for why in spec.unset.values())


def test_archived_preset_runs_resolve_as_they_were_written():
    """An archived run's config.yaml is fully resolved: the presets' new protocol keys change nothing in it
    (its resume and rerun), though its label now names the method keys its config overrode."""
    from pathlib import Path

    from fedpcd.config_identity import canonical_config, run_setting
    from fedpcd.labels import run_label
    from fedpcd.resolve import load_run_config

    runs = Path(__file__).resolve().parents[1] / "docs" / "results" / "runs" / "headline-fedssa-fmnist"
    folders = sorted(runs.glob("fedssa-preset*_seed0"))
    assert len(folders) == 2  # official and paper
    for folder in folders:
        written = yaml.safe_load((folder / "config.yaml").read_text())
        config = load_run_config(folder / "config.yaml")
        assert run_setting(config.to_dict()) == run_setting(written)
        assert config.rounds == 30  # not the preset's 500
        assert canonical_config(load_config(folder / "config.yaml")) == canonical_config(config)
        assert run_label(written).startswith(f"fedssa preset={written['algorithm']['preset']}")


def test_labels_and_the_code_comparison_import_without_torch():
    """The docs renderer reads labels and code records of many runs: importing them loads no torch."""
    import subprocess
    import sys

    code = (
        "import sys; from fedpcd.labels import preset_overrides, run_label; "
        "from fedpcd.run_format import comparable; "
        "assert run_label({'algorithm': {'name': 'fedavg'}}) == 'fedavg'; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_fedavgm_and_fedadam_are_fedavg_presets_that_set_the_server_optimiser(tmp_path):
    """FedAvg's presets set the server optimiser at Reddi et al.'s EMNIST CR values; a run under one equals a
    run with those keys given; no subclass of FedAvg inherits them, and FedGE declares FedGELA's."""
    from fedpcd.api import run

    assert set(presets_of("fedavg")) == {"fedavgm", "fedadam"}
    assert presets_of("fedprox") == {} and presets_of("scaffold") == {}
    assert presets_of("fedge") == presets_of("fedgela")
    adam = load_config(None, ["algorithm.preset=fedadam"]).server
    assert (adam.optimizer, adam.lr, adam.tau, adam.beta1, adam.beta2) == ("adam", 10**-2.5, 1e-4, 0.9, 0.99)
    momentum = load_config(None, ["algorithm.preset=fedavgm"]).server
    assert (momentum.optimizer, momentum.lr, momentum.momentum) == ("momentum", 10**-0.5, 0.9)
    tiny = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in [*TINY, "rounds=2"])}
    preset = run(algorithm__preset="fedadam", output_dir=str(tmp_path / "preset"), **_api(tiny))
    given = {f"server__{k.split('.')[1]}": v for k, v in presets_of("fedavg")["fedadam"].values.items()}
    explicit = run(output_dir=str(tmp_path / "explicit"), **given, **_api(tiny))
    plain = run(output_dir=str(tmp_path / "plain"), **_api(tiny))
    columns = ["global_acc", "personal_acc"]
    assert preset.metrics[columns].equals(explicit.metrics[columns])
    assert not preset.metrics[columns].equals(plain.metrics[columns])


def _api(dotted: dict) -> dict:
    """``{"dataset.name": ...}`` as the API's keyword overrides (``dataset__name``)."""
    return {key.replace(".", "__"): value for key, value in dotted.items()}
