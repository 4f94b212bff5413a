"""FedAvg-FT: FedAvg (McMahan et al., AISTATS 2017, Algorithm 1) whose personal model is the global model
fine-tuned on the client's training data; FedGELA (Fan et al., NeurIPS 2023) Sec. 5.1 ("Metrics": the G-FL
baselines get a personal accuracy by fine-tuning the global model for 10 epochs on each client).

Training, replies and aggregation are FedAvg's exactly: the fine-tuning runs after the reply is cloned and
draws from the client's generator only after the FedAvg part, so replies and GM equal FedAvg's bit for bit
under one seed. After its local update the client fine-tunes the global model it received this round (all
parameters, the shared loop with the local optimiser settings) for ``finetune_epochs`` epochs; that is its
personal model. Nothing of it is kept: the client state stays None, as FedAvg's.

Differences from FedGELA's protocol, which fine-tunes the *best* global model over the rounds once after
training: here the PM of each participant in each round is the received global model
fine-tuned, so every reported PA is a fine-tuned one (at the final round: the final global model).

Options (as FedBABU's): ``finetune_from`` "global" (the protocol) or "local" (fine-tune on top of this
round's locally trained model, i.e. FedAvg's PM trained further); ``finetune_lr`` None = the round's local lr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field
from torch import nn

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Reply, finetune
from fedpcd.algorithms.fedavg import FedAvg


@ALGORITHMS.register("fedavg_ft")
@dataclass
class FedAvgFT(FedAvg):
    """FedAvg-FT: FedAvg; the personal model is the received global model fine-tuned locally."""

    # Fine-tuning epochs: 10, FedGELA Sec. 5.1 (the FedGELA paper's protocol for G-FL baselines).
    finetune_epochs: Annotated[int, Field(ge=0)] = 10
    finetune_from: Literal["global", "local"] = "global"  # "global": FedGELA Sec. 5.1
    finetune_lr: Annotated[float, Field(gt=0.0)] | None = None  # None: the round's local lr

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply, then fine-tune ``model`` in place into the personal model."""
        reply, work.state = super().end_local(model, data, work, loss)
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
