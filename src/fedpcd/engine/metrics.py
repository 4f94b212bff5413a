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
- Class-mean angles (``geometry: true``, the last round; FedGELA's Fig. 2, 3a-b, 5): mu_c is the mean feature
  of class c's test samples; angles are taken between the centred means mu_c - mean_c' mu_c' (the
  neural-collapse convention: a simplex ETF has every pairwise angle arccos(-1/(C-1)), 96.4 degrees for
  C = 10; uncentred ReLU features would always sit below 90), with the centre of all C classes for subsets
  too. ``angle_all``: the global model, over all class pairs (Fig. 3a); ``angle_held`` / ``angle_missing``:
  each participant's personal model over pairs of the classes it holds / lacks, then the mean over clients
  (Fig. 3b, Fig. 2).
Across clients each is reported as the unweighted mean, the train-sample-weighted mean and the mean of
the worst 10% of clients (at least one client). Their keys and labels: `fedpcd.run_format.METRICS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fedpcd.algorithms.context import ClientData
from fedpcd.algorithms.readout import Readout, feature_map
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


@torch.no_grad()
def class_means(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """The mean feature of each class, in one pass over the features (a scatter-add by label).

    Args:
        features: The features of the samples, [n, d].
        labels: Their classes, [n], in [0, num_classes).
        num_classes: The number of classes C.

    Returns:
        [C, d] float64, on the features' device; NaN rows for classes without samples.
    """
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64, device=features.device)
    sums.index_add_(0, labels, features.to(torch.float64))
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    return sums / counts.unsqueeze(1)


@torch.no_grad()
def feature_means(
    features: Predictor, x: Tensor, y: Tensor, num_classes: int, batch_size: int = 512
) -> Tensor:
    """[`class_means`][fedpcd.engine.metrics.class_means] of a feature map over ``x``: one batched pass.

    Args:
        features: Inputs to features (``fedpcd.algorithms.readout.feature_map``), its model in eval mode.
        x: The inputs, [n, ...].
        y: Their labels, [n].
        num_classes: The number of classes C.
        batch_size: The inputs per forward pass.

    Returns:
        [C, d] float64: the mean feature of each class (NaN rows for classes without samples).
    """
    feats = torch.cat([features(x[i : i + batch_size]).flatten(1) for i in range(0, len(x), batch_size)])
    return class_means(feats, y, num_classes)


def mean_angle(means: Tensor, classes: Tensor | None = None) -> float | None:
    """The mean pairwise angle between centred class means (see the module doc).

    Args:
        means: [C, d] class means; NaN rows (classes without samples) are left out.
        classes: The classes whose pairs count (a bool mask or an index tensor); default all. The centre is
            the mean over all classes either way.

    Returns:
        The mean angle in degrees; None for fewer than two classes.
    """
    valid = ~means.isnan().any(1)
    centred = means - means[valid].mean(0, keepdim=True)
    chosen = centred if classes is None else centred[classes]
    chosen = chosen[~chosen.isnan().any(1)]
    if chosen.shape[0] < 2:
        return None
    unit = chosen / chosen.norm(dim=1, keepdim=True)
    cos = (unit @ unit.T).clamp(-1.0, 1.0)
    pairs = torch.triu_indices(len(unit), len(unit), offset=1)
    return float(torch.rad2deg(torch.arccos(cos[pairs[0], pairs[1]])).mean())


def held_missing_angles(means: Tensor, label_counts: Tensor) -> tuple[float | None, float | None]:
    """A personal model's (held, missing) angles: [`mean_angle`][fedpcd.engine.metrics.mean_angle] over the
    classes its client holds (``label_counts > 0``) and over those it lacks.

    Args:
        means: The personal model's [C, d] class means on the full test set.
        label_counts: The client's number of training samples of each class, [C].

    Returns:
        (held angle, missing angle) in degrees, each None for fewer than two such classes.
    """
    present = label_counts.to(means.device) > 0
    return mean_angle(means, present), mean_angle(means, ~present)


def mean_of_angles(values: Sequence[float | None]) -> float | None:
    """The mean of angles over clients.

    Args:
        values: Each client's angle in degrees; None or NaN leaves the client out.

    Returns:
        Their mean; None when no client has one.
    """
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


CLASS_MEANS = "class_means"  # a personal metric of the last round with ``geometry: true``: [C, d] means


def personal_evaluation_with_means(
    predictor: Predictor, model: torch.nn.Module, data: ClientData, full: bool, num_classes: int
) -> dict:
    """[`personal_evaluation`][fedpcd.engine.metrics.personal_evaluation] and, under ``CLASS_MEANS``, the
    personal model's [C, d] class means on the full test set in the feature space its classifier reads
    (``fedpcd.algorithms.readout.feature_map``): what its client's held and missing angles are taken from.

    Where the full test set is scored and the predictor is the model itself (``forward = head(features)``)
    or a ``Readout`` with a ``head``, the features come from that same pass (the head's inputs); else they
    take one more pass.

    Args:
        predictor: The client's personal predictor over ``model``.
        model: The client's model as its local update left it.
        data: The client's data (the full test set).
        full: Score the full test set (see ``personal_evaluation``).
        num_classes: The number of classes C.

    Returns:
        The metrics by `fedpcd.run_format.PERSONAL` key, and the class means (float64, NaN rows for classes
            without test samples).
    """
    if full and isinstance(predictor, Readout) and predictor.head is not None and predictor.model is model:
        pred, features = _readout_pass(predictor, data.test_x)
        metrics = personal_metrics(pred, data.test_y, data.local_test_idx, data.label_counts)
        metrics[CLASS_MEANS] = class_means(features, data.test_y, num_classes)
        return metrics
    inputs: list[Tensor] = []
    shared = full and predictor is model and isinstance(model, FedModel)
    hook = model.head.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) if shared else None
    try:
        metrics = personal_evaluation(predictor, data, full)
    finally:
        if hook is not None:
            hook.remove()
    if shared and sum(len(x) for x in inputs) == len(data.test_y):
        features = torch.cat([x.flatten(1) for x in inputs])
        metrics[CLASS_MEANS] = class_means(features, data.test_y, num_classes)
    else:
        model.eval()
        means = feature_means(feature_map(predictor, model), data.test_x, data.test_y, num_classes)
        metrics[CLASS_MEANS] = means
    return metrics


@torch.no_grad()
def _readout_pass(readout: Readout, x: Tensor, batch_size: int = 512) -> tuple[Tensor, Tensor]:
    """(predicted classes, features) of a readout with a ``head``: per batch its features, then its head
    on them; the predictions are ``predict``'s (the readout's logits are that head on those features)."""
    features = feature_map(readout, readout.model)
    readout.model.eval()
    feats = [features(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]
    pred = torch.cat([readout.head(f, readout.tensors).argmax(1) for f in feats])
    return pred, torch.cat([f.flatten(1) for f in feats])


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
