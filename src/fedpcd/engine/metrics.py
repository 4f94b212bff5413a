"""The metrics of docs/design.md section 6, defined once.

- GA: the global model's accuracy on the full, balanced test set.
- A[k, c]: client k's personal model, accuracy on the test samples of class c (full test set).
- PA-L_k, PA-V_k: FedNH's PM(L) and PM(V) (Dai et al., AAAI 2023, Sec. 4.1), the full test set's samples
  weighted by alpha_k(y): the client's train label distribution p_k(y), or 1 for the classes it holds.
- PA-split_k: the personal model's accuracy on the client's own local test split (FedGELA / FedSSA).
- PA-G_k: the personal model's accuracy on the full test set (on a balanced test set, the mean of row k of
  A): the "GA" that FedRoD's and FedGELA's papers report for methods without a global model ("the averaged
  accuracy of all best local models on the global test dataset", FedGELA section 5.1).
Across clients each is reported as the unweighted mean, the train-sample-weighted mean and the mean of
the worst 10% of clients (at least one client). Their keys and labels: ``fedpcd.run_format.METRICS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fedpcd.algorithms.base import ClientData
from fedpcd.models import FedModel
from fedpcd.run_format import PA_G, PA_L, PA_SPLIT, PA_V

Predictor = Callable[[Tensor], Tensor]


@torch.no_grad()
def predict(predictor: Predictor, x: Tensor, batch_size: int = 512) -> Tensor:
    """Arg-max class of ``predictor`` over ``x``, in batches (eval mode for modules; a model through its
    ``inference_forward``, the same logits bit for bit: the ConvNet family's is faster)."""
    if isinstance(predictor, torch.nn.Module):
        predictor.eval()
        if isinstance(predictor, FedModel):
            predictor = predictor.inference_forward()
    return torch.cat([predictor(x[i : i + batch_size]).argmax(1) for i in range(0, len(x), batch_size)])


@torch.no_grad()
def predict_stacked(logits: Callable[[Tensor], Tensor], x: Tensor, batch_size: int = 512) -> Tensor:
    """Arg-max classes of M models at once: ``logits(x_chunk)`` is [M, n, C] (e.g. a vmap over stacked
    personal models, the vectorized executor); returns [M, len(x)]. Each row equals :func:`predict` of that
    model up to ties within float rounding."""
    return torch.cat([logits(x[i : i + batch_size]).argmax(-1) for i in range(0, len(x), batch_size)], dim=1)


def accuracy(pred: Tensor, y: Tensor) -> float:
    """The fraction of ``pred`` equal to ``y`` (NaN without samples)."""
    return float((pred == y).float().mean()) if len(y) else float("nan")


def per_class_accuracy(pred: Tensor, y: Tensor, num_classes: int) -> Tensor:
    """A row of A: accuracy on each class's test samples (NaN for a class with no test samples)."""
    correct = torch.bincount(y[pred == y], minlength=num_classes).double()
    total = torch.bincount(y, minlength=num_classes).double()
    return correct / total


def alpha_weighted_accuracy(pred: Tensor, y: Tensor, alpha: Tensor) -> float:
    """FedNH's personal accuracy (Dai et al., AAAI 2023, Sec. 4.1, "Evaluation Metrics"):
    sum_j alpha(y_j) 1(y_j = pred_j) / sum_j alpha(y_j) over the test samples j, ``alpha`` one weight per
    class (NaN when no test sample has a positive weight)."""
    w = alpha.double()[y]
    return float((w * (pred == y)).sum() / w.sum())


def pa_l(pred: Tensor, y: Tensor, label_counts: Tensor) -> float:
    """FedNH's PM(L): :func:`alpha_weighted_accuracy` with alpha(c) = p_k(c), the client's train label
    distribution ``label_counts / sum(label_counts)``."""
    return alpha_weighted_accuracy(pred, y, label_counts.double() / label_counts.sum())


def pa_v(pred: Tensor, y: Tensor, label_counts: Tensor) -> float:
    """FedNH's PM(V): :func:`alpha_weighted_accuracy` with alpha(c) = 1 for the classes the client holds,
    0 otherwise (the accuracy on the test samples of its classes)."""
    return alpha_weighted_accuracy(pred, y, (label_counts > 0).double())


def split_metrics(pred_split: Tensor, split_y: Tensor) -> dict:
    """A client's personal metrics (by ``run_format.PERSONAL`` key) from predictions on its local test split
    only (PA-L, PA-V, PA-G: None)."""
    return {
        PA_SPLIT.key: accuracy(pred_split, split_y) if len(split_y) else None,
        PA_L.key: None,
        PA_V.key: None,
        PA_G.key: None,
    }


def personal_metrics(pred_test: Tensor, test_y: Tensor, local_test_idx: Tensor, label_counts: Tensor) -> dict:
    """A client's personal metrics (by ``run_format.PERSONAL`` key) from its personal model's predictions on
    the full test set."""
    local = local_test_idx
    return {
        PA_SPLIT.key: accuracy(pred_test[local], test_y[local]) if len(local) else None,
        PA_L.key: pa_l(pred_test, test_y, label_counts),
        PA_V.key: pa_v(pred_test, test_y, label_counts),
        PA_G.key: accuracy(pred_test, test_y),
    }


def personal_evaluation(predictor: Predictor, data: ClientData, full: bool) -> dict:
    """A client's personal metrics (by ``run_format.PERSONAL`` key) after its update: with ``full``, PA-split,
    PA-L, PA-V and PA-G from one pass over the full test set; else PA-split from its local test split alone
    (the others None)."""
    if full:
        return personal_metrics(
            predict(predictor, data.test_x), data.test_y, data.local_test_idx, data.label_counts
        )
    split = data.local_test_idx
    pred = predict(predictor, data.test_x[split]) if len(split) else split
    return split_metrics(pred, data.test_y[split])


def summarize(values: Sequence[float | None], weights: Sequence[float]) -> dict[str, float | None]:
    """Unweighted mean, weighted mean and worst-10% mean over clients (clients with None are skipped)."""
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None and not math.isnan(v)]
    if not pairs:
        return {"mean": None, "weighted": None, "worst10": None}
    vals = [v for v, _ in pairs]
    wsum = sum(w for _, w in pairs)
    worst = sorted(vals)[: max(1, math.ceil(0.1 * len(vals)))]
    return {
        "mean": sum(vals) / len(vals),
        "weighted": sum(v * w for v, w in pairs) / wsum if wsum > 0 else None,
        "worst10": sum(worst) / len(worst),
    }
