"""FedAvg (McMahan et al., AISTATS 2017, Algorithm 1): local SGD, then a sample-weighted model average.

This class is also the algorithm contract: every other algorithm subclasses it and overrides only the hooks
its paper changes. Hooks and the order the engine calls them in:

server: ``init_server`` once; each round ``payload_for`` per sampled client, then ``aggregate``;
        ``global_predictor`` for generic accuracy (GA).
client: ``local_update`` (default: ``load_payload``, then the shared ``train`` loop driven by ``loss``), then
        ``personal_predictor`` for the personal metrics, evaluated where the client state lives.

Server state, payloads, replies and client state are dicts of tensors, numbers and strings: nothing may rely
on running in one process. Client state holds only what is personal (None for FedAvg).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedpcd.algorithms.base import ALGORITHMS, ClientData, Context, clone_state, round_lr, weighted_average

Payload = dict[str, Any]
Reply = dict[str, Any]
Predictor = Callable[[Tensor], Tensor]


@ALGORITHMS.register("fedavg")
@dataclass
class FedAvg:
    """FedAvg: clients run E epochs of SGD from the global model; the server averages all state by n_k."""

    # True when the method runs with a different architecture per client (config model.name a list or map):
    # it exchanges no tensor whose shape depends on the architecture (FedSSA's header rows, prototypes).
    heterogeneous: ClassVar[bool] = False

    def setup(self, ctx: Context) -> None:
        """Called once on every process that runs this algorithm (server and clients)."""
        self.ctx = ctx
        self.round = 0  # the engine sets the current round (1..R) before each client step

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
    def local_update(
        self, model: nn.Module, data: ClientData, payload: Payload, state: Any, rng: torch.Generator
    ) -> tuple[Reply, Any]:
        """Train from the payload; reply with the new weights, the sample count and the mean train loss."""
        self.load_payload(model, payload, state)
        loss = self.train(model, data, payload, state, rng)
        return {"model": clone_state(model), "num_samples": data.num_samples, "train_loss": loss}, state

    def load_payload(self, model: nn.Module, payload: Payload, state: Any) -> None:
        """Put the received (and any personal) weights into the reusable model object."""
        model.load_state_dict(payload["model"])

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], payload: Payload, state: Any) -> Tensor:
        """The local objective on one batch: cross-entropy for FedAvg."""
        x, y = batch
        return F.cross_entropy(model(x), y)

    def trainable_parameters(self, model: nn.Module, payload: Payload, state: Any) -> Iterable[nn.Parameter]:
        """Parameters the local optimiser updates (all of them for FedAvg)."""
        return model.parameters()

    def before_step(self, model: nn.Module, payload: Payload, state: Any) -> None:
        """Called after backward and before the optimiser step (gradient corrections go here)."""

    def max_grad_norm(self) -> float | None:
        """The local loop's gradient-norm clip: ``local.grad_clip`` (None: no clipping)."""
        return self.ctx.local.grad_clip

    def train(
        self,
        model: nn.Module,
        data: ClientData,
        payload: Payload,
        state: Any,
        rng: torch.Generator,
        epochs: int | None = None,
        lr: float | None = None,
        plain_sgd: bool = False,
    ) -> float:
        """The shared local loop: a fresh SGD optimiser, ``epochs`` shuffled passes; returns the mean loss.

        ``epochs`` defaults to ``local.epochs``, ``lr`` to ``local.lr * local.lr_decay^(round - 1)``;
        ``plain_sgd`` drops ``local.momentum`` and ``local.weight_decay`` (e.g. Ditto's personal steps).
        """
        cfg = self.ctx.local
        params = [p for p in self.trainable_parameters(model, payload, state) if p.requires_grad]
        if lr is None:
            lr = round_lr(cfg, self.round)
        momentum, decay = (0.0, 0.0) if plain_sgd else (cfg.momentum, cfg.weight_decay)
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
        model.train()
        total = torch.zeros(())
        seen = 0
        for _ in range(cfg.epochs if epochs is None else epochs):
            for batch in data.batches(cfg.batch_size, rng):
                loss = self.loss(model, batch, payload, state)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                self.before_step(model, payload, state)
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
        payload: Payload,
        state: Any,
        rng: torch.Generator,
        *,
        epochs: int,
        lr: float | None,
        from_global: bool,
    ) -> None:
        """Fine-tune ``model`` in place into a personal model (after the reply and state were cloned): from
        the received global model (``from_global``) or from this round's local model (FedAvg-FT, FedBABU)."""
        if from_global:
            self.load_payload(model, payload, state)
        self.train(model, data, payload, state, rng, epochs=epochs, lr=lr)

    def personal_predictor(self, model: nn.Module, payload: Payload, state: Any) -> Predictor:
        """The client's personal model, right after ``local_update`` (FedAvg: the locally trained model)."""
        return model

    # ----- diagnostics (fedpcd.report.geometry): the feature space the classifier reads -----
    def global_features(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """x -> the global model's features h (the classifier's input); None without a global model."""
        if self.global_predictor(model, server) is None:
            return None
        return lambda x: model.features(x).flatten(1)

    def personal_features(self, model: nn.Module, payload: Payload, state: Any) -> Predictor:
        """x -> the personal model's features h, right after ``local_update``."""
        self.personal_predictor(model, payload, state)  # puts any personal weights into ``model``
        return lambda x: model.features(x).flatten(1)
