"""FedAvg (McMahan et al., AISTATS 2017, Algorithm 1): local SGD, then a sample-weighted model average.

This class is also the algorithm contract: every other algorithm subclasses it and overrides only the hooks
its paper changes. Hooks and the order the engine calls them in:

server: ``init_server`` once; each round ``payload_for`` per sampled client, then ``aggregate``;
        ``global_predictor`` for generic accuracy (GA).
client: ``local_update`` (default: ``begin_local`` = ``load_payload``; ``fit`` = the shared ``train`` loop
        driven by ``loss`` and ``correct_grads``; ``end_local`` = the reply), then ``personal_predictor`` for
        the personal metrics, evaluated where the client state lives. Every client hook gets the update's
        :class:`LocalWork`, which holds all of its working values; the algorithm object holds only its
        hyperparameters and ``ctx``.

Server state, payloads, replies and client state are dicts of tensors, numbers and strings: nothing may rely
on running in one process. Client state holds only what is personal (None for FedAvg).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpcd.algorithms.base import ALGORITHMS, ClientData, Context, clone_state, round_lr, weighted_average

Payload = dict[str, Any]
Reply = dict[str, Any]
Predictor = Callable[[Tensor], Tensor]


def shifted(grads: Mapping[str, Tensor], terms: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """g + terms[name] for every gradient that has a term (the others as they are): ``correct_grads``'s
    additive corrections."""
    return {name: g + terms[name] if name in terms else g for name, g in grads.items()}


class LocalWork:
    """One client's local update: everything it works on, from ``begin_local`` to ``personal_predictor``.

    The engine creates one for every client update (``fedpcd.engine.federation.client_step``) and passes it
    to every client hook, so the algorithm object holds no per-client or per-round value:

    - ``round``: the current round t (1..R);
    - ``payload``, ``state``: what the loss sees (``begin_local`` may replace them, e.g. by a copy with
      trainable tensors, or the initial state at a first participation); after ``local_update``, ``state``
      is the client's new state;
    - ``received``: the payload as received;
    - ``rng``: the client's generator (seeded from run seed, round and client id);
    - the method's working values, plain attributes its hooks set and read (FedNH's ``work.scale``,
      SCAFFOLD's ``work.correction``, FedRoD's ``work.personal_head``), listed by :meth:`working_values`.

    The vectorized executor (engine/vectorized/) stacks the tensors of ``payload``, ``state`` and the working
    values of the round's clients along a leading client dimension; a loss reads them the same way then.
    """

    FIELDS: ClassVar[tuple[str, ...]] = ("round", "payload", "state", "received", "rng")

    round: int
    payload: Payload
    state: Any
    received: Payload
    rng: torch.Generator

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
        for name, value in values.items():
            setattr(self, name, value)

    def working_values(self) -> dict[str, Any]:
        """The method's working values by name, in the order they were first set."""
        return {k: v for k, v in vars(self).items() if k not in self.FIELDS}

    def get(self, name: str, default: Any = None) -> Any:
        """The working value ``name``, or ``default`` when no hook has set it."""
        return getattr(self, name, default)

    def __repr__(self) -> str:
        return f"LocalWork(round={self.round}, values={sorted(self.working_values())})"


@ALGORITHMS.register("fedavg")
@dataclass
class FedAvg:
    """FedAvg: clients run E epochs of SGD from the global model; the server averages all state by n_k."""

    # True when the method runs with a different architecture per client (config model.name a list or map):
    # it exchanges no tensor whose shape depends on the architecture (FedSSA's header rows, prototypes).
    heterogeneous: ClassVar[bool] = False

    def setup(self, ctx: Context) -> None:
        """Called once on every process that runs this algorithm (server and clients); the algorithm object
        holds only its hyperparameters, ``ctx`` and what is derived from them (never a client's values)."""
        self.ctx = ctx

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """Initial server state from the seeded initial model."""
        return {"model": clone_state(model)}

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """What the server sends to ``client_id`` this round."""
        return {"model": server["model"]}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """w <- sum_k n_k w_k / sum_k n_k over the replies (all parameters and buffers)."""
        server["model"] = weighted_average([r["model"] for r in replies], [r["num_samples"] for r in replies])
        return server

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """The generic model (None for purely personalised methods); ``model`` is a reusable object."""
        model.load_state_dict(server["model"])
        return model

    # ----- client -----
    def local_update(self, model: nn.Module, data: ClientData, work: LocalWork) -> tuple[Reply, Any]:
        """Train from the payload; reply with the new weights, the sample count and the mean train loss.

        Three parts: ``begin_local``, ``fit`` (the shared ``train`` loop), ``end_local`` (the vectorized
        executor, engine/vectorized/, runs the middle part for many clients at once). Returns (reply, new
        state) and leaves the new state in ``work.state`` for ``personal_predictor``."""
        self.begin_local(model, data, work)
        loss = self.fit(model, data, work)
        reply, work.state = self.end_local(model, data, work, loss)
        return reply, work.state

    # ----- the local update in parts, for the vectorized executor (engine/vectorized/) -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Before training: load the payload into ``model`` and set up ``work``: what ``train`` and ``loss``
        see (``work.payload``, ``work.state``) and the method's working values.

        Must not draw from ``work.rng`` (the vectorized executor calls it again after training to re-enter
        the client's working values)."""
        self.load_payload(model, work.payload, work.state)

    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """Local training of one round on ``begin_local``'s work; the mean loss (FedAvg: the shared loop;
        FedRep: two phases). The vectorized executor runs only classes that keep this one."""
        return self.train(model, data, work)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """After training (``model`` and ``work`` hold the trained tensors): the reply and the new state."""
        return {"model": clone_state(model), "num_samples": data.num_samples, "train_loss": loss}, work.state

    def vector_loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """``loss`` in a form ``torch.func.vmap`` can trace (no data-dependent Python control flow, no random
        draws); equal to ``loss`` up to float rounding. The vectorized executor trains with this, on a
        ``work`` whose tensors are one client's slices of the stacked ones (its ``received`` is empty).
        Default: ``loss`` where a subclass overrides it, else ``objective(..., traceable=True)``."""
        if type(self).loss is not FedAvg.loss:
            return self.loss(model, batch, work)
        return self.objective(model, batch, work, traceable=True)

    def vectorize_blocker(self) -> str | None:
        """Why the vectorized executor cannot train this algorithm as configured (None: it can)."""
        return None

    def personal_extra(self, model: nn.Module, work: LocalWork) -> dict[str, Any] | None:
        """The tensors besides the model's weights that the personal predictor reads, so that right after
        ``personal_predictor(model, work)`` it equals ``x -> personal_logits(model, x, extra)``; None when
        it has no such form. A predictor that is the model itself needs neither hook."""
        return None

    def personal_logits(self, model: nn.Module, x: Tensor, extra: dict[str, Any]) -> Tensor:
        """The personal predictor's output from the model's weights and ``personal_extra`` (batched
        personal evaluation, engine/vectorized/)."""
        return model(x)

    def load_payload(self, model: nn.Module, payload: Payload, state: Any) -> None:
        """Put the received (and any personal) weights into the reusable model object."""
        model.load_state_dict(payload["model"])

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """The local objective on one batch (``objective`` as the shared loop runs it)."""
        return self.objective(model, batch, work, traceable=False)

    def objective(
        self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork, traceable: bool
    ) -> Tensor:
        """The local objective on one batch: cross-entropy for FedAvg. Override this instead of ``loss`` and
        ``vector_loss`` when one formula serves both: ``traceable`` asks for the form without data-dependent
        control flow or indexing (equal up to float rounding)."""
        x, y = batch
        return F.cross_entropy(model(x), y)

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """Parameters (or working tensors of ``work``) the local optimiser updates (all parameters for
        FedAvg)."""
        return model.parameters()

    def before_step(self, model: nn.Module, work: LocalWork) -> None:
        """Called after backward and before the optimiser step: the gradients become ``correct_grads``'s.

        Override ``correct_grads`` rather than this (the vectorized executor runs only classes that keep
        this one, and applies ``correct_grads`` to all clients at once)."""
        if type(self).correct_grads is FedAvg.correct_grads:
            return
        params = dict(model.named_parameters())
        grads = {name: p.grad for name, p in params.items() if p.grad is not None}
        with torch.no_grad():
            corrected = self.correct_grads(grads, params, work)
        for name, g in corrected.items():
            params[name].grad = g

    def correct_grads(
        self, grads: dict[str, Tensor], params: Mapping[str, Tensor], work: LocalWork
    ) -> dict[str, Tensor]:
        """The gradients the optimiser steps on, by parameter name, from the loss's ``grads`` (the
        parameters that have one); ``params`` holds every parameter's current value. Gradient corrections
        and the gradients of linear or closed-form terms go here (SCAFFOLD, FedDyn, FedDC); they apply before
        gradient clipping, weight decay and momentum, as ``before_step`` does. FedAvg: unchanged.

        Tensor code only, out of place (no data-dependent Python control flow, no random draws): the shared
        loop calls it on one model's gradients, the vectorized executor vmaps it over the clients' stacked
        gradients, parameters and works."""
        return grads

    def max_grad_norm(self) -> float | None:
        """The local loop's gradient-norm clip: ``local.grad_clip`` (None: no clipping)."""
        return self.ctx.local.grad_clip

    def train(
        self,
        model: nn.Module,
        data: ClientData,
        work: LocalWork,
        epochs: int | None = None,
        lr: float | None = None,
        plain_sgd: bool = False,
    ) -> float:
        """The shared local loop: a fresh SGD optimiser, ``epochs`` shuffled passes drawn from ``work.rng``;
        returns the mean loss.

        ``epochs`` defaults to ``local.epochs``, ``lr`` to ``local.lr * local.lr_decay^(t - 1)`` in round t
        (``work.round``); ``plain_sgd`` drops ``local.momentum`` and ``local.weight_decay`` (e.g. Ditto's
        personal steps).
        """
        cfg = self.ctx.local
        params = [p for p in self.trainable_parameters(model, work) if p.requires_grad]
        if lr is None:
            lr = round_lr(cfg, work.round)
        momentum, decay = (0.0, 0.0) if plain_sgd else (cfg.momentum, cfg.weight_decay)
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
        model.train()
        total = torch.zeros((), device=next(model.parameters()).device)
        seen = 0
        for _ in range(cfg.epochs if epochs is None else epochs):
            for batch in data.batches(cfg.batch_size, work.rng):
                loss = self.loss(model, batch, work)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                self.before_step(model, work)
                clip = self.max_grad_norm()
                if clip is not None:
                    nn.utils.clip_grad_norm_(params, clip)
                opt.step()
                n = len(batch[1])
                total += loss.detach() * n
                seen += n
        return float(total) / max(seen, 1)

    def finetune(
        self,
        model: nn.Module,
        data: ClientData,
        work: LocalWork,
        *,
        epochs: int,
        lr: float | None,
        from_global: bool,
    ) -> None:
        """Fine-tune ``model`` in place into a personal model (after the reply and state were cloned): from
        the received global model (``from_global``, with ``work.state``'s personal part) or from this round's
        local model (FedAvg-FT, FedBABU)."""
        if from_global:
            self.load_payload(model, work.received, work.state)
        self.train(model, data, work, epochs=epochs, lr=lr)

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The client's personal model, right after ``local_update`` (FedAvg: the locally trained model);
        ``work.received`` is the payload as received and ``work.state`` the new state."""
        return model

    # ----- diagnostics (fedpcd.report.geometry): the feature space the classifier reads -----
    def global_features(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """x -> the global model's features h (the classifier's input); None without a global model."""
        if self.global_predictor(model, server) is None:
            return None
        return lambda x: model.features(x).flatten(1)

    def personal_features(self, model: nn.Module, payload: Payload, state: Any) -> Predictor:
        """x -> the personal model's features h, right after ``local_update`` from ``payload`` (the new
        ``state``): the features of ``model`` as the update left it (every method here leaves its personal
        weights there; FedGELA's classifier reads its projected h instead)."""
        return lambda x: model.features(x).flatten(1)

    # ----- extra metrics -----
    def extra_global_predictors(
        self, model: nn.Module, server: dict[str, Any]
    ) -> Iterator[tuple[str, Predictor]]:
        """Further generic predictors to score on the full test set, as ``(name, predictor)`` pairs; each
        is reported as ``global_acc_<name>`` in metrics.jsonl next to ``global_acc`` (none for FedAvg).

        A generator: the engine scores each predictor before asking for the next, so each may load its
        weights into the one reusable ``model`` (e.g. FedDyn's mean of the local models)."""
        yield from ()
