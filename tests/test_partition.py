"""Partition schemes: property tests over random sizes and seeds, exact hand-checkable cases, bad input."""

from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpcd.data.partition import (
    PARTITIONERS,
    Partition,
    SchemeSplit,
    local_test_split,
    longtail_sizes,
    make_partition,
    resolve_params,
    scheme_params,
)
from fedpcd.errors import UserError

PROP = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw: st.DrawFn, per_client: int = 0) -> dict:
    """Random labels: C in 2..20, K in 1..30, N up to ~2000 (more when ``per_client`` demands it), every
    class with >= max(1, per_client * K, K / C) samples."""
    num_classes = draw(st.integers(2, 20))
    num_clients = draw(st.integers(1, 30))
    lo = max(1, per_client * num_clients, -(-num_clients // num_classes))
    base = draw(st.integers(lo, max(lo, 60)))
    extra = draw(st.integers(0, 400))
    seed = draw(st.integers(0, 2**32 - 1))
    data_rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    labels = np.concatenate(
        [np.repeat(np.arange(num_classes), base), data_rng.integers(num_classes, size=extra)]
    )
    test = np.concatenate([np.repeat(np.arange(num_classes), 3), data_rng.integers(num_classes, size=100)])
    return {
        "y": data_rng.permutation(labels),
        "yt": data_rng.permutation(test),
        "K": num_clients,
        "C": num_classes,
        "seed": seed,
    }


def check_common(part: Partition, y: np.ndarray, yt: np.ndarray, num_clients: int, complete: bool) -> None:
    """Shape, range and disjointness of train and local test indices; test classes within train classes."""
    assert len(part.train) == len(part.test) == num_clients
    for arrays, n in ((part.train, len(y)), (part.test, len(yt))):
        flat = np.concatenate(arrays)
        assert all(a.dtype == np.int64 and a.ndim == 1 for a in arrays)
        assert flat.size == 0 or (flat.min() >= 0 and flat.max() < n)
        assert np.unique(flat).size == flat.size, "indices overlap"
    if complete:
        assert np.array_equal(np.sort(np.concatenate(part.train)), np.arange(len(y)))
    train_counts, test_counts = part.train_counts(y), part.test_counts(yt)
    assert not ((test_counts > 0) & (train_counts == 0)).any(), "local test holds a class the client lacks"


def assert_same(a: Partition, b: Partition) -> None:
    assert a.num_classes == b.num_classes
    for x, z in zip(a.train + a.test, b.train + b.test, strict=True):
        assert np.array_equal(x, z)


# ------------------------------------------------------------------------------------------- properties


@PROP
@given(problems())
def test_iid_properties(p: dict) -> None:
    part = make_partition(p["y"], p["yt"], p["K"], "iid", {}, p["seed"])
    check_common(part, p["y"], p["yt"], p["K"], complete=True)
    sizes = [len(a) for a in part.train]
    assert max(sizes) - min(sizes) <= 1


@PROP
@given(problems(), st.sampled_from([0.05, 0.5, 5.0]), st.booleans())
def test_dirichlet_properties(p: dict, beta: float, cap: bool) -> None:
    params = {"beta": beta, "min_size": 0, "cap_fair_share": cap}
    part = make_partition(p["y"], p["yt"], p["K"], "dirichlet", params, p["seed"])
    check_common(part, p["y"], p["yt"], p["K"], complete=True)
    if cap:  # a client stops receiving once it holds its fair share: it overshoots by less than one class
        sizes = np.array([len(a) for a in part.train])
        assert sizes.max() < len(p["y"]) / p["K"] + np.bincount(p["y"]).max()


@PROP
@given(problems(per_client=1), st.data())
def test_pathological_properties(p: dict, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, p["C"]))
    K, C = p["K"], p["C"]
    part = make_partition(p["y"], p["yt"], K, "pathological", {"classes_per_client": k}, p["seed"])
    check_common(part, p["y"], p["yt"], K, complete=K * k >= C)
    counts = part.train_counts(p["y"])
    held = counts > 0
    assert (held.sum(axis=1) == k).all(), "every client holds exactly k distinct classes"
    if K * k >= C:
        assert held.any(axis=0).all(), "every class is held when K*k >= C"
    for slot in range(min(C, K * k)):  # the in-order first pass
        assert held[slot // k, slot]
    for c in range(C):  # holders of a class share it equally (+-1)
        shares = counts[held[:, c], c]
        if shares.size:
            assert shares.max() - shares.min() <= 1


@PROP
@given(problems(per_client=2), st.integers(1, 3))
def test_shards_properties(p: dict, s: int) -> None:
    part = make_partition(p["y"], p["yt"], p["K"], "shards", {"shards_per_client": s}, p["seed"])
    check_common(part, p["y"], p["yt"], p["K"], complete=True)
    shard = len(p["y"]) / (p["K"] * s)
    sizes = np.array([len(a) for a in part.train])
    assert (sizes >= s * math.floor(shard)).all() and (sizes <= s * math.ceil(shard)).all()


@PROP
@given(
    problems(per_client=1),
    st.floats(1.0, 100.0),
    st.sampled_from(
        [
            {"scheme": "iid"},
            {"scheme": "dirichlet", "min_size": 0},
            {"scheme": "shards", "shards_per_client": 1},
        ]
    ),
)
def test_longtail_properties(p: dict, rho: float, then: dict) -> None:
    y = p["y"]
    part = make_partition(y, p["yt"], p["K"], "longtail", {"rho": rho, "then": then}, p["seed"])
    check_common(part, y, p["yt"], p["K"], complete=False)
    counts = np.bincount(y, minlength=p["C"])
    expected = np.minimum(longtail_sizes(int(counts.max()), p["C"], rho), counts)
    assert np.array_equal(part.train_counts(y).sum(axis=0), expected), (
        "the inner schemes are complete on the pool"
    )


@PROP
@given(problems(per_client=2), st.data())
def test_fedssa_properties(p: dict, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, p["C"]))
    y, yt, K, C = p["y"], p["yt"], p["K"], p["C"]
    part = make_partition(y, yt, K, "fedssa", {"classes_per_client": k}, p["seed"])
    check_common(part, y, yt, K, complete=False)
    # Replay with the same generator to see the (class, proportion) lists behind the partition.
    rng = np.random.default_rng(p["seed"])
    raw = PARTITIONERS.get("fedssa")(y, K, C, rng, classes_per_client=k)
    assert isinstance(raw, SchemeSplit) and raw.test_split is not None
    test_again = raw.test_split(yt, rng)
    assert_same(part, Partition(C, list(raw), test_again))
    m = raw.info["slots_per_class"]
    lo, hi = 0.4 / (0.4 + 0.6 * (m - 1)), 0.6 / (0.6 + 0.4 * (m - 1))
    n_train, n_test = np.bincount(y, minlength=C), np.bincount(yt, minlength=C)
    train_counts, test_counts = part.train_counts(y), part.test_counts(yt)
    used = np.zeros(C)
    for i, picks in enumerate(raw.info["picks"]):
        classes = [c for c, _ in picks]
        assert len(set(classes)) == k
        assert set(np.flatnonzero(train_counts[i])) == set(classes)
        for c, share in picks:
            assert lo - 1e-12 <= share <= hi + 1e-12
            assert train_counts[i, c] == math.floor(n_train[c] * share)
            assert test_counts[i, c] == math.floor(n_test[c] * share)
            used[c] += share
    assert (used <= 1 + 1e-9).all()


@PROP
@given(problems(), st.data())
def test_explicit_roundtrip(p: dict, data: st.DataObject) -> None:
    owner = np.random.default_rng(p["seed"]).integers(-1, p["K"], size=len(p["y"]))  # -1: unused
    lists = [np.flatnonzero(owner == i).tolist() for i in range(p["K"])]
    keyed = data.draw(st.booleans())
    payload = {str(i): v for i, v in enumerate(lists)} if keyed else {"clients": lists}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "part.json"
        path.write_text(json.dumps(payload))
        if not any(lists):  # a file of empty clients only is refused (nothing to train)
            with pytest.raises(UserError, match="every client's list is empty"):
                make_partition(p["y"], p["yt"], p["K"], "explicit", {"path": str(path)}, p["seed"])
            return
        part = make_partition(p["y"], p["yt"], p["K"], "explicit", {"path": str(path)}, p["seed"])
    check_common(part, p["y"], p["yt"], p["K"], complete=False)
    for got, want in zip(part.train, lists, strict=True):
        assert got.tolist() == want


SCHEMES = [
    ("iid", {}),
    ("dirichlet", {"beta": 0.3, "min_size": 0}),
    ("dirichlet", {"beta": 0.3, "min_size": 0, "cap_fair_share": True}),
    ("pathological", {"classes_per_client": 2}),
    ("pathological", {"classes_per_client": 2, "legacy_duplicate": True}),
    ("shards", {}),
    ("longtail", {"rho": 5.0, "then": {"scheme": "dirichlet", "min_size": 0}}),
    ("fedssa", {"classes_per_client": 2}),
]


@PROP
@given(problems(per_client=4), st.sampled_from(SCHEMES), st.integers(0, 1000), st.integers(0, 1000))
def test_deterministic_and_pure(p: dict, scheme: tuple, g1: int, g2: int) -> None:
    name, params = scheme
    np.random.seed(g1)
    random.seed(g1)
    a = make_partition(p["y"], p["yt"], p["K"], name, params, p["seed"])
    np.random.seed(g2)
    random.seed(g2)
    np.random.random(17)
    b = make_partition(p["y"], p["yt"], p["K"], name, params, p["seed"])
    assert_same(a, b)


# -------------------------------------------------------------------------------------- exact examples


BALANCED = np.repeat(np.arange(10), 100)
BALANCED_TEST = np.repeat(np.arange(10), 20)


def test_p10c2_first_pass_and_equal_shares() -> None:
    part = make_partition(BALANCED, BALANCED_TEST, 10, "pathological", {"classes_per_client": 2}, 0)
    counts = part.train_counts(BALANCED)
    for i in range(5):
        assert set(np.flatnonzero(counts[i])) == {2 * i, 2 * i + 1}
    for c in range(10):
        holders = np.flatnonzero(counts[:, c])
        share = counts[holders, c]
        assert share.sum() == 100 and share.max() - share.min() <= 1
        assert sorted(share.tolist(), reverse=True) == [
            len(x) for x in np.array_split(np.arange(100), len(holders))
        ]
    assert (part.test_counts(BALANCED_TEST).sum(axis=0) == 20).all()  # every class held: whole test set used


def test_p5c2_is_fully_disjoint() -> None:
    part = make_partition(BALANCED, BALANCED_TEST, 5, "pathological", {}, 3)
    expected = np.kron(np.eye(5, dtype=np.int64), np.array([[100, 100]]))
    assert np.array_equal(part.train_counts(BALANCED), expected)
    assert np.array_equal(part.test_counts(BALANCED_TEST), expected // 5)


def test_pathological_legacy_duplicate_doubles_counts() -> None:
    single = make_partition(BALANCED, BALANCED_TEST, 10, "pathological", {}, 1)
    double = make_partition(BALANCED, BALANCED_TEST, 10, "pathological", {"legacy_duplicate": True}, 1)
    assert np.array_equal(double.train_counts(BALANCED), 2 * single.train_counts(BALANCED))
    flat = np.concatenate(double.train)
    assert np.array_equal(np.bincount(flat, minlength=1000), np.full(1000, 2))  # every sample exactly twice
    # P5C2: sole holders get every one of their samples twice
    sole = make_partition(BALANCED, BALANCED_TEST, 5, "pathological", {"legacy_duplicate": True}, 0)
    assert len(sole.train[0]) == 400 and len(np.unique(sole.train[0])) == 200


def test_local_test_split_hand_example() -> None:
    train_counts = np.array([[3, 0, 0], [1, 0, 0], [0, 2, 0]])
    test_labels = np.array([0] * 8 + [1] * 5 + [2] * 4)
    parts = local_test_split(train_counts, test_labels, np.random.default_rng(0))
    assert [len(p) for p in parts] == [6, 2, 5]  # class 0: cuts floor(0.75*8)=6, 8; class 1 all to client 2
    assert set(test_labels[parts[0]]) == {0} and set(test_labels[parts[1]]) == {0}
    assert set(test_labels[parts[2]]) == {1}
    flat = np.concatenate(parts)
    assert (
        len(np.unique(flat)) == 13 and not (test_labels[flat] == 2).any()
    )  # class 2: held by nobody, unused


def test_local_test_split_follows_train_mix() -> None:
    train_counts = np.array([[10, 30], [30, 10]])
    parts = local_test_split(train_counts, np.repeat([0, 1], 100), np.random.default_rng(1))
    assert [np.bincount(np.repeat([0, 1], 100)[p], minlength=2).tolist() for p in parts] == [
        [25, 75],
        [75, 25],
    ]


def test_longtail_sizes_follow_profile() -> None:
    y = np.repeat(np.arange(10), 500)
    part = make_partition(y, BALANCED_TEST, 5, "longtail", {"rho": 10.0, "then": {"scheme": "iid"}}, 0)
    sizes = part.train_counts(y).sum(axis=0)
    assert sizes.tolist() == [math.floor(500 * 10 ** (-c / 9)) for c in range(10)]
    assert sizes[0] == 500 and sizes[-1] == 50


def test_longtail_fedsc_cifar10_pool_size() -> None:
    # FedSC: CIFAR-10 at rho=10 keeps 20,431 samples (its official code's long-tail pool).
    y = np.repeat(np.arange(10), 5000)
    part = make_partition(y, BALANCED_TEST, 10, "longtail", {"rho": 10.0}, 0)
    assert sum(len(a) for a in part.train) == 20431


def test_longtail_n_max_is_largest_class_and_small_classes_keep_all() -> None:
    y = np.concatenate([np.repeat(0, 20), np.repeat(1, 200), np.repeat(2, 5)])
    part = make_partition(y, np.arange(3), 2, "longtail", {"rho": 2.0, "then": {"scheme": "iid"}}, 0)
    # n_max = 200: targets 200, 141, 100; class 0 has 20 and class 2 has 5, so both keep all they have
    assert part.train_counts(y).sum(axis=0).tolist() == [20, 141, 5]


def test_longtail_then_defaults_merge() -> None:
    y = np.repeat(np.arange(4), 50)
    a = make_partition(y, y, 3, "longtail", {"then": {"min_size": 1}}, 4)
    b = make_partition(y, y, 3, "longtail", {"then": {"scheme": "dirichlet", "beta": 0.2, "min_size": 1}}, 4)
    assert_same(a, b)
    c = make_partition(y, y, 3, "longtail", {"then": {"scheme": "pathological", "classes_per_client": 2}}, 4)
    assert ((c.train_counts(y) > 0).sum(axis=1) == 2).all()


def test_fedssa_cifar_like_structure() -> None:
    y = np.repeat(np.arange(10), 400)
    part = make_partition(y, BALANCED_TEST, 10, "fedssa", {"classes_per_client": 2}, 0)
    held = part.train_counts(y) > 0
    assert (held.sum(axis=1) == 2).all() and (held.sum(axis=0) == 2).all()  # m = 2: each class has 2 holders
    assert np.array_equal(part.test_counts(BALANCED_TEST) > 0, held)
    # CIFAR-100-like, N=10, k=10: m=1, so the class sets are disjoint and each client takes whole classes
    y100 = np.repeat(np.arange(100), 40)
    part = make_partition(y100, np.repeat(np.arange(100), 10), 10, "fedssa", {"classes_per_client": 10}, 0)
    counts = part.train_counts(y100)
    assert ((counts > 0).sum(axis=0) == 1).all() and set(counts[counts > 0].tolist()) == {40}


def test_fedssa_official_rule_can_repeat_a_class_distinct_never_does() -> None:
    y = np.repeat(np.arange(10), 400)
    fewer = []
    for rule in ("distinct", "official"):
        part = make_partition(y, BALANCED_TEST, 100, "fedssa", {"classes_per_client": 4, "rule": rule}, 0)
        held = (part.train_counts(y) > 0).sum(axis=1)
        fewer.append(int((held < 4).sum()))
        sizes = [len(ix) for ix in part.train]
        assert len(np.concatenate(part.train)) == len(set(np.concatenate(part.train).tolist())) == sum(sizes)
    assert fewer[0] == 0 and fewer[1] > 0  # some clients hold < 4 classes under the official pick
    with pytest.raises(
        UserError, match=r"'partition.rule' .* \('other'\): valid choices: distinct, official"
    ):
        make_partition(y, BALANCED_TEST, 10, "fedssa", {"rule": "other"}, 0)


def test_fedssa_proportions_train_vs_test() -> None:
    y = np.repeat(np.arange(5), 1000)
    yt = np.repeat(np.arange(5), 200)
    part = make_partition(y, yt, 8, "fedssa", {"classes_per_client": 3}, 2)
    tr, te = part.train_counts(y) / 1000, part.test_counts(yt) / 200
    assert np.abs(tr - te).max() <= 1 / 200 + 1e-12  # same proportions, floor rounding apart
    m = math.ceil(3 * 8 / 5)
    nonzero = tr[tr > 0]
    assert nonzero.min() >= math.floor(1000 * 0.4 / (0.4 + 0.6 * (m - 1))) / 1000
    assert nonzero.max() <= 0.6 / (0.6 + 0.4 * (m - 1))


def test_dirichlet_seeded() -> None:
    params = {"beta": 0.1}
    a = make_partition(BALANCED, BALANCED_TEST, 10, "dirichlet", params, 0)
    b = make_partition(BALANCED, BALANCED_TEST, 10, "dirichlet", params, 0)
    c = make_partition(BALANCED, BALANCED_TEST, 10, "dirichlet", params, 1)
    assert_same(a, b)
    assert not np.array_equal(a.train_counts(BALANCED), c.train_counts(BALANCED))
    assert min(len(t) for t in a.train) >= 10


def test_dirichlet_min_size_gives_up_with_clear_message() -> None:
    y = np.repeat(np.arange(10), 20)
    with pytest.raises(UserError, match=r"min_size=9.*larger beta, a smaller min_size or fewer clients"):
        make_partition(y, y, 20, "dirichlet", {"beta": 0.01, "min_size": 9, "max_retries": 200}, 0)
    with pytest.raises(UserError, match="needs 2000 samples but there are only 200"):
        make_partition(y, y, 20, "dirichlet", {"min_size": 100}, 0)


def test_shards_fedavg_example() -> None:
    part = make_partition(BALANCED, BALANCED_TEST, 10, "shards", {"shards_per_client": 2}, 0)
    counts = part.train_counts(BALANCED)
    assert set(counts[counts > 0].tolist()) <= {50, 100}  # 20 shards of 50: each lies inside one class
    assert (counts.sum(axis=1) == 100).all()


def test_scheme_params() -> None:
    assert scheme_params("dirichlet") == {
        "beta": 0.5,
        "min_size": 10,
        "cap_fair_share": False,
        "max_retries": 1000,
    }
    assert scheme_params("pathological") == {"classes_per_client": 2, "legacy_duplicate": False}
    assert scheme_params("iid") == {}
    then = scheme_params("longtail")["then"]
    then["beta"] = 99
    assert scheme_params("longtail")["then"] == {"scheme": "dirichlet", "beta": 0.2}  # a copy each time
    assert set(PARTITIONERS.names()) == {
        "iid", "dirichlet", "pathological", "shards", "longtail", "fedssa", "nid2", "explicit", "natural",
        "flwr:shard", "flwr:linear", "flwr:square", "flwr:exponential", "flwr:inner_dirichlet",
        "flwr:pathological",
    }  # fmt: skip


def test_resolve_params_fills_nested_then() -> None:
    assert resolve_params("longtail", {"rho": 50, "then": {"beta": 0.05}}) == {
        "rho": 50.0,
        "then": {
            "scheme": "dirichlet",
            "beta": 0.05,
            "min_size": 10,
            "cap_fair_share": False,
            "max_retries": 1000,
        },
    }
    assert resolve_params("longtail", {"then": {"scheme": "pathological"}})["then"] == {
        "scheme": "pathological",
        "classes_per_client": 2,
        "legacy_duplicate": False,
    }
    assert resolve_params("iid") == {}
    with pytest.raises(UserError, match="unknown parameter 'k'"):
        resolve_params("fedssa", {"k": 3})


def test_params_accept_int_or_yaml_string_for_float_and_scheme_key() -> None:
    a = make_partition(BALANCED, BALANCED_TEST, 4, "dirichlet", {"beta": 1, "scheme": "dirichlet"}, 0)
    b = make_partition(BALANCED, BALANCED_TEST, 4, "dirichlet", {"beta": 1.0}, 0)
    c = make_partition(
        BALANCED, BALANCED_TEST, 4, "dirichlet", {"beta": "1e0"}, 0
    )  # YAML 1.1: "1e0" is a str
    assert_same(a, b)
    assert_same(a, c)


# ------------------------------------------------------------------------------------------- bad input


def test_unknown_scheme_lists_valid() -> None:
    with pytest.raises(
        UserError, match="unknown partition scheme 'nope'; valid choices: dirichlet, explicit"
    ):
        make_partition(BALANCED, BALANCED_TEST, 2, "nope", {}, 0)
    with pytest.raises(UserError, match="valid choices"):
        scheme_params("nope")


def test_unknown_param_lists_valid_keys() -> None:
    with pytest.raises(UserError, match=r"unknown parameter 'alpha'.*valid parameters: beta, cap_fair_share"):
        make_partition(BALANCED, BALANCED_TEST, 2, "dirichlet", {"alpha": 0.1}, 0)
    with pytest.raises(UserError, match=r"unknown parameter 'beta'.*'iid'; valid parameters: \(none\)"):
        make_partition(BALANCED, BALANCED_TEST, 2, "iid", {"beta": 0.1}, 0)


@pytest.mark.parametrize(
    ("scheme", "params", "pattern"),
    [
        ("dirichlet", {"beta": "abc"}, r"'partition.beta' .* \('abc'\): expected a finite number > 0$"),
        ("dirichlet", {"beta": 0.0}, r"'partition.beta' .* \(0.0\): expected a finite number > 0$"),
        ("dirichlet", {"beta": True}, r"'partition.beta' .* \(True\): expected a finite number > 0$"),
        ("dirichlet", {"min_size": 2.5}, r"'partition.min_size' .* \(2.5\): expected an integer >= 0$"),
        ("dirichlet", {"cap_fair_share": "yes"}, "'partition.cap_fair_share' .*: expected true or false$"),
        ("dirichlet", {"cap_fair_share": 1}, "'partition.cap_fair_share' .*: expected true or false$"),
        ("pathological", {"classes_per_client": 11}, r"between 1 and the number of classes \(10\)"),
        (
            "pathological",
            {"classes_per_client": 0},
            "'partition.classes_per_client' .*: expected an integer >= 1",
        ),
        ("fedssa", {"classes_per_client": 11}, "between 1 and the number of classes"),
        ("shards", {"shards_per_client": 0}, "'partition.shards_per_client' .*: expected an integer >= 1"),
        ("shards", {"shards_per_client": 200}, "only 1000 samples"),
        ("longtail", {"rho": 0.5}, r"'partition.rho' of partition scheme 'longtail' \(0.5\): .* >= 1$"),
        ("longtail", {"then": {"scheme": "longtail"}}, "cannot be 'longtail'; valid choices"),
        ("longtail", {"then": {"scheme": "dirichlet", "alpha": 1}}, "unknown parameter 'alpha'"),
        (
            "longtail",
            {"then": {"beta": -1}},
            r"'partition.then.beta' .* \(-1\): expected a finite number > 0",
        ),
        ("longtail", {"then": "iid"}, "expected a mapping"),
        ("nid2", {"biased_clients": 0}, "'partition.biased_clients' .*: expected an integer >= 1"),
        ("explicit", {"path": 3}, "'partition.path' .*: expected a string"),
        ("explicit", {}, "needs 'path'"),
    ],
)
def test_bad_values(scheme: str, params: dict, pattern: str) -> None:
    with pytest.raises(UserError, match=pattern):
        make_partition(BALANCED, BALANCED_TEST, 10, scheme, params, 0)


def test_bad_inputs() -> None:
    with pytest.raises(UserError, match=r"more clients \(11\) than samples \(10\)"):
        make_partition(np.arange(10) % 2, np.arange(4) % 2, 11, "iid", {}, 0)
    with pytest.raises(UserError, match=r"train labels must lie in \[0, 5\)"):
        make_partition(BALANCED, BALANCED_TEST, 2, "iid", {}, 0, num_classes=5)
    with pytest.raises(UserError, match="labels must be integers"):
        make_partition(BALANCED.astype(float), BALANCED_TEST, 2, "iid", {}, 0)
    with pytest.raises(UserError, match="positive integer"):
        make_partition(BALANCED, BALANCED_TEST, 0, "iid", {}, 0)
    y = np.array([0] * 10 + [1])  # class 1 has one sample but, in P3C2, three holders
    with pytest.raises(UserError, match="class 1 has 1 samples, fewer than its 3 holders"):
        make_partition(y, y, 3, "pathological", {"classes_per_client": 2}, 0)
    with pytest.raises(UserError, match="fedssa partition: client"):
        make_partition(np.array([0] * 50 + [1] * 2), BALANCED_TEST[:4] % 2, 10, "fedssa", {}, 0)


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (None, "not found"),
        ("{not json", "not valid JSON at line 1"),
        ("[[0, 1], [2]]", "expected"),
        ('{"clients": [[0, 1], [1, 2]]}', "index 1 is listed more than once"),
        ('{"clients": [[0, 1], [5000]]}', r"client 1: index out of range \[0, 1000\)"),
        ('{"clients": [[0, 1]]}', "lists 1 clients but the config asks for 2"),
        ('{"0": [0], "2": [1]}', "without gaps"),
        ('{"clients": [[0, 1.5], [2]]}', "integer indices"),
        (
            json.dumps({"clients": [[0, 2**70], [2]]}),
            r"client 0: index out of range \[0, 1000\): 1180591620717411303424",
        ),
        (
            json.dumps({"clients": [[-(2**70)], [2]]}),
            r"client 0: index out of range \[0, 1000\): -1180591620717411303424",
        ),
        (
            '{"clients": [[' + "9" * 5000 + "], [2]]}",
            r"holds an integer too long to read \(over 4300 digits\)",
        ),
        ("[" * 100000 + "]" * 100000, "is nested more than 3 levels deep"),
        ('{"clients": [[[0]], [2]]}', "is nested more than 3 levels deep"),
        ('{"clients": [[], []]}', "every client's list is empty"),
        ('{"0": [0], "\u00b9": [1]}', "expected"),  # a superscript digit is no client number
        (json.dumps({"0": [0], "1" * 5000: [1]}), "expected"),
        ("\udcff", "not UTF-8 text"),
    ],
)
def test_bad_explicit_file(tmp_path: Path, content: str | None, pattern: str) -> None:
    path = tmp_path / "clients.json"
    if content is not None:
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(UserError, match=pattern) as info:
        make_partition(BALANCED, BALANCED_TEST, 2, "explicit", {"path": str(path)}, 0)
    assert str(path) in str(info.value)
