"""The codec between the engine's dicts and Flower records: exact round trips through Flower's wire format."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict  # noqa: E402
from flwr.common.serde import context_from_proto, context_to_proto, recorddict_from_proto, recorddict_to_proto  # noqa: E402

from fedpcd.flower import codec  # noqa: E402


def _wire(rd: RecordDict) -> RecordDict:
    """What the other side gets: the RecordDict through Flower's protobuf serialisation."""
    return recorddict_from_proto(recorddict_to_proto(rd))


def _same(a, b) -> bool:
    """Structural equality with exact tensors (dtype, shape, bits) and exact scalar types."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.detach().contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes()
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def _roundtrip(obj, name="x"):
    out = codec.decode(_wire(codec.record_dict(**{name: obj})), name)
    assert _same(obj, out), (obj, out)
    return out


def test_nested_payload_with_every_leaf_kind_round_trips():
    obj = {
        "model": {
            "features.0.weight": torch.randn(4, 3),
            "features.0.bias": torch.randn(4),
            "bn.num_batches_tracked": torch.tensor(7),
            "head.weight": torch.randn(2, 4, dtype=torch.float64),
        },
        "etf": {"matrix": torch.eye(3), "mask": torch.tensor([True, False, True])},
        "num_samples": 12,
        "train_loss": 0.25,
        "one": 1.0,
        "flag": True,
        "name": "fedavg",
        "blob": b"\x00\x01",
        "nothing": None,
        "empty": {},
        "deep": {"a": {"b": {"c": 3, "d": None, "e": {}}}},
        "ints": [1, 2, 3],
        "words": ["a", "b"],
        "no_list": [],
        "nan": float("nan"),
        "big": 2**62,
        "empty_tensor": torch.zeros(0, 5),
    }
    out = _roundtrip(obj)
    assert type(out["num_samples"]) is int and type(out["one"]) is float and type(out["flag"]) is bool
    assert out["model"]["bn.num_batches_tracked"].dtype == torch.int64
    assert out["model"]["bn.num_batches_tracked"].shape == ()


def test_none_and_empty_objects_round_trip():
    assert _roundtrip(None) is None
    assert _roundtrip({}) == {}
    assert _roundtrip({"a": {}}) == {"a": {}}


def test_keys_with_separators_and_odd_characters_round_trip():
    obj = {"a/b": 1, "a": {"b": 2}, "%2F": 3, "": {"": 4.0}, "x.y z": torch.ones(2), "ü": "ß"}
    out = _roundtrip(obj)
    assert out["a/b"] == 1 and out["a"] == {"b": 2} and out[""] == {"": 4.0} and out["ü"] == "ß"


def test_key_order_is_kept_across_tensors_and_scalars():
    obj = {"z": 1, "a": torch.ones(1), "m": {"q": 2.0, "b": torch.zeros(1)}, "c": None}
    out = _roundtrip(obj)
    assert list(out) == ["z", "a", "m", "c"] and list(out["m"]) == ["q", "b"]


def test_decoded_tensors_are_writable_and_independent():
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    out = _roundtrip({"t": t})
    out["t"].add_(1)  # no read-only warning, no aliasing of the message's buffer
    assert torch.equal(t, torch.arange(6, dtype=torch.float32).view(2, 3))


def test_non_contiguous_and_grad_tensors_encode():
    w = torch.randn(3, 4, requires_grad=True)
    out = codec.decode(_wire(codec.record_dict(x={"w": w, "t": w.detach().t()})), "x")
    assert torch.equal(out["w"], w.detach()) and torch.equal(out["t"], w.detach().t())


def test_records_layout_tensors_in_arrayrecord_scalars_in_configrecord():
    rd = codec.record_dict(p={"model": {"w": torch.ones(2)}, "n": 3})
    assert isinstance(rd["p.arrays"], ArrayRecord) and list(rd["p.arrays"]) == ["model/w"]
    assert isinstance(rd["p.config"], ConfigRecord) and rd["p.config"]["n"] == 3
    assert isinstance(rd["p.meta"], ConfigRecord)
    scalars_only = codec.record_dict(q={"n": 1})
    assert "q.arrays" not in scalars_only and "q.config" in scalars_only


def test_several_objects_share_one_recorddict():
    rd = _wire(codec.record_dict(reply={"num_samples": 3}, personal=None, other={"t": torch.ones(1)}))
    assert codec.decode(rd, "reply") == {"num_samples": 3}
    assert codec.decode(rd, "personal") is None
    assert torch.equal(codec.decode(rd, "other")["t"], torch.ones(1))


def test_put_replaces_previous_object_in_context_state():
    ctx = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={})
    codec.put(ctx.state, "state", {"head": {"w": torch.ones(2)}, "step": 1})
    codec.put(ctx.state, "state", {"step": 2})  # no tensors any more: the old ArrayRecord must go
    assert "state.arrays" not in ctx.state
    back = context_from_proto(context_to_proto(ctx))
    assert codec.get(back.state, "state") == {"step": 2}
    assert codec.get(back.state, "missing", default="absent") == "absent"
    codec.clear(ctx.state, "state")
    assert codec.get(ctx.state, "state") is None


def test_unsupported_values_fail_with_the_path():
    with pytest.raises(TypeError, match="deep/x"):
        codec.encode({"deep": {"x": object()}}, "p")
    with pytest.raises(TypeError, match="only str keys"):
        codec.encode({1: torch.ones(1)}, "p")
    with pytest.raises(TypeError):
        codec.encode({"mixed": [1, "a"]}, "p")
    with pytest.raises(TypeError, match="bfloat16"):
        codec.encode({"w": torch.ones(1, dtype=torch.bfloat16)}, "p")
    with pytest.raises(TypeError, match="dict or None"):
        codec.encode([1, 2], "p")
    with pytest.raises(KeyError):
        codec.decode(RecordDict(), "p")
