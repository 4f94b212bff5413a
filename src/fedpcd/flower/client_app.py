"""The Flower ClientApp of every registered algorithm: the algorithm's client hooks over Flower messages.

- ``query``: discovery; replies with this node's partition id (``context.node_config["partition-id"]``),
  so the server can map Flower's random node ids to fedpcd client ids.
- ``train``: one client round through :func:`fedpcd.engine.client_update.run_client`, the code of the local
  backend and its worker pool (local update from the payload, personal evaluation when the server asks for
  it, DP clipping on the client, the divergence policy). The client state lives in
  ``context.state`` (encoded with :mod:`fedpcd.flower.codec`); it leaves the node only when the server
  asks for it for a checkpoint (``get-state``) and is replaced from one on resume (``set-state``).

The run's resolved config arrives inside every message. Each process builds the federation (dataset,
partition, model object, algorithm) once per config and keeps it: Ray actors and long-lived worker
processes therefore load data once, and a fresh per-message process rebuilds the identical federation.
A node may set ``--node-config "data-root=/path"`` to find the dataset files somewhere else than the
server's ``dataset.root``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedpcd.flower import _env

_env.set_offline_defaults()

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedpcd.algorithms import Algorithm  # noqa: E402
from fedpcd.config import Config  # noqa: E402
from fedpcd.engine.client_update import run_client  # noqa: E402
from fedpcd.engine.federation import Federation, build_federation, set_threads  # noqa: E402
from fedpcd.engine.tasks import ClientTask  # noqa: E402
from fedpcd.engine.update_policy import drops_divergent, store_state  # noqa: E402
from fedpcd.errors import UserError  # noqa: E402
from fedpcd.flower import codec, secagg  # noqa: E402
from fedpcd.flower.protocol import (  # noqa: E402
    DATA_ROOT,
    DISCOVER,
    GET_STATE,
    PAYLOAD,
    PERSONAL,
    REPLY,
    SET_STATE,
    STATE,
    TASK,
    config_from_text,
    node_partition,
    tag_user_error,
)


@dataclass
class Runtime:
    """What a ClientApp process builds once per run config and reuses for every message."""

    config: Config
    federation: Federation
    algorithm: Algorithm


_CACHE: dict[tuple[str, str | None], Runtime] = {}


def runtime_for(text: str, data_root: str | None = None) -> Runtime:
    """The cached runtime for this config text (only the latest one is kept per process)."""
    key = (text, data_root)
    if key not in _CACHE:
        config = config_from_text(text)
        if data_root is not None:
            dataset = config.dataset.model_copy(update={"root": data_root})
            config = config.model_copy(update={"dataset": dataset})
        set_threads(config)
        fed = build_federation(config)
        _CACHE.clear()
        _CACHE[key] = Runtime(config, fed, fed.new_algorithm())
    return _CACHE[key]


Handler = Callable[[Message, Context], Message]


def _tagged(handler: Handler) -> Handler:
    """Let a UserError raised here reach the server as a one-line UserError (see protocol.tag_user_error)."""

    @functools.wraps(handler)
    def wrapped(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except UserError as exc:
            raise tag_user_error(exc) from None

    return wrapped


app = ClientApp()


@app.query()
@_tagged
def query(msg: Message, context: Context) -> Message:
    """Discovery (this node's partition id and count, and the process id serving it; with the run's config
    the federation is built and cached here already), or the client state for a checkpoint (``get-state``)
    or from one (``set-state``, on resume)."""
    pid, n = node_partition(context.node_config)
    task = msg.content.get(TASK)
    action = str(task.get("action", DISCOVER)) if task is not None else DISCOVER
    info: dict[str, Any] = {"client-id": pid, "partition-id": pid, "process-id": os.getpid()}
    if action == GET_STATE:
        content = codec.record_dict(**{STATE: codec.get(context.state, STATE)})
    elif action == SET_STATE:
        state = codec.get(msg.content, STATE)
        if state is None:
            codec.clear(context.state, STATE)
        else:
            codec.put(context.state, STATE, state)
        content = RecordDict()
    else:
        if task is not None and "config" in task:
            root = context.node_config.get(DATA_ROOT)
            runtime_for(str(task["config"]), None if root is None else str(root))
        if n is not None:
            info["num-partitions"] = n
        content = RecordDict()
    content[TASK] = ConfigRecord(info)
    return Message(content, reply_to=msg)


@app.train()
@_tagged
def train(msg: Message, context: Context) -> Message:
    """One client round; with ``privacy.secagg`` every SecAgg+ stage goes to Flower's ``secaggplus_mod``
    (:mod:`fedpcd.flower.secagg`), which calls the round in its stage 2 and masks the model it returns."""
    if secagg.is_stage(msg):
        return secagg.client_stage(msg, context, client_round)
    return client_round(msg, context)


def client_round(msg: Message, context: Context) -> Message:
    """One client round: decode the payload, run ``client_update.run_client``, keep the state, reply."""
    t0 = time.perf_counter()
    task = msg.content[TASK]
    k, n = node_partition(context.node_config)
    if int(task["client-id"]) != k:
        raise UserError(f"message for client {task['client-id']} reached the node holding partition {k}")
    root = context.node_config.get(DATA_ROOT)
    runtime = runtime_for(str(task["config"]), None if root is None else str(root))
    config = runtime.config
    if n is not None and n != config.clients:
        raise UserError(f"node has num-partitions={n} but the run's config has clients={config.clients}")
    set_threads(config)
    client_task = ClientTask(
        round=int(task["round"]),
        client=k,
        payload=codec.decode(msg.content, PAYLOAD),
        state=codec.get(context.state, STATE),
        evaluate=bool(task["evaluate"]),
        full_test=bool(task.get("full-test", True)),
    )
    result = run_client(runtime.algorithm, runtime.federation, client_task)
    if result.error is not None:  # Flower's error reply: the server leaves the client out (engine/guard.py)
        raise result.error
    reply, metrics = result.update, result.metrics
    info: dict[str, Any] = {}
    if bool(task.get("secagg", False)):  # the model goes to secaggplus_mod, the rest in the clear
        content, info[secagg.KEYS] = secagg.pack_reply(reply, drops_divergent(config))  # raises if non-finite
    else:
        content = codec.record_dict(**{REPLY: reply})
    store_state(result, lambda _client, state: codec.put(context.state, STATE, state))
    codec.put(content, PERSONAL, metrics)
    content[TASK] = ConfigRecord(
        {
            "client-id": k,
            "has-state": STATE + ".meta" in context.state,  # only non-None states are stored
            "dp-clipped": result.clipped,
            "process-id": os.getpid(),
            "client-s": time.perf_counter() - t0,
            **info,
        }
    )
    return Message(content, reply_to=msg)
