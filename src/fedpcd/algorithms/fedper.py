"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019).

Body and head are trained jointly on the client; only the body ("base layers") is sent and averaged, the
last linear layer ("personalization layer") never leaves the client (Sec. 3, Alg. 1). A baseline of the
FedNH paper (Dai et al., AAAI 2023, App. A.2: the last linear layer private, the rest shared).

This module also holds what the split-model baselines share (:class:`SplitModel`): which state keys are
private, the private part kept as the client state and initialised on the client. FedRep,
FedBABU, LG-FedAvg and Local subclass it and only name their private keys or change the training (``fit``,
FedAvg's hook: the shared loop unless overridden).

Protocol details (the library's; docs/design.md section 9):

- The personal part is the client state, a dict ``{state-dict key: tensor}``. A client that has none yet
  starts from its own model's seeded initial private part (the engine hands a client without state its
  architecture's initial weights), so nothing private is ever sent and the byte counters show the real
  traffic; clients may have different architectures where only the shared part must agree (LG-FedAvg, Local).
- Replies carry only the shared part; :meth:`aggregate` averages it by n_k (the library's FedAvg).
- GM (FedNH Sec. 4.1): the averaged shared part with the *initial* private part, i.e. the initial
  head for methods that never upload one (FedPer, FedRep, FedBABU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from fedpcd.algorithms.base import ALGORITHMS, ClientData, StateDict, clone_state
from fedpcd.algorithms.fedavg import FedAvg, LocalWork, Payload, Predictor, Reply
from fedpcd.models import head_keys


@dataclass
class SplitModel(FedAvg):
    """A model split into a shared part (averaged) and a private part (the client state); base of FedPer."""

    def private_keys(self, model: nn.Module) -> list[str]:
        """State-dict keys that stay on the client (FedPer: the linear head)."""
        return head_keys(model)

    def shared_keys(self, model: nn.Module) -> list[str]:
        private = set(self.private_keys(model))
        return [k for k in model.state_dict() if k not in private]

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """Shared part of the seeded model and its initial private part (kept for the GM only)."""
        return {
            "model": clone_state(model, self.shared_keys(model)),
            "initial": clone_state(model, self.private_keys(model)),
        }

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """GM: the averaged shared part with the initial private part (FedNH Sec. 4.1)."""
        model.load_state_dict({**server["model"], **server["initial"]})
        return model

    # ----- client -----
    # FedAvg's ``local_update``: ``begin_local`` (shared + personal part), ``fit``, ``end_local`` (reply,
    # state, ``personalise``).
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Load the shared part and the personal part; ``fit`` and the loss see the personal part as state."""
        work.state = self.personal_part(model, work.state)
        self.load_payload(model, work.payload, work.state)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """Reply with the shared part, keep the private part, then ``personalise`` the model."""
        reply = {
            "model": clone_state(model, self.shared_keys(model)),
            "num_samples": data.num_samples,
            "train_loss": loss,
        }
        work.state = clone_state(model, self.private_keys(model))
        self.personalise(model, data, work)
        return reply, work.state

    def personal_part(self, model: nn.Module, state: Any) -> StateDict:
        """The client's private tensors: its state, or (none yet) its freshly initialised model's."""
        return state if state is not None else clone_state(model, self.private_keys(model))

    def load_payload(self, model: nn.Module, payload: Payload, state: Any) -> None:
        """Shared part from the payload, private part from ``state`` (strict: together they are the model)."""
        model.load_state_dict({**payload["model"], **state})

    def personalise(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """After the reply and the new state (``work.state``) are cloned: turn ``model`` into the personal
        model (FedPer: as is)."""


@ALGORITHMS.register("fedper")
@dataclass
class FedPer(SplitModel):
    """FedPer: joint local training, the body is averaged, the last linear layer stays private."""
