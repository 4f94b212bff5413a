"""FD, federated distillation (Jeong, Oh, Kim, Bennis & Kim, "Communication-Efficient On-Device Machine
Learning: Federated Distillation and Augmentation under Non-IID Private Data", NeurIPS-W 2018, Alg. 1); a
model-heterogeneous baseline of FedSSA (Yi et al., IJCAI 2024, Sec. 2 and 6.1): clients upload per-class
mean logits; the server averages them per class; clients add a distillation term pulling their logits toward
the global per-class logits.

No weights are shared: each client's whole model is private (the client state) and may have its own
architecture. With F_k(x) the model's logits (C values) and G_c the global mean logit vector of class c:

- Upload, after local training: the mean logit vector of each held class over the client's training
  samples (eval mode, no augmentation), with the class counts: |S_k| x C numbers.
- Server: G_c = the mean of this round's uploads of class c (``weighting``); a class nobody reported keeps
  its vector; before any upload there is none and the distillation term of that class is off.
- Local objective: CE(F_k(x), y) + gamma * D(F_k(x), G_y), with D
  ``"mse"``: the mean over the batch and the C outputs of (F_k(x) - G_y)^2 (samples without G_y add 0), or
  ``"kl"``: T^2 * KL(softmax(G_y / T) || softmax(F_k(x) / T)), summed over the samples that have a G_y and
  divided by the batch size. gamma = 0 is the ``local`` baseline exactly.
- Personal model: the client's own model. There is no global model (GA is None).

Library choices, documented: Alg. 1 of the paper gives each device the global average *excluding its own*
upload and accumulates logits during training; here every client receives the same average (as the common
open implementations do, and as FedSSA's Sec. 2 describes it) and the means are recomputed after training
(like FedProto here). The paper's and FedSSA's distance and gamma are not stated; "mse" with gamma = 1 is the
library default, "kl" the usual distillation form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Predictor
from fedpcd.algorithms.fedproto import ClassMeanExchange, prototype_mse
from fedpcd.algorithms.statedict import device_of


def logit_kl(logits: Tensor, y: Tensor, targets: Tensor, known: Tensor, temperature: float) -> Tensor:
    """T^2 * sum over samples with a target of KL(softmax(G_y/T) || softmax(logits/T)), divided by the batch
    size; targets are constants."""
    log_q = F.log_softmax(logits / temperature, dim=1)
    log_p = F.log_softmax(targets[y].detach() / temperature, dim=1)
    per_sample = (log_p.exp() * (log_p - log_q)).sum(dim=1) * known[y].to(logits.dtype)
    return temperature**2 * per_sample.sum() / logits.shape[0]


@ALGORITHMS.register("fd")
@dataclass
class FD(ClassMeanExchange):
    """FD: private models distilled towards the global per-class mean logits; only logits travel."""

    statistic: ClassVar[str] = "logits"
    output: ClassVar[Literal["features", "logits"]] = "logits"

    gamma: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0  # weight of the distillation term
    distill: Literal["mse", "kl"] = "mse"
    temperature: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0  # T of "kl"
    # weighting (inherited): "uniform" = mean over the holders; "samples" = weighted by their class counts

    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """C x C global mean logits, none known yet (on the model's device)."""
        c, device = self.ctx.num_classes, device_of(model)
        return {
            "logits": torch.zeros(c, c, device=device),
            "known": torch.zeros(c, dtype=torch.bool, device=device),
        }

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """CE + gamma * D(F_k(x), G_y) (``distill``; classes without a global logit vector add 0)."""
        x, y = batch
        logits = model(x)
        ce = F.cross_entropy(logits, y)
        if self.gamma == 0.0:
            return ce
        targets, known = work.payload["logits"], work.payload["known"]
        if self.distill == "mse":
            term = prototype_mse(logits, y, targets, known)
        else:
            term = logit_kl(logits, y, targets, known, self.temperature)
        return ce + self.gamma * term

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The own model."""
        model.load_state_dict(work.state["model"])
        return model
