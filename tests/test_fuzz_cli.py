"""Fuzzing the command line: random and malformed configs and overrides never end in a traceback.

Every case runs ``fedpcd.cli.main`` in-process (``partition``, ``sweep --dry-run`` or a 1-round ``run`` on the
synthetic dataset) and must return 0 or 2 with nothing but one-line errors on stderr. The generator is
seeded, so a failure names a reproducible case.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedpcd.cli import main

# Per key: a list of values, valid ones first (a "mostly valid" config picks those), or a nested section.
SPACE: dict[str, Any] = {
    "seed": [0, 3, -1, 1.5, "abc", 2**70, True],
    "dataset": {
        "name": ["synthetic", "bogus", 3],
        "root": [None, "/nonexistent", 5],
        "train_fraction": [0.5, 0, 2, "x", float("nan")],
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
        ],
        "beta": [0.5, -1, 0, float("inf"), "x"],
        "classes_per_client": [2, 0, 11, -3, 2.5, "two"],
        "min_size": [0, 5, 10000, -1],
        "shards_per_client": [2, 0, 1000],
        "rho": [0.1, 10, 0, -5],
        "then": [{"scheme": "iid"}, "x", {"scheme": "bogus"}, None],
        "path": ["/nope.json", 3],
    },
    "clients": [3, 1, 0, -2, "x", 2.5, None, 10**6],
    "participation": [1.0, 0.5, 0, 1.5, "half", float("nan")],
    "rounds": [1, 0, -1, "x", 1.5],
    "model": {
        "name": ["mlp", "cnn1", "bogus", 3, ["mlp", "mlp"], []],
        "hidden": [8, 0, -4, "x"],
        "clients": [{0: "mlp"}, {99: "mlp"}, "x", {"a": "b"}],
    },
    "local": {
        "epochs": [1, 0, "x"],
        "batch_size": [64, 0, -1],
        "lr": [0.01, 0, -1, float("inf"), 1e6, "x"],
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
        ],
        "mu": [0.01, -1, "x", float("nan")],
        "alpha": [0.1, float("inf"), "x"],
        "bogus_param": [1],
    },
    "eval_every": [1, 0, "x"],
    "personal_test": ["full", "split", "bogus"],
    "backend": ["local", "bogus"],
    "engine": {
        "executor": ["auto", "sequential", "bogus"],
        "threads": [1, 0, "x"],
        "checkpoint_every": [1, 0, -1],
        "on_divergence": ["stop", "drop", "bogus"],
        "min_clients": [1, 0, 99],
    },
}

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
]

RUN_FIX = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=8", "rounds=1", "local.batch_size=64"]


def _value(rng: random.Random, spec: Any, valid: bool) -> Any:
    if isinstance(spec, dict):
        if rng.random() < (0.01 if valid else 0.1):
            return rng.choice(["str", 5, [1, 2], None])
        return {k: _value(rng, v, valid) for k, v in spec.items() if rng.random() < 0.35}
    return spec[0] if valid and rng.random() < 0.9 else rng.choice(spec)


def _case(rng: random.Random, tmp: Path, i: int) -> list[str]:
    path = tmp / f"c{i}.yaml"
    valid = rng.random() < 0.6
    if rng.random() < 0.15:
        path.write_bytes(rng.choice(MALFORMED + [bytes(rng.randrange(256) for _ in range(40))]))
        valid = False
    else:
        cfg = {k: _value(rng, v, valid) for k, v in SPACE.items() if rng.random() < 0.3}
        if rng.random() < 0.05:
            cfg["bogus_key"] = 1
        path.write_text(yaml.safe_dump(cfg))
    overrides = rng.sample(OVERRIDES, rng.randint(0, 3)) if not valid or rng.random() < 0.2 else []
    command = rng.choice(["partition", "partition", "run", "run", "run", "sweep"])
    if command == "partition":
        return ["partition", "--config", str(path), *overrides, "dataset.name=synthetic"]
    if command == "sweep":
        return ["sweep", "--dry-run", "--config", str(path), *overrides]
    return ["run", "--quiet", "--config", str(path), *overrides, *RUN_FIX, f"output_dir={tmp / f'run{i}'}"]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_and_malformed_configs_exit_0_or_2_without_traceback(tmp_path, capsys, seed):
    rng = random.Random(seed)
    outcomes = {0: 0, 2: 0}
    for i in range(150):
        argv = _case(rng, tmp_path, i)
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code
        err = capsys.readouterr().err
        assert code in (0, 2), (argv, err)
        assert "Traceback" not in err, (argv, err)
        if code == 2 and err.startswith("fedpcd: error:"):
            assert len(err.strip().splitlines()) == 1, (argv, err)
        outcomes[code] += 1
    assert outcomes[0] >= 5 and outcomes[2] >= 30  # both paths were exercised
