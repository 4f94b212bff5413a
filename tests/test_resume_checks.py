"""What a resume checks and keeps: a checkpoint's tensors against the model's shapes, partition.json against
what the checkpoint vouches for (a foreign or changed one refused), and a hand-written config.yaml kept as it
is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, cli_main, one_error_line
from fedpcd.cli import main
from fedpcd.errors import UserError


def test_a_server_tensor_of_the_wrong_shape_is_refused_with_one_line():
    import torch

    from fedpcd.engine.checkpoint import check_server_state

    reference = {"model": {"fc.weight": torch.zeros(3, 4), "fc.bias": torch.zeros(3)}, "round_lr": 0.1}
    fits = {"model": {"fc.weight": torch.ones(3, 4), "fc.bias": torch.ones(3)}, "extra": [torch.ones(2)]}
    check_server_state(fits, reference, "ckpt")  # more than the reference: state added in later rounds
    wrong = {"model": {"fc.weight": torch.ones(4, 3), "fc.bias": torch.ones(3)}}
    with pytest.raises(UserError) as exc:
        check_server_state(wrong, reference, "ckpt")
    assert str(exc.value) == (
        "ckpt: the checkpoint's server tensor model.fc.weight is [4, 3] torch.float32, but the run's model "
        "needs [3, 4] torch.float32; it is not this run's checkpoint: delete the checkpoint folder to "
        "restart the run"
    )
    with pytest.raises(UserError, match="has no tensor model.fc.bias, which the run's model needs"):
        check_server_state({"model": {"fc.weight": torch.ones(3, 4)}}, reference, "ckpt")
    with pytest.raises(UserError, match=r"model.fc.bias is \[3\] torch.float64"):
        check_server_state({"model": {**fits["model"], "fc.bias": torch.ones(3).double()}}, reference, "c")


def _hand_written(folder: Path) -> bytes:
    folder.mkdir()
    text = "# my experiment\ndataset: {name: synthetic}  # tiny\nmodel: {name: mlp, hidden: 8}\n"
    text += f"clients: 2\nrounds: 1\nengine: {{workers: 1}}\noutput_dir: {folder}\n"
    (folder / "config.yaml").write_text(text)
    return text.encode()


def test_resume_keeps_a_hand_written_config_yaml(tmp_path, capsys):
    out = tmp_path / "run"
    mine = _hand_written(out)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert (out / "config.yaml").read_bytes() == mine and (out / "summary.json").exists()


def test_resume_refuses_a_foreign_partition_json(tmp_path, capsys):
    out = tmp_path / "run"
    mine = _hand_written(out)
    (out / "partition.json").write_text('{"clients": [[0], [1]]}')
    assert main(["run", "--resume", str(out), "--quiet"]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning.startswith("fedpcd: warning: ") and "restarting it from round 0" in warning
    assert error.startswith(
        f"fedpcd: error: {out}/partition.json is not the one this run writes (another partition, or written "
        "by hand); fedpcd never overwrites files it did not write for this run"
    )
    assert (out / "partition.json").read_text() == '{"clients": [[0], [1]]}'
    assert (out / "config.yaml").read_bytes() == mine


def _without_wall(run: Path) -> list[dict[str, object]]:
    """A run's metrics.jsonl records without their wall times (the rest is bitwise reproducible)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in records]


def test_a_partition_json_changed_since_the_checkpoint_is_refused_at_resume(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--quiet", *TINY, "rounds=1", "engine.checkpoint_every=1", f"output_dir={out}"]
    assert cli_main(argv).returncode == 0
    more = ["run", "--quiet", "--resume", str(out), "--allow-config-change", "rounds"]
    config = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(config.replace("rounds: 1\n", "rounds: 2\n"))
    partition = json.loads((out / "partition.json").read_text())
    (out / "partition.json").write_text(json.dumps(partition, indent=1))  # same data, other bytes: changed
    line = one_error_line(cli_main(more))
    assert line == (
        f"fedpcd: error: {out}/partition.json changed since the checkpoint (its SHA-256 differs): a run "
        "cannot go on with another partition; restore the file or start a new run"
    )
    (out / "partition.json").write_text(json.dumps(partition))  # as the run wrote it: it goes on
    assert cli_main(more).returncode == 0
    assert [r["round"] for r in _without_wall(out)] == [1, 2]
