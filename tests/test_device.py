"""engine.device: cpu | cuda | cuda:N | auto, honoured by the engine, checkpoints and the Flower backend."""

from __future__ import annotations

import json

import pytest
import torch

from fedpcd.backends import run_experiment
from fedpcd.cli import main
from fedpcd.engine.federation import build_federation, resolve_device, to_device
from fedpcd.errors import UserError
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=32", "rounds=2"]
NO_CUDA = "engine.device=cuda but no CUDA device is available; choose cpu or auto"
has_cuda = torch.cuda.is_available()


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _records(path):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


def test_config_default_and_bad_values():
    assert load_config(None, []).engine.device == "cpu"
    for ok in ("cpu", "cuda", "cuda:1", "auto"):
        assert load_config(None, [f"engine.device={ok}"]).engine.device == ok
    with pytest.raises(UserError, match="valid devices: cpu, cuda, cuda:N"):
        load_config(None, ["engine.device=gpu"])


def test_resolve_device(no_cuda):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        with pytest.raises(UserError) as err:
            resolve_device(name)
        assert str(err.value) == NO_CUDA.replace("=cuda ", f"={name} ")


def test_cuda_without_gpu_exits_2_with_one_line(no_cuda, tmp_path, capsys):
    assert main(["run", "--quiet", *SMALL, "engine.device=cuda", f"output_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fedpcd: error: {NO_CUDA}"


def test_auto_equals_cpu_here(tmp_path):
    """On a machine without CUDA, auto is cpu: the same numbers; tensors of the federation on the device."""
    runs = {}
    for device in ("cpu", "auto"):
        out = tmp_path / device
        cfg = load_config(
            None, [*SMALL, "algorithm.name=fedper", f"engine.device={device}", f"output_dir={out}"]
        )
        run_experiment(cfg, progress=False)
        runs[device] = _records(out)
    if not has_cuda:
        assert runs["cpu"] == runs["auto"]


def test_to_device_identity_and_moves():
    state = {"a": torch.ones(2), "b": [torch.zeros(1), 3], "c": None}
    assert to_device(state, "cpu") is state  # nothing to move: the same object, no copies
    meta = to_device(state, "meta")
    assert meta["a"].device.type == "meta" and meta["b"][1] == 3 and meta["c"] is None
    assert state["a"].device.type == "cpu"


def test_flower_gpu_share(no_cuda, monkeypatch):
    from fedpcd.flower.simulation import client_gpus, ray_backend_config

    cfg = load_config(None, ["engine.device=auto"])
    cpu = resolve_device("auto")
    assert client_gpus(cfg, cpu) == (0, 0.0)
    assert ray_backend_config(cfg, cpu)["client_resources"]["num_gpus"] == 0.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda")
    assert client_gpus(load_config(None, ["engine.device=cuda"]), cuda, num_cpus=4) == (2, 0.5)
    cfg = load_config(None, ["engine.device=auto", "engine.threads=2"])
    backend = ray_backend_config(cfg, cuda, num_cpus=8)
    assert backend["client_resources"] == {"num_cpus": 2, "num_gpus": 0.5}
    assert backend["init_args"]["num_gpus"] == 2
    with pytest.raises(UserError, match="CUDA_VISIBLE_DEVICES=1"):
        client_gpus(load_config(None, ["engine.device=cuda:1"]), torch.device("cuda:1"))


@pytest.mark.skipif(not has_cuda, reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["fedavg", "fedper", "scaffold", "moon", "fedprox"])
def test_cuda_run_and_cpu_checkpoint(tmp_path, algorithm):
    out = tmp_path / "run"
    cfg = load_config(
        None, [*SMALL, f"algorithm.name={algorithm}", "engine.device=cuda", f"output_dir={out}"]
    )
    fed = build_federation(cfg)
    assert (
        fed.clients[0].x.is_cuda and fed.clients[0].train_idx.is_cuda and fed.new_model().head.weight.is_cuda
    )
    run_experiment(cfg, progress=False)
    ckpt = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert all(t.device.type == "cpu" for t in ckpt["server"]["model"].values())
    assert _records(out)[-1]["global_acc"] is not None or algorithm == "fedper"
