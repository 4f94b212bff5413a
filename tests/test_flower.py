"""The Flower backend in one process: the same numbers as the local backend.

The ServerApp's round loop against the ClientApp in this process (a Grid that calls the ClientApp through
Flower's wire format), with per-client payloads and client state in ``context.state``: every algorithm,
resume, differential privacy, SecAgg+, discovery, client failures. Flower's real processes (Ray, a
loopback deployment, signals) are tested in ``test_flower_processes.py``.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402
from flwr.app.error import Error  # noqa: E402
from flwr.common.serde import (  # noqa: E402
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
)
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from conftest import assert_same_backend_run, run_records  # noqa: E402
from fedpcd.algorithms import ALGORITHMS, FedAvg  # noqa: E402
from fedpcd.backends import run_experiment  # noqa: E402
from fedpcd.engine.tasks import payloads_for  # noqa: E402
from fedpcd.errors import UserError  # noqa: E402
from fedpcd.flower import codec  # noqa: E402
from fedpcd.flower.client_app import app as client_app  # noqa: E402
from fedpcd.flower.discovery import discover, federation_size, fit_to_federation  # noqa: E402
from fedpcd.flower.protocol import GET_STATE, STATE, TASK, raise_for_error, tag_user_error  # noqa: E402
from fedpcd.flower.server_app import config_from_run_config, serve  # noqa: E402
from fedpcd.resolve import load_config

REPO = Path(__file__).resolve().parents[1]
SMALL = ["dataset.name=synthetic", "model.name=mlp", "model.hidden=32", "local.batch_size=32"]


# ----- an algorithm with per-client payloads and client state (exercises the codec end to end) -----
@dataclass
class StatefulProbe(FedAvg):
    """FedAvg plus a per-client payload entry and a personal state (a head copy, a counter, a None)."""

    def payload_for(self, server, client_id):
        return {
            "model": server["model"],
            "client": client_id,
            "scale": torch.tensor(float(client_id + 1)),
            "extra": {"nothing": None, "empty": {}},
        }

    def local_update(self, model, data, work):
        payload, state = work.received, work.state
        assert payload["client"] == data.id and payload["extra"] == {"nothing": None, "empty": {}}
        reply, _ = super().local_update(model, data, work)
        calls = 0 if state is None else state["calls"]
        head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("head.")}
        scale = payload["scale"] * (calls + 1)
        work.state = {"calls": calls + 1, "head": head, "scale": scale, "none": None}
        return reply, work.state


@pytest.fixture
def stateful_probe():
    name = "_flower_test_stateful"
    ALGORITHMS.register(name)(StatefulProbe)
    yield name
    ALGORITHMS.unregister(name)


@pytest.fixture
def task_identity(monkeypatch):
    """Flower's Message() needs a task identity; the simulation and the runtimes set one per process."""
    for attr, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, attr, value)


class InProcessGrid(Grid):
    """Delivers each message to the ClientApp of its node in this process, through Flower's protobuf wire
    format (messages and each node's Context), and returns replies in a shuffled order."""

    def __init__(self, node_configs: list[dict], seed: int = 0) -> None:
        rng = random.Random(seed)
        self.contexts = {
            rng.getrandbits(63): Context(
                run_id=1, node_id=0, node_config=cfg, state=RecordDict(), run_config={}
            )
            for cfg in node_configs
        }
        self.replies: dict[str, Message] = {}
        self.rng = rng

    def set_run(self, run):
        pass

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid4().hex
            node = msg.metadata.dst_node_id
            wire = message_from_proto(message_to_proto(msg))
            try:
                reply = client_app(wire, self.contexts[node])
            except Exception as ex:  # what Flower's runtimes do with a ClientApp's exception
                reply = Message(Error(code=0, reason=f"{type(ex)}:<'{ex}'>"), reply_to=wire)
            self.contexts[node] = context_from_proto(context_to_proto(self.contexts[node]))
            self.replies[msg.metadata.message_id] = message_from_proto(message_to_proto(reply))
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        out = [self.replies.pop(i) for i in list(message_ids) if i in self.replies]
        self.rng.shuffle(out)
        return out

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def _nodes(n: int, with_count: bool = True) -> list[dict]:
    return [{"partition-id": k, **({"num-partitions": n} if with_count else {})} for k in range(n)]


def test_strategy_with_per_client_payloads_and_client_state_matches_local(
    tmp_path, stateful_probe, task_identity
):
    args = SMALL + [
        "clients=4",
        "rounds=3",
        "participation=0.75",
        "eval_every=2",
        "seed=3",
        f"algorithm.name={stateful_probe}",
        "partition.classes_per_client=3",
    ]
    local = load_config(None, args + [f"output_dir={tmp_path / 'local'}"])
    flower = load_config(None, args + [f"output_dir={tmp_path / 'flower'}", "backend=flower"])
    run_experiment(local, progress=False)
    grid = InProcessGrid(_nodes(4))
    summary = serve(grid, flower, node_timeout=5)
    assert_same_backend_run(tmp_path / "local", tmp_path / "flower")
    assert [r["round"] for r in run_records(tmp_path / "flower")] == [2, 3]  # eval_every=2 and the last round
    assert summary["rounds"] == 3
    # the client states live on the nodes (context.state), identical to the local backend's
    expected = torch.load(tmp_path / "local" / "checkpoint" / "state.pt", weights_only=False)["client_states"]
    by_partition = {int(c.node_config["partition-id"]): c for c in grid.contexts.values()}
    for k, want in expected.items():
        got = codec.get(by_partition[k].state, STATE)
        assert got["calls"] == want["calls"] and got["none"] is None
        assert torch.equal(got["scale"], want["scale"])
        assert all(torch.equal(got["head"][n], t) for n, t in want["head"].items())
    sampled = {k for r in run_records(tmp_path / "local") for k in r["clients"]}
    assert set(expected) <= set(range(4)) and sampled <= set(expected)
    # the checkpoint is complete: the nodes' states were fetched for it, equal to the local backend's
    got = torch.load(tmp_path / "flower" / "checkpoint" / "state.pt", weights_only=False)["client_states"]
    assert sorted(got) == sorted(expected)
    for k, want in expected.items():
        assert got[k]["calls"] == want["calls"] and torch.equal(got[k]["scale"], want["scale"])


class KilledGrid(InProcessGrid):
    """An InProcessGrid whose server process 'dies' when round ``kill_at``'s training messages are sent."""

    def __init__(self, node_configs: list[dict], kill_at: int) -> None:
        super().__init__(node_configs)
        self.kill_at = kill_at

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.metadata.group_id == str(self.kill_at) for m in messages):
            raise KeyboardInterrupt
        return super().push_messages(messages)


@pytest.mark.parametrize("name", ["_flower_test_stateful", "scaffold", "fedavg"])
def test_a_flower_run_killed_after_round_2_resumes_on_flower_to_the_uninterrupted_metrics(
    tmp_path, stateful_probe, name, task_identity
):
    """The server dies during round 3; the resume starts new nodes (empty states): the checkpoint's client
    states are sent back to them and the run ends with the local backend's (= uninterrupted) metrics."""
    args = SMALL + ["clients=4", "rounds=5", "participation=0.75", "seed=4", f"algorithm.name={name}"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    flower = load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"])
    with pytest.raises(KeyboardInterrupt):
        serve(KilledGrid(_nodes(4), kill_at=3), flower, node_timeout=5)
    assert [r["round"] for r in run_records(tmp_path / "fl")] == [1, 2]
    fresh = InProcessGrid(_nodes(4), seed=1)  # new SuperNodes: nothing in their context.state
    serve(fresh, flower, node_timeout=5, resume=True)
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")


class DeafGrid(InProcessGrid):
    """An InProcessGrid on which client 0's node does not answer the ``deaf_at``-th state query."""

    def __init__(self, node_configs: list[dict], deaf_at: int) -> None:
        super().__init__(node_configs)
        self.deaf_at, self.asked = deaf_at, 0

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        if any(m.content[TASK].get("action") == GET_STATE for m in messages):
            self.asked += 1
            if self.asked == self.deaf_at:
                for m in messages:
                    if self.contexts[m.metadata.dst_node_id].node_config["partition-id"] == 0:
                        self.replies.pop(m.metadata.message_id)
        return ids


def test_a_checkpoint_without_every_client_state_is_skipped_with_a_warning(
    tmp_path, stateful_probe, capsys, task_identity
):
    """A node that does not answer the state query of round 2: that checkpoint is skipped (one warning
    naming the client), the run goes on to the local backend's numbers and the last checkpoint is complete."""
    args = SMALL + ["clients=3", "rounds=3", "seed=6", f"algorithm.name={stateful_probe}"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    flower = load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"])
    capsys.readouterr()
    serve(DeafGrid(_nodes(3), deaf_at=2), flower, node_timeout=5, round_timeout=1)
    err = capsys.readouterr().err
    assert "round 2: no checkpoint (client state (get-state): no reply from client(s) 0 within" in err
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")
    ckpt = torch.load(tmp_path / "fl" / "checkpoint" / "state.pt", weights_only=False)
    assert ckpt["round"] == 3 and sorted(ckpt["client_states"]) == [0, 1, 2]


class StateQueryLog(InProcessGrid):
    """An InProcessGrid that records, per state query, which clients it asked."""

    def __init__(self, node_configs: list[dict]) -> None:
        super().__init__(node_configs)
        self.asked: list[list[int]] = []

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.content[TASK].get("action") == GET_STATE for m in messages):
            self.asked.append(sorted(int(m.content[TASK]["client-id"]) for m in messages))
        return super().push_messages(messages)


def test_a_checkpoint_fetches_only_the_states_of_the_clients_trained_since_the_last(
    tmp_path, stateful_probe, task_identity
):
    """Each round's checkpoint asks the round's participants only; the others' states are unchanged, and
    the checkpoints equal the local backend's."""
    args = SMALL + ["clients=4", "rounds=3", "participation=0.5", "seed=7"]
    args += [f"algorithm.name={stateful_probe}"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    grid = StateQueryLog(_nodes(4))
    serve(grid, load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"]), node_timeout=5)
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")
    assert grid.asked == [r["clients"] for r in run_records(tmp_path / "fl")]
    want = torch.load(tmp_path / "local" / "checkpoint" / "state.pt", weights_only=False)["client_states"]
    got = torch.load(tmp_path / "fl" / "checkpoint" / "state.pt", weights_only=False)["client_states"]
    assert sorted(got) == sorted(want) and all(got[k]["calls"] == want[k]["calls"] for k in want)


@pytest.mark.parametrize("side", ["client", "server"])
def test_differential_privacy_gives_the_local_numbers_through_flower(tmp_path, side, task_identity):
    """Clipping in the ClientApp (or the ServerApp) and the seeded noise: the local backend's numbers."""
    args = SMALL + ["clients=3", "rounds=2", "privacy.clip=0.05", "privacy.noise_multiplier=0.5"]
    args += [f"privacy.clipping={side}"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    flower = load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"])
    serve(InProcessGrid(_nodes(3)), flower, node_timeout=5)
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")
    assert [r["dp_clipped"] for r in run_records(tmp_path / "fl")] == [3, 3]


def _round_one_replies(args: list[str]) -> tuple[list, int]:
    """Every client's round-1 reply by the local backend (bitwise the ClientApps' ones) and the largest
    client training set (SecAgg+'s default max_weight)."""
    from fedpcd.engine.executor import LocalExecutor
    from fedpcd.engine.federation import build_federation

    fed = build_federation(load_config(None, args))
    algorithm = fed.new_algorithm()
    server = algorithm.init_server(fed.model_for(0, fresh=True))
    results = LocalExecutor(fed).train(
        algorithm, payloads_for(algorithm, server, list(range(len(fed.clients)))), 1, False
    )
    return [r.update for r in results], max(c.num_samples for c in fed.clients)


def _assert_secure_mean(server_model: dict, replies: list, max_weight: int) -> None:
    """The server's model is the q-weighted mean of the replies' models, q_k = round(n_k / W * Q), within
    the protocol's error: stochastic rounding moves each client's value by less than one step 2r/Q, so the
    dequantized sum divided by sum_k q_k / Q is off by less than 2 r N / sum_k q_k; the float32 cast and
    FedAvg's float32 average of N copies of the mean add at most (2N + 1) ulp-halves (2^-24 relative)."""
    r, levels, n = 8.0, 2**22, len(replies)
    q = [round(rep["num_samples"] / max_weight * levels) for rep in replies]
    assert set(server_model) == set(replies[0]["model"])
    for key, got in server_model.items():
        values = [rep["model"][key].double() for rep in replies]
        assert max(float(v.abs().max()) for v in values) <= r  # inside the clipping range: no clipping error
        want = sum(qk * v for qk, v in zip(q, values, strict=True)) / sum(q)
        tol = 2 * r * n / sum(q) + (2 * n + 1) * 2.0**-24 * want.abs()
        assert bool(((got.double() - want).abs() <= tol).all()), key
        plain = sum(rep["num_samples"] * v for rep, v in zip(replies, values, strict=True))
        plain = plain / sum(rep["num_samples"] for rep in replies)
        assert not torch.equal(got.double(), plain)  # it went through the quantized protocol


@pytest.mark.parametrize("name", ["fedavg", "fedper"])
def test_secagg_plus_aggregates_to_the_weighted_mean_of_the_client_models(tmp_path, name, task_identity):
    """Flower's SecAgg+ (workflow on the server, secaggplus_mod on the nodes): the server's model after a
    round is the weighted mean of the clients' models within the quantization's bound, and the run repeats
    bitwise (the stochastic rounding is seeded)."""
    args = SMALL + ["clients=4", "rounds=1", f"algorithm.name={name}", "engine.checkpoint_every=1"]
    replies, max_weight = _round_one_replies(args)
    for run in ("a", "b"):
        out = [f"output_dir={tmp_path / run}", "backend=flower", "privacy.secagg=true"]
        cfg = load_config(None, args + out)
        serve(InProcessGrid(_nodes(4), seed=ord(run)), cfg, node_timeout=5)
    server = torch.load(tmp_path / "a" / "checkpoint" / "state.pt", weights_only=False)["server"]
    _assert_secure_mean(server["model"], replies, max_weight)
    record = run_records(tmp_path / "a")[0]
    assert record == run_records(tmp_path / "b")[0]
    assert record["bytes_up"] >= 2 * record["bytes_down"]  # masked: 64-bit integers for float32 values


def test_a_secagg_plus_run_killed_in_round_3_resumes_to_the_uninterrupted_run(tmp_path, task_identity):
    """SecAgg+ rounds are deterministic (exact modular sums, seeded rounding): a FedPer run (private heads
    on the nodes) killed during round 3 and resumed on fresh nodes gives the uninterrupted run's metrics."""
    args = SMALL + ["clients=4", "rounds=4", "participation=0.75", "algorithm.name=fedper", "backend=flower"]
    args += ["privacy.secagg=true"]
    serve(
        InProcessGrid(_nodes(4)), load_config(None, args + [f"output_dir={tmp_path / 'a'}"]), node_timeout=5
    )
    killed = load_config(None, args + [f"output_dir={tmp_path / 'b'}"])
    with pytest.raises(KeyboardInterrupt):
        serve(KilledGrid(_nodes(4), kill_at=3), killed, node_timeout=5)
    serve(InProcessGrid(_nodes(4), seed=1), killed, node_timeout=5, resume=True)
    assert_same_backend_run(tmp_path / "a", tmp_path / "b")


def test_secagg_plus_leaves_out_a_client_that_fails_during_the_protocol(tmp_path, monkeypatch, task_identity):
    """A ClientApp raising in the masked-upload stage drops out: the protocol rebuilds its masks from the
    others' shares and the mean is the other clients' one; the round records it as left out."""
    _fail_client(monkeypatch, client=2, rnd=1)
    args = SMALL + ["clients=4", "rounds=1", "engine.checkpoint_every=1"]
    replies, max_weight = _round_one_replies(args[:-1])  # the failure is injected in the local run too
    cfg = load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower", "privacy.secagg=true"])
    serve(InProcessGrid(_nodes(4)), cfg, node_timeout=5)
    server = torch.load(tmp_path / "fl" / "checkpoint" / "state.pt", weights_only=False)["server"]
    _assert_secure_mean(server["model"], [r for r in replies if r], max_weight)
    assert run_records(tmp_path / "fl")[0]["left_out"] == [2]


@pytest.mark.parametrize("policy", ["stop", "drop"])
def test_a_non_finite_update_under_secagg_stops_the_run_or_drops_the_client(
    tmp_path, monkeypatch, policy, task_identity
):
    """The server cannot screen a masked update: the ClientApp does (engine.on_divergence)."""
    original = FedAvg.local_update

    def local_update(self, model, data, work):
        reply, state = original(self, model, data, work)
        if data.id == 1 and work.round == 2:
            reply["model"] = {k: v * float("nan") for k, v in reply["model"].items()}
        return reply, state

    monkeypatch.setattr(FedAvg, "local_update", local_update)
    args = SMALL + ["clients=3", "rounds=2", f"output_dir={tmp_path}", "backend=flower"]
    args += ["privacy.secagg=true"]
    cfg = load_config(None, args + [f"engine.on_divergence={policy}"])
    if policy == "stop":
        with pytest.raises(UserError, match=r"round 2: client 1: diverged \(non-finite update at model/"):
            serve(InProcessGrid(_nodes(3)), cfg, node_timeout=5)
        assert [r["round"] for r in run_records(tmp_path)] == [1]
    else:
        serve(InProcessGrid(_nodes(3)), cfg, node_timeout=5)
        assert run_records(tmp_path)[1]["left_out"] == [1]


SECAGG_ABLE = [
    n for n in ALGORITHMS.names() if not n.startswith("_") and ALGORITHMS.get(n).aggregate is FedAvg.aggregate
]


@pytest.mark.parametrize("name", SECAGG_ABLE)
def test_every_algorithm_secagg_admits_runs_under_it(tmp_path, name, task_identity):
    """Their replies hold no tensor but the model (else the ClientApp refuses); Local sends no model."""
    cfg = load_config(
        None,
        SMALL
        + ["clients=3", "rounds=2", f"algorithm.name={name}", f"output_dir={tmp_path}", "backend=flower"]
        + ["privacy.secagg=true"]
        + EXTRA.get(name, []),
    )
    if name == "local":
        with pytest.raises(UserError, match="clients send no model to aggregate; turn it off"):
            serve(InProcessGrid(_nodes(3)), cfg, node_timeout=5)
        return
    assert serve(InProcessGrid(_nodes(3)), cfg, node_timeout=5)["rounds"] == 2
    assert [r["clients"] for r in run_records(tmp_path)] == [[0, 1, 2]] * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["privacy.secagg=true"], "privacy.secagg runs on the Flower backend (set backend=flower)"),
        (
            ["backend=flower", "privacy.secagg=true", "algorithm.name=scaffold"],
            "aggregates with its own rule. Choose one of: apfl, ditto, fedala, fedavg",
        ),
        (
            ["backend=flower", "privacy.secagg=true", "privacy.clip=1", "privacy.clipping=server"],
            "privacy.clipping=server needs every update on the server, which privacy.secagg hides",
        ),
        (["backend=flower", "privacy.secagg.modulus_range=1000"], "modulus_range must be a power of 2"),
        (["backend=flower", "privacy.secagg.num_shares=2"], "num_shares as a count must be at least 3"),
        (
            ["backend=flower", "privacy.secagg.num_shares=3", "privacy.secagg.reconstruction_threshold=3"],
            "reconstruction_threshold must be less than num_shares",
        ),
    ],
)
def test_secagg_plus_refuses_what_it_cannot_hide_in_one_line(args, message):
    with pytest.raises(UserError, match=re.escape(message)) as err:
        load_config(None, SMALL + args)
    assert "\n" not in str(err.value)


# the shared small model of FML / FedKD must fit synthetic's 8x8 images
EXTRA = {
    "fml": ["algorithm.shared_model=mlp"],
    "fedkd": ["algorithm.shared_model=mlp"],
    "fedbn": ["model.name=mlp_bn"],  # FedBN needs BatchNorm layers
    # CReFF's server work at a tenth of its default (it never crosses the records); FedETF: one alternation
    "creff": ["algorithm.match_steps=10", "algorithm.retrain_epochs=30"],
    "fedetf": ["algorithm.finetune_rounds=1"],
}


@pytest.mark.parametrize("name", [n for n in ALGORITHMS.names() if not n.startswith("_")])
def test_every_registered_algorithm_gives_the_local_numbers_through_flower(tmp_path, name, task_identity):
    """The adapter is generic: each algorithm's payloads, replies and client states survive the records."""
    args = SMALL + ["clients=4", "rounds=3", "participation=0.75", "seed=2", f"algorithm.name={name}"]
    args += EXTRA.get(name, [])
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    flower = load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"])
    serve(InProcessGrid(_nodes(4)), flower, node_timeout=5)
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")


@pytest.mark.parametrize("name", ["fedavg", "fedgela"])
def test_geometry_gives_the_local_angles_through_flower(tmp_path, name, task_identity):
    """``geometry: true``: each ClientApp sends its personal model's class means with its personal metrics in
    the last round; the server's angles are the local backend's, bit for bit."""
    args = SMALL + ["clients=4", "rounds=2", "geometry=true", f"algorithm.name={name}"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    flower = load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"])
    serve(InProcessGrid(_nodes(4)), flower, node_timeout=5)
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")
    assert run_records(tmp_path / "fl")[-1]["angle_held"] is not None


def test_model_heterogeneous_fedssa_gives_the_local_numbers_through_flower(tmp_path, task_identity):
    """Each node builds its own architecture (cnn1..cnn5 by partition id); only header rows travel."""
    args = [
        "dataset.name=synthetic16",
        "model.name=[cnn1, cnn2, cnn3, cnn4, cnn5]",
        "local.batch_size=32",
        "clients=5",
        "rounds=2",
        "participation=0.6",
        "algorithm.name=fedssa",
    ]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    flower = load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"])
    serve(InProcessGrid(_nodes(5)), flower)
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")


def test_fedavg_strategy_writes_the_local_checkpoint(tmp_path, task_identity):
    args = SMALL + ["clients=3", "rounds=2", "seed=1"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    serve(
        InProcessGrid(_nodes(3, with_count=False)),
        load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"]),
    )
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")
    a = torch.load(tmp_path / "local" / "checkpoint" / "state.pt", weights_only=False)
    b = torch.load(tmp_path / "fl" / "checkpoint" / "state.pt", weights_only=False)
    assert a["round"] == b["round"] == 2 and b["client_states"] == {}
    assert all(torch.equal(a["server"]["model"][k], v) for k, v in b["server"]["model"].items())


@pytest.mark.parametrize(
    ("nodes", "clients", "message"),
    [
        (_nodes(2), 3, "only 2 of the 3 SuperNodes"),
        ([{"partition-id": 0}, {"partition-id": 0}], 2, "two SuperNodes have partition-id=0"),
        ([{"partition-id": 0}, {"partition-id": 5}], 2, "outside 0..1"),
        (_nodes(3), 2, "num-partitions=3"),
        ([{}, {}], 2, "no partition id"),
    ],
)
def test_discovery_errors_are_user_errors(nodes, clients, message, task_identity):
    with pytest.raises(UserError, match=message):
        discover(InProcessGrid(nodes), clients, timeout=0.2)


def test_discovery_maps_partitions_to_random_node_ids(task_identity):
    grid = InProcessGrid(_nodes(3))
    nodes = discover(grid, 3, timeout=1)
    assert sorted(nodes) == [0, 1, 2]
    assert {int(grid.contexts[n].node_config["partition-id"]) for n in nodes.values()} == {0, 1, 2}
    for node, ctx in grid.contexts.items():
        assert nodes[int(ctx.node_config["partition-id"])] == node


def test_federation_size_is_read_from_the_first_supernode_and_fitted_or_refused(task_identity):
    """`flwr run .` with Flower's default 2 SuperNodes: `clients` follows them, or the run stops at once."""
    assert federation_size(InProcessGrid(_nodes(2)), timeout=1) == 2
    assert federation_size(InProcessGrid(_nodes(2, with_count=False)), timeout=1) is None
    with pytest.raises(UserError, match="no SuperNode connected within 0 s"):
        federation_size(InProcessGrid([]), timeout=0.1)
    cfg = load_config(None, ["clients=4"])
    assert fit_to_federation(cfg, None, adapt=False) is cfg and fit_to_federation(cfg, 4, adapt=False) is cfg
    assert fit_to_federation(cfg, 2, adapt=True).clients == 2
    with pytest.raises(UserError, match=r"clients=4: start 4 SuperNodes .*num-supernodes=4.*'clients=2'"):
        fit_to_federation(cfg, 2, adapt=False)


def test_client_errors_come_back_as_one_line_user_errors(task_identity):
    msg = Message(RecordDict({"x": ConfigRecord({"a": 1})}), message_type=MessageType.TRAIN, dst_node_id=1)
    msg.metadata.__dict__["_message_id"] = "m"
    tagged = str(tag_user_error(UserError("dataset files not found")))
    ray_style = (
        f"<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'Traceback...\nMessage: {tagged}\n'>"
    )
    err = Message(Error(code=0, reason=ray_style), reply_to=msg)
    with pytest.raises(UserError, match="^client: dataset files not found$"):
        raise_for_error(err, "client")
    other = Message(Error(code=0, reason="<class 'ZeroDivisionError'>:<'division by zero'>"), reply_to=msg)
    with pytest.raises(RuntimeError, match="division by zero"):
        raise_for_error(other, "client")


def test_flwr_run_config_reads_the_app_config_file_and_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_from_run_config(
        {"config-file": str(REPO / "flower-app" / "fedpcd.yaml"), "overrides": "rounds=1 'output_dir=a b'"},
        None,
    )
    assert cfg.rounds == 1 and cfg.output_dir == "a b" and cfg.backend == "flower" and cfg.clients == 4
    assert config_from_run_config({"config-file": "", "overrides": ""}, None).clients == 10
    with pytest.raises(UserError, match="config file not found"):
        config_from_run_config({"config-file": "nope.yaml"}, None)
    # the key the run config had before the setting moved into fedpcd's config: named, not ignored
    with pytest.raises(UserError, match="now the fedpcd setting flower.round_timeout"):
        config_from_run_config({"config-file": "", "round-timeout": 600}, None)


def test_flower_app_declares_fedpcd_components_and_no_torch_dependency():
    import tomllib

    project = tomllib.loads((REPO / "flower-app" / "pyproject.toml").read_text())
    app = project["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "fedpcd.flower.server_app:app",
        "clientapp": "fedpcd.flower.client_app:app",
    }
    assert {"config-file", "overrides"} <= set(app["config"])
    assert not any("torch" in d for d in project["project"]["dependencies"])
    assert "federations" not in project["tool"]["flwr"]  # flwr 1.41 would migrate it into FLWR_HOME


# ----- reliability: client failures, divergence, Ctrl-C, SIGTERM and SIGKILL ------------------


def _fail_client(monkeypatch, client: int, rnd: int, nan: bool = False) -> None:
    """Client ``client`` raises in round ``rnd`` (or, ``nan``, replies with a NaN train loss)."""
    original = FedAvg.local_update

    def local_update(self, model, data, work):
        if data.id == client and work.round == rnd and not nan:
            raise ValueError("injected failure")
        reply, state = original(self, model, data, work)
        if data.id == client and work.round == rnd:
            reply["train_loss"] = float("nan")
        return reply, state

    monkeypatch.setattr(FedAvg, "local_update", local_update)


def test_a_failing_clientapp_is_left_out_as_in_the_local_backend(
    tmp_path, monkeypatch, task_identity, capsys
):
    _fail_client(monkeypatch, client=2, rnd=2)
    args = SMALL + ["clients=3", "rounds=3", "seed=1", "engine.executor=sequential"]
    run_experiment(load_config(None, args + [f"output_dir={tmp_path / 'local'}"]), progress=False)
    serve(
        InProcessGrid(_nodes(3)),
        load_config(None, args + [f"output_dir={tmp_path / 'fl'}", "backend=flower"]),
    )
    assert_same_backend_run(tmp_path / "local", tmp_path / "fl")
    assert run_records(tmp_path / "fl")[1]["left_out"] == [2]
    assert capsys.readouterr().err.count("warning: round 2: client 2 failed") == 2  # once per backend


def test_a_diverging_clientapp_stops_the_flower_run(tmp_path, monkeypatch, task_identity):
    from fedpcd.errors import DivergenceError

    _fail_client(monkeypatch, client=0, rnd=1, nan=True)
    cfg = load_config(
        None, SMALL + ["clients=2", "rounds=2", f"output_dir={tmp_path / 'fl'}", "backend=flower"]
    )
    with pytest.raises(DivergenceError, match=r"round 1: algorithm 'fedavg' diverged: client\(s\) 0"):
        serve(InProcessGrid(_nodes(2)), cfg)
    assert (tmp_path / "fl" / "metrics.jsonl").read_text() == ""


def test_a_set_stop_event_ends_the_serverapp_at_its_next_poll(tmp_path, task_identity):
    from fedpcd.flower.discovery import Interrupted

    stop = threading.Event()
    stop.set()
    cfg = load_config(
        None, SMALL + ["clients=2", "rounds=2", f"output_dir={tmp_path / 'fl'}", "backend=flower"]
    )
    with pytest.raises(Interrupted):
        serve(InProcessGrid(_nodes(2)), cfg, stop=stop)


def test_the_client_app_and_the_worker_pool_run_the_one_client_update(tmp_path, task_identity, monkeypatch):
    """Both call fedpcd.engine.client_update's code for each client: a copy of the client update in either
    path would not reach the spied ``local_step``."""
    import pickle

    from fedpcd.engine import client_update, pool
    from fedpcd.engine.federation import build_federation
    from fedpcd.engine.tasks import ClientTask

    trained: list[int] = []
    real = client_update.local_step

    def spy(algorithm, model, data, *args, **kwargs):
        trained.append(data.id)
        return real(algorithm, model, data, *args, **kwargs)

    monkeypatch.setattr(client_update, "local_step", spy)
    args = [*SMALL, "clients=3", "rounds=1"]
    flower = load_config(None, [*args, f"output_dir={tmp_path / 'flower'}", "backend=flower"])
    serve(InProcessGrid(_nodes(3)), flower, node_timeout=5)
    assert sorted(trained) == [0, 1, 2]

    trained.clear()  # the function a pool worker runs, called here
    fed = build_federation(load_config(None, args))
    monkeypatch.setattr(pool, "_FEDERATION", fed)
    algorithm = fed.new_algorithm()
    server = algorithm.init_server(fed.model_for(0, fresh=True))
    tasks = [ClientTask(1, k, algorithm.payload_for(server, k), None, False) for k in range(3)]
    replies = pickle.loads(pool._work(pickle.dumps(algorithm), pickle.dumps(tasks)))
    assert sorted(trained) == [0, 1, 2] and [r.client for r in replies] == [0, 1, 2]
