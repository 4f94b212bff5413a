"""Aggregation math and byte counting."""

from __future__ import annotations

import pytest
import torch

from fedpcd.algorithms.statedict import clone_state, tensor_bytes, weighted_average


def test_weighted_average_by_hand():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(4)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(8)}
    out = weighted_average([a, b], [1, 3])
    assert out["w"].tolist() == pytest.approx([2.5, 5.0])
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 7  # round(0.25 * 4 + 0.75 * 8)


def test_weighted_average_single_state_is_identity():
    a = {"w": torch.randn(3, 3)}
    assert torch.allclose(weighted_average([a], [17])["w"], a["w"])


def test_clone_state_is_detached_copy():
    m = torch.nn.Linear(2, 1)
    s = clone_state(m)
    with torch.no_grad():
        m.weight.add_(1.0)
    assert not torch.equal(s["weight"], m.weight)
    assert set(clone_state(m, ["bias"])) == {"bias"}


def test_tensor_bytes_nested():
    payload = {
        "model": {"a": torch.zeros(10), "b": torch.zeros(2, dtype=torch.float64)},
        "k": 3,
        "l": [torch.zeros(1)],
    }
    assert tensor_bytes(payload) == 40 + 16 + 4
