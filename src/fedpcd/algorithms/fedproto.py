"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022, Alg. 1); a baseline of the FedNH paper (Dai et al., AAAI 2023, Sec. 4.1,
App. A.2) and a model-heterogeneous baseline of FedSSA (Yi et al., IJCAI 2024, Sec. 6.1).

No weights are shared: each client's whole model is private (the client state) and may have its own
architecture; only the representation dimension d (``model.feature_dim``) must agree. With z = f_k(x) the
representation (``model.features``) and C_j the global prototype of class j:

- Local prototypes, after local training: c_k^j = (1/n_k^j) sum_{i: y_i = j} f_k(x_i) over the client's
  training samples (eval mode, no augmentation), sent with the counts n_k^j, only for the classes it holds.
- Local objective: CE(head(z), y) + lambda * MSE(z, C_y). The MSE is the mean over the batch and the d
  dimensions (both codes' ``nn.MSELoss``); a sample whose class has no global prototype yet adds 0 but still
  counts in the mean, as in the official code (its target is its own z there).
- Server: C_j = the mean of the c_k^j of this round's clients that hold j; a class nobody reported keeps
  its prototype. Global prototypes are constants in the local loss.
- Personal model: the client's own model classifying by the nearest global prototype (L2), the protocol of
  the FedNH benchmark code [C]. There is no global model (GA is None).

Options, each naming its source ([P] the paper, [O] the official code yuetan031/FedProto, [C] the FedNH
benchmark code Yutong-Dai/FedNH, which produced the FedNH paper's FedProto numbers):

- ``init``: "uniform" = every class starts with a random U[0,1)^d prototype drawn on the server from the run
  seed ([C]); "none" = no global prototype before the first upload ([O]): the
  prototype term of a class is off until some client reported it.
- ``weighting``: "uniform" = unweighted mean over the holders ([O], [C]); "samples" =
  weighted by the holders' counts n_k^j, [P]'s aggregation rule (normalised so the weights sum to one).
- ``predict``: "prototype" = nearest global prototype over every class that has one ([C]); "prototype_local"
  = nearest among the client's own classes ([O]'s "with protos" test); "head" = the model's own classifier
  ([O]'s "w/o protos" test). While none of the candidate classes has a global prototype (``init="none"``,
  first round) the prototype predictions fall back to the head.

Not options: [O] and [C] average the training-mode representations seen during the last local epoch
instead of recomputing them after training ([P], used here); the first participation trains the model as
the engine delivers it (its architecture's seeded initial weights), later ones the client's own model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd import seeds
from fedpcd.algorithms.common import aggregate_prototypes, class_means_reply
from fedpcd.algorithms.context import CLASS_MEAN_UPLOADS, ClientData, Upload
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Predictor, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.statedict import clone_state, device_of
from fedpcd.errors import UserError


def prototype_mse(z: Tensor, y: Tensor, prototypes: Tensor, known: Tensor) -> Tensor:
    """mean over the batch and the d dimensions of (z - C_y)^2; samples of a class without a prototype
    (``known[y]`` False) add 0 to the sum but count in the mean. Prototypes are constants. (FD uses it on
    logits: z = the model's outputs, C = the global per-class mean logits.)"""
    diff = (z - prototypes[y].detach()) * known[y, None].to(z.dtype)
    return diff.pow(2).sum() / z.numel()


def mean_prototypes(
    prototypes: Tensor, known: Tensor, replies: Sequence[Reply], weighting: Literal["uniform", "samples"]
) -> tuple[Tensor, Tensor]:
    """C_j = mean of the replies' class means of j, unweighted or by counts; unreported classes unchanged."""
    if weighting == "uniform":
        replies = [{**r, "class_counts": torch.ones_like(r["class_counts"])} for r in replies]
    return aggregate_prototypes(prototypes, known, replies)


class NearestPrototype(nn.Module):
    """Scores -||f(x) - C_j||_2 per class, -inf for classes outside ``allowed``; a view of the model (holds a
    reference, so the engine's eval() reaches it)."""

    def __init__(self, model: nn.Module, prototypes: Tensor, allowed: Tensor) -> None:
        super().__init__()
        self.model = model
        self.prototypes = prototypes
        self.allowed = allowed

    def forward(self, x: Tensor) -> Tensor:
        dist = torch.cdist(self.model.features(x), self.prototypes.to(x.dtype))
        return (-dist).masked_fill(~self.allowed, float("-inf"))


@dataclass
class ClassMeanExchange(FedAvg):
    """Private whole models that exchange only per-class means of some output (FedProto's prototypes, FD's
    logits): the server averages them per class over this round's holders, unreported classes keep theirs.

    Subclasses name what travels (``statistic``: a payload/server key, and ``output`` for
    :func:`class_means_reply`) and the initial server state; the client state is the own model and classes.
    """

    extra_uploads: ClassVar[tuple[str, ...]] = ("classes", "class_counts", "class_means")
    uploads: ClassVar[tuple[Upload, ...]] = CLASS_MEAN_UPLOADS
    averages_model: ClassVar[bool] = False

    heterogeneous: ClassVar[bool] = True
    statistic: ClassVar[str] = "prototypes"
    output: ClassVar[Literal["features", "logits"]] = "features"

    weighting: Literal["uniform", "samples"] = "uniform"

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """The global class means and the mask of classes that have one (no weights)."""
        return {self.statistic: server[self.statistic], "known": server["known"]}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """Per-class mean of the uploaded class means over the clients holding the class (``weighting``)."""
        server[self.statistic], server["known"] = mean_prototypes(
            server[self.statistic], server["known"], replies, self.weighting
        )
        return server

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """No global model."""
        return None

    def check_payload(self, model: nn.Module, data: ClientData, payload: Payload) -> None:
        """Raise a UserError when the client's model cannot use the payload (default: always can)."""

    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """The own model (as delivered at first participation) trains; no weights are received."""
        self.check_payload(model, data, work.payload)
        if work.state is not None:
            model.load_state_dict(work.state["model"])

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """Upload the held classes' means and counts; the state is the model and the client's classes."""
        reply = {**class_means_reply(model, data, self.output), "num_samples": data.num_samples}
        reply["train_loss"] = loss
        return reply, {"model": clone_state(model), "classes": reply["classes"]}


@ALGORITHMS.register("fedproto")
@dataclass
class FedProto(ClassMeanExchange):
    """FedProto: private models regularised towards global class prototypes; only prototypes travel."""

    # lambda of the prototype term. 0.1: FedNH App. A.2 (the FedNH paper's and code's value);
    # the FedProto paper tunes it per dataset. lambda = 0: local training with CE alone.
    lam: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.1
    init: Literal["uniform", "none"] = "uniform"  # "uniform": [C]; "none": [O]
    # weighting (inherited) "uniform": [O], [C]; "samples": [P]
    predict: Literal["prototype", "prototype_local", "head"] = "prototype"  # "prototype": [C]

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """C x d global prototypes and the mask of classes that have one (``init``; uniform ones are drawn on
        the CPU, the same on every device), on the model's device."""
        c, d, device = self.ctx.num_classes, int(model.feature_dim), device_of(model)
        if self.init == "uniform":
            g = seeds.generator(seeds.fedproto_prototypes(self.ctx.seed))
            prototypes = torch.rand(c, d, generator=g).to(device)
            return {"prototypes": prototypes, "known": torch.ones(c, dtype=torch.bool, device=device)}
        return {
            "prototypes": torch.zeros(c, d, device=device),
            "known": torch.zeros(c, dtype=torch.bool, device=device),
        }

    # ----- client -----
    def check_payload(self, model: nn.Module, data: ClientData, payload: Payload) -> None:
        """One representation size d for all clients."""
        d = payload["prototypes"].shape[1]
        if int(model.feature_dim) != d:
            raise UserError(
                f"FedProto needs one representation size: the prototypes have d={d}, client {data.id}'s "
                f"model has feature_dim={int(model.feature_dim)}"
            )

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """CE + lambda * MSE(z, C_y) (classes without a global prototype add 0)."""
        x, y = batch
        z = model.features(x)
        ce = F.cross_entropy(model.head(z), y)
        if self.lam == 0.0:
            return ce
        return ce + self.lam * prototype_mse(z, y, work.payload["prototypes"], work.payload["known"])

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The own model, classifying by the nearest received global prototype (``predict``)."""
        payload, state = work.received, work.state
        model.load_state_dict(state["model"])
        allowed = payload["known"].clone()
        if self.predict == "prototype_local":
            own = torch.zeros_like(allowed)
            own[state["classes"]] = True
            allowed &= own
        if self.predict == "head" or not bool(allowed.any()):
            return model
        return NearestPrototype(model, payload["prototypes"], allowed)
