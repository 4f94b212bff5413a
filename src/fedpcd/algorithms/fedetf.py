"""FedETF (Li et al., "No Fear of Classifier Biases: Neural Collapse Inspired Federated Learning with
Synthetic and Fixed Classifier", ICCV 2023); official code ZexiLee/ICCV-2023-FedETF.

The classifier is a synthetic simplex ETF M in R^{d x C} (``fedgela.simplex_etf``, the same construction as
the official ``Proto_Classifier``), fixed during federated training. Features pass through a projection layer
(Linear(feature_dim, d)) and are L2-normalised: h = P(z)/|P(z)|; logits are beta * M^T h with a learnable
temperature (scale) beta. Local training uses the balanced feature loss, the balanced softmax of the local
class counts, CE(beta M^T h + log n_k, y) (code ``balanced_softmax_loss``; classes the client lacks get
log 0 = -inf and drop out). The server averages backbone, projection and beta by n_k; M never changes and is
re-sent each round. The model's own linear ``head`` is never used, trained or sent.

Personalisation (the paper's local fine-tuning; code ``Client_personalization``): starting from the
locally trained model (the code's first step is the same local update from the global model), the client
fine-tunes with the plain CE of its local data, backbone and beta frozen, alternately the ETF (SGD lr 0.1,
no momentum) and the projection (SGD lr 0.05 with the run's momentum and weight decay), ``finetune_epochs``
epochs each, ``finetune_rounds`` times (code: 20 x (3 + 3) epochs, once after federated training). Here it
runs in ``personal_predictor``, i.e. at every evaluation round for the round's participants, on working
copies (the reply and the payload are untouched). Library choice for speed: the frozen backbone's features
are computed once per fine-tuning, in eval mode and without augmentation (the code recomputes them every
batch in train mode). ``finetune_rounds = 0`` evaluates the locally trained model with the global ETF.

Options follow the code where the paper gives no number: scale_init 1.0 (code's ResNets; its CNN uses
10.0), learned and averaged scale, ETF dimension d = C (``proj_dim`` None; the code's ResNets and LeNet
project to C dimensions, its CIFAR CNN to 64; d >= C is required).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd import seeds
from fedpcd.algorithms.common import balanced_softmax_loss, linear_init, log_prior
from fedpcd.algorithms.context import ClientData, Upload, made_public
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Predictor, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.fedgela import simplex_etf
from fedpcd.algorithms.sgd import SGD
from fedpcd.algorithms.statedict import (
    backbone_parameters,
    clone_state,
    device_of,
    load_backbone,
    weighted_average,
)
from fedpcd.errors import UserError
from fedpcd.models import backbone_keys

NORM_EPS = 1e-12  # the code's clamp(min=1e-12) on the feature norm


def etf_logits(z: Tensor, proj: dict[str, Tensor], etf: Tensor, scale: Tensor | float) -> Tensor:
    """beta * M^T h with h = P(z) / |P(z)| (the code's projection, normalisation and scaling)."""
    h = F.normalize(F.linear(z, proj["weight"], proj["bias"]), dim=1, eps=NORM_EPS)
    return scale * (h @ etf)


def init_projection(in_dim: int, out_dim: int, generator: torch.Generator) -> dict[str, Tensor]:
    """nn.Linear's default initialisation (Kaiming-uniform weight, U(+-1/sqrt(in)) bias) as its
    ``reset_parameters`` draws it, seeded; on the generator's device."""
    weight, bias = linear_init(out_dim, in_dim, True, generator, draw="nn_init")
    return {"weight": weight, "bias": bias}


@ALGORITHMS.register("fedetf")
@dataclass
class FedETF(FedAvg):
    """FedETF: backbone + projection against a fixed ETF with a learnable scale; personal fine-tuning."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("proj", "scale")
    uploads: ClassVar[tuple[Upload, ...]] = (
        Upload("proj", "model", "the trained projection, averaged with the backbone"),
        Upload("scale", "model", "the trained ETF scale beta, averaged with the backbone"),
    )

    scale_init: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0  # beta^0 (code, ResNet20)
    learn_scale: bool = True  # code: beta is a trained, averaged parameter; False keeps beta = scale_init
    proj_dim: Annotated[int, Field(ge=2)] | None = None  # ETF dim d (None: d = C, as the code's ResNets)
    balanced: bool = True  # the balanced feature loss (code); False: plain CE (ablation)
    finetune_rounds: Annotated[int, Field(ge=0)] = 20  # alternations ETF/projection (code: 20)
    finetune_epochs: Annotated[int, Field(ge=1)] = 3  # epochs per phase (code: 3)
    finetune_lr_etf: Annotated[float, Field(gt=0.0)] = 0.1  # code: SGD(proto, lr=0.1)
    finetune_lr_proj: Annotated[float, Field(gt=0.0)] = 0.05  # code: SGD(linear_proto, 0.05, momentum, wd)

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """Backbone (no head), the ETF M (d x C), the projection and beta, all seeded from the run seed (drawn
        on the CPU, the same on every device) and kept on the model's device."""
        feature_dim = int(model.feature_dim)
        dim = self.ctx.num_classes if self.proj_dim is None else self.proj_dim
        if dim < self.ctx.num_classes:
            raise UserError(
                f"FedETF needs an ETF dimension d >= classes C, got d={dim} < C={self.ctx.num_classes}: "
                "set algorithm.proj_dim >= C"
            )
        etf_gen = seeds.generator(seeds.fedetf_etf(self.ctx.seed))
        proj_gen = seeds.generator(seeds.fedetf_projection(self.ctx.seed))
        device = device_of(model)
        return {
            "model": clone_state(model, backbone_keys(model)),
            "etf": simplex_etf(dim, self.ctx.num_classes, etf_gen).to(device),
            "proj": {k: v.to(device) for k, v in init_projection(feature_dim, dim, proj_gen).items()},
            "scale": torch.tensor(float(self.scale_init), device=device),
        }

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """Backbone, projection, beta and the fixed ETF."""
        return {k: server[k] for k in ("model", "proj", "scale", "etf")}

    def upload_bounds(self) -> tuple[Upload, ...]:
        """With ``learn_scale`` false beta is sent back as received: public, not averaged."""
        if self.learn_scale:
            return self.uploads
        return made_public(
            self.uploads, "scale", "beta = scale_init sent back unchanged: the server's own value"
        )

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """n_k-weighted average of backbone, projection and beta; the ETF stays."""
        weights = [float(r["num_samples"]) for r in replies]
        server["model"] = weighted_average([r["model"] for r in replies], weights)
        server["proj"] = weighted_average([r["proj"] for r in replies], weights)
        if self.learn_scale:
            server["scale"] = weighted_average([{"s": r["scale"]} for r in replies], weights)["s"]
        return server

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor:
        """Aggregated backbone, projection and beta with the ETF."""
        load_backbone(model, server["model"])
        return self._predictor(model, server["proj"], server["etf"], server["scale"])

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Backbone; working, trainable copies of the projection and beta (``work.proj``, ``work.scale``)
        and the log class prior of the balanced feature loss (``work.log_prior``); the ETF is fixed (the
        model's linear head is never used)."""
        load_backbone(model, work.payload["model"])
        work.proj = {k: v.detach().clone().requires_grad_(True) for k, v in work.payload["proj"].items()}
        work.scale = work.payload["scale"].detach().clone().requires_grad_(self.learn_scale)
        work.log_prior = log_prior(data.label_counts)

    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """Backbone, projection and beta as the reply; the data and seed of this client's personal fine-tuning
        (``work.data``, ``work.finetune_seed``)."""
        work.data = data
        work.finetune_seed = int(torch.randint(0, 2**62, (1,), generator=work.rng))
        reply = {
            "model": clone_state(model, backbone_keys(model)),
            "proj": {k: v.detach().clone() for k, v in work.proj.items()},
            "scale": work.scale.detach().clone(),
            "num_samples": data.num_samples,
            "train_loss": loss,
        }
        return reply, work.state

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """The balanced feature loss on beta * M^T h (plain CE if ``balanced`` is False)."""
        x, y = batch
        logits = etf_logits(model.features(x), work.proj, work.payload["etf"], work.scale)
        if self.balanced:
            return balanced_softmax_loss(logits, y, work.log_prior)
        return F.cross_entropy(logits, y)

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """Backbone, projection and beta; never the ETF, never the unused head."""
        params = [*backbone_parameters(model), *work.proj.values()]
        return [*params, work.scale] if self.learn_scale else params

    def personal_predictor(self, model: nn.Module, work: LocalWork) -> Predictor:
        """The locally trained model after the alternating ETF / projection fine-tuning (module docstring)."""
        etf = work.received["etf"].detach().clone()
        proj = {k: v.detach().clone() for k, v in work.proj.items()}
        scale = work.scale.detach()
        if self.finetune_rounds > 0 and work.data.num_samples > 0:
            etf, proj = self.finetune_classifier(model, work.data, etf, proj, scale, work.finetune_seed)
        return self._predictor(model, proj, etf, scale)

    def finetune_classifier(
        self,
        model: nn.Module,
        data: ClientData,
        etf: Tensor,
        proj: dict[str, Tensor],
        scale: Tensor,
        seed: int,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Alternate CE fine-tuning of the ETF and of the projection on cached frozen-backbone features."""
        with torch.no_grad():
            was_training = model.training
            model.eval()
            idx = data.train_idx
            z = torch.cat([model.features(data.x[idx[i : i + 512]]) for i in range(0, len(idx), 512)])
            model.train(was_training)
        y = data.y[idx]
        gen = torch.Generator().manual_seed(seed)
        etf = etf.requires_grad_(True)
        proj = {k: v.requires_grad_(True) for k, v in proj.items()}
        cfg = self.ctx.local
        for _ in range(self.finetune_rounds):
            phases = (
                SGD([etf], lr=self.finetune_lr_etf),
                SGD(
                    list(proj.values()),
                    lr=self.finetune_lr_proj,
                    momentum=cfg.momentum,
                    weight_decay=cfg.weight_decay,
                ),
            )
            for opt in phases:
                for _ in range(self.finetune_epochs):
                    order = torch.randperm(len(y), generator=gen)
                    for start in range(0, len(order), cfg.batch_size):
                        b = order[start : start + cfg.batch_size]
                        loss = F.cross_entropy(etf_logits(z[b], proj, etf, scale), y[b])
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
        return etf.detach(), {k: v.detach() for k, v in proj.items()}

    # ----- helpers -----
    @staticmethod
    def _predictor(model: nn.Module, proj: dict[str, Tensor], etf: Tensor, scale: Tensor) -> Predictor:
        def predict(x: Tensor) -> Tensor:
            model.eval()
            return etf_logits(model.features(x), proj, etf, scale)

        return predict
