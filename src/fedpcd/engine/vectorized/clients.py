"""The vectorized executor's participants: one client's ``begin_local`` (its :class:`LocalWork`, whose
tensors the executor stacks, and its trainable tensors), its batch stream, and the write-back of its trained
tensors into the model and that same work."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedpcd import seeds
from fedpcd.algorithms import Algorithm, ClientData, LocalWork
from fedpcd.algorithms.readout import Readout
from fedpcd.engine.federation import Federation, to_device
from fedpcd.engine.tasks import ClientTask
from fedpcd.engine.vectorized.stacking import model_tensors, tensor_leaves


class Fallback(Exception):
    """The vectorized executor cannot run this round (the reason); the sequential one runs it instead."""


@dataclass
class Client:
    """One participant of a chunk: its inputs, its working context after ``begin_local`` and its stream."""

    k: int
    data: ClientData
    payload: dict[str, Any]  # as received
    state: Any  # as stored
    rng: torch.Generator
    round: int
    work: LocalWork  # after begin_local; end_local and the personal evaluation go on with it
    context: dict[str, Any]  # {"payload", "state", "values"} of ``work``: what the loss sees (``context_of``)
    tensors: dict[str, Tensor]  # the model's tensors after begin_local (snapshots)
    trainable: list[str]  # keys "m:<name>" / "c:<leaf index>" of the trainable tensors, optimiser order


# a client whose personal evaluation is batched: (result position, client, model tensors, the Readout of its
# personal predictor, None when that is the model itself)
Pending = tuple[int, Client, dict[str, Tensor], Readout | None]


def context_of(work: LocalWork) -> dict[str, Any]:
    """What the loss sees after ``begin_local``: the work's payload, state and working values (their tensors
    are stacked across the clients; other values must be equal within a group)."""
    return {"payload": work.payload, "state": work.state, "values": work.working_values()}


def work_of(context: dict[str, Any], rng: torch.Generator, rnd: int) -> LocalWork:
    """A :class:`LocalWork` holding ``context`` (under vmap: one client's slices of the stacked tensors),
    with nothing received and the spare generator ``rng`` (the loss must not draw)."""
    return LocalWork(context["payload"], context["state"], rng, round=rnd, received={}, **context["values"])


def begin(algorithm: Algorithm, fed: Federation, task: ClientTask) -> Client:
    """The task's ``begin_local`` on the reusable model object, as the sequential executor runs it; which
    tensors it trains. Raises :class:`Fallback` for a trainable tensor the executor cannot stack."""
    k, rnd, payload, state = task.client, task.round, task.payload, task.state
    model = fed.model_for(k, fresh=state is None)
    device = next(model.parameters()).device
    payload, state = to_device(payload, device), to_device(state, device)
    rng = seeds.generator(seeds.client_update(fed.config.seed, rnd, k))
    work = LocalWork(payload, state, rng, round=rnd)
    algorithm.begin_local(model, fed.clients[k], work)
    context = context_of(work)
    names = {id(p): f"m:{n}" for n, p in model.named_parameters()}
    names.update({id(t): f"c:{i}" for i, t in enumerate(tensor_leaves(context))})
    trainable = []
    for p in algorithm.trainable_parameters(model, work):
        if p.requires_grad:
            if id(p) not in names:
                raise Fallback("a trainable tensor is neither a model parameter nor in the loss's inputs")
            trainable.append(names[id(p)])
    tensors = {n: t.detach().clone() for n, t in model_tensors(model).items()}
    return Client(k, fed.clients[k], payload, state, rng, rnd, work, context, tensors, trainable)


def batch_stream(client: Client, batch_size: int, epochs: int) -> Iterator[tuple[Tensor, Tensor]]:
    """The client's batches, epoch after epoch, as the shared loop draws them."""
    for _ in range(epochs):
        yield from client.data.batches(batch_size, client.rng)


def write_back(model: nn.Module, client: Client, final: dict[str, Tensor]) -> None:
    """Put the client's model tensors as ``begin_local`` left them into the (shared) model object, then its
    trained (or in-place updated) tensors into the model and its work."""
    tensors = model_tensors(model)
    leaves = tensor_leaves(client.context)
    with torch.no_grad():
        for name, value in client.tensors.items():
            tensors[name].copy_(value)
        for key, value in final.items():
            kind, name = key.split(":", 1)
            target = tensors[name] if kind == "m" else leaves[int(name)]
            target.copy_(value)
