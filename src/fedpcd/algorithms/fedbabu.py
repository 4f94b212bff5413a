"""FedBABU (Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification",
ICLR 2022, Alg. 1).

During federated training the head stays at its random initialisation and is never in the optimiser; only
the body is trained and averaged. Personalisation fine-tunes the *whole* network (the paper's default, "FT
(full)") for ``finetune_epochs`` epochs on the client's training data (FedNH paper, App. A.2: 5 epochs).

How this maps onto the engine (which evaluates the personal model right after ``local_update``): the head
lives in the client state like FedPer's private head, but is the initial one forever (never trained, never
sent back). After the reply (body only) and the state (initial head) are cloned, the model object is
fine-tuned in place and is the personal predictor; the next round starts again from the initial head.

Options: ``finetune_from`` "global" (paper: fine-tune the received global body + the fixed head) or
"local" (fine-tune on top of this round's local body); ``finetune_when`` "every_round" (every reported PM is
a fine-tuned model) or "last_round" (only in round R, as the FedNH benchmark code; earlier PMs are then the
un-fine-tuned local models, and compute is saved); ``finetune_lr`` None = the round's local lr.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field
from torch import nn

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Reply, finetune
from fedpcd.algorithms.fedper import FedPer
from fedpcd.algorithms.statedict import backbone_parameters


@ALGORITHMS.register("fedbabu")
@dataclass
class FedBABU(FedPer):
    """FedBABU: body-only training against a frozen random head; full fine-tuning for the personal model."""

    finetune_epochs: Annotated[int, Field(ge=0)] = 5  # FedNH App. A.2 and its code; the paper's tau_f
    finetune_from: Literal["global", "local"] = "global"  # "global": the paper's protocol
    finetune_when: Literal["every_round", "last_round"] = "every_round"
    finetune_lr: Annotated[float, Field(gt=0.0)] | None = None  # None: the round's local lr

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """Body only during FL (the head is not in the optimiser); everything while fine-tuning."""
        return model.parameters() if work.get("finetuning", False) else backbone_parameters(model)

    def total_rounds_use(self) -> str | None:
        """With ``finetune_when`` "last_round", the fine-tuning happens in the run's last round only."""
        if self.finetune_when == "last_round":
            return "finetune_when=last_round fine-tunes in the last of the total rounds"
        return None

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedPer's reply (the body) and state (the initial head), then fine-tune the whole model in place
        into the personal model."""
        reply, work.state = super().end_local(model, data, work, loss)
        if self.finetune_when == "every_round" or work.round == self.ctx.rounds:
            work.finetuning = True
            finetune(
                self,
                model,
                data,
                work,
                epochs=self.finetune_epochs,
                lr=self.finetune_lr,
                from_global=self.finetune_from == "global",
            )
        return reply, work.state
