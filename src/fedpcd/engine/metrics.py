"""The metrics of docs/design.md section 6, defined once.

- GA: the global model's accuracy on the full, balanced test set.
- GA-balanced: the global model's balanced accuracy, the mean per-class recall over the classes present in the
  test set (the mean of ``global_class_acc``); equal to GA on a class-balanced test set, the fairer number on
  an unbalanced one (SVHN, Fed-ISIC2019, whose paper metric it is).
- A[k, c]: client k's personal model, accuracy on the test samples of class c (full test set).
- PA-L_k, PA-V_k: FedNH's PM(L) and PM(V) (Dai et al., AAAI 2023, Sec. 4.1), the full test set's samples
  weighted by alpha_k(y): the client's train label distribution p_k(y), or 1 for the classes it holds.
- PA-split_k: the personal model's accuracy on the client's own local test split (FedGELA / FedSSA).
- PA-G_k: the personal model's accuracy on the full test set (on a balanced test set, the mean of row k of
  A): the "GA" that FedRoD's and FedGELA's papers report for methods without a global model ("the averaged
  accuracy of all best local models on the global test dataset", FedGELA section 5.1).
Across clients each is reported as the unweighted mean, the train-sample-weighted mean and the mean of
the worst 10% of clients (at least one client). Their keys and labels: `fedpcd.run_format.METRICS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fedpcd.algorithms.context import ClientData
from fedpcd.models import FedModel
from fedpcd.run_format import PA_G, PA_L, PA_SPLIT, PA_V

Predictor = Callable[[Tensor], Tensor]


@torch.no_grad()
def predict(predictor: Predictor, x: Tensor, batch_size: int = 512) -> Tensor:
    """Arg-max class of `predictor` over `x`, in batches.

    Args:
        predictor: Inputs to logits: a module (put in eval mode; a model runs through its
            `inference_forward`, the same logits bit for bit: the ConvNet family's is faster) or a function.
        x: The inputs, [n, ...].
        batch_size: The inputs per forward pass.

    Returns:
        The predicted class of each input, [n].
    """
    if isinstance(predictor, torch.nn.Module):
        predictor.eval()
        if isinstance(predictor, FedModel):
            predictor = predictor.inference_forward()
    return torch.cat([predictor(x[i : i + batch_size]).argmax(1) for i in range(0, len(x), batch_size)])


@torch.no_grad()
def predict_stacked(logits: Callable[[Tensor], Tensor], x: Tensor, batch_size: int = 512) -> Tensor:
    """Arg-max classes of M models at once (e.g. a vmap over stacked personal models, the vectorized
    executor). Each row equals [`predict`][fedpcd.engine.metrics.predict] of that model up to ties within
    float rounding.

    Args:
        logits: A chunk of inputs [n, ...] to the M models' logits [M, n, C].
        x: The inputs, [N, ...].
        batch_size: The inputs per call of `logits`.

    Returns:
        Each model's predicted class of each input, [M, N].
    """
    return torch.cat([logits(x[i : i + batch_size]).argmax(-1) for i in range(0, len(x), batch_size)], dim=1)


def accuracy(pred: Tensor, y: Tensor) -> float:
    """The fraction of predictions equal to the labels.

    Args:
        pred: Predicted classes, [n].
        y: The labels, [n].

    Returns:
        The accuracy in [0, 1]; NaN without samples.
    """
    return float((pred == y).float().mean()) if len(y) else float("nan")


def per_class_accuracy(pred: Tensor, y: Tensor, num_classes: int) -> Tensor:
    """A row of A: the accuracy on each class's test samples.

    Args:
        pred: Predicted classes, [n].
        y: The labels, [n], in [0, num_classes).
        num_classes: The number of classes C.

    Returns:
        The accuracy of each class, [C] float64; NaN for a class with no test samples.
    """
    correct = torch.bincount(y[pred == y], minlength=num_classes).double()
    total = torch.bincount(y, minlength=num_classes).double()
    return correct / total


def balanced_accuracy(class_acc: Sequence[float | None]) -> float | None:
    """Balanced accuracy from per-class accuracies (recalls): their mean over the classes with test samples.

    Args:
        class_acc: Each class's accuracy; None or NaN for a class without test samples.

    Returns:
        The mean over the classes with test samples; None when there are none.
    """
    present = [float(a) for a in class_acc if a is not None and not math.isnan(a)]
    return sum(present) / len(present) if present else None


def alpha_weighted_accuracy(pred: Tensor, y: Tensor, alpha: Tensor) -> float:
    """FedNH's personal accuracy (Dai et al., AAAI 2023, Sec. 4.1, "Evaluation Metrics"):
    sum_j alpha(y_j) 1(y_j = pred_j) / sum_j alpha(y_j) over the test samples j.

    Args:
        pred: Predicted classes, [n].
        y: The labels, [n].
        alpha: One weight per class, [C].

    Returns:
        The weighted accuracy in [0, 1]; NaN when no test sample has a positive weight.
    """
    w = alpha.double()[y]
    return float((w * (pred == y)).sum() / w.sum())


def pa_l(pred: Tensor, y: Tensor, label_counts: Tensor) -> float:
    """FedNH's PM(L) (PA-L): [`alpha_weighted_accuracy`][fedpcd.engine.metrics.alpha_weighted_accuracy]
    with alpha(c) = p_k(c), the client's train label distribution `label_counts / sum(label_counts)`.

    Args:
        pred: The personal model's predicted classes on the full test set, [n].
        y: The test labels, [n].
        label_counts: The client's number of training samples of each class, [C].

    Returns:
        PA-L of the client, in [0, 1].
    """
    return alpha_weighted_accuracy(pred, y, label_counts.double() / label_counts.sum())


def pa_v(pred: Tensor, y: Tensor, label_counts: Tensor) -> float:
    """FedNH's PM(V) (PA-V): [`alpha_weighted_accuracy`][fedpcd.engine.metrics.alpha_weighted_accuracy]
    with alpha(c) = 1 for the classes the client holds, 0 otherwise (the accuracy on the test samples of
    its classes).

    Args:
        pred: The personal model's predicted classes on the full test set, [n].
        y: The test labels, [n].
        label_counts: The client's number of training samples of each class, [C].

    Returns:
        PA-V of the client, in [0, 1].
    """
    return alpha_weighted_accuracy(pred, y, (label_counts > 0).double())


def split_metrics(pred_split: Tensor, split_y: Tensor) -> dict:
    """A client's personal metrics from predictions on its local test split only.

    Args:
        pred_split: The personal model's predicted classes on the local test split.
        split_y: The split's labels.

    Returns:
        The metrics by `fedpcd.run_format.PERSONAL` key: PA-split (None for an empty split); PA-L, PA-V
            and PA-G None.
    """
    return {
        PA_SPLIT.key: accuracy(pred_split, split_y) if len(split_y) else None,
        PA_L.key: None,
        PA_V.key: None,
        PA_G.key: None,
    }


def personal_metrics(pred_test: Tensor, test_y: Tensor, local_test_idx: Tensor, label_counts: Tensor) -> dict:
    """A client's personal metrics from its personal model's predictions on the full test set.

    Args:
        pred_test: The predicted classes on the full test set, [n].
        test_y: The test labels, [n].
        local_test_idx: The client's local test split: indices into the test set.
        label_counts: The client's number of training samples of each class, [C].

    Returns:
        The metrics by `fedpcd.run_format.PERSONAL` key: PA-split (None for an empty split), PA-L, PA-V
            and PA-G.
    """
    local = local_test_idx
    return {
        PA_SPLIT.key: accuracy(pred_test[local], test_y[local]) if len(local) else None,
        PA_L.key: pa_l(pred_test, test_y, label_counts),
        PA_V.key: pa_v(pred_test, test_y, label_counts),
        PA_G.key: accuracy(pred_test, test_y),
    }


def personal_evaluation(predictor: Predictor, data: ClientData, full: bool) -> dict:
    """A client's personal metrics after its update.

    Args:
        predictor: The client's personal model (see [`predict`][fedpcd.engine.metrics.predict]).
        data: The client's data: the test set, its local test split and its label counts.
        full: Score the full test set (PA-split, PA-L, PA-V and PA-G from one pass), else the local test
            split alone (PA-split; the others None).

    Returns:
        The metrics by `fedpcd.run_format.PERSONAL` key.
    """
    if full:
        return personal_metrics(
            predict(predictor, data.test_x), data.test_y, data.local_test_idx, data.label_counts
        )
    split = data.local_test_idx
    pred = predict(predictor, data.test_x[split]) if len(split) else split
    return split_metrics(pred, data.test_y[split])


def summarize(values: Sequence[float | None], weights: Sequence[float]) -> dict[str, float | None]:
    """A metric over clients: unweighted mean, weighted mean and the mean of the worst 10% (at least one).

    Args:
        values: Each client's value; None or NaN skips the client.
        weights: Each client's weight (its number of training samples).

    Returns:
        `{"mean", "weighted", "worst10"}`, each None when no client has a value (`weighted` also when the
            weights of those that do sum to 0).
    """
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
