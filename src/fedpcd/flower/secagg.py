"""SecAgg+ secure aggregation on the Flower backend (``privacy.secagg``), run by Flower's own implementation.

SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020): each
client quantizes its weight-scaled model and adds pairwise masks (agreed by key exchange with its neighbours)
and a private mask whose seed it secret-shares among them. The server sums the masked vectors; the masks
cancel, so it learns sum_k q_k x_k and sum_k q_k, never one client's model. The ServerApp runs the stages of
Flower's ``SecAggPlusWorkflow`` (setup, share keys, collect masked vectors, unmask) with fedpcd's training
message as the one of stage 2; the ClientApp hands every stage to Flower's ``secaggplus_mod``, which calls
fedpcd's training in stage 2 and masks the model it returns.

What the server gets: the mean sum_k q_k x_k / sum_k q_k of the clients' ``model`` tensors, with weights
q_k = round(n_k / W * Q) (n_k the sample count, W ``max_weight``, Q ``quantization_range``) and every value
clipped to [-r, r] (``clipping_range``) and stochastically rounded to the grid of step 2r/Q (seeded by run
seed, round and client, so a run repeats): each value of the mean is within 2 r N / sum_k q_k of the exact
q-weighted mean of N clients. The algorithm's ``aggregate`` (FedAvg's, the only one allowed) receives one
reply per client holding that mean as its ``model``, next to the client's own scalars (sample count, train
loss), which travel in the clear like Flower's fit metrics.

By design the server cannot screen single updates, so the ClientApp does: a non-finite update stops the run
(``engine.on_divergence: drop``: the client does not upload and the protocol leaves it out), and
server-side clipping is refused.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.compat.common.recorddict_compat import fitres_to_recorddict
from flwr.server import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from fedpcd.algorithms.context import MODEL, NUM_SAMPLES
from fedpcd.config import SecAggConfig
from fedpcd.engine.guard import first_nonfinite
from fedpcd.errors import UserError
from fedpcd.flower import codec
from fedpcd.flower.protocol import REPLY, TASK
from fedpcd.utils import quiet

KEYS = "secagg-keys"  # TASK entry of a stage-2 reply: the state-dict keys of the masked model, in order


def is_stage(msg: Message) -> bool:
    """Whether ``msg`` is a SecAgg+ stage (it carries the protocol's config record)."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


@contextmanager
def _numpy_seeded(seed: int | None) -> Iterator[None]:
    """numpy's global generator (``secaggplus_mod`` rounds with it) seeded for the block, then restored."""
    if seed is None:
        yield
        return
    saved = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        np.random.set_state(saved)


def client_stage(msg: Message, context: Context, train: Callable[[Message, Context], Message]) -> Message:
    """One SecAgg+ stage on the node, by Flower's ``secaggplus_mod``; in stage 2 it calls ``train``."""
    task = msg.content.get(TASK)
    seed = None if task is None else task.get("secagg-seed")
    with _numpy_seeded(None if seed is None else int(seed)):
        return secaggplus_mod(msg, context, train)


def pack_reply(reply: Mapping[str, Any], drop: bool) -> tuple[RecordDict, list[str]]:
    """A client's reply in SecAgg+'s form: its ``model`` as the fit result's parameters (masked by the mod),
    weighted by ``num_samples``; every other entry, scalars only, in the clear. Returns the content and the
    model's keys in order. A non-finite model stops the run, or with ``drop`` (``engine.on_divergence:
    drop``) leaves this client out of the round: the server cannot screen it once it is masked."""
    model, rest = reply.get(MODEL), {k: v for k, v in reply.items() if k != MODEL}
    if not isinstance(model, Mapping) or not model:
        raise UserError("privacy.secagg: this algorithm's clients send no model to aggregate; turn it off")
    clear = codec.encode(rest, REPLY)
    extra = list(clear.get(f"{REPLY}.arrays", {}).keys())
    if extra:
        raise UserError(
            f"privacy.secagg hides only the reply's model, but it also holds tensors: {extra[:3]}"
        )
    bad = first_nonfinite({MODEL: model})
    if bad is not None and drop:  # this client does not upload: the protocol leaves it out
        raise RuntimeError(f"non-finite update ({bad}): left out of the secure aggregation")
    if bad is not None:
        raise UserError(
            f"diverged (non-finite update at {bad}); lower local.lr, set local.grad_clip or set "
            "engine.on_divergence=drop to leave such clients out of the secure aggregation"
        )
    keys = list(model)
    arrays = [model[k].detach().cpu().double().numpy() for k in keys]
    fit = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), int(reply[NUM_SAMPLES]), {})
    content = fitres_to_recorddict(fit, keep_input=False)
    for name, record in clear.items():
        content[name] = record
    return content, keys


def masked_bytes(reply: Message) -> int:
    """Bytes of the masked model in a stage-2 reply (what the client uploaded in place of its model)."""
    masked = reply.content.config_records[RECORD_KEY_CONFIGS][SecAggKey.MASKED_PARAMETERS]
    return sum(len(b) for b in masked)  # type: ignore[union-attr]


@dataclass
class _Node:
    """What the workflow reads of a legacy ClientProxy."""

    node_id: int


class _Rounds:
    """The two legacy ``Strategy`` calls the workflow makes: the round's nodes, and where the mean goes."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)
        self.results: list[tuple[_Node, FitRes]] = []

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return [(_Node(nid), FitIns(parameters, {})) for nid in self.nodes]

    def aggregate_fit(
        self, server_round: int, results: list, failures: list
    ) -> tuple[Parameters | None, dict]:
        self.results = results
        return (results[0][1].parameters if results else None), {}


class _Workflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow whose stage-2 message to each node is fedpcd's training message."""

    def __init__(self, contents: Mapping[int, RecordDict], **params: Any) -> None:
        super().__init__(**params)
        self.contents = contents

    def setup_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        ok = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        return ok


class _Recorder:
    """The Grid, keeping each node's stage-2 reply (the one holding fedpcd's task record) and its errors."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.replies: dict[int, Message] = {}
        self.errors: dict[int, Message] = {}

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        out = list(self.grid.send_and_receive(messages, timeout=timeout))
        for msg in out:
            if msg.has_error():
                self.errors.setdefault(msg.metadata.src_node_id, msg)
            elif TASK in msg.content:
                self.replies[msg.metadata.src_node_id] = msg
        return out


def workflow_params(secagg: SecAggConfig, max_weight: float) -> dict[str, Any]:
    """``SecAggPlusWorkflow``'s arguments (counts as int, fractions as float, as Flower reads them)."""

    def count_or_fraction(value: float) -> int | float:
        return int(value) if value > 1 else float(value)

    params = {
        "num_shares": count_or_fraction(secagg.num_shares),
        "reconstruction_threshold": count_or_fraction(secagg.reconstruction_threshold),
        "max_weight": float(secagg.max_weight or max_weight),
        "clipping_range": secagg.clipping_range,
        "quantization_range": secagg.quantization_range,
        "modulus_range": secagg.modulus_range,
    }
    try:
        SecAggPlusWorkflow(**params)
    except (TypeError, ValueError) as exc:
        raise UserError(f"privacy.secagg: {exc}") from None
    return params


def secure_round(
    grid: Grid, contents: Mapping[int, RecordDict], rnd: int, params: Mapping[str, Any], timeout: float
) -> tuple[list[np.ndarray] | None, dict[int, Message], list[Message]]:
    """Run the four SecAgg+ stages with ``contents`` (node id -> training message content) as stage 2's
    messages. Returns the weighted mean of the uploaded models (None if the protocol halted: too few nodes
    answered), the stage-2 replies of the nodes inside it, and the first error of each node outside it."""
    state = RecordDict(
        {MAIN_PARAMS_RECORD: ArrayRecord(), MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: rnd})}
    )
    rounds = _Rounds(sorted(contents))
    context = LegacyContext(
        Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}), strategy=rounds
    )
    recorder = _Recorder(grid)
    saved = random.getstate()  # the workflow shuffles the nodes with the global generator
    try:
        with quiet(logging.getLogger("flwr")):  # its INFO lines talk of legacy strategies and managers
            _Workflow(contents, timeout=timeout, **params)(recorder, context)  # type: ignore[arg-type]
    finally:
        random.setstate(saved)
    inside = {proxy.node_id for proxy, _ in rounds.results}
    errors = [msg for nid, msg in recorder.errors.items() if nid not in inside]
    if not rounds.results:
        return None, {}, errors
    mean = parameters_to_ndarrays(rounds.results[0][1].parameters)
    return mean, {nid: msg for nid, msg in recorder.replies.items() if nid in inside}, errors


def mean_model(mean: Sequence[np.ndarray], keys: Sequence[str], like: Mapping[str, Any]) -> dict[str, Any]:
    """The mean as a state dict with ``keys``, each tensor in the dtype of ``like``'s (float32 if absent;
    integer buffers rounded)."""
    out = {}
    for key, arr in zip(keys, mean, strict=True):
        ref = like.get(key)
        dtype = ref.dtype if isinstance(ref, torch.Tensor) else torch.float32
        t = torch.from_numpy(np.asarray(arr, dtype=np.float64))
        out[key] = (t if dtype.is_floating_point else torch.round(t)).to(dtype)
    return out
