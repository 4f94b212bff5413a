"""Finding the federation for the ServerApp: the SuperNodes, their partition ids, and a Grid that polls.

Flower node ids are random; a discovery (query) round first maps them to partition ids = client ids
(:func:`discover`). :func:`federation_size` reads the first SuperNode's ``num-partitions`` so that a
federation of the wrong size is named at once (:func:`fit_to_federation`). :class:`PollingGrid` asks for
replies every ``POLL_S`` seconds and ends the run at its next poll once asked to stop (:class:`Interrupted`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from fedpcd.flower import _env

_env.set_offline_defaults()

from flwr.app import ConfigRecord, Message, MessageType, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from fedpcd.config import Config  # noqa: E402
from fedpcd.errors import UserError  # noqa: E402
from fedpcd.flower.protocol import DISCOVER, TASK, raise_for_error  # noqa: E402

LOG = logging.getLogger("flwr")
POLL_S = 0.1  # how often the server asks for replies (Flower's HTTP grid waits 3 s between pulls)


class Interrupted(Exception):
    """The run was stopped from outside (Ctrl-C, SIGTERM): the ServerApp ends at its next poll."""


class PollingGrid(Grid):
    """A Grid that delegates to Flower's and polls for replies every ``interval`` seconds.

    ``stop``: when set (e.g. by ``run_flower`` on Ctrl-C), the next poll raises :class:`Interrupted`, so
    the ServerApp never waits for replies that will not come."""

    def __init__(self, grid: Grid, interval: float = POLL_S, stop: threading.Event | None = None) -> None:
        self.grid = grid
        self.interval = interval
        self.stop = stop

    def check_stop(self) -> None:
        """Raise :class:`Interrupted` when the run was asked to stop."""
        if self.stop is not None and self.stop.is_set():
            raise Interrupted("the run was interrupted")

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        pending = set(self.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        out: list[Message] = []
        while pending and (end is None or time.monotonic() < end):
            self.check_stop()
            got = list(self.pull_messages(pending))
            out.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if pending:
                time.sleep(self.interval)
        return out


def federation_size(grid: Grid, timeout: float) -> int | None:
    """The ``num-partitions`` the first SuperNode to connect reports (None where its node config has none),
    so that a federation of the wrong size is named in seconds instead of after ``timeout``."""
    end = time.monotonic() + timeout
    while not (node_ids := list(grid.get_node_ids())):
        if isinstance(grid, PollingGrid):
            grid.check_stop()
        if time.monotonic() > end:
            raise UserError(f"no SuperNode connected within {timeout:.0f} s")
        time.sleep(0.2)
    task = RecordDict({TASK: ConfigRecord({"action": DISCOVER})})
    ask = Message(task, message_type=MessageType.QUERY, dst_node_id=node_ids[0])
    (reply,) = grid.send_and_receive([ask], timeout=timeout)
    raise_for_error(reply, "SuperNode discovery")
    info = reply.content[TASK]
    return int(info["num-partitions"]) if "num-partitions" in info else None


def fit_to_federation(config: Config, size: int | None, adapt: bool) -> Config:
    """``config``, or with ``adapt`` a copy whose ``clients`` is the federation's ``size`` (logged); a size
    that differs and may not be adapted is a UserError saying what to pass."""
    if size is None or size == config.clients:
        return config
    if not adapt:
        raise UserError(
            f"the federation has {size} SuperNodes (num-partitions={size}) but the config has "
            f"clients={config.clients}: start {config.clients} SuperNodes (flwr run . --federation-config "
            f'"num-supernodes={config.clients}") or pass --run-config "overrides=\'clients={size}\'"'
        )
    LOG.warning(
        "fedpcd: %d SuperNodes found, so clients=%d instead of the config's %d "
        "(run config adapt-clients=false refuses instead)",
        size,
        size,
        config.clients,
    )
    return Config.model_validate({**config.model_dump(), "clients": size})


def discover(grid: Grid, num_clients: int, timeout: float, config: str | None = None) -> dict[int, int]:
    """Map client id -> Flower node id with a query round (waits up to ``timeout`` s for the nodes).

    With the run's ``config`` text the nodes also build (and cache) their federation now, so data problems
    surface before the first round and round 1 is not charged with loading the dataset."""
    end = time.monotonic() + timeout
    while len(node_ids := list(grid.get_node_ids())) < num_clients:
        if isinstance(grid, PollingGrid):
            grid.check_stop()
        if time.monotonic() > end:
            raise UserError(
                f"only {len(node_ids)} of the {num_clients} SuperNodes the config needs "
                f"(clients={num_clients}) connected within {timeout:.0f} s"
            )
        time.sleep(0.5)
    ask = {"action": DISCOVER} if config is None else {"action": DISCOVER, "config": config}
    asks = [
        Message(RecordDict({TASK: ConfigRecord(ask)}), message_type=MessageType.QUERY, dst_node_id=node)
        for node in node_ids
    ]
    replies = list(grid.send_and_receive(asks, timeout=timeout))
    nodes: dict[int, int] = {}
    for msg in replies:
        raise_for_error(msg, "SuperNode discovery")
        info = msg.content[TASK]
        k = int(info["partition-id"])
        if "num-partitions" in info and int(info["num-partitions"]) != num_clients:
            raise UserError(
                f"SuperNode with partition-id={k} has num-partitions={info['num-partitions']}, "
                f"but the config has clients={num_clients}"
            )
        if not 0 <= k < num_clients:
            raise UserError(
                f"SuperNode partition-id={k} is outside 0..{num_clients - 1} (clients={num_clients})"
            )
        if k in nodes:
            raise UserError(f"two SuperNodes have partition-id={k}; each partition must be served once")
        nodes[k] = msg.metadata.src_node_id
    missing = sorted(set(range(num_clients)) - set(nodes))
    if missing:
        raise UserError(f"no SuperNode serves partition(s) {missing} (clients={num_clients})")
    return nodes
