"""FedClassAvg (Jang, Kim, Lee & Yoon, "FedClassAvg: Local Representation Learning for Personalized
Federated Learning on Heterogeneous Neural Networks", ICPP 2022); a model-heterogeneous baseline of FedSSA
(Yi et al., IJCAI 2024, Sec. 2 and 6.1): global averaging of the full classifier, plus a proximal term toward
the global classifier and supervised contrastive learning on the representations.

LG-FedAvg's split (private, possibly heterogeneous feature extractor; the linear classifier is global,
replaced by the received average at the start of local training, averaged by n_k) with the local objective

    CE(head(z), y) + (rho / 2) * prox(head, global head) + lam * SupCon(z, y; tau)

where z = the extractor's representation and SupCon is the supervised contrastive loss of Khosla et al.
2020 (L_out): for each anchor i with at least one other same-class sample in the batch,
-(1/|P(i)|) sum_{p in P(i)} log(exp(s_ip / tau) / sum_{a != i} exp(s_ia / tau)), averaged over those
anchors, with s = the dot product of the (L2-normalised, ``normalize``) representations. The personal model
is the client's extractor with its locally trained classifier (the official evaluation); GA is None.

Options ([O] = the official code hukla/FedClassAvg):

- ``prox``: "mse" = sum over the classifier's tensors of the *mean* squared difference ([O], ``MSELoss``
  per tensor, with ``rho`` = its ``--mu``, 0.1 in its README); "norm" = the squared L2 norm ||w - w_g||^2
  (FedProx's form).
- ``normalize``, ``tau``, ``lam``: the defaults are SupCon's standard form (normalised z, tau = 0.07,
  weight 1). [O] contrasts unnormalised representations with tau = 100 and scales the loss by
  tau / 0.07; that is ``normalize=false, tau=100, lam=1428.57`` (it trains with Adam, lr 1e-4; with this
  library's SGD the unnormalised form is unstable, hence not the default).

Not emulated: [O] contrasts two augmented views of each image (the batch doubles); the library's pipeline
feeds one view, so the positives are the other same-class samples of the batch (an anchor alone of its class
is left out). [O] also pre-trains every client locally once before round 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.contract import ALGORITHMS, LocalWork
from fedpcd.algorithms.lgfedavg import LGFedAvg
from fedpcd.algorithms.statedict import device_of
from fedpcd.algorithms.vectorizable import TwoFormLoss


def supcon_loss(z: Tensor, y: Tensor, tau: float, normalize: bool = True, traceable: bool = False) -> Tensor:
    """Single-view supervised contrastive loss (Khosla et al. 2020, L_out), mean over the anchors that have
    a positive; 0 (with a gradient graph) when no anchor has one. ``traceable``: the same up to float
    rounding without data-dependent branches or indexing (for ``torch.func.vmap``)."""
    if normalize:
        z = F.normalize(z, dim=1)
    n = z.shape[0]
    sim = z @ z.T / tau
    self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(self_mask, float("-inf"))
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    positives = (y[:, None] == y[None, :]) & ~self_mask
    num_pos = positives.sum(dim=1)
    anchors = num_pos > 0
    pos_log_prob = log_prob.masked_fill(~positives, 0.0).sum(dim=1)
    if traceable:
        per_anchor = pos_log_prob / num_pos.clamp(min=1)
        return -(per_anchor * anchors).sum() / anchors.sum().clamp(min=1)
    if not bool(anchors.any()):
        return z.sum() * 0.0
    return -(pos_log_prob[anchors] / num_pos[anchors]).mean()


def classifier_proximal(
    model: nn.Module, reference: Mapping[str, Tensor], form: Literal["mse", "norm"]
) -> Tensor:
    """sum over the parameters named in ``reference`` of mean ("mse") or sum ("norm") of (w - w_g)^2."""
    total = torch.zeros((), device=device_of(model))
    for name, p in model.named_parameters():
        if name in reference:
            sq = (p - reference[name].detach()).pow(2)
            total = total + (sq.mean() if form == "mse" else sq.sum())
    return total


@ALGORITHMS.register("fedclassavg")
@dataclass
class FedClassAvg(TwoFormLoss, LGFedAvg):
    """FedClassAvg: LG-FedAvg's shared classifier, a proximal term to it, supervised contrastive learning."""

    rho: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.1  # [O] README's --mu
    prox: Literal["mse", "norm"] = "mse"  # "mse": [O]
    lam: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0  # weight of SupCon
    tau: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.07  # SupCon temperature
    normalize: bool = True  # L2-normalise z before SupCon ([O]: false)

    def loss_form(
        self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork, traceable: bool
    ) -> Tensor:
        """CE + (rho/2) prox(head, received head) + lam SupCon(z, y); ``traceable``: SupCon's masked form."""
        x, y = batch
        z = model.features(x)
        total = F.cross_entropy(model.head(z), y)
        if self.rho > 0.0:
            total = total + self.rho / 2 * classifier_proximal(model, work.payload["model"], self.prox)
        if self.lam > 0.0:
            total = total + self.lam * supcon_loss(z, y, self.tau, self.normalize, traceable)
        return total
