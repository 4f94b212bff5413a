"""The Flower backend's executor: the round loop's clients are ClientApps reached through Flower's Grid.

``GridExecutor`` implements the engine's ``Executor``: ``train`` encodes each participant's payload
(``payload_for(server, k)``, computed once by the round loop) as a TRAIN Message (:mod:`fedpcd.flower.codec`),
sends them all, waits up to the round timeout, and decodes the replies into ``ClientReply`` objects in
client-id order (weighted sums are not associative: arrival order would change the bits). A ClientApp that
raised, or did not reply in time, gives a result with ``error`` set; the round loop leaves it out.

Client states live on the nodes (``context.state``). ``states`` asks the nodes trained since the last
checkpoint for their states (a QUERY ``get-state``; the others' are unchanged) so that a checkpoint is
complete; ``restore`` sends each node its state back (``set-state``, on resume). Only checkpoints of
algorithms with client states move them over the wire: with ``engine.checkpoint_every: 0`` they never
leave the nodes.

With ``privacy.secagg`` a round's training runs inside Flower's SecAgg+ protocol
(:mod:`fedpcd.flower.secagg`): the server learns only the weighted mean of the clients' models, which every
decoded reply then holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedpcd import seeds
from fedpcd.algorithms import Algorithm
from fedpcd.algorithms.context import MODEL
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.engine.executor import StatesUnavailable
from fedpcd.engine.federation import to_device
from fedpcd.engine.guard import InvalidReply
from fedpcd.engine.tasks import ClientReply
from fedpcd.errors import UserError
from fedpcd.flower import codec, secagg
from fedpcd.flower.protocol import (
    GET_STATE,
    PAYLOAD,
    PERSONAL,
    REPLY,
    SET_STATE,
    STATE,
    TASK,
    raise_for_error,
)


class GridExecutor:
    """The round's clients as Flower ClientApps (``nodes``: client id -> Flower node id)."""

    def __init__(
        self,
        grid: Grid,
        nodes: Mapping[int, int],
        config_text: str,
        device: torch.device,
        round_timeout: float = 3600.0,
        secure: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        self.grid = grid
        self.secagg = secure  # SecAgg+ workflow parameters (privacy.secagg); None: plain messages
        self.seed = seed
        self.nodes = dict(nodes)
        self.config_text = config_text
        self.device = device
        self.round_timeout = round_timeout
        self.client_of = {node: k for k, node in self.nodes.items()}
        self.clients_keep_state = False  # set once a ClientApp reports a state: checkpoints then fetch them
        self.known: dict[int, Any] = {}  # the clients' states as last fetched (or restored)
        self.changed: set[int] = set()  # clients trained since: only their states are fetched again

    def train(
        self,
        algorithm: Algorithm,
        payloads: Mapping[int, dict[str, Any]],
        rnd: int,
        evaluate: bool,
        full_test: bool = True,
    ) -> list[ClientReply]:
        contents, down, sent = {}, {}, payloads
        for k, payload in payloads.items():
            down[k] = tensor_bytes(payload)
            contents[k] = codec.record_dict(**{PAYLOAD: payload})
            task: dict[str, Any] = {
                "round": rnd,
                "client-id": k,
                "evaluate": evaluate,
                "full-test": full_test,
                "config": self.config_text,
            }
            if self.secagg is not None:
                task.update({"secagg": True, "secagg-seed": seeds.secagg_rounding(self.seed, rnd, k)})
            contents[k][TASK] = ConfigRecord(task)
        if self.secagg is not None:
            replies, mean = self._secure_round(contents, rnd)
        else:
            messages = [
                Message(c, message_type=MessageType.TRAIN, dst_node_id=self.nodes[k], group_id=str(rnd))
                for k, c in contents.items()
            ]
            replies, mean = self.grid.send_and_receive(messages, timeout=self.round_timeout), None
        got: dict[int, ClientReply] = {}
        for msg in replies:
            k = self.client_of.get(msg.metadata.src_node_id, -1)
            if msg.has_error():  # the ClientApp raised: left out (engine/guard.py); a UserError stops the run
                try:
                    raise_for_error(msg, f"round {rnd}: client {k}")
                except UserError:
                    raise
                except RuntimeError as exc:
                    got[k] = ClientReply(k, {}, None, down.get(k, 0), 0, error=exc)
                continue
            if k not in down or k in got:  # a node not asked this round, or a second reply
                continue
            try:
                got[k] = self._decode(msg, k, down[k], sent[k], mean)
            except Exception as exc:  # noqa: BLE001 - a malformed reply is that client's failure
                got[k] = ClientReply(k, {}, None, down[k], 0, error=InvalidReply(f"malformed reply: {exc}"))
                continue
            self.changed.add(k)
        missing = TimeoutError(f"no reply within the round timeout ({self.round_timeout:g} s)")
        if self.secagg is not None:
            missing = TimeoutError(
                "left out of the secure aggregation (no masked update, or the protocol halted)"
            )
        return [got.get(k) or ClientReply(k, {}, None, down[k], 0, error=missing) for k in payloads]

    def _decode(self, msg: Message, k: int, down: int, sent: Any, mean: Any) -> ClientReply:
        """Client ``k``'s TRAIN reply as a :class:`ClientReply`; raises for a reply that is not one."""
        task = msg.content[TASK]
        if int(task["client-id"]) != k:
            raise ValueError(f"it names client {task['client-id']}")
        reply = to_device(codec.decode(msg.content, REPLY), self.device)  # CPU tensors off the wire
        if not isinstance(reply, dict):
            raise ValueError(f"its {REPLY!r} record is not a dict")
        up = tensor_bytes(reply)
        if mean is not None:  # SecAgg+: every reply holds the mean, the only model the server saw
            model = secagg.mean_model(mean, list(task[secagg.KEYS]), sent[MODEL])
            reply, up = {MODEL: to_device(model, self.device), **reply}, secagg.masked_bytes(msg)
        metrics = codec.get(msg.content, PERSONAL)
        self.clients_keep_state |= bool(task.get("has-state", False))
        return ClientReply(k, reply, metrics, down, up, clipped=bool(task.get("dp-clipped", False)))

    def _secure_round(self, contents: Mapping[int, RecordDict], rnd: int) -> tuple[list[Message], Any]:
        """The round's training through SecAgg+ (:mod:`fedpcd.flower.secagg`): the clients' stage-2 replies
        (and any node's error) and the weighted mean of their models (None if the protocol halted)."""
        if len(contents) < 2:
            raise UserError(
                f"round {rnd}: privacy.secagg needs at least 2 clients per round, {len(contents)} sampled; "
                "raise participation or clients"
            )
        assert self.secagg is not None
        by_node = {self.nodes[k]: c for k, c in contents.items()}
        mean, replies, errors = secagg.secure_round(self.grid, by_node, rnd, self.secagg, self.round_timeout)
        return [*errors, *replies.values()], mean

    def _ask(
        self, action: str, clients: Sequence[int], states: Mapping[int, Any] | None = None
    ) -> list[Message]:
        """One QUERY ``action`` to each of ``clients`` (with its state from ``states``); their replies, or
        :class:`StatesUnavailable` naming the clients that failed or did not answer in time."""
        messages = []
        for k in clients:
            content = codec.record_dict(**({STATE: states.get(k)} if states is not None else {}))
            content[TASK] = ConfigRecord({"action": action, "client-id": k, "config": self.config_text})
            messages.append(Message(content, message_type=MessageType.QUERY, dst_node_id=self.nodes[k]))
        replies = list(self.grid.send_and_receive(messages, timeout=self.round_timeout))
        for msg in replies:
            try:
                raise_for_error(msg, f"client state ({action})")
            except RuntimeError as exc:
                raise StatesUnavailable(str(exc)) from None
        if len(replies) < len(messages):
            missing = sorted(set(clients) - {self.client_of.get(m.metadata.src_node_id) for m in replies})
            raise StatesUnavailable(
                f"client state ({action}): no reply from client(s) {', '.join(map(str, missing))} within "
                f"{self.round_timeout:g} s"
            )
        return replies

    def states(self) -> dict[int, Any]:
        """The clients' states: fetched again only from the clients trained since the last call."""
        if not self.clients_keep_state:
            return {}
        for msg in self._ask(GET_STATE, sorted(self.changed)):
            k, state = int(msg.content[TASK]["client-id"]), codec.get(msg.content, STATE)
            if state is None:
                self.known.pop(k, None)
            else:
                self.known[k] = to_device(state, self.device)
        self.changed.clear()
        return dict(sorted(self.known.items()))

    def close(self) -> None:
        """Nothing to release: the nodes belong to the deployment."""

    def restore(self, states: Mapping[int, Any]) -> None:
        """Send the nodes their states (nothing to do for none: a Flower run's nodes start without state)."""
        self.known, self.changed = dict(states), set()
        if states:
            self._ask(SET_STATE, sorted(self.nodes), states)
            self.clients_keep_state = True
