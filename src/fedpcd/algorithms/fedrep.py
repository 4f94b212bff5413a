"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized FL", ICML 2021, Alg. 1).

Each round the client first updates its private head with the received body frozen, then the body with its
new head frozen; only the body is sent and averaged (a baseline of FedNH, App. A.2, and FedGELA, Sec. 5.1).
Everything else (private head as client state, GM = averaged body + initial head) is FedPer's.

Epoch split: ``head_epochs`` = 10 head epochs as in the unified FedNH code (FedNH paper App. A.2,
"10 epochs ... then the body for 5 epochs", where 5 is that code's local epochs); the body gets
``body_epochs`` (default: ``local.epochs``, so the shared part sees the same compute as FedAvg/FedPer).
Collins et al. take many head steps and few body steps per round (their code: ``local_ep`` epochs in all, of
which ``local_rep_ep`` = 1 on the body); set ``head_epochs``/``body_epochs`` to reproduce that split.
The reply's ``train_loss`` is the body phase's mean loss (the federated objective).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field
from torch import nn

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, train_loop
from fedpcd.algorithms.fedper import FedPer
from fedpcd.algorithms.statedict import backbone_parameters


@ALGORITHMS.register("fedrep")
@dataclass
class FedRep(FedPer):
    """FedRep: ``head_epochs`` on the private head (body frozen), then ``body_epochs`` on the body."""

    head_epochs: Annotated[int, Field(ge=0)] = 10  # FedNH App. A.2 (its unified code)
    body_epochs: Annotated[int, Field(ge=1)] | None = None  # None: local.epochs (matched compute)

    def fit(self, model: nn.Module, data: ClientData, work: LocalWork) -> float:
        """Alg. 1: head epochs with the body fixed, then body epochs with the head fixed (``work.phase``)."""
        work.phase = "head"
        train_loop(self, model, data, work, epochs=self.head_epochs)
        work.phase = "body"
        return train_loop(self, model, data, work, epochs=self.body_epochs)

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """The head in the head phase, the body (all but the head) in the body phase (and outside ``fit``)."""
        return model.head.parameters() if work.get("phase") == "head" else backbone_parameters(model)
