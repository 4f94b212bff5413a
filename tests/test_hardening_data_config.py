"""Hardening: data files never run code, run folders are never written through symbolic links nor over
files fedpcd did not write, configs are bounded, a resume checks its checkpoint against config.yaml, and a
failed write (a full disk) is one line naming the file."""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import run_records
from fedpcd.backends import run_experiment
from fedpcd.cli import main
from fedpcd.config_identity import canonical_config, config_yaml
from fedpcd.data.datasets import load_dataset
from fedpcd.engine.rundir import RunDir
from fedpcd.engine.state_store import ClientStateStore
from fedpcd.errors import UserError
from fedpcd.resolve import load_config
from test_reliability import _interrupt_in_round

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=50"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpcd: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), links not followed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----- data files that would run code ---------------------------------------------------------------


class _RunsCode:
    """What a crafted batch holds: unpickling it calls ``os.system`` or ``exec`` to create ``marker``."""

    def __init__(self, marker: Path, how: str) -> None:
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "system":
            return (os.system, (f"touch {self.marker}",))
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _write_cifar10(root: Path, protocol: int = 2, per_batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10 batches as the official files are pickled: a dict with bytes keys, a uint8 [N, 3072] array and
    a list of int labels (protocol 2). Returns the train images and labels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"img_{i}.png".encode() for i in range(per_batch)],
        }
        raw = pickle.dumps(batch, protocol=protocol)
        if protocol == 2:  # the module names of the official files (numpy 1), which numpy 2 still reads
            raw = raw.replace(b"numpy._core.", b"numpy.core.")
        (folder / name).write_bytes(raw)
        if name != "test_batch":
            xs.append(data)
            ys.append(labels)
    return np.concatenate(xs), np.concatenate(ys)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_real_format_cifar_batches_still_load(tmp_path, protocol):
    train_x, train_y = _write_cifar10(tmp_path, protocol)
    ds = load_dataset("cifar10", root=tmp_path, download=False)
    np.testing.assert_array_equal(ds.train_x.reshape(20, -1).numpy(), train_x)
    np.testing.assert_array_equal(ds.train_y.numpy(), train_y)


@pytest.mark.parametrize("how", ["system", "exec"])
def test_cifar_batch_that_would_run_code_is_refused_on_resume(tmp_path, capsys, how):
    """A run folder whose config points dataset.root at a crafted batch: --resume refuses the batch (exit 2,
    one line naming it) and its payload never runs."""
    _write_cifar10(tmp_path / "data")
    run = tmp_path / "run"
    args = ["dataset.name=cifar10", f"dataset.root={tmp_path / 'data'}", "dataset.download=false"]
    args += ["model.name=mlp", "model.hidden=8", "partition.scheme=iid", "clients=2", "rounds=1"]
    assert main(["run", "--quiet", *args, f"output_dir={run}"]) == 0
    (run / "summary.json").unlink()
    marker = tmp_path / "pwned"
    batch = tmp_path / "data" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(pickle.dumps({b"data": _RunsCode(marker, how), b"labels": [0]}, protocol=2))
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    err = _error_line(capsys)
    assert f"{batch} is not a plain CIFAR batch" in err and "never code" in err
    assert not marker.exists()


def test_official_sized_cifar_batch_is_checksummed_before_it_is_parsed(tmp_path, monkeypatch):
    _write_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    payload = pickle.dumps({b"data": _RunsCode(marker, "system"), b"labels": [0]}, protocol=2)
    batch.write_bytes(payload + bytes(10000 * 3072))  # large enough to be the official file
    with pytest.raises(UserError, match=r"data_batch_1 is corrupt: .*c99cafc152244af753f735de768cd75f"):
        load_dataset("cifar10", root=tmp_path, download=False)
    monkeypatch.setenv("FEDPCD_SKIP_CHECKSUMS", "1")  # a modified copy on purpose: still never code
    with pytest.raises(UserError, match="data_batch_1 is not a plain CIFAR batch: it refers to posix.system"):
        load_dataset("cifar10", root=tmp_path, download=False)
    assert not marker.exists()


def _write_idx(path: Path, arr: np.ndarray, dims: tuple[int, ...] | None = None) -> None:
    dims = arr.shape if dims is None else dims
    header = bytes((0, 0, 0x08, len(dims))) + b"".join(int(d).to_bytes(4, "big") for d in dims)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


@pytest.mark.parametrize(
    ("dims", "needle"),
    [((20, 0, 0), "holds no data: its header says 20x0x0"), ((20, 28, 14), "28x14 images")],
)
def test_idx_images_of_no_or_non_square_size_are_one_line(tmp_path, capsys, dims, needle):
    rng = np.random.default_rng(0)
    _write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, dims), dims)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(20) % 10)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 256, (10, 28, 28)))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(10) % 10)
    argv = ["partition", "dataset.name=mnist", f"dataset.root={tmp_path}", "dataset.download=false"]
    assert main([*argv, "clients=2"]) == 2
    err = _error_line(capsys)
    assert str(tmp_path / "train-images-idx3-ubyte") in err and needle in err


# ----- symbolic links in a run folder ---------------------------------------------------------------

CUT = [*SMALL, "clients=3", "rounds=2", "algorithm.name=fedper", "engine.client_state=disk"]


def _cut_run(tmp_path: Path, monkeypatch, name: str = "run", *extra: str) -> Path:
    """A run stopped in round 2, after round 1's checkpoint (client states on disk)."""
    _interrupt_in_round(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_config(None, [*CUT, *extra, f"output_dir={tmp_path / name}"]), progress=False)
    return tmp_path / name


ENTRIES = [".lock", "config.yaml", "partition.json", "metrics.jsonl", "summary.json", "checkpoint"]


@pytest.mark.parametrize("entry", [*ENTRIES, "client_states"])
def test_run_folder_entry_that_is_a_symlink_is_refused(tmp_path, monkeypatch, capsys, entry):
    """A .lock link would have its target truncated, a client_states link the N.pt files of the folder it
    points to deleted, a checkpoint link a state.pt written elsewhere: every entry that is a link is refused
    with one line, and what it points to is left as it was."""
    run = _cut_run(tmp_path, monkeypatch)
    assert sorted(p.name for p in (run / "client_states").iterdir()) == ["0.pt", "1.pt", "2.pt"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / entry
    if (run / entry).exists():
        (run / entry).rename(target)
    else:
        target.write_text("precious")
    if target.is_file():
        target.write_bytes(target.read_bytes() + b"\nprecious")
    (run / entry).symlink_to(target)
    before = _tree(elsewhere)
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    err = _error_line(capsys)
    assert f"{run / entry} is a symbolic link" in err
    assert main(["run", "--quiet", *CUT, f"output_dir={run}"]) == 2  # a new run into it: refused too
    assert f"{run / entry} is a symbolic link" in _error_line(capsys)
    assert _tree(elsewhere) == before


def test_links_put_there_during_a_run_are_not_followed(tmp_path):
    """Writes that happen after the start check never follow a link either (O_NOFOLLOW, lstat)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("precious")
    (elsewhere / "3.pt").write_text("precious")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    (run.path / "metrics.jsonl").symlink_to(elsewhere / "precious")
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        run.append({"round": 1, "global_acc": 0.5})
    (run.path / "summary.json").symlink_to(elsewhere / "precious")
    with pytest.raises(UserError, match="summary.json is a symbolic link"):
        run.write_summary({"rounds": 1})
    (run.path / "checkpoint").symlink_to(elsewhere)
    with pytest.raises(UserError, match="checkpoint is a symbolic link"):
        run.save_checkpoint({"round": 1, "server": {}, "client_states": {}})
    (run.path / "client_states").symlink_to(elsewhere)
    with pytest.raises(UserError, match="client_states is a symbolic link"):
        ClientStateStore("disk", run.path / "client_states")
    assert _tree(elsewhere) == {"3.pt": b"precious", "precious": b"precious"}


# ----- configs: bounded size, depth and numbers -----------------------------------------------------


def test_billion_laughs_yaml_is_refused_at_once(tmp_path, capsys):
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs.replace("i: &i", "seed:"))
    assert len(laughs) < 700
    t0 = time.perf_counter()
    assert main(["run", "--config", str(path)]) == 2
    assert time.perf_counter() - t0 < 5
    err = _error_line(capsys)
    assert "uses the YAML alias *a (line 2); aliases are not allowed" in err and len(err) < 200
    assert main(["run", *SMALL, "seed=[&a [1, 1], *a, *a]"]) == 2
    assert "override 'seed' uses the YAML alias *a" in _error_line(capsys)


def test_deep_nesting_is_one_line(tmp_path, capsys):
    deep = "[" * 10000 + "]" * 10000
    assert main(["run", *SMALL, f"seed={deep}"]) == 2
    assert "override 'seed' is nested more than 32 levels deep" in _error_line(capsys)
    path = tmp_path / "deep.yaml"
    path.write_text(f"seed: {deep}\n")
    assert main(["run", "--config", str(path)]) == 2
    assert f"config file {path} is nested more than 32 levels deep" in _error_line(capsys)
    assert main(["run", *SMALL, ".".join(["a"] * 10000) + "=1"]) == 2
    assert "is nested more than 32 levels deep" in _error_line(capsys)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["local.lr=1e39"], "'local.lr' (1e+39): must be representable as float32"),
        (["local.weight_decay=1e300"], "'local.weight_decay' (1e+300): must be representable as float32"),
        (["local.lr=1e-50"], "'local.lr' (1e-50): must be representable as float32"),
        (["partition.scheme=dirichlet", "partition.beta=1e39"], "'partition.beta' (1e+39)"),
        (["algorithm.name=fedprox", "algorithm.mu=1e39"], "'algorithm.mu' (1e+39)"),
        ([f"seed={2**70}"], "'seed' (1180591620717411303424): must fit in 64 bits"),
        (["seed=" + "1" * 5000], "override 'seed' holds a value that cannot be read"),
        (
            ["engine.threads=1000000"],
            "'engine.threads' (1000000): Input should be less than or equal to 1024",
        ),
        (
            ["model.hidden=1000000000"],
            "'model.hidden' of model 'mlp' (1000000000): expected an integer in [1, 8192]",
        ),
        (["output_dir=runs/a\x00b"], "'output_dir' ('runs/a\\x00b'): contains a NUL character"),
    ],
)
def test_out_of_range_values_exit_2_with_one_line(args, needle, capsys):
    assert main(["run", *SMALL, *args]) == 2
    assert needle in _error_line(capsys)


def test_a_model_over_the_weight_limit_is_refused_at_load(monkeypatch, capsys):
    import fedpcd.resolve

    monkeypatch.setattr(fedpcd.resolve, "MAX_MODEL_PARAMS", 10**6)  # mlp's widest (8192 units) is below 1e8
    assert main(["run", *SMALL, "model.hidden=2000"]) == 2
    assert "more than the limit of 1e+06" in _error_line(capsys)


@pytest.mark.parametrize(
    "arg",
    ["dataset.name=", "algorithm.name=", "seed=", "local.lr=", "algorithm.name=fedprox algorithm.", "bogus_"],
)
def test_long_values_are_cut_in_error_messages(arg, capsys):
    long = "x" * 100_000
    *first, last = arg.split(" ")
    assert main(["run", *SMALL, *first, last + long + ("=1" if "=" not in last else "")]) == 2
    err = _error_line(capsys)
    assert len(err) < 600 and "xxx..." in err  # the clipped value, the near names and the valid names


def test_a_billion_clients_fail_before_any_per_client_work(tmp_path, capsys):
    t0 = time.perf_counter()
    assert main(["run", "--quiet", *SMALL, "clients=1000000000", f"output_dir={tmp_path / 'run'}"]) == 2
    assert time.perf_counter() - t0 < 30
    assert "more clients (1000000000) than samples (1000)" in _error_line(capsys)


def test_architectures_are_found_without_a_loop_over_clients():
    cfg = load_config(None, ["algorithm.name=fedssa", "model.name=[cnn1, cnn2, cnn1, cnn3]", "clients=9"])
    for clients in [{}, {0: "cnn3"}, {0: "mlp", 4: "cnn2", 1: "cnn4"}, {2: "cnn5", 6: "cnn5", 3: "cnn4"}]:
        model = cfg.model.model_copy(update={"clients": clients})
        for n in range(1, 10):
            loop = list(dict.fromkeys(model.architecture(k) for k in range(n)))
            assert model.architectures(n) == loop, (clients, n)
    t0 = time.perf_counter()
    assert cfg.model.architectures(10**12) == ["cnn1", "cnn2", "cnn3"]
    assert time.perf_counter() - t0 < 1


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["partition.scheme=dirichlet", "partition.beta=0.1", "algorithm.name=fedprox", "local.lr=0.05"],
        ["algorithm.name=fedssa", "model.name=[cnn1, cnn2]", "model.clients={1: cnn3}", "clients=4"],
    ],
)
def test_canonical_config_survives_the_written_config_yaml(tmp_path, overrides):
    cfg = load_config(None, [*overrides, f"output_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))
    again = load_config(tmp_path / "config.yaml", ["output_dir=elsewhere"])
    assert canonical_config(again) == canonical_config(cfg)
    assert "output_dir" not in json.loads(canonical_config(cfg))


# ----- resume checks its checkpoint against config.yaml ---------------------------------------------


def _edit_config(run: Path, key: str, value) -> None:
    data = yaml.safe_load((run / "config.yaml").read_text())
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[leaf] = value
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("clients", 5, "(clients: 3 -> 5); a run cannot go on with another clients"),
        ("seed", 7, "(seed: 0 -> 7); a run cannot go on with another seed"),
        ("local.lr", 0.5, "(local.lr: 0.01 -> 0.5)"),
        ("algorithm", {"name": "fedrep"}, "algorithm.name: 'fedper' -> 'fedrep'"),
        ("rounds", 5, "(rounds: 2 -> 5); to go on with the change, add --allow-config-change rounds"),
    ],
)
def test_resume_refuses_a_changed_config_with_a_diff(tmp_path, monkeypatch, capsys, key, value, needle):
    run = _cut_run(tmp_path, monkeypatch)
    _edit_config(run, key, value)
    before = _tree(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    err = _error_line(capsys)
    assert f"{run}/config.yaml changed since its checkpoint" in err and needle in err
    assert _tree(run) == before


def test_rounds_raised_on_resume_with_the_flag_goes_on_like_a_longer_run(tmp_path, capsys):
    full, short = tmp_path / "full", tmp_path / "short"
    # PA-G every round: else the short run's last round has it and the full run's round 2 does not
    args = ["run", "--quiet", *SMALL, "clients=3", "personal_full_every=1"]
    assert main([*args, "rounds=3", f"output_dir={full}"]) == 0
    assert main([*args, "rounds=2", f"output_dir={short}"]) == 0
    _edit_config(short, "rounds", 3)
    _edit_config(short, "engine.threads", 1)
    capsys.readouterr()
    assert main(["run", "--resume", str(short), "--quiet", "--allow-config-change", "rounds"]) == 2
    assert "add --allow-config-change engine.threads" in _error_line(capsys)
    argv = ["run", "--resume", str(short), "--quiet", "--allow-config-change", "rounds", "engine.threads"]
    assert main(argv) == 0
    assert run_records(short) == run_records(full)
    assert json.loads((short / "summary.json").read_text())["rounds"] == 3
    assert RunDir(short).load_checkpoint()["config"] == canonical_config(load_config(short / "config.yaml"))
    capsys.readouterr()
    assert main(["run", "--resume", str(short), "--quiet"]) == 0  # finished, with its new config


def test_allow_config_change_takes_only_safe_keys_and_only_with_resume(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path), "--allow-config-change", "rounds", "seed"]) == 2
    err = _error_line(capsys)
    assert "--allow-config-change seed: a resumed run may change only rounds, engine.checkpoint_every" in err
    assert main(["run", *SMALL, "--allow-config-change", "rounds"]) == 2
    assert "--allow-config-change goes with --resume" in _error_line(capsys)


def test_rounds_never_below_the_checkpoint_round(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=3", f"output_dir={run}"]) == 0
    _edit_config(run, "rounds", 2)
    capsys.readouterr()
    assert main(["run", "--resume", str(run), "--quiet", "--allow-config-change", "rounds"]) == 2
    assert "checkpoint round 3 is outside 0..2" in _error_line(capsys)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"round": -5}, "checkpoint round -5 is outside 0..2"),
        ({"round": 9}, "checkpoint round 9 is outside 0..2"),
        ({"client_states": {7: None}}, "holds a state of client 7, but clients are 0..2"),
        ({"wall_s": math.nan}, "wall_s nan is not a time"),
        ({"metrics": '{"round": 4}\n'}, "metrics line 1 in the checkpoint is not a record of a round in 1.."),
        ({"format": 99}, "checkpoint format 99 is not one this fedpcd reads"),
        ({"config_sha256": "0" * 64}, "the checkpoint's config record is corrupt"),
        ({"rng": {"torch": 3}}, "random number generator states are corrupt"),
    ],
)
def test_checkpoint_fields_are_range_checked(tmp_path, monkeypatch, capsys, change, needle):
    run = _cut_run(tmp_path, monkeypatch)
    state = torch.load(run / "checkpoint" / "state.pt", weights_only=True)
    torch.save({**state, **change}, run / "checkpoint" / "state.pt")
    before = _tree(run)
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    assert needle in _error_line(capsys)
    if "rng" not in change:  # the RNG states are put back after the data is loaded: nothing written before
        assert _tree(run) == before


def test_checkpoint_from_before_the_config_record_still_resumes(tmp_path, monkeypatch):
    run_experiment(load_config(None, [*CUT, f"output_dir={tmp_path / 'full'}"]), progress=False)
    run = _cut_run(tmp_path, monkeypatch, "cut")
    state = torch.load(run / "checkpoint" / "state.pt", weights_only=True)
    assert len(state.pop("config_sha256")) == 64 and json.loads(state.pop("config"))["clients"] == 3
    torch.save({**state, "format": 2}, run / "checkpoint" / "state.pt")
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    assert run_records(run) == run_records(tmp_path / "full")


@pytest.mark.parametrize("damage", ["code", "truncated"])
def test_bad_checkpoint_message_is_one_line_of_our_own(tmp_path, monkeypatch, capsys, damage):
    run = _cut_run(tmp_path, monkeypatch)
    path = run / "checkpoint" / "state.pt"
    if damage == "code":
        torch.save({"round": 1, "server": {"x": _RunsCode(tmp_path / "pwned", "system")}}, path)
    else:
        path.write_bytes(path.read_bytes()[:1000])
    assert main(["run", "--resume", str(run), "--quiet"]) == 2
    err = _error_line(capsys)
    assert f"cannot load checkpoint {path}: it is corrupt, truncated or holds objects other than" in err
    assert "weights_only" not in err and "Weights only" not in err and not (tmp_path / "pwned").exists()


def test_client_state_file_that_does_not_load_is_one_line(tmp_path):
    ClientStateStore("disk", tmp_path / "states")[0] = {"w": torch.zeros(2)}
    (tmp_path / "states" / "0.pt").write_bytes(b"garbage")
    with pytest.raises(UserError, match=r"cannot load client state .*states/0.pt: it is corrupt"):
        ClientStateStore("disk", tmp_path / "states")[0]


# ----- output_dir holding files fedpcd did not write ------------------------------------------------

ONE_ROUND = ["clients=2", "rounds=1"]


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        ({"config.yaml": "hello: world\n"}, "holds config.yaml, not written by fedpcd for this run"),
        ({"partition.json": "{}"}, "holds partition.json, not written by fedpcd for this run"),
        ({"config.yaml": None}, "holds the config.yaml of another run (seed: 5 -> 0)"),
    ],
)
def test_output_dir_with_files_fedpcd_did_not_write_is_refused(tmp_path, capsys, files, needle):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        text = text if text is not None else config_yaml(load_config(None, [*SMALL, *ONE_ROUND, "seed=5"]))
        (out / name).write_text(text)
    before = _tree(out)
    assert main(["run", "--quiet", *SMALL, *ONE_ROUND, f"output_dir={out}"]) == 2
    err = _error_line(capsys)
    assert needle in err and "fedpcd never overwrites files it did not write" in err
    assert _tree(out) == before


def test_output_dir_of_the_same_config_stopped_early_or_with_other_files_is_used(tmp_path):
    args = [*SMALL, "clients=2", "rounds=1"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text(config_yaml(load_config(None, [*args, f"output_dir={out}"])))
    (out / "notes.txt").write_text("mine")
    assert main(["run", "--quiet", *args, f"output_dir={out}"]) == 0
    assert (out / "summary.json").exists() and (out / "notes.txt").read_text() == "mine"


# ----- write failures: one line naming the file, nothing lost ---------------------------------------


def test_disk_full_while_checkpointing(tmp_path, monkeypatch, capsys):
    args = [*SMALL, "clients=2", "rounds=2"]
    assert main(["run", "--quiet", *args, f"output_dir={tmp_path / 'full'}"]) == 0
    real_save, calls = torch.save, []

    def save(obj, fh, *a, **kw):
        if isinstance(obj, dict) and "client_states" in obj:  # a checkpoint (not a state sent elsewhere)
            calls.append(1)
        if len(calls) == 2:  # round 2's checkpoint: part of it written, then the disk is full
            fh.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, fh, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["run", "--quiet", *args, f"output_dir={run}"]) == 2
    err = _error_line(capsys)
    assert err == f"fedpcd: error: cannot write {run}/checkpoint/state.pt: No space left on device"
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["state.pt"]  # no temp file left
    assert RunDir(run).load_checkpoint()["round"] == 1  # round 1's checkpoint is kept
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["run", "--resume", str(run), "--quiet"]) == 0
    assert run_records(run) == run_records(tmp_path / "full")


def test_disk_full_while_appending_metrics(tmp_path, monkeypatch, capsys):
    real_write = os.write

    def write(fd, data):
        if bytes(data[:11]) == b'{"round": 2':
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    run = tmp_path / "run"
    assert main(["run", "--quiet", *SMALL, "clients=2", "rounds=3", f"output_dir={run}"]) == 2
    assert _error_line(capsys) == f"fedpcd: error: cannot write {run}/metrics.jsonl: No space left on device"
    assert [r["round"] for r in run_records(run)] == [1]
