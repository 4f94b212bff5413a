"""The algorithm contract: the hooks every algorithm implements, the working values of one local update
(`LocalWork`) and the shared local loop (`train_loop`).

An algorithm is a dataclass registered by name (`@ALGORITHMS.register("name")`) that subclasses `Algorithm`
(mostly through `FedAvg`, whose defaults these are) and overrides only the hooks its paper changes
(docs/adding-an-algorithm.md lists all 17, with who calls each and when):

- server: `init_server` once; each round `payload_for` per sampled client, then `aggregate`;
  `global_predictor` (and `extra_global_predictors`) for the generic accuracy (GA).
- client: `local_update` = `begin_local` (the one place a payload is loaded into the model), `fit` (the
  shared loop `train_loop`, driven by `trainable_parameters`, `loss` and `correct_grads`), `end_local`
  (the reply and the new state); then `personal_predictor` for the personal metrics, evaluated where the
  client state lives. Every client hook gets the update's [`LocalWork`][fedpcd.algorithms.contract.LocalWork],
  which holds all of its working values; the algorithm object holds only its hyperparameters and `ctx`.
  `private_keys` names the model weights that never leave the client (FedPer's head).
Server state, payloads, replies and client state are dicts of tensors, numbers and strings (nothing relies
on one process); client state holds only what is personal (None for FedAvg).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpcd.algorithms.common import round_lr
from fedpcd.algorithms.context import ClientData, Context, Upload
from fedpcd.algorithms.sgd import SGD
from fedpcd.algorithms.statedict import clone_state, weighted_average
from fedpcd.registry import Registry

ALGORITHMS: Registry[type] = Registry("algorithm")

Payload = dict[str, Any]
Reply = dict[str, Any]
Predictor = Callable[[Tensor], Tensor]


class LocalWork:
    """One client's local update: everything it works on, from `begin_local` to `personal_predictor`.

    The engine creates one for every client update (`fedpcd.engine.client_update.local_step`) and passes it
    to every client hook, so the algorithm object holds no per-client or per-round value. Besides the
    attributes below it holds the method's working values: plain attributes its hooks set and read (FedNH's
    `work.scale`, SCAFFOLD's `work.correction`, FedRoD's `work.personal_head`; keyword arguments beyond the
    listed ones set them too), listed by `working_values`.

    Attributes:
        round: The current round t (1..R).
        payload: What the loss sees of the server's payload (`begin_local` may replace it, e.g. by a copy
            with trainable tensors).
        state: The client's state as the loss sees it (`begin_local` may replace it, e.g. by the initial
            state at a first participation); after `local_update`, the client's new state.
        received: The payload as received.
        rng: The client's generator (seeded from run seed, round and client id).
        steps: The optimiser steps taken so far (`train_loop` counts them; FedNova's tau_i).

    Args:
        **values: The method's first working values, set as attributes.
    """

    FIELDS: ClassVar[tuple[str, ...]] = ("round", "payload", "state", "received", "rng", "steps")

    round: int
    payload: Payload
    state: Any
    received: Payload
    rng: torch.Generator
    steps: int

    def __init__(
        self,
        payload: Payload,
        state: Any,
        rng: torch.Generator,
        *,
        round: int = 1,
        received: Payload | None = None,
        **values: Any,
    ) -> None:
        self.round = round
        self.payload = payload
        self.state = state
        self.received = payload if received is None else received
        self.rng = rng
        self.steps = 0
        for name, value in values.items():
            setattr(self, name, value)

    def working_values(self) -> dict[str, Any]:
        """The method's working values.

        Returns:
            `{name: value}`, in the order they were first set.
        """
        return {k: v for k, v in vars(self).items() if k not in self.FIELDS}

    def get(self, name: str, default: Any = None) -> Any:
        """A working value.

        Args:
            name: The value's name.
            default: What to return when no hook has set it.

        Returns:
            The value, else `default`.
        """
        return getattr(self, name, default)

    def __repr__(self) -> str:
        return f"LocalWork(round={self.round}, values={sorted(self.working_values())})"


class Algorithm:
    """The contract; its defaults are FedAvg's (McMahan et al., AISTATS 2017, Algorithm 1): clients run E
    epochs of SGD from the global model, the server averages all state by n_k.

    Attributes:
        heterogeneous: True when the method runs with a different architecture per client (config
            `model.name` a list or map): it exchanges no tensor whose shape depends on the architecture.
        extra_uploads: The reply keys a client uploads besides "model", "num_samples" and "train_loss",
            which `privacy.clip` does not cover (the engine refuses the algorithm under it, docs/privacy.md).
        extra_server_state: The server-state keys besides "model" that the server computes from the
            replies (not from the noised model alone), likewise.
    """

    heterogeneous: ClassVar[bool] = False
    extra_uploads: ClassVar[tuple[str, ...]] = ()
    extra_server_state: ClassVar[tuple[str, ...]] = ()
    # How privacy.clip bounds each of extra_uploads and which of them aggregation.robust averages
    # (context.Upload); an algorithm whose own aggregate this declaration does not accompany gets neither.
    uploads: ClassVar[tuple[Upload, ...]] = ()
    # Why an upload cannot be bounded by a declaration (privacy.clip's refusal says so); "" where none is.
    unprivatised: ClassVar[str] = ""
    # Whether the server's "model" is a mean of the clients' models (server.optimizer and Krum apply to it).
    averages_model: ClassVar[bool] = True

    def setup(self, ctx: Context) -> None:
        """Called once on every process that runs this algorithm (server and clients).

        The algorithm object holds only its hyperparameters, `ctx` and what is derived from them (never a
        client's values).

        Args:
            ctx: What server and clients both know of the run: client and class counts, rounds, seed, the
                local training settings, the input shape, the model's parameter names.
        """
        self.ctx = ctx

    def private_keys(self, model: nn.Module) -> list[str]:
        """The model weights that stay on the client as its state (FedPer: the head; none for FedAvg).

        FedAvg's server, `begin_local` and `end_local` then move only the other keys: a client without state
        starts from its model's seeded initial private part, the generic model uses the initial private part
        (FedNH Sec. 4.1).

        Args:
            model: A model of the run's architecture.

        Returns:
            State-dict keys of `model`.
        """
        return []

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """The initial server state.

        Args:
            model: The seeded initial model.

        Returns:
            Its shared part as "model" and, with private keys, the initial private part as "initial" (for
                the generic model only).
        """
        private = self.private_keys(model)
        if not private:
            return {"model": clone_state(model)}
        shared = [k for k in model.state_dict() if k not in set(private)]
        return {"model": clone_state(model, shared), "initial": clone_state(model, private)}

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """What the server sends to a client this round.

        Args:
            server: The server state.
            client_id: The sampled client.

        Returns:
            The payload (FedAvg: the global model).
        """
        return {"model": server["model"]}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """The server's step: w <- sum_k n_k w_k / sum_k n_k over the replies for FedAvg (all parameters
        and buffers; `self.ctx.parameter_names` tells them apart).

        Args:
            server: The server state.
            replies: The round's replies (`end_local`'s).

        Returns:
            The new server state (FedAvg updates `server` in place and returns it).
        """
        server["model"] = weighted_average([r["model"] for r in replies], [r["num_samples"] for r in replies])
        return server

    def upload_bounds(self) -> tuple[Upload, ...]:
        """The declarations of what this instance uploads (its ``uploads``; an override drops or relabels what
        its hyperparameters leave out, e.g. FedNH's fixed scale)."""
        return type(self).uploads

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """The generic model, scored for GA.

        Args:
            model: A reusable model object to load the server's weights into.
            server: The server state.

        Returns:
            `model` holding the server's weights (with the initial private part if any), or a predictor over
                it; None for purely personalised methods.
        """
        if self.private_keys(model):
            model.load_state_dict({**server["model"], **server["initial"]})
        else:
            model.load_state_dict(server["model"])
        return model

    def total_rounds_use(self) -> str | None:
        """What of this method depends on the run's total number of rounds (``ctx.rounds``), in words; None
        when nothing does (FedAvg). A resume that raises ``rounds`` is refused where it is not None: the
        rounds already run were computed for the old total, so the longer run would not equal one made
        with the new total from the start."""
        return None

    def extra_global_predictors(
        self, model: nn.Module, server: dict[str, Any]
    ) -> Iterator[tuple[str, Predictor]]:
        """Further generic predictors to score on the full test set (none for FedAvg).

        A generator: the engine scores each predictor before asking for the next, so each may load its
        weights into the one reusable `model` (e.g. FedDyn's mean of the local models).

        Args:
            model: A reusable model object.
            server: The server state.

        Yields:
            `(name, predictor)` pairs; each is reported as `global_acc_<name>` in metrics.jsonl next to
                `global_acc`.
        """
        yield from ()

    # ----- client -----
    def local_update(self, model: nn.Module, data: ClientData, work: LocalWork) -> tuple[Reply, Any]:
        """Train from the payload; reply with the new weights, the sample count and the mean train loss.

        Three parts: `begin_local`, `fit`, `end_local`. The new state is also left in `work.state` for
        `personal_predictor`.

        Args:
            model: The client's model object.
            data: The client's training data and test splits.
            work: This update's working values.

        Returns:
            `(reply, new state)`.
        """
        self.begin_local(model, data, work)
        loss = self.fit(model, data, work)
        reply, work.state = self.end_local(model, data, work, loss)
        return reply, work.state

    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Before training: load `work.payload` (and the private part, `work.state`) into `model` and set
        up `work`: what `loss` sees (`work.payload`, `work.state`) and the working values.

        The one place a payload is loaded: `finetune` from the global model calls it again. Must not draw
        from `work.rng`.

        Args:
            model: The client's model object.
            data: The client's data.
            work: This update's working values.
        """
        private = self.private_keys(model)
        if not private:
            model.load_state_dict(work.payload["model"])
            return
        if work.state is None:  # first participation: the model's seeded initial private part
            work.state = clone_state(model, private)
        model.load_state_dict({**work.payload["model"], **work.state})

    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """Local training of one round on `begin_local`'s work (FedAvg: the shared loop `train_loop`;
        FedRep: two phases).

        Args:
            model: The client's model, loaded by `begin_local`.
            data: The client's data.
            work: This update's working values.

        Returns:
            The mean training loss.
        """
        return train_loop(self, model, data, work)

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """What the local optimiser updates; `train_loop` freezes the model's other parameters while it runs.

        Args:
            model: The client's model.
            work: This update's working values.

        Returns:
            Parameters of `model` or working tensors of `work` (all parameters for FedAvg).
        """
        return model.parameters()

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """The local objective on one batch: cross-entropy for FedAvg.

        Args:
            model: The client's model.
            batch: `(x, y)`.
            work: This update's working values.

        Returns:
            The scalar loss.
        """
        x, y = batch
        return F.cross_entropy(model(x), y)

    def correct_grads(
        self, grads: dict[str, Tensor], params: Mapping[str, Tensor], work: LocalWork
    ) -> dict[str, Tensor]:
        """The gradients the optimiser steps on (FedAvg: unchanged).

        Gradient corrections and the gradients of linear or closed-form terms go here (SCAFFOLD, FedDyn,
        FedDC); they apply before gradient clipping, weight decay and momentum. Out of place: the shared loop
        calls it under `torch.no_grad()` on one model's gradients and steps on what it returns.

        Args:
            grads: The loss's gradients by parameter name (the parameters that have one).
            params: Every parameter's current value by name.
            work: This update's working values.

        Returns:
            The gradients to step on, by parameter name.
        """
        return grads

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """After training: the reply and the new state.

        Args:
            model: The trained model.
            data: The client's data.
            work: This update's working values, with the trained tensors.
            loss: `fit`'s mean training loss.

        Returns:
            `(reply, new state)`: the reply holds the shared part of the weights as "model", "num_samples" and
                "train_loss"; the new state is the private part, else `work.state`.
        """
        private = self.private_keys(model)
        if not private:
            return {
                "model": clone_state(model),
                "num_samples": data.num_samples,
                "train_loss": loss,
            }, work.state
        shared = [k for k in model.state_dict() if k not in set(private)]
        reply = {"model": clone_state(model, shared), "num_samples": data.num_samples, "train_loss": loss}
        return reply, clone_state(model, private)

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The client's personal model, right after `local_update` (FedAvg: the locally trained model).

        Args:
            model: The trained model.
            work: This update's working values: `work.received` is the payload as received, `work.state`
                the new state.

        Returns:
            `model` itself, a `Readout` (`fedpcd.algorithms.readout`) over it (the model's weights
                plus a few tensors), or any function from inputs to logits.
        """
        return model


# ----- what the hooks call (not hooks: not to be overridden) -----------------------------------------------


def train_loop(
    algorithm: Algorithm,
    model: nn.Module,
    data: ClientData,
    work: LocalWork,
    *,
    epochs: int | None = None,
    lr: float | None = None,
    plain_sgd: bool = False,
) -> float:
    """The shared local loop: a fresh SGD optimiser (``fedpcd.algorithms.sgd.SGD``) over
    ``trainable_parameters``, ``epochs`` shuffled passes drawn from ``work.rng``, on each batch ``loss``,
    backward, ``correct_grads``, the gradient-norm clip ``local.grad_clip`` and the step (counted in
    ``work.steps``). Other parameters are frozen for the loop
    (FedRep's head epochs skip the body's backward; the steps are the same).

    Args:
        algorithm: Whose hooks the loop calls.
        model: The client's model, trained in place.
        data: The client's data.
        work: The client's round (its rng, payload, state, step count).
        epochs: Passes over the data (default ``local.epochs``).
        lr: The step size (default ``local.lr * local.lr_decay^(t - 1)`` in round t, ``work.round``).
        plain_sgd: Drop ``local.momentum`` and ``local.weight_decay`` (e.g. Ditto's personal steps).

    Returns:
        The mean training loss.
    """
    params = [p for p in algorithm.trainable_parameters(model, work) if p.requires_grad]
    cfg = algorithm.ctx.local
    if lr is None:
        lr = round_lr(cfg, work.round)
    momentum, decay = (0.0, 0.0) if plain_sgd else (cfg.momentum, cfg.weight_decay)
    opt = SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
    correcting = type(algorithm).correct_grads is not Algorithm.correct_grads
    model.train()
    total = torch.zeros((), device=next(model.parameters()).device)
    seen = 0
    with _frozen_except(model, params):
        for _ in range(cfg.epochs if epochs is None else epochs):
            for batch in data.batches(cfg.batch_size, work.rng):
                loss = algorithm.loss(model, batch, work)
                opt.zero_grad()
                loss.backward()
                if correcting:
                    _correct_grads(algorithm, model, work)
                if cfg.grad_clip is not None:
                    nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                work.steps += 1
                n = len(batch[1])
                total += loss.detach() * n
                seen += n
    return float(total) / max(seen, 1)


@contextlib.contextmanager
def _frozen_except(model: nn.Module, params: list[nn.Parameter]) -> Iterator[None]:
    """The model's parameters outside ``params`` with ``requires_grad=False`` for the block, then restored."""
    kept = {id(p) for p in params}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in kept]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _correct_grads(algorithm: Algorithm, model: nn.Module, work: LocalWork) -> None:
    """After backward, before the step: the model's gradients become ``correct_grads``'s."""
    params = dict(model.named_parameters())
    grads = {name: p.grad for name, p in params.items() if p.grad is not None}
    with torch.no_grad():
        corrected = algorithm.correct_grads(grads, params, work)
    for name, g in corrected.items():
        params[name].grad = g


def finetune(
    algorithm: Algorithm,
    model: nn.Module,
    data: ClientData,
    work: LocalWork,
    *,
    epochs: int,
    lr: float | None,
    from_global: bool,
) -> None:
    """Fine-tune ``model`` in place into a personal model (after the reply and state were cloned): from the
    received global model (``from_global``: ``begin_local`` on ``work.received`` with ``work.state``'s
    private part) or from this round's local model (FedAvg-FT, FedBABU)."""
    if from_global:
        work.payload = work.received
        algorithm.begin_local(model, data, work)
    train_loop(algorithm, model, data, work, epochs=epochs, lr=lr)
