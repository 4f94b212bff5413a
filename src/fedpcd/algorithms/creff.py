"""CReFF (Shang, Lu, Huang & Wang, "Federated Learning on Heterogeneous and Long-Tailed Data via Classifier
Re-Training with Federated Features", IJCAI 2022); a baseline of the FedNH paper (Dai et al., AAAI 2023,
App. A.2).

FedAvg, untouched (local training, the n_k-weighted average, the model clients receive), plus a classifier
re-trained on the server from "federated features". Sources: [P] the paper; [C] the official code
(github.com/shangxinyi/CReFF-FL, ``main.py`` and ``Dataset/Gradient_matching_loss.py``); [F] FedNH's port
of [C], which produced the CReFF rows of the FedNH tables and "follows the official implementation"
(Yutong-Dai/FedNH ``src/flbase/strategies/CReFF.py``). With the classifier phi = (W, b) on the
representation z, l the mean cross-entropy, and m = ``feats_per_class``:

1. Real feature gradients (client k, before local training, on the representations of the received
   FedAvg backbone, under the classifier phi picked by ``grad_head``; only the classes c it holds):
   g_c^k = grad_phi l(phi; {(z_i, c) : y_i = c}), computed in closed form,
   grad_W = (1/n) sum_i (p_i - e_c) z_i^T and grad_b = (1/n) sum_i (p_i - e_c), p_i = softmax(W z_i + b)
   (``class_head_gradients``). The reply carries them with the class counts n_k^c.
2. Aggregation (server): g_c = sum_k a_k^c g_c^k / sum_k a_k^c over the replies holding c
   (``aggregate_class_gradients``).
3. Federated features F_c (m x d per class, N(0, 1) at the start and kept across rounds, as [C] keeps
   ``feature_syn``): ``match_steps`` full-batch SGD steps on
       L(F) = sum_{c reported this round} D(grad_phi l(phi; {(f, c) : f in F_c}), g_c),
       D(G, G') = sum_j (1 - <G_j, G'_j> / (|G_j| |G'_j| + 1e-6)),
   j running over the rows of the weight gradient (one per output node), the bias gradient counting as
   one row ([C] ``dis_metric='ours'``, the layer-wise distance of gradient-matching dataset condensation,
   Zhao et al., ICLR 2021). phi is the classifier the clients' gradients were taken under. Classes
   nobody reported keep their features.
4. Classifier re-training: ``retrain_epochs`` shuffled mini-batch passes of SGD on the cross-entropy of
   all C * m federated features ([C] ``feature_re_train``); the result is kept in the server state.

The global model (GM) is the averaged FedAvg backbone with the re-trained classifier; the federated model
itself keeps training with its own, averaged classifier (both [C] and [F] reload the FedAvg state after
evaluating the re-trained one). The personal model is FedAvg's: the client's local model after training.
[P]'s text was not available when this was written, so steps 1-4 are stated in full (pinned by [C] and [F])
rather than by [P]'s equation numbers; every point where a reading of [P] may differ from [C]/[F] is an
option below (``grad_head``, ``grad_weighting``, ``retrain_init``, ``real_batch``), defaulting to [C]/[F],
the code behind the FedNH paper's CReFF numbers. Not implemented: [C]'s differentiable augmentation (DSA)
of the real images before their gradients are taken.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd import seeds
from fedpcd.algorithms.common import ClassSums, frozen_forward, linear_init
from fedpcd.algorithms.context import ClientData, Upload
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Payload, Predictor, Reply
from fedpcd.algorithms.fedavg import FedAvg
from fedpcd.algorithms.sgd import SGD
from fedpcd.algorithms.statedict import StateDict, clone_state, device_of
from fedpcd.models import head_keys

COS_EPS = 1e-6  # the denominator guard of [C]'s distance

GradWeighting = Literal["clients", "samples"]  # a_k^c = 1 or n_k^c in the per-class gradient average


# ----- formulas ------------------------------------------------------------------------------------------


def class_head_gradients(
    z: Tensor, labels: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Gradients of the mean cross-entropy of the linear classifier (weight, bias) on groups of one class.

    ``z`` is [K, n, d]: K groups of n representations, group k all labelled ``labels[k]``. Returns
    (grad_W [K, C, d], grad_b [K, C] or None): (1/n) sum_i (p_i - e_c) z_i^T and (1/n) sum_i (p_i - e_c).
    Differentiable in ``z`` (the server differentiates it in the federated features).
    """
    logits = z @ weight.T
    if bias is not None:
        logits = logits + bias
    residual = torch.softmax(logits, dim=-1) - F.one_hot(labels, weight.shape[0]).to(z.dtype)[:, None, :]
    grad_w = torch.einsum("knc,knd->kcd", residual, z) / z.shape[1]
    return grad_w, (residual.mean(dim=1) if bias is not None else None)


def _one_minus_cos(a: Tensor, b: Tensor) -> Tensor:
    """1 - <a, b> / (|a| |b| + 1e-6) along the last dimension ([C]'s ``distance_wb``)."""
    return 1.0 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + COS_EPS)


def matching_distance(
    syn_w: Tensor, real_w: Tensor, syn_b: Tensor | None = None, real_b: Tensor | None = None
) -> Tensor:
    """sum_k D(syn_k, real_k) for per-class gradients [K, C, d] (and biases [K, C]): one 1 - cos term per
    row of a weight gradient (output node) and one per bias gradient."""
    dist = _one_minus_cos(syn_w, real_w).sum()
    if syn_b is not None and real_b is not None:
        dist = dist + _one_minus_cos(syn_b, real_b).sum()
    return dist


def aggregate_class_gradients(
    replies: Sequence[Mapping[str, Any]], num_classes: int, weighting: GradWeighting
) -> tuple[Tensor, Tensor | None, Tensor]:
    """g_c = sum_k a_k^c g_c^k / sum_k a_k^c over the replies holding c, a_k^c = 1 ("clients") or n_k^c
    ("samples"). Returns (grad_W [C, C, d], grad_b [C, C] or None, reported [C] bool); zero rows for
    classes nobody reported."""
    first = replies[0]
    f64 = {"dtype": torch.float64, "device": first["grad_weight"].device}
    keys = ["grad_weight", "grad_bias"] if "grad_bias" in first else ["grad_weight"]
    sums = ClassSums(num_classes, *[first[k].shape[1:] for k in keys], **f64, count_dtype=torch.float64)
    for r in replies:
        cls = r["classes"]
        a = r["class_counts"].double() if weighting == "samples" else torch.ones(len(cls), **f64)
        sums.add(cls, *[r[k].double() for k in keys], weights=a)
    reported = sums.held
    for i, grad in enumerate(sums.sums):
        grad[reported] = sums.mean(i)
    dtype = first["grad_weight"].dtype
    grad_w, grad_b = sums.sums[0].to(dtype), (sums.sums[1].to(dtype) if len(keys) == 2 else None)
    return grad_w, grad_b, reported


def matching_loss(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    real_w: Tensor,
    real_b: Tensor | None,
    classes: Tensor,
) -> Tensor:
    """L(F) = sum_{c in classes} D(grad_phi l(phi; F_c), g_c); features [C, m, d], real gradients [C, ...]."""
    syn_w, syn_b = class_head_gradients(features[classes], classes, weight, bias)
    return matching_distance(syn_w, real_w[classes], syn_b, real_b[classes] if real_b is not None else None)


def match_features(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    real_w: Tensor,
    real_b: Tensor | None,
    classes: Tensor,
    steps: int,
    lr: float,
) -> Tensor:
    """``steps`` plain SGD steps of L(F) on all features at once ([C]: one step per match epoch); the
    features of classes outside ``classes`` get no gradient and are returned unchanged."""
    feats = features.detach().clone().requires_grad_(True)
    opt = SGD([feats], lr=lr)
    for _ in range(steps):
        loss = matching_loss(feats, weight, bias, real_w, real_b, classes)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return feats.detach()


def retrain_classifier(
    features: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor | None]:
    """SGD (no momentum, no weight decay, as [C]) on the cross-entropy of the C x m federated features,
    ``epochs`` passes of shuffled mini-batches (last one short); starts from copies of (weight, bias) on the
    features' device. The shuffles are drawn from ``generator`` (a CPU one: the same on every device).

    The step uses the closed-form gradient of the batch-mean cross-entropy, (softmax - onehot) / B, which is
    what autograd would give, at about half the cost of an autograd step for these tiny problems.
    """
    num_classes, m, dim = features.shape
    x = features.detach().reshape(num_classes * m, dim)
    y = torch.arange(num_classes, device=x.device).repeat_interleave(m)
    w = weight.detach().to(x.device, copy=True)
    b = bias.detach().to(x.device, copy=True) if bias is not None else None
    rows = torch.arange(batch_size, device=x.device)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator).to(x.device)
        for start in range(0, len(y), batch_size):
            idx = order[start : start + batch_size]
            xb = x[idx]
            residual = torch.softmax(xb @ w.T if b is None else torch.addmm(b, xb, w.T), dim=1)
            residual[rows[: len(idx)], y[idx]] -= 1.0
            residual /= len(idx)
            w.sub_(residual.T @ xb, alpha=lr)
            if b is not None:
                b.sub_(residual.sum(0), alpha=lr)
    return w, b


# ----- the algorithm ---------------------------------------------------------------------------------------


@ALGORITHMS.register("creff")
@dataclass
class CReFF(FedAvg):
    """CReFF: FedAvg + a classifier re-trained on server-side features learnt by gradient matching."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("classes", "class_counts", "grad_weight", "grad_bias")
    uploads: ClassVar[tuple[Upload, ...]] = (
        Upload("classes", "classes", "the held classes the gradients belong to"),
        Upload("class_counts", "counts", "n_k^c, the weights of grad_weighting samples"),
        Upload("grad_weight", "rows", "per held class, the classifier-weight gradient of its real features"),
        Upload("grad_bias", "rows", "per held class, the classifier-bias gradient of its real features"),
    )

    # m, federated features per class: 100 ([C] num_of_feature, [F]; FedNH App. A.2).
    feats_per_class: Annotated[int, Field(ge=1)] = 100
    # SGD steps on the matching loss per round: 100 ([C] match_epoch, one full-batch step each; FedNH
    # App. A.2).
    match_steps: Annotated[int, Field(ge=0)] = 100
    # Learning rate of the features: 0.01, the FedNH paper's setting for [F] (FedNH App. A.2: [C]'s default
    # lr_feature = 0.1 made its cross-device runs unstable). 0.1 reproduces [C].
    feature_lr: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.01
    # Re-training passes over the C x m features per round: 300 ([C] crt_epoch; FedNH App. A.2).
    retrain_epochs: Annotated[int, Field(ge=0)] = 300
    # Learning rate of the re-training: 0.01 ([C] lr_net; FedNH App. A.2).
    retrain_lr: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.01
    # Re-training batch size; None = local.batch_size, as [C] (batch_size_local_training) and [F].
    retrain_batch_size: Annotated[int, Field(ge=1)] | None = None
    # The classifier the real (and matched) gradients are taken under, with the received FedAvg backbone.
    # "retrained" = the classifier re-trained in the previous round (round 1: the initial model's head),
    # sent with the payload: [C] and [F]. "aggregated" = the received FedAvg model's own head.
    grad_head: Literal["retrained", "aggregated"] = "retrained"
    # Weights a_k^c of the per-class aggregation: "clients" = 1 per client holding c ([C], [F]);
    # "samples" = n_k^c, a count-weighted average (an alternative reading of [P], not checked against its
    # text; it uses the class counts the replies carry).
    grad_weighting: GradWeighting = "clients"
    # Start of each round's re-training: "fresh" = a newly initialised linear layer (nn.Linear's default
    # init, seeded per round), as [C] and [F]; "aggregated" = a copy of the averaged FedAvg classifier.
    retrain_init: Literal["fresh", "aggregated"] = "fresh"
    # Real gradients per class: None = the exact gradient on all of the client's samples of the class
    # (what [C]'s estimate approximates); an int = [C]'s estimate, the mean over
    # ``real_repeats`` gradients on ``real_batch`` samples of the class drawn without replacement
    # ([C]: batch_real = 32, 10 repeats).
    real_batch: Annotated[int, Field(ge=1)] | None = None
    real_repeats: Annotated[int, Field(ge=1)] = 10

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """FedAvg's state, the features F (C x m x d, N(0, 1) from the run seed), the initial model's head
        as the first "re-trained" classifier, and the count of re-trainings done. F is drawn on the CPU (the
        same on every device) and kept on the model's device."""
        server = super().init_server(model)
        g = seeds.generator(seeds.creff_features(self.ctx.seed))
        server["features"] = torch.randn(
            self.ctx.num_classes, self.feats_per_class, int(model.feature_dim), generator=g
        ).to(device_of(model))
        server["head"] = clone_state(model, head_keys(model))
        server["retrained"] = 0
        return server

    def payload_for(self, server: dict[str, Any], client_id: int) -> Payload:
        """The FedAvg model, plus the re-trained classifier the gradients are taken under (``grad_head``)."""
        payload = super().payload_for(server, client_id)
        if self.grad_head == "retrained":
            payload["head"] = server["head"]
        return payload

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """FedAvg's average; then aggregate the real gradients, match the features, re-train a classifier."""
        if self.grad_head == "retrained":
            used = server["head"]
        else:
            used = {k: server["model"][k] for k in server["head"]}  # the head the clients received
        server = super().aggregate(server, replies)
        weight, bias = _unpack(used)
        real_w, real_b, reported = aggregate_class_gradients(
            replies, self.ctx.num_classes, self.grad_weighting
        )
        classes = torch.nonzero(reported).flatten()
        if len(classes) and self.match_steps:
            server["features"] = match_features(
                server["features"], weight, bias, real_w, real_b, classes, self.match_steps, self.feature_lr
            )
        rnd = int(server["retrained"]) + 1
        g = seeds.generator(seeds.creff_retrain(self.ctx.seed, rnd))
        num_classes, _, dim = server["features"].shape
        if self.retrain_init == "fresh":
            w0, b0 = linear_init(num_classes, dim, bias is not None, g)
        else:
            w0, b0 = _unpack({k: server["model"][k] for k in server["head"]})
        w, b = retrain_classifier(
            server["features"],
            w0,
            b0,
            epochs=self.retrain_epochs,
            lr=self.retrain_lr,
            batch_size=self.retrain_batch_size or self.ctx.local.batch_size,
            generator=g,
        )
        server["head"] = _pack(w, b)
        server["retrained"] = rnd
        return server

    def global_predictor(self, model: nn.Module, server: dict[str, Any]) -> Predictor | None:
        """GM = the averaged FedAvg backbone with the re-trained classifier."""
        model.load_state_dict({**server["model"], **server["head"]})
        return model

    # ----- client -----
    def end_local(
        self, model: nn.Module, data: ClientData, work: LocalWork, loss: float
    ) -> tuple[Reply, Any]:
        """FedAvg's reply plus the real gradients under the *received* model (eval mode; as computed before
        training: the trained weights are not used)."""
        reply, state = super().end_local(model, data, work, loss)
        keys = head_keys(model)
        received = work.received
        head = received["head"] if self.grad_head == "retrained" else {k: received["model"][k] for k in keys}
        reply.update(self.real_gradients(model, data, received["model"], head, work.rng))
        return reply, state

    def real_gradients(
        self,
        model: nn.Module,
        data: ClientData,
        received: Mapping[str, Tensor],
        head: Mapping[str, Tensor],
        rng: torch.Generator,
    ) -> dict[str, Tensor]:
        """{"classes", "class_counts", "grad_weight" [C_k, C, d], "grad_bias" [C_k, C] (heads with a bias)}
        for the classes the client holds; z from the ``received`` weights (model untouched, rng unused:
        sampled batches come from a generator derived from its seed)."""
        idx = data.train_idx
        z = torch.cat(
            [frozen_forward(model, received, data.x[idx[s : s + 512]])[0] for s in range(0, len(idx), 512)]
        )
        y = data.y[idx]
        weight, bias = _unpack(head)
        counts = data.label_counts
        classes = torch.nonzero(counts > 0).flatten()
        sampler = seeds.generator(seeds.creff_real_batches(rng.initial_seed()))
        gw, gb = [], []
        for c in classes:
            zc = z[y == c]
            if self.real_batch is None:
                w_c, b_c = class_head_gradients(zc[None], c[None], weight, bias)
            else:
                draws = [
                    zc[torch.randperm(len(zc), generator=sampler)[: self.real_batch]]
                    for _ in range(self.real_repeats)
                ]
                w_c, b_c = class_head_gradients(torch.stack(draws), c.repeat(len(draws)), weight, bias)
            gw.append(w_c.mean(0))
            if b_c is not None:
                gb.append(b_c.mean(0))
        out = {"classes": classes, "class_counts": counts[classes], "grad_weight": torch.stack(gw)}
        if bias is not None:
            out["grad_bias"] = torch.stack(gb)
        return out


def _unpack(head: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(weight, bias or None) of a head state dict ("head.weight", "head.bias")."""
    return head["head.weight"], head.get("head.bias")


def _pack(weight: Tensor, bias: Tensor | None) -> StateDict:
    """The head state dict of (weight, bias or None)."""
    return {"head.weight": weight} if bias is None else {"head.weight": weight, "head.bias": bias}
