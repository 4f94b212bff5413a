"""FedKD (Wu et al., "Communication-efficient federated learning via knowledge distillation", Nature
Communications 13:2032, 2022; arXiv 2108.13323), Methods: adaptive mutual distillation and dynamic gradient
approximation; a model-heterogeneous baseline of FedSSA (Yi et al., IJCAI 2024, Sec. 6.1).

Each client k keeps a private teacher (any architecture, never sent; kept in the client state) and trains it
together with a local copy of the shared student (``shared_model``, CNN-5 in FedSSA's setting). With CE_t,
CE_s the teacher's and student's cross-entropies, p_t, p_s their softmax outputs, H_t, H_s their hidden
representations (``model.features``, 500-d for the CNN zoo) and W^h a learnable linear map:

- teacher: L_t = CE_t + KL(p_s || p_t) / (CE_t + CE_s) + MSE(H_t, W^h H_s) / (CE_t + CE_s),
- student: L_s = CE_s + KL(p_t || p_s) / (CE_t + CE_s) + MSE(H_t, W^h H_s) / (CE_t + CE_s),

the distillation and hidden losses scaled by the inverse of the two task losses ("adaptive": strong when both
predict well, weak when either is wrong). The attention-heatmap MSE of the paper's Transformers has no CNN
counterpart and is left out, and the hidden states are the representations z (the official code matches
several Transformer layers). Both models take one SGD step per batch on L_t + L_s.

Dynamic gradient approximation: the client uploads, per weight matrix of the student's update
Delta = w_trained - w_received (conv kernels viewed as out x (in k k); vectors go dense), the truncated SVD
U_k diag(sigma_k) V_k with the smallest k such that sum_{i<=k} sigma_i^2 >= T(t) sum_i sigma_i^2, where
T(t) = T_start + (T_end - T_start) t / T rises linearly over the rounds t = 1..T (official code:
(comm_round + 1) / T; T_start = 0.95, T_end = 0.98 as in the official ``parameters.py``). Bytes up per matrix:
k (m + n + 1) floats instead of m n. The server reconstructs each update, averages them (n_k-weighted;
``weighting="uniform"`` is the official code's plain mean), truncates the average again with T(t)
(``compress_aggregate``, paper and code) and adds it to the global student.

Options, each following a source:
- ``coupling="joint"`` (official code): one loss L_t + L_s with no stop-gradient, so the other model's
  outputs and the factor 1/(CE_t + CE_s) carry gradient too (the factor then also pushes the task losses up
  once the distillation terms exceed (CE_t + CE_s)^2). ``"detached"``: each loss treats the other model's
  outputs and the factor as constants (the DML reading of the paper's per-model losses).
- ``kl_reduction``: "batchmean" (the paper's KL per sample, batch mean) or "mean" (the official code's
  ``nn.KLDivLoss()``, which also divides by the number of classes).
- ``hidden_projection=True``: the paper's learnable W^h (student -> teacher width, no bias), private to the
  client and initialised to the identity (a library choice; rectangular identity if the widths differ).
  ``False``: the official code's identity (it defines the projections but never uses them); needs equal
  widths.

Library choices: the download is the full global student (so clients that missed rounds can join; the
official code also sends the compressed averaged update, which only works when every client takes part in
every round); uploads are always the factors (the official code too, even when they are larger than the
matrix); the rank rule keeps >= T where the official client keeps > T and drops matrices that need full rank
(k = 0, a bug). Personal metrics: the teacher after local training; GA: the global student.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedpcd.algorithms.common import reply_weights
from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.contract import ALGORITHMS, LocalWork, Reply, train_loop
from fedpcd.algorithms.fml import KLReduction, SharedModelMethod, kl_divergence
from fedpcd.algorithms.statedict import StateDict, clone_state, device_of, weighted_average
from fedpcd.errors import UserError

Factors = dict[str, Tensor]  # {"u": [m, k], "s": [k], "v": [k, n]}


def energy_threshold(t: int, rounds: int, start: float, end: float) -> float:
    """T(t) = T_start + (T_end - T_start) t / T for the round t = 1..T (T(T) = T_end)."""
    return start + (end - start) * t / rounds


def energy_rank(singular_values: Tensor, threshold: float) -> int:
    """The smallest k >= 1 whose leading singular values (descending) keep sum_{i<=k} s_i^2 >= threshold of
    sum_i s_i^2 (1 for a zero matrix)."""
    cum = singular_values.double().square().cumsum(0)
    first = int(torch.searchsorted(cum, threshold * cum[-1]))  # first index with cum >= threshold * total
    return min(max(first + 1, 1), len(cum))


def is_compressed(tensor: Tensor) -> bool:
    """Floating tensors of two or more dimensions (weight matrices, conv kernels) travel as SVD factors."""
    return tensor.is_floating_point() and tensor.dim() >= 2


def svd_compress(tensor: Tensor, threshold: float) -> Factors:
    """Truncated SVD of ``tensor`` viewed as shape[0] x rest, at the smallest rank keeping ``threshold`` of
    the energy; the discarded part has squared Frobenius norm sum_{i>k} sigma_i^2."""
    u, s, vh = torch.linalg.svd(tensor.reshape(tensor.shape[0], -1), full_matrices=False)
    k = energy_rank(s, threshold)
    return {"u": u[:, :k].clone(), "s": s[:k].clone(), "v": vh[:k].clone()}


def svd_reconstruct(factors: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
    """U diag(s) V, reshaped to ``shape``."""
    return ((factors["u"] * factors["s"]) @ factors["v"]).reshape(shape)


def compress_update(update: Mapping[str, Tensor], threshold: float) -> dict[str, Any]:
    """Per state key: SVD factors for weight matrices and kernels, the tensor itself otherwise."""
    return {k: svd_compress(v, threshold) if is_compressed(v) else v.clone() for k, v in update.items()}


def reconstruct_update(update: Mapping[str, Any], reference: Mapping[str, Tensor]) -> StateDict:
    """The dense update from :func:`compress_update`'s output; ``reference`` gives the shapes."""
    return {
        k: svd_reconstruct(v, reference[k].shape) if isinstance(v, Mapping) else v for k, v in update.items()
    }


def adaptive_mutual_losses(
    teacher_logits: Tensor,
    student_logits: Tensor,
    teacher_hidden: Tensor,
    student_hidden: Tensor,
    y: Tensor,
    coupling: Literal["joint", "detached"] = "joint",
    kl_reduction: KLReduction = "batchmean",
) -> tuple[Tensor, Tensor]:
    """(L_t, L_s) of the module docstring; ``student_hidden`` is already mapped by W^h."""
    ce_t, ce_s = F.cross_entropy(teacher_logits, y), F.cross_entropy(student_logits, y)
    scale = ce_t + ce_s
    if coupling == "joint":
        kl_t = kl_divergence(student_logits, teacher_logits, kl_reduction)
        kl_s = kl_divergence(teacher_logits, student_logits, kl_reduction)
        mse_t = mse_s = F.mse_loss(student_hidden, teacher_hidden)
    else:
        scale = scale.detach()
        kl_t = kl_divergence(student_logits.detach(), teacher_logits, kl_reduction)
        kl_s = kl_divergence(teacher_logits.detach(), student_logits, kl_reduction)
        mse_t = F.mse_loss(student_hidden.detach(), teacher_hidden)
        mse_s = F.mse_loss(student_hidden, teacher_hidden.detach())
    return ce_t + (kl_t + mse_t) / scale, ce_s + (kl_s + mse_s) / scale


@ALGORITHMS.register("fedkd")
@dataclass
class FedKD(SharedModelMethod):
    """FedKD: private teacher and shared student distil each other adaptively; student updates go as SVD
    factors at a rising energy threshold."""

    extra_uploads: ClassVar[tuple[str, ...]] = ("update",)
    unprivatised: ClassVar[str] = (
        "its update travels as SVD factors truncated to a data-dependent rank, not as a vector a norm bound "
        "and Gaussian noise apply to"
    )

    t_start: Annotated[float, Field(gt=0.0, le=1.0)] = 0.95  # T_start (official parameters.py)
    t_end: Annotated[float, Field(gt=0.0, le=1.0)] = 0.98  # T_end (official parameters.py)
    coupling: Literal["joint", "detached"] = "joint"  # joint: official code; detached: per-model DML losses
    kl_reduction: KLReduction = "batchmean"  # batchmean: paper's KL; mean: official nn.KLDivLoss()
    hidden_projection: bool = True  # learnable W^h (paper); False: identity (official code)
    compress_aggregate: bool = True  # the server truncates the averaged update too (paper and official code)

    def threshold(self, t: int) -> float:
        """T(t) for the round t (1..R)."""
        return energy_threshold(t, self.ctx.rounds, self.t_start, self.t_end)

    def total_rounds_use(self) -> str | None:
        """T(t) = T_start + (T_end - T_start) t / T rises over the run's T rounds (Wu et al., FedKD, its SVD
        energy threshold): a run of more rounds truncates every round differently."""
        if self.t_start == self.t_end:
            return None
        return "its SVD energy threshold runs from t_start to t_end over the total rounds"

    # ----- server -----
    def init_server(self, model: nn.Module) -> dict[str, Any]:
        """The student's seeded initial weights and the number of aggregated rounds (for T(t))."""
        return {**super().init_server(model), "round": 0}

    def aggregate(self, server: dict[str, Any], replies: Sequence[Reply]) -> dict[str, Any]:
        """w <- w + trunc_T(t)(sum_k p_k U_k diag(s_k) V_k) over the replies' reconstructed updates."""
        t = int(server["round"]) + 1
        weights = reply_weights(replies, self.weighting)
        mean = weighted_average([reconstruct_update(r["update"], server["model"]) for r in replies], weights)
        if self.compress_aggregate:
            mean = reconstruct_update(compress_update(mean, self.threshold(t)), mean)
        server["model"] = {k: w + mean[k] for k, w in server["model"].items()}
        server["round"] = t
        return server

    # ----- client -----
    def begin_local(self, model: nn.Module, data: ClientData, work: LocalWork) -> None:
        """Teacher and student as ``SharedModelMethod``'s; this client's W^h (student width -> teacher width)
        as a trainable working tensor ``work.projection``: from the client state, the identity at first;
        None (the identity map itself) without ``hidden_projection``."""
        super().begin_local(model, data, work)
        d_s, d_t = int(self.shared.feature_dim), int(model.feature_dim)
        if not self.hidden_projection:
            if d_s != d_t:
                raise UserError(
                    f"FedKD without hidden_projection needs equal feature widths, got teacher {d_t} and "
                    f"student {d_s}: set algorithm.hidden_projection=true"
                )
            work.projection = None
            return
        state = work.state
        initial = state["projection"] if state is not None else torch.eye(d_t, d_s, device=device_of(model))
        work.projection = initial.detach().clone().requires_grad_(True)

    def local_update(self, model: nn.Module, data: ClientData, work: LocalWork) -> tuple[Reply, Any]:
        """Mutual distillation for ``local.epochs``; reply with the compressed student update."""
        self.begin_local(model, data, work)
        loss = train_loop(self, model, data, work)
        trained = work.shared.state_dict()
        delta = {k: trained[k].detach() - w for k, w in work.payload["model"].items()}
        reply = {
            "update": compress_update(delta, self.threshold(work.round)),
            "num_samples": data.num_samples,
            "train_loss": loss,
        }
        new_state: dict[str, Any] = {"model": clone_state(model)}
        if work.projection is not None:
            new_state["projection"] = work.projection.detach().clone()
        work.state = new_state
        return reply, work.state

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """L_t + L_s on one batch."""
        x, y = batch
        shared, projection = work.shared, work.projection
        h_t, h_s = model.features(x), shared.features(x)
        teacher, student = adaptive_mutual_losses(
            model.head(h_t),
            shared.head(h_s),
            h_t,
            h_s if projection is None else F.linear(h_s, projection),
            y,
            self.coupling,
            self.kl_reduction,
        )
        return teacher + student

    def trainable_parameters(self, model: nn.Module, work: LocalWork) -> Iterable[nn.Parameter]:
        """Teacher, student and W^h."""
        params = list(super().trainable_parameters(model, work))
        return params if work.projection is None else [*params, work.projection]
