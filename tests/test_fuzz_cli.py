"""Fuzzing the command line: random and malformed configs, overrides, run folders and paths never end in a
traceback.

Every case runs ``fedpcd.cli.main`` in-process (``partition``, ``sweep --dry-run``, a 1-round ``run`` on the
synthetic dataset, or ``report`` on a damaged copy of finished runs) and must return 0 or 2 with nothing but
one-line errors on stderr. The shapes include YAML alias bombs, deep nesting, huge numbers, NUL bytes and
invisible unicode (right-to-left override, zero-width space) in values and paths. The generator is seeded, so
a failure names a reproducible case.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedpcd.cli import main

RLO, ZWSP = "\u202e", "\u200b"  # right-to-left override, zero-width space
# Per key: a list of values, valid ones first (a "mostly valid" config picks those), or a nested section.
# (Integers of 5000 digits, which YAML cannot write from Python, come as text: MALFORMED and OVERRIDES.)
SPACE: dict[str, Any] = {
    "seed": [0, 3, -1, 1.5, "abc", 2**70, True, 1e39, 1e300, f"1{ZWSP}"],
    "dataset": {
        "name": ["synthetic", "bogus", 3, f"synthetic{ZWSP}", f"synth{RLO}etic", "synthetic\x00"],
        "root": [None, "/nonexistent", 5, "/tmp/a\x00b", f"/tmp/{RLO}x"],
        "train_fraction": [0.5, 0, 2, "x", float("nan"), 1e-320, 1e300],
        "download": [False, "yes", 2],
    },
    "partition": {
        "scheme": [
            "iid",
            "dirichlet",
            "pathological",
            "shards",
            "longtail",
            "fedssa",
            "explicit",
            "bogus",
            7,
            f"iid{RLO}",
        ],
        "beta": [0.5, -1, 0, float("inf"), "x", 1e39, 1e300],
        "classes_per_client": [2, 0, 11, -3, 2.5, "two", 2**70],
        "min_size": [0, 5, 10000, -1, 2**70],
        "shards_per_client": [2, 0, 1000, 1e39],
        "rho": [0.1, 10, 0, -5, 1e300],
        "then": [{"scheme": "iid"}, "x", {"scheme": "bogus"}, None],
        "path": ["/nope.json", 3, "/tmp/x\x00.json", f"/tmp/{ZWSP}.json"],
    },
    "clients": [3, 1, 0, -2, "x", 2.5, None, 10**6, 2**70, 1e39],
    "participation": [1.0, 0.5, 0, 1.5, "half", float("nan"), 1e-300],
    "rounds": [1, 0, -1, "x", 1.5, 2**70, 1e39],
    "model": {
        "name": ["mlp", "cnn1", "bogus", 3, ["mlp", "mlp"], [], f"m{RLO}lp", "mlp\x00"],
        "hidden": [8, 0, -4, "x", 2**70, 10**9],
        "clients": [{0: "mlp"}, {99: "mlp"}, "x", {"a": "b"}, {2**70: "mlp"}],
    },
    "local": {
        "epochs": [1, 0, "x", 2**70],
        "batch_size": [64, 0, -1, 1e39],
        "lr": [0.01, 0, -1, float("inf"), 1e6, "x", 1e39, 1e300, 1e-320],
        "lr_decay": [0.9, 0, 2],
        "momentum": [0.9, 1.0, -0.1],
        "weight_decay": [0.0, -1],
        "grad_clip": [None, 0, 10, -1],
    },
    "algorithm": {
        "name": [
            "fedavg",
            "fedprox",
            "fednh",
            "fedgela",
            "scaffold",
            "feddyn",
            "moon",
            "fedrod",
            "ditto",
            "x",
            3,
            f"fed{RLO}avg",
            f"fedavg{ZWSP}",
        ],
        "mu": [0.01, -1, "x", float("nan"), 1e39],
        "alpha": [0.1, float("inf"), "x"],
        "bogus_param": [1],
    },
    "eval_every": [1, 0, "x", 2**70],
    "personal_test": ["full", "split", "bogus"],
    "backend": ["local", "bogus"],
    "engine": {
        "executor": ["auto", "sequential", "bogus"],
        "threads": [1, 0, "x", 2**70],
        "checkpoint_every": [1, 0, -1],
        "on_divergence": ["stop", "drop", "bogus"],
        "min_clients": [1, 0, 99],
    },
}


def _laughs(where: str) -> bytes:
    """The 'billion laughs': nine levels of nine aliases each, 9^9 strings once expanded, under ``where``."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return ("\n".join(lines) + f"\n{where}\n").encode()


def _deep_block(levels: int) -> bytes:
    """Mappings nested ``levels`` deep, in block style."""
    return "".join(f"{'  ' * i}a:\n" for i in range(levels)).encode() + b"  " * levels + b"b: 1\n"


MALFORMED = [
    b"\xff\xfe\x00garbage",
    b"seed: [1, 2\n",
    b"- a\n- b\n",
    b"just a string",
    b"seed: 1\n\tclients: 2\n",
    b"a: &x [*x]\n",
    b"{" * 200,
    b"dataset: {name: synthetic}\ndataset: {name: mnist}\n",
    b"42",
    b"",
    b"~: 3\n",
    b"1: 2\n",
    b"partition: !!python/object:os.system 'echo hi'\n",
    b"sweep: {seed: [0, 1]}\nrounds: x\n",
    b"sweep: {seed: []}\n",
    b"sweep: 5\n",
    _laughs("algorithm: {name: fedavg, mu: *l8}"),
    _laughs("sweep: {seed: *l8}"),
    _laughs("model: {name: mlp, clients: *l8}"),
    b"seed: &s 1\nclients: *s\n",
    b"seed: " + b"[" * 10000 + b"]" * 10000 + b"\n",
    b"partition: " + b"{a: " * 5000 + b"1" + b"}" * 5000 + b"\n",
    _deep_block(200),
    b"seed: " + b"9" * 5000 + b"\n",
    b"clients: 1180591620717411303424\n",
    b"rounds: 1.0e+39\nlocal: {lr: 1.0e+300}\n",
    b"seed: 1e39\n",
    b'dataset: {name: "synthetic\\0"}\n',
    b'output_dir: "runs/a\\0b"\n',
    b"\x00\x00\x00",
    b"seed: 1\x00\n",
    f"algorithm: {{name: fed{RLO}avg}}\n".encode(),
    f"output_dir: runs/{RLO}{ZWSP}x\n".encode(),
    f"dataset:\n  name: synthetic\n  root: /tmp/{ZWSP}\n".encode(),
    "\ufeffseed: 1\n".encode(),
]

OVERRIDES = [
    "seed=-1",
    "seed=abc",
    "=",
    "a..b=1",
    ".x=1",
    "x.=1",
    "clients",
    "clients=",
    "rounds=1e9",
    "local.lr=inf",
    "local.lr=.nan",
    "partition.scheme=[1",
    "model=3",
    "algorithm=fedavg",
    "engine.min_clients=2",
    "algorithm.name=fedprox",
    "participation=0.5",
    "output_dir=",
    "local=5",
    "local.lr=1e6",
    "partition=iid",
    "engine.on_divergence=drop",
    "partition.scheme=dirichlet",
    "unknown.key=1",
    "seed=1.5",
    "rounds=0x10",
    "rounds=1.0e+39",
    "local.lr=1.0e+300",
    f"seed={2**70}",
    "seed=" + "9" * 5000,
    "clients=" + "9" * 5000,
    "seed=" + "[" * 10000 + "]" * 10000,
    "partition=" + "{a: " * 2000 + "1" + "}" * 2000,
    "seed=&a [1, 1, 1]",
    "model.clients=[&a [1, 1], *a, *a]",
    "output_dir=runs/a\x00b",
    "dataset.root=/tmp/\x00",
    "algorithm.name=fedavg\x00",
    f"algorithm.name=fed{RLO}avg",
    f"dataset.name=synthetic{ZWSP}",
    f"output_dir=runs/{RLO}x{ZWSP}",
    "seed=\x00",
    f"a{RLO}b=1",
    "se\x00ed=1",
]

RUN_FIX = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "rounds=1", "local.batch_size=64"]

# Output targets for --json / --plot / --out: fine, a folder, under a file, odd characters.
TARGETS = ["plain", "folder", "under-file", "nul", "rlo", "zero-width", "newline"]

# Replacements for one file of a finished run, for ``report``.
RUN_FILE_SHAPES: list[bytes | None] = [
    b"{}",
    b"[]",
    b"{bad",
    b"",
    b"null",
    b'{"rounds": "x", "wall_s": 1}',
    b'{"rounds": 1e39, "wall_s": 1e300}',
    b'{"rounds": 1180591620717411303424, "wall_s": 1}',
    b'{"rounds": ' + b"9" * 5000 + b', "wall_s": 1}',
    b"[" * 100000 + b"]" * 100000,
    b'{"round": 1, "global_acc": "x"}',
    b'{"round": 1, "global_acc": 1e400, "global_class_acc": [0.5, null, "x"]}',
    b'{"round": 1, "global_class_acc": [0.5]}\n{"round": 2, "global_class_acc": [0.5, 0.5]}',
    b'{"clients": [{"train_counts": [1, -2]}]}',
    b'{"clients": [{"train_counts": [' + b"9" * 5000 + b"]}]}",
    b"\x00\xff\xfe",
    b"a: 1\n",
    b"algorithm: 3\n",
    _laughs("algorithm: {name: fedavg, mu: *l8}"),
    b"seed: " + b"[" * 10000 + b"]" * 10000 + b"\n",
    None,  # the file replaced by a folder
]
RUN_FILES = ["summary.json", "metrics.jsonl", "config.yaml", "partition.json"]

# Contents of an explicit partition file (3 clients of the synthetic dataset).
EXPLICIT_FILES = [
    b'{"clients": [[0], [1], [2]]}',
    b'{"clients": [[1180591620717411303424], [1], [2]]}',
    b'{"clients": [[-1180591620717411303424], [1], [2]]}',
    b'{"clients": [[' + b"9" * 5000 + b"], [1], [2]]}",
    b'{"clients": [[1e39], [1], [2]]}',
    b'{"clients": [[1e400], [1], [2]]}',
    b"[" * 100000 + b"]" * 100000,
    b'{"clients": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    b'{"clients": [[], [], []]}',
    rb'{"0": [0], "1": [1], "\u00b2": [2]}',  # a superscript two
    b'{"0": [0], "1": [1], "' + b"2" * 5000 + b'": [2]}',
    b'{"clients": [[0, 0], [1], [2]]}',
    rb'{"clients": [[0], [1], ["\u0000"]]}',
    b"\x00\xff",
    b"",
]


def _value(rng: random.Random, spec: Any, valid: bool) -> Any:
    if isinstance(spec, dict):
        if rng.random() < (0.01 if valid else 0.1):
            return rng.choice(["str", 5, [1, 2], None])
        return {k: _value(rng, v, valid) for k, v in spec.items() if rng.random() < 0.35}
    return spec[0] if valid and rng.random() < 0.9 else rng.choice(spec)


def _target(rng: random.Random, tmp: Path, i: int, suffix: str, kind: str | None = None) -> str:
    """An output path of ``kind`` (default: a random one of TARGETS)."""
    kind = kind or rng.choice(TARGETS)
    (tmp / "a-file").write_text("x")
    (tmp / f"folder{i}").mkdir(exist_ok=True)
    return {
        "plain": str(tmp / f"out{i}{suffix}"),
        "folder": str(tmp / f"folder{i}"),
        "under-file": str(tmp / "a-file" / f"out{i}{suffix}"),
        "nul": str(tmp / f"out\x00{i}{suffix}"),
        "rlo": str(tmp / f"out{RLO}{i}{suffix}"),
        "zero-width": str(tmp / f"{ZWSP}out{i}{suffix}"),
        "newline": str(tmp / f"out\n{i}{suffix}"),
    }[kind]


def _config_case(rng: random.Random, tmp: Path, i: int) -> list[str]:
    path = tmp / f"c{i}.yaml"
    valid = rng.random() < 0.6
    if rng.random() < 0.2:
        path.write_bytes(rng.choice(MALFORMED + [bytes(rng.randrange(256) for _ in range(40))]))
        valid = False
    else:
        cfg = {k: _value(rng, v, valid) for k, v in SPACE.items() if rng.random() < 0.3}
        if rng.random() < 0.05:
            cfg["bogus_key"] = 1
        path.write_text(yaml.safe_dump(cfg, allow_unicode=rng.random() < 0.5))
    overrides = rng.sample(OVERRIDES, rng.randint(0, 3)) if not valid or rng.random() < 0.2 else []
    command = rng.choice(["partition", "partition", "run", "run", "run", "sweep"])
    if command == "partition":
        outputs = []
        if rng.random() < 0.3:
            outputs += ["--json", _target(rng, tmp, i, ".json")]
        if rng.random() < 0.1:
            outputs += ["--plot", _target(rng, tmp, i, ".png")]
        return ["partition", "--config", str(path), *outputs, *overrides, "dataset.name=synthetic"]
    if command == "sweep":
        return ["sweep", "--dry-run", "--config", str(path), *overrides]
    return ["run", "--quiet", "--config", str(path), *overrides, *RUN_FIX, f"output_dir={tmp / f'run{i}'}"]


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory) -> Path:
    """Two finished 1-round runs of different methods and partitions (the report's papers' layout)."""
    root = tmp_path_factory.mktemp("fuzz-runs")
    for algorithm, scheme in (("fedavg", "iid"), ("fedprox", "dirichlet")):
        argv = [*RUN_FIX, "clients=2", f"algorithm.name={algorithm}", f"partition.scheme={scheme}"]
        assert main(["run", "--quiet", *argv, f"output_dir={root / algorithm}"]) == 0
    return root


def _report_case(rng: random.Random, tmp: Path, i: int, runs: Path) -> list[str]:
    """``report`` on a copy of ``runs`` with one file of one run replaced (or none), maybe with --out."""
    copy = tmp / f"runs{i}"
    shutil.copytree(runs, copy)
    if rng.random() < 0.85:
        victim = copy / rng.choice(["fedavg", "fedprox"]) / rng.choice(RUN_FILES)
        shape = rng.choice(RUN_FILE_SHAPES)
        victim.unlink()
        if shape is None:
            victim.mkdir()
        else:
            victim.write_bytes(shape)
    argv = ["report", str(copy), "--last", str(rng.choice([1, 5]))]
    if rng.random() < 0.15:
        argv += ["--out", _target(rng, tmp, i, rng.choice([".md", ""]))]
    return argv


def _check(argv: list[str], capsys) -> int:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 2), (argv, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2 and err.startswith("fedpcd: error:"):
        assert len(err.strip().splitlines()) == 1, (argv, err)
    return code


@pytest.mark.parametrize("seed", [0, 1])
def test_random_and_malformed_configs_exit_0_or_2_without_traceback(tmp_path, capsys, seed):
    rng = random.Random(seed)
    outcomes = {0: 0, 2: 0}
    for i in range(150):
        outcomes[_check(_config_case(rng, tmp_path, i), capsys)] += 1
    assert outcomes[0] >= 5 and outcomes[2] >= 30  # both paths were exercised


def test_damaged_run_folders_and_odd_targets_exit_0_or_2_without_traceback(tmp_path, capsys, finished_runs):
    rng = random.Random(7)
    outcomes = {0: 0, 2: 0}
    for i in range(120):
        outcomes[_check(_report_case(rng, tmp_path, i, finished_runs), capsys)] += 1
    assert outcomes[0] >= 10 and outcomes[2] >= 30


def test_every_shape_once_exits_0_or_2_without_traceback(tmp_path, capsys, finished_runs):
    """Each malformed file, override, damaged run file and odd target at least once (the random cases above
    draw only some of them)."""
    cases: list[list[str]] = []
    for i, content in enumerate(MALFORMED):
        path = tmp_path / f"m{i}.yaml"
        path.write_bytes(content)
        cases += [
            ["partition", "--config", str(path), "dataset.name=synthetic"],
            ["sweep", "--dry-run", "--config", str(path)],
            ["run", "--quiet", "--config", str(path), *RUN_FIX, f"output_dir={tmp_path / f'm-run{i}'}"],
        ]
    for i, override in enumerate(OVERRIDES):
        cases.append(["run", "--quiet", *RUN_FIX, override, f"output_dir={tmp_path / f'o-run{i}'}"])
    for i, content in enumerate(EXPLICIT_FILES):
        path = tmp_path / f"explicit{i}.json"
        path.write_bytes(content)
        cases.append(
            ["partition", "dataset.name=synthetic", "partition.scheme=explicit", f"partition.path={path}"]
        )
    # partition.json is read for the figures only (--out): a third of the shapes there, to save time
    damaged = [(n, s) for n in RUN_FILES[:3] for s in RUN_FILE_SHAPES] + [
        ("partition.json", s) for s in RUN_FILE_SHAPES[::3]
    ]
    for i, (name, shape) in enumerate(damaged):
        copy = tmp_path / f"shape{i}"
        shutil.copytree(finished_runs, copy)
        (copy / "fedprox" / name).unlink()
        if shape is None:
            (copy / "fedprox" / name).mkdir()
        else:
            (copy / "fedprox" / name).write_bytes(shape)
        out = ["--out", str(tmp_path / f"shape-report{i}")] if name == "partition.json" else []
        cases.append(["report", str(copy), *out])
    rng = random.Random(0)
    for i, kind in enumerate(TARGETS):
        json_target, png_target = (
            _target(rng, tmp_path, 1000 + i, suffix, kind) for suffix in (".json", ".png")
        )
        cases.append(["partition", "dataset.name=synthetic", "--json", json_target, "--plot", png_target])
        for suffix in (".md", "") if kind != "folder" else ("",):  # a folder's path has no suffix
            cases.append(
                ["report", str(finished_runs), "--out", _target(rng, tmp_path, 2000 + i, suffix, kind)]
            )
    codes = [_check(argv, capsys) for argv in cases]
    assert codes.count(2) >= len(MALFORMED) * 3 + len(EXPLICIT_FILES) - 1 and codes.count(0) >= 4
