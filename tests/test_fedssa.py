"""FedSSA (Yi et al., IJCAI 2024) and model-heterogeneous federations: the schedule, per-class aggregation,
fusion, what leaves a client, bytes, the Standalone equivalence, and heterogeneous end-to-end runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import HETERO_MODELS, seeded, tiny_client
from fedpcd.algorithms import Context, LocalTraining, LocalWork, build_algorithm
from fedpcd.algorithms.fedssa import per_class_mean, stabilisation_weight
from fedpcd.backends import run_experiment
from fedpcd.engine.federation import build_federation
from fedpcd.engine.rundir import RunDir
from fedpcd.errors import UserError
from fedpcd.models import build_model
from fedpcd.resolve import load_config

S, D = 5, 8


def _alg(num_clients: int = 3, heterogeneous: bool = False, **params):
    alg = build_algorithm("fedssa", params)
    local = LocalTraining(epochs=1, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0)
    alg.setup(Context(num_clients, S, 10, 0, local, heterogeneous=heterogeneous))
    return alg


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model("mlp", 1, S, 2, hidden=D)


def _client(labels: list[int], k: int = 0):
    return tiny_client(torch.tensor(labels), S, seed=3 + k, cid=k, local_test=True)


# ----- schedule (Sec. 4.2) -----


def test_schedule_values():
    assert [stabilisation_weight(t, 0.5, 2) for t in range(5)] == pytest.approx(
        [0.5, 0.5 * math.sqrt(0.5), 0.0, 0.0, 0.0], abs=1e-12
    )
    assert stabilisation_weight(1, 0.5, 2) == pytest.approx(0.353553, abs=1e-6)
    for t in range(100):
        mu = stabilisation_weight(t, 0.5, 45)
        assert mu == (pytest.approx(0.5 * math.cos(math.pi * t / 90)) if t <= 45 else 0.0)
        assert 0.0 <= mu <= 0.5
    assert stabilisation_weight(0, 0.7, 0) == 0.0


def test_default_t_stable_is_2_and_null_follows_the_official_scripts():
    assert _alg(heterogeneous=True).stable_rounds() == 2
    assert _alg(heterogeneous=False).stable_rounds() == 2  # 45 only with its whole setting (preset official)
    assert _alg(heterogeneous=True, t_stable=None).stable_rounds() == 2
    assert _alg(heterogeneous=False, t_stable=None).stable_rounds() == 45
    assert _alg(t_stable=7).stable_rounds() == 7
    assert _alg(case="B").mu(0) == 0.0 and _alg(case="A").mu(0) == 0.0 and _alg().mu(0) == 0.5


# ----- per-class aggregation (Eq. 3) -----


def _fig1_uploads():
    g = torch.Generator().manual_seed(0)
    c1 = (torch.tensor([0, 1]), torch.randn(2, D, generator=g), torch.randn(2, generator=g))
    c2 = (torch.tensor([0, 1, 2]), torch.randn(3, D, generator=g), torch.randn(3, generator=g))
    c3 = (torch.tensor([1]), torch.randn(1, D, generator=g), torch.randn(1, generator=g))
    return c1, c2, c3


def test_per_class_mean_on_the_papers_figure_1_example():
    prev_w, prev_b = torch.randn(S, D), torch.randn(S)
    c1, c2, c3 = _fig1_uploads()
    w, b = per_class_mean(prev_w, prev_b, [c1, c2, c3])
    assert torch.allclose(w[0], (c1[1][0] + c2[1][0]) / 2) and torch.allclose(b[0], (c1[2][0] + c2[2][0]) / 2)
    assert torch.allclose(w[1], (c1[1][1] + c2[1][1] + c3[1][0]) / 3)
    assert torch.allclose(b[1], (c1[2][1] + c2[2][1] + c3[2][0]) / 3)
    assert torch.equal(w[2], c2[1][2]) and torch.equal(b[2], c2[2][2])
    assert torch.equal(w[3:], prev_w[3:]) and torch.equal(b[3:], prev_b[3:])  # nobody held 3, 4
    w2, b2 = per_class_mean(prev_w, prev_b, [c3, c1, c2])  # client order does not matter
    assert torch.allclose(w, w2) and torch.allclose(b, b2)


def test_aggregate_is_unweighted_and_learns_each_clients_classes():
    alg = _alg()
    server = alg.init_server(_model())
    prev = server["weight"].clone()
    replies = [
        {"client": k, "classes": cls, "weight": w, "bias": b, "num_samples": n}
        for k, ((cls, w, b), n) in enumerate(zip(_fig1_uploads(), [1, 50, 1000], strict=True))
    ]
    server = alg.aggregate(server, replies)
    w, b = per_class_mean(prev, alg.init_server(_model())["bias"], [alg.upload_rows(r) for r in replies])
    assert torch.equal(server["weight"], w) and torch.equal(server["bias"], b)  # n_k plays no part
    assert server["seen"].tolist() == [
        [True, True, False, False, False],
        [True, True, True, False, False],
        [False, True, False, False, False],
    ]
    assert server["known"].tolist() == [True, True, True]
    payload = alg.payload_for(server, 1)  # now only the seen rows go down
    assert torch.equal(payload["weight"], server["weight"][:3]) and torch.equal(
        payload["bias"], server["bias"][:3]
    )


def test_first_download_is_the_whole_header_and_case_a_always_is():
    alg = _alg()
    server = alg.init_server(_model())
    assert alg.payload_for(server, 0)["weight"].shape == (S, D)
    server["known"][0] = True
    server["seen"][0, [1, 3]] = True
    assert alg.payload_for(server, 0)["weight"].shape == (2, D)
    assert _alg(case="A").payload_for(server, 0)["weight"].shape == (S, D)


# ----- fusion (Eq. 4) and what leaves the client -----


def test_fusion_is_literal_on_seen_rows_and_leaves_everything_else():
    alg = _alg(mu0=0.5, t_stable=2)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    payload = {"weight": torch.randn(2, D, generator=g), "bias": torch.randn(2, generator=g)}
    alg.fuse(model, payload, torch.tensor([1, 3]), 2)  # round 2, t = 1: mu = 0.5 cos(pi/4)
    mu = 0.5 * math.cos(math.pi / 4)
    after = model.state_dict()
    assert torch.allclose(
        after["head.weight"][[1, 3]], payload["weight"] + mu * before["head.weight"][[1, 3]]
    )
    assert torch.allclose(after["head.bias"][[1, 3]], payload["bias"] + mu * before["head.bias"][[1, 3]])
    for k in before:
        rows = [0, 2, 4] if k.startswith("head.") else slice(None)
        assert torch.equal(after[k][rows], before[k][rows])  # unseen rows and the extractor: untouched


def test_convex_fusion_and_case_a():
    model, ref = _model(), _model()
    g = {"weight": torch.randn(S, D), "bias": torch.randn(S)}
    _alg(mu0=0.5, fusion="convex", t_stable=2).fuse(model, g, torch.tensor([0]), 1)
    assert torch.allclose(model.head.weight[0], 0.5 * g["weight"][0] + 0.5 * ref.head.weight[0])
    model = _model()
    _alg(case="A").fuse(model, g, torch.tensor([0]), 1)
    assert torch.equal(model.head.weight, g["weight"]) and torch.equal(model.head.bias, g["bias"])


def test_only_seen_rows_leave_the_client_and_the_state_is_the_whole_model():
    alg = _alg()
    model = _model()
    server = alg.init_server(model)
    reply, state = alg.local_update(
        model, _client([0, 0, 3, 3, 3, 0]), LocalWork(alg.payload_for(server, 0), None, seeded())
    )
    tensors = {k for k, v in reply.items() if isinstance(v, torch.Tensor)}
    assert tensors == {"classes", "weight", "bias"}
    assert reply["classes"].tolist() == [0, 3]
    assert torch.equal(reply["weight"], model.head.weight[[0, 3]]) and torch.equal(
        reply["bias"], model.head.bias[[0, 3]]
    )
    assert state.keys() == model.state_dict().keys()


def test_zero_filled_upload_gives_the_same_global_header():
    data = [_client([0, 1, 1], 0), _client([1, 2, 2, 4], 1)]
    headers = {}
    for upload in ("seen_rows", "zero_filled"):
        alg = _alg(num_clients=2, upload=upload)
        server = alg.init_server(_model())
        replies = []
        for k, d in enumerate(data):
            reply, _ = alg.local_update(
                _model(k + 1), d, LocalWork(alg.payload_for(server, k), None, seeded(k))
            )
            replies.append(reply)
        if upload == "zero_filled":
            assert all(r["weight"].shape == (S, D) for r in replies)
            assert [r["mask"].nonzero().flatten().tolist() for r in replies] == [[0, 1], [1, 2, 4]]
            assert torch.all(replies[0]["weight"][[2, 3, 4]] == 0)
        server = alg.aggregate(server, replies)
        headers[upload] = (server["weight"], server["bias"])
    assert torch.equal(headers["seen_rows"][0], headers["zero_filled"][0])
    assert torch.equal(headers["seen_rows"][1], headers["zero_filled"][1])


# ----- end to end -----

SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=16", "local.batch_size=32", "rounds=3"]


def _run(tmp_path, name: str, *extra: str):
    out = tmp_path / name
    run_experiment(load_config(None, [*SMALL, *extra, f"output_dir={out}"]), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, RunDir(out).load_checkpoint()


def test_disjoint_classes_and_mu0_zero_equal_standalone_exactly(tmp_path):
    common = ["clients=5", "partition.scheme=fedssa", "partition.classes_per_client=2"]  # m = 1: disjoint
    rows_ssa, ck_ssa = _run(tmp_path, "ssa", *common, "algorithm.name=fedssa", "algorithm.mu0=0.0")
    rows_loc, ck_loc = _run(tmp_path, "loc", *common, "algorithm.name=local")
    for k, state in ck_loc["client_states"].items():
        assert all(torch.equal(state[key], ck_ssa["client_states"][k][key]) for key in state)
    assert [r["client_pa_split"] for r in rows_ssa] == [r["client_pa_split"] for r in rows_loc]


def test_bytes_per_round_are_the_seen_rows(tmp_path):
    rows, ck = _run(tmp_path, "b", "clients=4", "algorithm.name=fedssa")
    seen = ck["server"]["seen"].sum(1).tolist()  # |S_k| (pathological P4C2 here: 2 each)
    row = 4 * (16 + 1)  # one float32 row of W and its bias
    assert rows[0]["bytes_down"] == 4 * 10 * row  # first contact: the whole header
    for r in rows[1:]:
        assert r["bytes_down"] == sum(s * row for s in seen)
    for r in rows:
        assert r["bytes_up"] == sum(s * (row + 8) for s in seen)  # rows + int64 class ids


def test_full_participation_cached_all_equals_participants(tmp_path):
    _, a = _run(tmp_path, "p", "clients=4", "algorithm.name=fedssa")
    _, b = _run(tmp_path, "c", "clients=4", "algorithm.name=fedssa", "algorithm.aggregation=cached_all")
    assert torch.equal(a["server"]["weight"], b["server"]["weight"])
    assert torch.equal(a["server"]["bias"], b["server"]["bias"])


def test_partial_participation_cached_all_differs_and_keeps_stale_rows(tmp_path):
    args = ["clients=6", "participation=0.5", "algorithm.name=fedssa"]
    _, a = _run(tmp_path, "p", *args)
    _, b = _run(tmp_path, "c", *args, "algorithm.aggregation=cached_all")
    assert not torch.equal(a["server"]["weight"], b["server"]["weight"])
    known = b["server"]["known"]
    assert known.sum() >= 3 and b["server"]["cache_weight"].shape == (6, 10, 16)


HETERO = [*HETERO_MODELS, "clients=5", "rounds=2"]


@pytest.mark.parametrize("name", ["fedssa", "local", "lgfedavg"])
def test_model_heterogeneous_run(tmp_path, name):
    out = tmp_path / name
    run_experiment(
        load_config(None, [*HETERO, f"algorithm.name={name}", f"output_dir={out}"]), progress=False
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(r["global_acc"] is None for r in rows)
    assert all(0.0 <= r["personal_acc"] <= 1.0 for r in rows)
    states = RunDir(out).load_checkpoint()["client_states"]
    if name != "lgfedavg":
        assert states[0]["fc1.weight"].shape == (2000, 32) and states[4]["fc1.weight"].shape == (500, 32)


def test_heterogeneous_models_need_a_heterogeneous_algorithm():
    with pytest.raises(UserError, match="'fedavg' needs one architecture.*fedssa.*local"):
        load_config(None, [*HETERO, "algorithm.name=fedavg"])
    with pytest.raises(UserError, match="model.clients names client 9"):
        load_config(None, [*HETERO, "algorithm.name=fedssa", "model.clients={9: cnn1}"])


def test_engine_gives_each_client_its_architecture_and_fresh_weights():
    config = load_config(None, [*HETERO, "algorithm.name=fedssa", "model.clients={2: cnn5}"])
    fed = build_federation(config)
    assert [config.model.architecture(k) for k in range(5)] == ["cnn1", "cnn2", "cnn5", "cnn4", "cnn5"]
    m0, m5 = fed.model_for(0), fed.model_for(4)
    assert m0.fc1.out_features == 2000 and m5.fc1.out_features == 500 and fed.model_for(2) is m5
    initial = m5.fc1.weight.detach().clone()
    with torch.no_grad():
        m5.fc1.weight.add_(1.0)
    assert fed.model_for(4) is m5 and not torch.equal(m5.fc1.weight, initial)  # reused as it is
    assert torch.equal(fed.model_for(4, fresh=True).fc1.weight, initial)  # reset for a client without state
    assert fed.context.heterogeneous
