"""The daily loop (issue 54): a light `make demo` install, extending a finished run, did-you-mean on every
name a user types, the generated configuration page, single-split Hugging Face folders and the W&B read-back
the docs describe."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_main
from install_helpers import torch_requirement

ROOT = Path(__file__).resolve().parents[1]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


# ----- Makefile: `make demo` installs the core and torch only; `make test` the suite's extras too ----------


def make_dry(venv: Path, *targets: str) -> str:
    """`make -n TARGETS` (nothing runs) against the environment ``venv``: the commands it would run."""
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", *targets, f"VIRTUAL_ENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def fake_venv(tmp_path: Path, *stamps: str) -> Path:
    """An environment folder with a python and the given install stamps, newer than the files they depend on
    (the Makefile and pyproject.toml: in a working copy either may be newer than the other)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    newer = max((ROOT / name).stat().st_mtime for name in ("Makefile", "pyproject.toml")) + 60
    for stamp in stamps:
        (venv / stamp).touch()
        os.utime(venv / stamp, (newer, newer))
    return venv


def pip_lines(commands: str) -> list[str]:
    return [line for line in commands.splitlines() if " -m pip install" in line and "--index-url" not in line]


@needs_make
def test_make_demo_installs_the_core_and_torch_only(tmp_path):
    commands = make_dry(fake_venv(tmp_path), "demo")
    torch, core = pip_lines(commands)
    assert f'"{torch_requirement()}"' in torch and core.endswith("--disable-pip-version-check -e .")
    assert "[test" not in commands and commands.rstrip().endswith("fedpcd demo")


@needs_make
def test_make_test_after_a_demo_install_adds_the_test_extras_only(tmp_path):
    commands = make_dry(fake_venv(tmp_path, ".fedpcd-core-installed"), "test")
    (extras,) = pip_lines(commands)
    assert extras.endswith('-e ".[test,flower,docs,trackers,privacy,hf,cluster]"')
    assert "torch" not in commands.split("ruff check")[0]  # torch and the core stay as installed


@needs_make
def test_make_demo_after_make_test_installs_nothing(tmp_path):
    commands = make_dry(fake_venv(tmp_path, ".fedpcd-core-installed", ".fedpcd-installed"), "demo")
    assert commands.strip() == "fedpcd demo"


@needs_make
def test_make_test_shows_why_tests_were_skipped(tmp_path):
    commands = make_dry(fake_venv(tmp_path, ".fedpcd-core-installed", ".fedpcd-installed"), "test")
    assert " -m pytest -rs " in commands


@needs_make
@pytest.mark.parametrize("kind", ["unresolvable", "silent"])
def test_the_torch_fallback_says_whether_the_index_timed_out_or_failed_at_once(kind):
    with socket.socket() as server:  # accepts connections and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        host = "no-such-host.invalid" if kind == "unresolvable" else f"127.0.0.1:{server.getsockname()[1]}"
        index = f"http://{host}/whl/cpu"
        done = subprocess.run(  # PIP_INSTALL=true: pip is never run, the installed torch is reported
            ["make", "-s", "--no-print-directory", "torch", f"VIRTUAL_ENV={sys.prefix}", "PIP_INSTALL=true"]
            + [f"TORCH_CPU_INDEX={index}", "TORCH_INDEX_TIMEOUT=1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    first, then = done.stdout.splitlines()[0], f"{torch_requirement()} from the default index"
    if kind == "silent":
        assert first == f"torch: {index} did not answer within 1 s: {then}"
    else:
        assert first.startswith(f"torch: {index} failed at once (") and first.endswith(f"): {then}")
        assert "within" not in first


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git clone")
def test_what_the_readmes_report_commands_write_in_a_clone_is_ignored_by_git():
    readme = (ROOT / "README.md").read_text()
    outs = {
        line.split("--out ", 1)[1].split()[0]
        for line in readme.splitlines()
        if "fedpcd report " in line and "--out " in line
    }
    assert "board.md" in outs
    for out in outs:  # the report's markdown and the folder of its figures beside it
        paths = [out, f"{out.removesuffix('.md')}/curves.png"]
        done = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
        assert done.stdout.split() == paths, out


# ----- did-you-mean on every name a user types ------------------------------------------------------------


def fedpcd_cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`fedpcd ARGV` from ``cwd``, through the command's entry point in this process."""
    return cli_main(list(argv), cwd)


def test_did_you_mean_names_the_near_names_the_nearest_first():
    from fedpcd.errors import did_you_mean

    assert did_you_mean("fedgella", ["ditto", "fedgela"]) == " (did you mean 'fedgela'?)"
    assert did_you_mean("fedavgg", ["fedag", "fedavg", "qrst"]) == " (did you mean 'fedavg' or 'fedag'?)"
    three = " (did you mean 'fedprox', 'fedpro' or 'fedpr'?)"  # at most three
    assert did_you_mean("fedproxx", ["fedp", "fedpr", "fedpro", "fedprox"]) == three
    assert did_you_mean("zzz", ["fedavg"]) == "" and did_you_mean(3, ["fedavg"]) == ""


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["algorithm.name=fedgella"], "unknown algorithm 'fedgella' (did you mean 'fedgela'"),
        (["dataset.name=fmnst"], "unknown dataset 'fmnst' (did you mean 'fmnist'"),
        (["model.name=simplecn"], "unknown model 'simplecn' (did you mean 'simplecnn' or 'simplecnn_bn'?)"),
        (
            ["partition.scheme=dirichet"],
            "unknown partition scheme 'dirichet' (did you mean 'dirichlet'?); valid",
        ),
        (
            ["engine.exector=auto"],
            "unknown config key 'engine.exector' (did you mean 'executor'?); valid keys",
        ),
        (["rouds=3"], "unknown config key 'rouds' (did you mean 'rounds'?); valid keys here: seed, "),
        (
            ["algorithm.name=fedgela", "algorithm.scal=2"],
            "unknown parameter 'scal' for algorithm 'fedgela' (did you mean 'scale'?); valid",
        ),
        (
            ["algorithm.name=fedgela", "algorithm.preset=papr"],
            "unknown preset 'papr' for algorithm 'fedgela' (did you mean 'paper'?)",
        ),
        (["--config", "exampel"], "no shipped config has that name either (did you mean 'example'?) ("),
    ],
)
def test_a_mistyped_name_is_answered_with_the_near_names(tmp_path, argv, said):
    done = fedpcd_cli("config", "show", *argv, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert said in line and line.startswith("fedpcd: error: ")


def test_list_of_an_unknown_name_groups_the_near_names_by_kind(tmp_path):
    done = fedpcd_cli("list", "exampel", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("fedpcd: error: unknown name 'exampel'; did you mean configs: example? (")
    done = fedpcd_cli("list", "fedgella", cwd=tmp_path)
    assert done.stderr.startswith("fedpcd: error: unknown name 'fedgella'; did you mean algorithms: fedgela,")
    done = fedpcd_cli("list", "zzzz", cwd=tmp_path)
    assert "no component or shipped config has it or a name near it" in done.stderr


# ----- extending a run: fedpcd run --resume DIR rounds=N ---------------------------------------------------

TINY = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "clients=3", "local.epochs=1"]


def records(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock times (which differ between equal runs)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


@pytest.mark.parametrize(
    "setting",
    [
        # round 2 had the full personal test as the last; a 4-round run tests round 2's split only
        ["personal_full_every=3"],
        # round 2 was evaluated as the last; a 4-round run evaluates rounds 3 and 4 only
        ["eval_every=3", "personal_test=split"],
    ],
)
def test_a_run_extended_with_rounds_n_equals_a_run_of_n_rounds_from_the_start(tmp_path, setting):
    short, full = tmp_path / "short", tmp_path / "full"
    for run, rounds in ((short, 2), (full, 4)):
        done = fedpcd_cli("run", "-q", *TINY, *setting, f"rounds={rounds}", f"output_dir={run}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    done = fedpcd_cli("run", "-q", "--resume", str(short), "rounds=4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert records(short) == records(full) and [r["round"] for r in records(full)][-1] == 4
    assert (short / "config.yaml").read_text() == (full / "config.yaml").read_text().replace(
        str(full), str(short)
    )
    summary = json.loads((short / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["final"]["round"] == 4


def test_extending_takes_more_rounds_only_and_a_finished_run_says_so(tmp_path):
    run = tmp_path / "run"
    assert fedpcd_cli("run", "-q", *TINY, "rounds=2", f"output_dir={run}", cwd=tmp_path).returncode == 0
    before = (run / "config.yaml").read_text()
    done = fedpcd_cli("run", "--resume", str(run), cwd=tmp_path)
    assert done.returncode == 0 and f"{run}: already finished (2 rounds)" in done.stderr
    for rounds in (1, 2):
        done = fedpcd_cli("run", "--resume", str(run), f"rounds={rounds}", cwd=tmp_path)
        assert done.returncode == 2
        said = f"rounds={rounds} does not extend {run}: it has run 2 rounds; give more than 2"
        assert done.stderr == f"fedpcd: error: {said}\n"
    done = fedpcd_cli("run", "--resume", str(run), "seed=3", cwd=tmp_path)
    assert done.returncode == 2 and "of the overrides only rounds=N" in done.stderr
    assert (run / "config.yaml").read_text() == before
    # the flag takes keys and KEY=VALUE items alike: `rounds` is a key, `rounds=3` sets it
    done = fedpcd_cli(
        "run", "-q", "--resume", str(run), "--allow-config-change", "rounds", "rounds=3", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert [r["round"] for r in records(run)] == [1, 2, 3]
    done = fedpcd_cli(
        "run", "-q", "--resume", str(run), "--allow-config-change", "engine.threads=1", cwd=tmp_path
    )
    assert done.returncode == 0 and "threads: 1" in (run / "config.yaml").read_text()


def test_an_algorithm_whose_rounds_depend_on_the_total_is_not_extended(tmp_path):
    import fedpcd

    run, babu = tmp_path / "run", ["algorithm.name=fedbabu", "algorithm.finetune_when=last_round"]
    assert (
        fedpcd_cli("run", "-q", *TINY, *babu, "rounds=1", f"output_dir={run}", cwd=tmp_path).returncode == 0
    )
    before = records(run)
    use = "finetune_when=last_round fine-tunes in the last of the total rounds"
    with pytest.raises(fedpcd.UserError, match=f"'fedbabu' cannot go on with rounds 1 -> 2: {use}, so"):
        fedpcd.run(run, resume=True, rounds=2)
    assert records(run) == before


def test_which_algorithms_depend_on_the_total_rounds():
    from fedpcd.algorithms import ALGORITHMS, build_algorithm

    assert build_algorithm("fedkd").total_rounds_use() is not None  # T(t) rises over the total rounds
    assert build_algorithm("fedkd", {"t_start": 0.9, "t_end": 0.9}).total_rounds_use() is None
    assert build_algorithm("fedbabu").total_rounds_use() is None  # fine-tunes every round
    others = [n for n in ALGORITHMS.names() if n not in ("fedkd", "fedbabu")]
    assert all(build_algorithm(n).total_rounds_use() is None for n in others)


# ----- docs/configuration.md: generated from the schema, checked here ---------------------------------------


def test_the_configuration_page_is_the_one_generated_from_the_schema():
    from fedpcd.config_docs import configuration_page

    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == configuration_page(), (
        "docs/configuration.md is stale: regenerate it (fedpcd.config_docs.write_page)"
    )


def test_the_configuration_page_has_every_key_of_the_schema_once():
    from pydantic import BaseModel

    from fedpcd.config import Config
    from fedpcd.config_docs import configuration_page

    def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            members = [info.annotation, *getattr(info.annotation, "__args__", ())]
            section = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)
            out += keys(section, f"{prefix}{name}.") if section is not None else [f"{prefix}{name}"]
        return out

    page = configuration_page()
    rows = [line.split("`")[1] for line in page.splitlines() if line.startswith("| `")]
    assert "dataset.train_fraction" in rows and "privacy.noise_multiplier" in rows and "local.lr" in rows
    assert sorted(set(keys(Config)) - {"privacy.secagg"}) == sorted(set(rows) - {"privacy.secagg"})
    assert len(rows) == len(set(rows))
    assert "``" not in page and ":func:" not in page
    nav = (ROOT / "mkdocs.yml").read_text()
    assert "  - Configuration: configuration.md\n" in nav


def test_a_schema_key_without_a_description_fails_the_page():
    from pydantic import Field

    from fedpcd import config_docs
    from fedpcd.config import Config

    class Undescribed(Config):
        new_key: int = Field(1, ge=0)

    with pytest.raises(ValueError, match="config key new_key has no description"):
        config_docs._tables(Undescribed, "", "Top-level keys", "")


def test_docstring_markup_is_shown_plain_on_the_command_line(tmp_path):
    from fedpcd.utils import plain_text

    assert plain_text("``head_epochs`` of :func:`fedpcd.run` and :class:`~fedpcd.Config`") == (
        "`head_epochs` of `fedpcd.run` and `fedpcd.Config`"
    )
    for argv in (["--help"], ["list"], ["list", "fedbabu"], ["list", "configs"]):
        done = fedpcd_cli(*argv, cwd=tmp_path)
        assert done.returncode == 0 and "``" not in done.stdout and ":func:" not in done.stdout, argv


# ----- reading an offline W&B run back as docs/trackers.md says (no network) -------------------------------


def test_the_documented_ways_to_read_an_offline_wandb_run_back_work(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("pandas")
    from doc_blocks import blocks

    run = tmp_path / "runs" / "sweep" / "RUN"
    argv = [
        "run",
        "-q",
        *TINY,
        "rounds=2",
        "personal_full_every=1",
        "tracking.loggers=[wandb]",
        f"output_dir={run}",
    ]
    assert fedpcd_cli(*argv, cwd=tmp_path).returncode == 0
    section = [
        b for b in blocks("docs/trackers.md") if "offline-run-*" in b.code or "metrics.jsonl" in b.code
    ]
    python = next(b.code for b in section if b.lang == "python")
    bash = next(b.code for b in section if b.lang == "bash" and "leet inspect" in b.code)
    expected = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    env = {"pd": __import__("pandas")}
    monkeypatch.chdir(tmp_path)  # the docs' paths are relative, as in a user's project folder
    exec(compile(python.replace("history[", "got = history["), "trackers.md", "exec"), env)
    assert env["got"].to_dict() == {r["round"]: r["global_acc"] for r in expected}

    history_line, summary_line = [line for line in bash.splitlines() if line.strip()]
    wandb_bin = str(Path(sys.executable).parent)
    shell = {**os.environ, "PATH": f"{wandb_bin}:{os.environ['PATH']}", "WANDB_MODE": "offline"}
    out = subprocess.run(history_line, shell=True, cwd=tmp_path, env=shell, capture_output=True, text=True)
    items = [json.loads(line)["history"]["item"] for line in out.stdout.splitlines()]
    assert [i["_step"] for i in items] == [r["round"] for r in expected]
    for item, record in zip(items, expected, strict=True):  # every logged number is the record's
        numbers = {k: v for k, v in item.items() if not k.startswith("_")}
        assert numbers and all(record[k] == v for k, v in numbers.items()), numbers
    summary = subprocess.run(
        summary_line, shell=True, cwd=tmp_path, env=shell, capture_output=True, text=True
    )
    assert summary.returncode == 0 and str(expected[-1]["global_acc"])[:6] in summary.stdout


# ----- hf: datasets saved as one split; images that are not square ----------------------------------------


def test_the_test_split_carved_from_one_split_is_a_sixth_of_each_class_and_fixed():
    import numpy as np

    from fedpcd.data.hf import carve_test

    labels = np.array(["a"] * 12 + ["b"] * 7 + ["c"] * 2 + ["d"])
    held = carve_test(labels)
    assert held.tolist() == sorted(set(held.tolist())) and carve_test(labels).tolist() == held.tolist()
    counts = {c: int((labels[held] == c).sum()) for c in "abcd"}
    assert counts == {
        "a": 2,
        "b": 1,
        "c": 1,
        "d": 0,
    }  # round(n / 6), at least one of two or more, none of one


def test_a_single_split_folder_loads_with_the_carved_test_split(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import numpy as np

    from fedpcd.data.hf import carve_test, load_hub_dataset

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    labels = [c for c in range(3) for _ in range(12)]
    images = [np.full((4, 4), 7 * i, dtype=np.uint8) for i in range(len(labels))]  # image i: value 7 * i
    features = datasets.Features(
        {"image": datasets.Array2D((4, 4), "uint8"), "label": datasets.ClassLabel(num_classes=3)}
    )
    datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(
        str(tmp_path / "me" / "one")
    )
    ds = load_hub_dataset("me/one", tmp_path, download=False)
    held = carve_test(np.array(labels).astype(str))
    assert ds.test_x[:, 0, 0, 0].tolist() == [7 * i for i in held.tolist()]
    assert ds.test_y.tolist() == [labels[i] for i in held] and ds.test_y.bincount().tolist() == [2, 2, 2]
    assert len(ds.train_y) == 30 and ds.train_y.bincount().tolist() == [10, 10, 10]


def test_non_square_images_are_refused_with_the_reason(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import numpy as np

    from fedpcd.data.hf import load_hub_dataset
    from fedpcd.errors import UserError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    part = datasets.Dataset.from_dict(
        {"image": [np.zeros((4, 6), dtype=np.uint8)] * 4, "label": [0, 1, 0, 1]}
    )
    datasets.DatasetDict({"train": part, "test": part}).save_to_disk(str(tmp_path / "me" / "wide"))
    with pytest.raises(UserError, match=r"images are 6x4 \(width x height\); fedpcd needs square images"):
        load_hub_dataset("me/wide", tmp_path, download=False)
