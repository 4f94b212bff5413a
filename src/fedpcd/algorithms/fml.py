"""FML (Shen et al., "Federated Mutual Learning", arXiv 2006.16765, 2020), Sec. 3 and Alg. 1; the
model-heterogeneous baseline of FedSSA (Yi et al., IJCAI 2024, Sec. 6.1). Also the shared-small-model
machinery that FedKD (``fedkd.py``) reuses.

Each client k trains two models on its data at every local step, by Deep Mutual Learning (DML, Zhang et al.
CVPR 2018): its private model (any architecture; never sent; kept in the client state) and a "meme" model, a
copy of the global model of one shared small architecture (``shared_model``, CNN-5 as in FedSSA's setting):

- L_local = alpha CE(p_local, y) + (1 - alpha) KL(p_meme || p_local),
- L_meme  = beta  CE(p_meme, y)  + (1 - beta)  KL(p_local || p_meme),

with p = softmax(logits) (no temperature), KL(p || q) = sum_c p_c log(p_c / q_c) averaged over the batch, and
the other model's distribution a constant in each loss (the official code detaches it). alpha = beta = 0.5
(the official ``Args.py`` defaults). Both models take one SGD step per batch on the same learning rate (the
official code: two identical optimisers; here one optimiser over both parameter sets, which is the same
update because the two losses share no parameter). The server averages the meme models like FedAvg
(``weighting="samples"``, n_k; ``"uniform"`` is the official code's plain mean) and sends the average back.

Communication per client and round: the shared model, down and up (CNN-5 of FedSSA's Table 4: 670,058
params on CIFAR-10). Personal metrics: the private model after local training; GA: the global meme model on
the full test set (the paper reports both the global and the local models).

Library choices: the shared model's initial weights are seeded with the stream
``fedpcd.seeds.fml_shared_model``, so every process builds the same one; the private model starts from its
architecture's seeded initial weights (the engine's reset at first participation); the paper's dynamic
alpha/beta and the "catfish" variants are not implemented.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd import seeds
from fedpcd.algorithms.common import Weighting, reply_weights
from fedpcd.algorithms.context import ClientData, Context
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor, Reply, train_loop
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import clone_state, device_of, weighted_average
from fedpcd.errors import UserError
from fedpcd.models import build_model

KLReduction = Literal["batchmean", "mean"]


def kl_divergence(target_logits: Tensor, logits: Tensor, reduction: KLReduction = "batchmean") -> Tensor:
    """KL(softmax(target_logits) || softmax(logits)) = sum_c p_c (log p_c - log q_c), averaged over the batch
    ("batchmean") or over all B x C entries ("mean", what torch's ``nn.KLDivLoss()`` default computes).
    Gradients flow into both arguments: detach ``target_logits`` for a constant target."""
    kl = F.kl_div(
        F.log_softmax(logits, dim=1),
        F.log_softmax(target_logits, dim=1),
        reduction="batchmean",
        log_target=True,
    )
    return kl / logits.shape[1] if reduction == "mean" else kl


def mutual_losses(
    private_logits: Tensor, meme_logits: Tensor, y: Tensor, alpha: float, beta: float
) -> tuple[Tensor, Tensor]:
    """FML's (L_local, L_meme): alpha CE + (1 - alpha) KL(p_meme || p_local) and beta CE + (1 - beta)
    KL(p_local || p_meme); each loss sees the other model's distribution as a constant."""
    local = alpha * F.cross_entropy(private_logits, y) + (1 - alpha) * kl_divergence(
        meme_logits.detach(), private_logits
    )
    meme = beta * F.cross_entropy(meme_logits, y) + (1 - beta) * kl_divergence(
        private_logits.detach(), meme_logits
    )
    return local, meme


@dataclass
class SharedModelMethod(FedAvg):
    """A private model of any architecture per client plus one shared small model that alone is federated.

    Server state and payload: ``{"model": shared model state}``. Client state: ``{"model": private state}``
    (subclasses add their own private tensors). ``self.shared`` is the shared architecture with its initial
    weights, seeded from the run seed and never trained: each local update trains its own copy
    (``work.shared``). Subclasses define ``loss`` (over both models), ``local_update``'s reply and
    ``aggregate``.
    """

    heterogeneous: ClassVar[bool] = True

    shared_model: str = "cnn5"  # the shared small model's architecture (FedSSA: CNN-5 for FML and FedKD)
    weighting: Weighting = "samples"  # aggregation weights: n_k (FedAvg) or uniform (both official codes)

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        if ctx.input_shape is None:
            raise UserError(
                f"{type(self).__name__} needs the input shape in the run context to build its model"
            )
        channels, height, _ = ctx.input_shape
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds.fml_shared_model(ctx.seed))
            self.shared = build_model(self.shared_model, channels, ctx.num_classes, height)
        self.shared_init = clone_state(self.shared)

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """The shared model's seeded initial weights (``model``, client 0's architecture, is not used)."""
        device = device_of(model)
        return {"model": {k: v.to(device, copy=True) for k, v in self.shared_init.items()}}

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """The global shared model (GA), on the run's device."""
        return self.shared_copy(server["model"], device_of(model))

    def shared_copy(self, weights: Mapping[str, Tensor], device: torch.device) -> nn.Module:
        """A copy of the shared model on ``device`` holding ``weights``."""
        shared = copy.deepcopy(self.shared).to(device)
        shared.load_state_dict(weights)
        return shared

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Private weights into ``model``; the received global weights into this update's copy of the shared
        model (``work.shared``), which trains with it."""
        if work.state is not None:  # else the engine's seeded initial weights
            model.load_state_dict(work.state["model"])
        work.shared = self.shared_copy(work.payload["model"], device_of(model))
        work.shared.train()

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """Both models: one SGD step on each per batch."""
        return [*model.parameters(), *work.shared.parameters()]


@ALGORITHMS.register("fml")
@dataclass
class FML(SharedModelMethod):
    """FML: private and meme models learn from the labels and from each other (DML); memes are averaged."""

    alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5  # CE weight of the private model (official: 0.5)
    beta: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5  # CE weight of the meme model (official: 0.5)

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """Global meme = weighted average of the trained meme models (all parameters and buffers)."""
        server["model"] = weighted_average(
            [r["model"] for r in replies], reply_weights(replies, self.weighting)
        )
        return server

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """L_local + L_meme; each has gradients only in its own model."""
        x, y = batch
        local, meme = mutual_losses(model(x), work.shared(x), y, self.alpha, self.beta)
        return local + meme

    def local_update(self, model: nn.Module, data: ClientData, work: LocalWork) -> tuple[Reply, Any]:
        """Mutual learning for ``local.epochs``; reply with the trained meme model, keep the private one."""
        self.begin_local(model, data, work)
        loss = train_loop(self, model, data, work)
        reply = {"model": clone_state(work.shared), "num_samples": data.num_samples, "train_loss": loss}
        work.state = {"model": clone_state(model)}
        return reply, work.state
