"""engine.state_store: client states in memory or one file per client, compact, checkpointable."""

from __future__ import annotations

import pytest
import torch

from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.federation import build_federation
from fedpcd.engine.state_store import ClientStateStore, compact, state_store_for
from fedpcd.engine.tasks import payloads_for
from fedpcd.errors import UserError
from fedpcd.resolve import load_config

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=32"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "head.weight": torch.randn(3, 4, generator=g),
        "head.bias": torch.randn(3, generator=g),
        "n": seed,
    }


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path) -> ClientStateStore:
    return ClientStateStore(request.param, tmp_path / "states" if request.param == "disk" else None)


def test_mapping_roundtrip(store):
    assert len(store) == 0 and store.get(3) is None and 3 not in store
    store[3], store[1] = _state(3), _state(1)
    assert list(store) == [1, 3] and len(store) == 2 and 1 in store
    got = store[3]
    assert torch.equal(got["head.weight"], _state(3)["head.weight"]) and got["n"] == 3
    store[3] = _state(30)  # overwrite
    assert store[3]["n"] == 30
    del store[1]
    assert list(store) == [3]
    with pytest.raises(KeyError):
        store[1]
    assert store.to_dict().keys() == {3}
    store.replace({7: _state(7), 8: None})
    assert list(store) == [7, 8] and store[8] is None
    assert store.nbytes() > 0
    store.clear()
    assert len(store) == 0


def test_disk_backend_files_atomic_and_reopened(tmp_path):
    directory = tmp_path / "client_states"
    store = ClientStateStore("disk", directory)
    for k in range(5):
        store[k] = _state(k)
    assert sorted(p.name for p in directory.iterdir()) == [f"{k}.pt" for k in range(5)]  # no temp files
    again = ClientStateStore("disk", directory)  # resume: the files already there are the states
    assert list(again) == list(range(5))
    assert torch.equal(again[4]["head.bias"], _state(4)["head.bias"])
    assert torch.load(directory / "2.pt", weights_only=True)["n"] == 2
    again.clear()
    assert list(directory.iterdir()) == []


def test_views_are_stored_compactly(tmp_path):
    big = torch.randn(1000, 100)
    state = {"head": big[:2]}  # a view that would keep (and, saved, write) all of ``big``
    mem = ClientStateStore()
    mem[0] = state
    assert mem[0]["head"].untyped_storage().nbytes() == 2 * 100 * 4
    disk = ClientStateStore("disk", tmp_path / "s")
    disk[0] = state
    assert (tmp_path / "s" / "0.pt").stat().st_size < 10_000
    plain = {"w": torch.randn(3)}
    assert compact(plain) is plain  # nothing to change: the same object


def test_config_key_and_store_for(tmp_path):
    cfg = load_config(None, ["engine.client_state=disk", f"output_dir={tmp_path / 'run'}"])
    store = state_store_for(cfg)
    assert store.backend == "disk" and store.directory == tmp_path / "run" / "client_states"
    assert state_store_for(load_config(None, [])).backend == "memory"
    with pytest.raises(UserError, match="client_state"):
        load_config(None, ["engine.client_state=redis"])


@pytest.mark.parametrize("algorithm", ["fedper", "scaffold"])
def test_disk_store_trains_like_a_dict(tmp_path, algorithm):
    """The executor writes states through the store; disk and dict give the same server state."""
    cfg = load_config(None, [*SMALL, "clients=3", f"algorithm.name={algorithm}", f"output_dir={tmp_path}"])
    servers = []
    for states in ({}, ClientStateStore("disk", tmp_path / "cs")):
        fed = build_federation(cfg)
        algo = fed.new_algorithm()
        server = algo.init_server(fed.model_for(0, fresh=True))
        for rnd in (1, 2):
            results = LocalExecutor(fed, states=states).train(
                algo, payloads_for(algo, server, [0, 2]), rnd, evaluate=False
            )
            server = algo.aggregate(server, [r.update for r in results])
        assert sorted(states) == [0, 2]
        servers.append(server["model"])
    for key, value in servers[0].items():
        assert torch.equal(value, servers[1][key]), key


def test_checkpoint_holds_the_store_as_a_plain_dict(store, tmp_path):
    """RunDir.save_checkpoint turns the store into a plain dict of CPU tensors (loads weights_only)."""
    from fedpcd.engine.rundir import RunDir

    store[2], store[5] = _state(2), None
    run = RunDir(tmp_path / "run")
    run.save_checkpoint({"round": 1, "client_states": store})
    loaded = torch.load(run.checkpoint, weights_only=True)["client_states"]
    assert type(loaded) is dict and sorted(loaded) == [2, 5] and loaded[5] is None
    assert torch.equal(loaded[2]["head.weight"], _state(2)["head.weight"])


def test_runs_and_resumes_with_client_states_on_disk(tmp_path):
    """engine.client_state=disk through the local backend: same metrics as memory; resume undoes files
    written after the checkpoint (the store is replaced by the checkpoint's states)."""
    from fedpcd.backends import resume_run, run_experiment
    from fedpcd.run_read import read_metrics

    def run(name: str, backend: str) -> list[dict]:
        cfg = load_config(
            None,
            [
                *SMALL,
                "clients=4",
                "participation=0.5",
                "rounds=3",
                "algorithm.name=fedper",
                f"engine.client_state={backend}",
                f"output_dir={tmp_path / name}",
            ],
        )
        run_experiment(cfg, progress=False)
        return read_metrics(tmp_path / name / "metrics.jsonl", resuming=True)

    def strip(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in records]

    memory, disk = run("memory", "memory"), run("disk", "disk")
    assert strip(memory) == strip(disk)
    files = sorted(p.name for p in (tmp_path / "disk" / "client_states").iterdir())
    assert files and all(f.endswith(".pt") for f in files)
    # a kill after the checkpoint of round 3 but with a stray state file: resume from round 2's checkpoint
    (tmp_path / "disk" / "summary.json").unlink()
    torch.save({"stray": torch.zeros(1)}, tmp_path / "disk" / "client_states" / "99.pt")
    resume_run(tmp_path / "disk", progress=False)
    assert strip(read_metrics(tmp_path / "disk" / "metrics.jsonl", resuming=True)) == strip(memory)
    assert "99.pt" not in {p.name for p in (tmp_path / "disk" / "client_states").iterdir()}
