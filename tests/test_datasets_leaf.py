"""FEMNIST and Shakespeare in LEAF's JSON format, and the ``natural`` partition scheme that keeps their
writers / speaking roles as clients: round trips of small files written in the real format, the refusals,
and 2-round runs (FedAvg, FedGELA and FedNH for the LSTM)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dataset_files_more import make_femnist, make_shakespeare
from fedpcd import run
from fedpcd.data.datasets import load_dataset
from fedpcd.data.leaf import SHAKESPEARE_LETTERS
from fedpcd.data.partition import make_partition
from fedpcd.data.sources import LEAF_URL
from fedpcd.errors import UserError


def test_femnist_round_trip_keeps_each_writer(tmp_path):
    written = make_femnist(tmp_path / "femnist")
    ds = load_dataset("femnist", root=tmp_path, download=False)
    users = sorted(written["train"])
    assert ds.num_classes == 62 and ds.train_x.shape == (48, 1, 28, 28) and ds.num_groups == len(users)
    for split, x, y, groups in (
        ("train", ds.train_x, ds.train_y, ds.train_groups),
        ("test", ds.test_x, ds.test_y, ds.test_groups),
    ):
        for g, user in enumerate(users):
            xs, ys = written[split][user]
            mine = groups == g
            assert y[mine].tolist() == ys
            expected = np.rint(np.asarray(xs, dtype=np.float32) * 255).astype(np.uint8).reshape(-1, 1, 28, 28)
            assert np.array_equal(x[mine].numpy(), expected)
    mean = ds.train_x.double().mean().item() / 255
    assert ds.mean == (round(mean, 4),)  # measured on the train split when loaded


def test_shakespeare_round_trip_is_leaf_vocabulary(tmp_path):
    written = make_shakespeare(tmp_path / "shakespeare")
    ds = load_dataset("shakespeare", root=tmp_path, download=False)
    assert ds.vocab_size == ds.num_classes == 80 and ds.in_channels == 0 and ds.image_size == 80
    roles = sorted(written["train"])
    first = written["train"][roles[0]]
    ids = ds.train_x[ds.train_groups == 0]
    assert "".join(SHAKESPEARE_LETTERS[i] for i in ids[0].tolist()) == first[0][0]
    assert [SHAKESPEARE_LETTERS[i] for i in ds.train_y[ds.train_groups == 0].tolist()] == first[1]
    assert ds.normalized("train").dtype == torch.int64


def test_a_character_outside_the_vocabulary_is_one_line(tmp_path):
    make_shakespeare(tmp_path / "shakespeare")
    path = next((tmp_path / "shakespeare" / "train").glob("*.json"))
    data = json.loads(path.read_text())
    user = data["users"][0]
    line = data["user_data"][user]["x"][0]
    data["user_data"][user]["x"][0] = "\u00e9" + line[1:]  # same length, not in the vocabulary
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="not in LEAF's 80-symbol vocabulary") as info:
        load_dataset("shakespeare", root=tmp_path, download=False)
    assert "\n" not in str(info.value)


def test_missing_leaf_files_name_the_folder_and_source(tmp_path):
    for name in ("femnist", "shakespeare"):
        with pytest.raises(UserError) as info:
            load_dataset(name, root=tmp_path, download=True)  # nothing to download: same answer
        msg = str(info.value)
        assert msg.startswith(f"{name} files not found in ") and str(tmp_path / name) in msg
        assert LEAF_URL in msg and "train/ and test/" in msg and "\n" not in msg


def _natural(ds, clients: int, seed: int = 0):
    y, test_y = ds.train_y.numpy(), ds.test_y.numpy()
    return make_partition(y, test_y, clients, "natural", {}, seed, ds.num_classes, ds.groups)


def test_natural_partition_is_one_writer_per_client(tmp_path):
    make_femnist(tmp_path / "femnist", writers=6)
    ds = load_dataset("femnist", root=tmp_path, download=False)
    part = _natural(ds, 6)
    for k in range(6):  # all writers: client k is writer k, train and test
        assert np.array_equal(part.train[k], np.flatnonzero(ds.train_groups.numpy() == k))
        assert np.array_equal(part.test[k], np.flatnonzero(ds.test_groups.numpy() == k))
    sub = _natural(ds, 3, seed=1)
    picked = [int(np.unique(ds.train_groups.numpy()[idx])[0]) for idx in sub.train]
    assert len(set(picked)) == 3 and picked == sorted(picked)
    for idx, test_idx in zip(sub.train, sub.test, strict=True):
        assert len(np.unique(ds.train_groups.numpy()[idx])) == 1
        assert set(ds.test_groups.numpy()[test_idx]) <= set(ds.train_groups.numpy()[idx])
    again = _natural(ds, 3, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(sub.train, again.train, strict=True))
    others = {tuple(int(ds.train_groups[i[0]]) for i in _natural(ds, 3, seed=s).train) for s in range(8)}
    assert len(others) > 1  # the seed picks the writers


def test_natural_refuses_too_many_clients_and_datasets_without_clients(tmp_path):
    make_femnist(tmp_path / "femnist", writers=4)
    ds = load_dataset("femnist", root=tmp_path, download=False)
    with pytest.raises(UserError, match=r"the dataset has 4 clients .* use clients <= 4"):
        _natural(ds, 5)
    synthetic = load_dataset("synthetic")
    with pytest.raises(UserError) as info:
        _natural(synthetic, 2)
    assert "needs a dataset with its own clients" in str(info.value) and "dirichlet" in str(info.value)
    assert "\n" not in str(info.value)
    # other schemes still apply to a dataset with natural clients
    part = make_partition(ds.train_y.numpy(), ds.test_y.numpy(), 2, "iid", {}, 0, ds.num_classes)
    assert sorted(np.concatenate(part.train).tolist()) == list(range(len(ds.train_y)))


def _run(tmp_path, root, **kw):
    base = dict(
        dataset__root=str(root),
        dataset__download=False,
        rounds=2,
        local__epochs=1,
        local__batch_size=8,
        engine__threads=1,
        engine__workers=1,
        output_dir=str(tmp_path / f"run-{kw.get('algorithm__name', 'fedavg')}"),
    )
    return run(**{**base, **kw})


def test_femnist_two_rounds_of_fedavg_on_natural_clients(tmp_path):
    make_femnist(tmp_path / "data" / "femnist", writers=5)
    result = _run(tmp_path, tmp_path / "data", dataset__name="femnist", model__name="simplecnn",
                  partition__scheme="natural", clients=4)  # fmt: skip
    assert result.summary["final"]["round"] == 2 and np.isfinite(result.summary["final"]["train_loss"])


@pytest.mark.parametrize("algorithm", ["fedavg", "fedgela", "fednh"])
def test_lstm_trains_on_shakespeare_roles(tmp_path, algorithm):
    make_shakespeare(tmp_path / "data" / "shakespeare", roles=4)
    result = _run(tmp_path, tmp_path / "data", dataset__name="shakespeare", model__name="lstm",
                  partition__scheme="natural", clients=4, algorithm__name=algorithm)  # fmt: skip
    final = result.summary["final"]
    assert final["round"] == 2 and np.isfinite(final["train_loss"]) and final["global_acc"] is not None


def test_an_image_model_on_token_sequences_is_one_line(tmp_path):
    make_shakespeare(tmp_path / "data" / "shakespeare", roles=3)
    with pytest.raises(UserError) as info:
        _run(tmp_path, tmp_path / "data", dataset__name="shakespeare", model__name="simplecnn",
             partition__scheme="natural", clients=3)  # fmt: skip
    assert str(info.value) == (
        "model 'simplecnn' reads images but this dataset holds token sequences of length 80; use one of: lstm"
    )
