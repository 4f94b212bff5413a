"""FedProc (Mu et al., "FedProc: Prototypical Contrastive Federated Learning on Non-IID Data", arXiv 2021 /
FGCS 2023): cross-entropy plus a prototypical contrastive loss against global class prototypes.

With z the sample's representation, g_c the global prototype of class c and s the cosine similarity,

    l_pc = -log( exp(s(z, g_y)/tau) / sum_c exp(s(z, g_c)/tau) ),      l = CE + weight * l_pc

(as FedMR's FedProc baseline: FedMR tunes one weight on l_pc, Table 9, instead of the paper's round-dependent
blend of CE and l_pc; the blend is not implemented). Prototypes are constants in the local loss.

Prototypes (aggregated as in FedMR Sec. 3.3.2; FedMR runs its baselines on them): after local training each
client sends, for every class it holds, the mean representation g_k^c of its samples under the final local
model (eval mode, no augmentation) and the count n_k^c; the server sets g_c = sum_k n_k^c g_k^c / sum_k n_k^c
over the round's participants holding c, and a class nobody reported keeps its previous prototype. Until a
class has been reported it has no prototype: it is left out of the denominator, and samples of such a class
contribute no l_pc (in round 1 the loss is CE alone). The model weights are averaged as in FedAvg.

Representation: the model's ``features(x)`` (the paper's hybrid network adds a projection; not used here).
weight = 0 is FedAvg (plus the prototype traffic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import aggregate_prototypes, class_means_reply
from fedpcd.algorithms.context import CLASS_MEAN_UPLOADS, ClientData, Upload
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import device_of
from fedpcd.algorithms.vectorizable import TwoFormLoss


def prototype_contrastive_loss(
    z: Tensor, y: Tensor, prototypes: Tensor, known: Tensor, tau: float, traceable: bool = False
) -> Tensor:
    """l_pc averaged over the samples whose class has a prototype (0 if none); unknown classes are skipped.
    ``traceable``: the same up to float rounding without data-dependent branches or indexing (for
    ``torch.func.vmap``; unknown classes get the smallest finite logit, whose exp underflows to 0 as
    -inf's does)."""
    valid = known[y]
    if traceable:
        sim = F.cosine_similarity(z[:, None, :], prototypes[None, :, :], dim=2) / tau
        sim = sim.masked_fill(~known[None, :], torch.finfo(sim.dtype).min)
        per_sample = F.cross_entropy(sim, y, reduction="none")
        return (per_sample * valid).sum() / valid.sum().clamp(min=1)
    if not bool(valid.any()):
        return z.sum() * 0.0
    sim = F.cosine_similarity(z[valid, None, :], prototypes[None, :, :], dim=2) / tau
    sim = sim.masked_fill(~known[None, :], float("-inf"))
    return F.cross_entropy(sim, y[valid])


@ALGORITHMS.register("fedproc")
@dataclass
class FedProc(TwoFormLoss, FedAvg):
    """FedProc: FedAvg + weight * l_pc against count-averaged global class prototypes."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("classes", "class_counts", "class_means")
    uploads: ClassVar[tuple[Upload, ...]] = CLASS_MEAN_UPLOADS

    # Weight of l_pc. Default 1e-3: FedMR Table 9 for CIFAR-10 P10C3 and CIFAR-100 (1e-5 .. 1e-3 elsewhere
    # in that table). weight = 0 is FedAvg.
    weight: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0e-3
    # tau of l_pc: 0.5 (FedMR states none; the same as MOON's, an assumption).
    tau: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.5

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """FedAvg's state plus empty prototypes (C x d zeros) and the mask of classes that have one, on the
        model's device."""
        server = super().init_server(model)
        c, device = self.ctx.num_classes, device_of(model)
        server["prototypes"] = torch.zeros(c, int(model.feature_dim), device=device)
        server["known"] = torch.zeros(c, dtype=torch.bool, device=device)
        return server

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """The global model and the global prototypes."""
        return {"model": server["model"], "prototypes": server["prototypes"], "known": server["known"]}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """FedAvg's model average; g_c = count-weighted mean of the reported g_k^c (others unchanged)."""
        server = super().aggregate(server, replies)
        server["prototypes"], server["known"] = aggregate_prototypes(
            server["prototypes"], server["known"], replies
        )
        return server

    # ----- client -----
    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply, then the class means of the final local model's features."""
        reply, state = super().end_local(model, data, work, loss)
        reply.update(class_means_reply(model, data))
        return reply, state

    def loss_form(
        self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork, traceable: bool
    ) -> Tensor:
        """CE + weight * l_pc (l_pc = 0 while no prototype exists); ``traceable``: l_pc's masked form."""
        x, y = batch
        z = model.features(x)
        ce = F.cross_entropy(model.head(z), y)
        prototypes, known = work.payload["prototypes"], work.payload["known"]
        if self.weight == 0.0 or (not traceable and not bool(known.any())):
            return ce
        pc = prototype_contrastive_loss(z, y, prototypes, known, self.tau, traceable)
        return ce + self.weight * pc
