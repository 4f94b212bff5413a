"""The client update: what every backend runs for one client in one round, in one place.

A :class:`ClientTask` says what the server sends (round, client id, payload, the client's stored state,
whether to evaluate); :func:`run_client` runs it on a federation (the local update from a (seed, round,
client) generator, then the personal evaluation; a failure caught and returned; then the client side of
the update policy, :func:`fedpcd.engine.update_policy.settle_reply`) and returns a typed
:class:`ClientReply`. :func:`run_clients` runs a list of tasks: one after another, or at
once through the vectorized executor (``engine.executor: vectorized``).

The in-process executor, the worker pool (:mod:`fedpcd.engine.pool`) and the Flower ClientApp
(:mod:`fedpcd.flower.client_app`) all call these functions, which is why every backend gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from fedpcd import seeds
from fedpcd.algorithms import Algorithm, ClientData, LocalWork
from fedpcd.algorithms.statedict import tensor_bytes
from fedpcd.engine.federation import Federation, to_device
from fedpcd.engine.guard import NonFiniteError, model_nonfinite
from fedpcd.engine.metrics import personal_evaluation, personal_evaluation_with_means
from fedpcd.engine.tasks import ClientReply, ClientTask
from fedpcd.engine.update_policy import settle_reply, state_to_keep
from fedpcd.errors import UserError

__all__ = ["ClientReply", "ClientTask", "local_step", "run_client", "run_clients"]


def local_step(
    algorithm: Algorithm,
    model: nn.Module,
    data: ClientData,
    payload: dict[str, Any],
    state: Any,
    *,
    seed: int,
    rnd: int,
) -> tuple[dict[str, Any], LocalWork]:
    """The local update: the reply and the update's :class:`LocalWork` (its ``state`` the new state), after
    which ``model`` and the work are what ``personal_predictor`` reads.

    Payload and state are moved to the model's device first (a no-op in the local simulator; over Flower
    and from the worker pool they arrive as CPU tensors). The generator is a CPU one on every device: the
    same batches everywhere. The algorithm object is not written."""
    device = next(model.parameters()).device
    payload, state = to_device(payload, device), to_device(state, device)
    rng = seeds.generator(seeds.client_update(seed, rnd, data.id))
    work = LocalWork(payload, state, rng, round=rnd)
    reply, work.state = algorithm.local_update(model, data, work)
    return reply, work


def run_client(algorithm: Algorithm, fed: Federation, task: ClientTask) -> ClientReply:
    """``task`` on ``fed``'s reusable model object of the client's architecture (reset to its seeded initial
    weights when the client has no state): local update, personal evaluation, then the client side of the
    update policy (:func:`_settle`).

    A client that raises (anything but a UserError, which stops the run) gets a reply with ``error`` set."""
    config = fed.config
    data = fed.clients[task.client]
    before = state_to_keep(config, task.state)
    model = fed.model_for(task.client, fresh=task.state is None)
    try:
        update, work = local_step(
            algorithm, model, data, task.payload, task.state, seed=config.seed, rnd=task.round
        )
        metrics = None
        if task.evaluate:
            predictor = algorithm.personal_predictor(model, work)
            if config.geometry and task.round == config.rounds:  # and the class means of its angles
                classes = fed.dataset.num_classes
                metrics = personal_evaluation_with_means(predictor, model, data, task.full_test, classes)
            else:
                metrics = personal_evaluation(predictor, data, task.full_test)
    except UserError:
        raise
    except Exception as exc:  # one client's failure is the round's business (engine/guard.py)
        bad = model_nonfinite(model)
        error: BaseException = exc
        if bad is not None:
            error = NonFiniteError(f"non-finite {bad}, then {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        return ClientReply(task.client, {}, None, tensor_bytes(task.payload), 0, error=error)
    reply = ClientReply(task.client, update, metrics, tensor_bytes(task.payload), 0, state=work.state)
    return _settle(fed, task, reply, before)


def _settle(fed: Federation, task: ClientTask, reply: ClientReply, kept: Any) -> ClientReply:
    """:func:`fedpcd.engine.update_policy.settle_reply` on ``fed``'s device and classes."""
    return settle_reply(fed.config, fed.dataset.num_classes, fed.device, task, reply, kept)


def run_clients(algorithm: Algorithm, fed: Federation, tasks: Iterable[ClientTask]) -> list[ClientReply]:
    """The replies to ``tasks`` (in their order). ``engine.executor: vectorized`` trains them at once where
    the algorithm and round allow (``fedpcd.engine.vectorized``), else (and for ``auto`` and
    ``sequential``) one after another with :func:`run_client`. ``auto`` stays sequential: the vectorized
    executor is only ~1.3x faster on a CPU and not bitwise equal to the sequential path that Flower's
    ClientApps and the archived results use (rounding-level differences)."""
    if fed.config.engine.executor == "vectorized":
        from fedpcd.engine.vectorized import train_or_none  # torch.func only when used

        tasks = list(tasks)
        kept = [state_to_keep(fed.config, t.state) for t in tasks]
        replies = train_or_none(algorithm, fed, tasks)
        if replies is not None:
            return [_settle(fed, t, r, s) for t, r, s in zip(tasks, replies, kept, strict=True)]
    return [run_client(algorithm, fed, task) for task in tasks]
