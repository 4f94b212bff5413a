"""Every metric formula on hand-made tensors (docs/design.md section 6)."""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import balanced_accuracy_score

from fedpcd.engine.metrics import (
    accuracy,
    balanced_accuracy,
    pa_l,
    pa_v,
    per_class_accuracy,
    personal_metrics,
    predict,
    summarize,
)
from fedpcd.engine.records import round_record, summary_of
from fedpcd.engine.tasks import ClientReply


def test_per_class_accuracy_by_hand():
    y = torch.tensor([0, 0, 1, 1, 1, 2])
    pred = torch.tensor([0, 1, 1, 1, 0, 0])
    row = per_class_accuracy(pred, y, 4)
    assert row[:3].tolist() == pytest.approx([0.5, 2 / 3, 0.0])
    assert math.isnan(row[3])  # no test sample of class 3


def test_balanced_accuracy_on_a_tiny_confusion():
    # true class (rows) x predicted: class 0 [4 0 0], class 1 [1 0 0], class 2 [0 0 1]; class 3 has no samples
    y = torch.tensor([0, 0, 0, 0, 1, 2])
    pred = torch.tensor([0, 0, 0, 0, 0, 2])
    assert accuracy(pred, y) == pytest.approx(5 / 6)
    row = per_class_accuracy(pred, y, 4).tolist()  # recalls 1, 0, 1 and NaN
    assert balanced_accuracy(row) == 2 / 3  # (1 + 0 + 1) / 3: the class without test samples is skipped
    assert balanced_accuracy(row) == pytest.approx(balanced_accuracy_score(y.numpy(), pred.numpy()))
    assert balanced_accuracy([0.5, None, 0.25]) == 0.375  # a record's global_class_acc: None = no samples
    assert balanced_accuracy([None, math.nan]) is None and balanced_accuracy([]) is None


def test_pa_l_and_pa_v_by_hand():
    # FedNH Sec. 4.1: sum_j alpha(y_j) 1(y_j = pred_j) / sum_j alpha(y_j) over the test samples
    y = torch.tensor([0, 0, 1, 1, 2, 3])
    pred = torch.tensor([0, 1, 1, 1, 2, 0])
    counts = torch.tensor([30, 10, 0, 0])  # p = (0.75, 0.25, 0, 0)
    assert pa_l(pred, y, counts) == pytest.approx((0.75 * 1 + 0.25 * 2) / (0.75 * 2 + 0.25 * 2))
    assert pa_v(pred, y, counts) == pytest.approx(3 / 4)  # the samples of classes 0 and 1: 3 of 4 right


def test_pa_l_and_pa_v_weight_samples_not_classes_on_an_unbalanced_test_set():
    y = torch.tensor([0, 0, 0, 0, 1, 2])  # class 0 has 4 test samples, class 1 one
    pred = torch.tensor([0, 0, 0, 1, 1, 0])  # A = (3/4, 1, 0)
    counts = torch.tensor([5, 5, 0])  # p = (1/2, 1/2, 0)
    assert pa_l(pred, y, counts) == pytest.approx((0.5 * 3 + 0.5 * 1) / (0.5 * 4 + 0.5 * 1))  # 0.8
    assert pa_v(pred, y, counts) == pytest.approx(4 / 5)
    row = per_class_accuracy(pred, y, 3)
    assert float(0.5 * row[0] + 0.5 * row[1]) == pytest.approx(0.875)  # the per-class form differs


def test_pa_l_and_pa_v_equal_the_per_class_forms_on_a_balanced_test_set():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(5).repeat(20)  # 20 test samples per class
    pred = torch.randint(0, 5, (100,), generator=g)
    counts = torch.tensor([7, 0, 3, 12, 1])
    row = per_class_accuracy(pred, y, 5).double()
    held = counts > 0
    p = counts.double() / counts.sum()
    # equal in real arithmetic; in float64 they differ by a few ulps of sums of at most 100 terms
    assert pa_l(pred, y, counts) == pytest.approx(float((p[held] * row[held]).sum()), abs=1e-12)
    assert pa_v(pred, y, counts) == pytest.approx(float(row[held].mean()), abs=1e-12)


def test_pa_l_and_pa_v_skip_held_classes_without_test_samples():
    y = torch.tensor([0, 0, 1])
    pred = torch.tensor([0, 1, 1])
    counts = torch.tensor([1, 2, 1])  # class 2: held, but no test sample (contributes to neither sum)
    assert pa_l(pred, y, counts) == pytest.approx((0.25 * 1 + 0.5 * 1) / (0.25 * 2 + 0.5 * 1))
    assert pa_v(pred, y, counts) == pytest.approx(2 / 3)
    assert math.isnan(pa_v(pred, y, torch.tensor([0, 0, 4])))  # no test sample of a held class


def test_personal_metrics_uses_local_split_and_full_test():
    test_y = torch.tensor([0, 0, 1, 1, 2, 2])
    pred = torch.tensor([0, 1, 1, 1, 2, 0])
    local = torch.tensor([0, 2, 3])  # the client's local test split
    m = personal_metrics(pred, test_y, local, torch.tensor([1, 3, 0]))
    assert m["personal_acc"] == pytest.approx(1.0)  # all three local samples right
    assert m["pa_l"] == pytest.approx(0.25 * 0.5 + 0.75 * 1.0)
    assert m["pa_v"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["pa_global"] == pytest.approx(4 / 6)  # the full test set, classes the client lacks included
    assert (
        personal_metrics(pred, test_y, torch.tensor([], dtype=torch.long), torch.tensor([1, 1, 0]))[
            "personal_acc"
        ]
        is None
    )


def test_summarize_means_and_worst10():
    vals = [0.1, 0.5, 0.9, None]
    weights = [1.0, 1.0, 2.0, 5.0]
    s = summarize(vals, weights)
    assert s["mean"] == pytest.approx(0.5)
    assert s["weighted"] == pytest.approx((0.1 + 0.5 + 1.8) / 4)
    assert s["worst10"] == pytest.approx(0.1)  # ceil(10% of 3) = 1 client
    twenty = summarize([i / 20 for i in range(20)], [1.0] * 20)
    assert twenty["worst10"] == pytest.approx((0.0 + 0.05) / 2)  # the two lowest of 20
    assert summarize([None], [1.0]) == {"mean": None, "weighted": None, "worst10": None}


def test_predict_and_accuracy():
    lin = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 3.0]])
    pred = predict(lin, x, batch_size=2)
    assert pred.tolist() == [0, 1, 1]
    assert accuracy(pred, torch.tensor([0, 0, 1])) == pytest.approx(2 / 3)


def test_round_record_and_summary():
    evals = [
        {"personal_acc": 0.5, "pa_l": 0.4, "pa_v": 0.3, "pa_global": 0.2},
        {"personal_acc": 1.0, "pa_l": 0.8, "pa_v": 0.6, "pa_global": 0.4},
    ]
    updates = [{"num_samples": 10, "train_loss": 1.0}, {"num_samples": 30, "train_loss": 2.0}]
    replies = [ClientReply(k, u, e, 0, 0) for k, (u, e) in enumerate(zip(updates, evals, strict=True))]
    r1 = round_record(1, 0.7, replies, [0, 1], 100, 200, 1.5)
    assert r1["personal_acc"] == pytest.approx(0.75)
    assert r1["personal_acc_weighted"] == pytest.approx((5 + 30) / 40)
    assert r1["pa_l"] == pytest.approx(0.6) and r1["pa_v_worst10"] == pytest.approx(0.3)
    assert r1["pa_global"] == pytest.approx(0.3) and r1["pa_global_weighted"] == pytest.approx(0.35)
    assert r1["train_loss"] == pytest.approx(1.75)
    assert (r1["bytes_up"], r1["bytes_down"]) == (100, 200)
    r2 = round_record(2, 0.6, replies, [0, 1], 100, 200, 1.0)
    s = summary_of([r1, r2], 2.5, 2)
    assert s["final"]["round"] == 2 and s["final"]["global_acc"] == pytest.approx(0.6)
    assert s["best"]["global_acc"] == pytest.approx(0.7) and s["best_round"]["global_acc"] == 1


def test_the_summary_keeps_the_best_balanced_accuracy_and_its_round():
    records = [
        {"round": 1, "global_acc": 0.7, "global_balanced_acc": 0.5},
        {"round": 2, "global_acc": 0.6, "global_balanced_acc": 0.55},
    ]
    s = summary_of(records, 1.0, 2)
    assert s["best"]["global_balanced_acc"] == pytest.approx(0.55)
    assert s["best_round"]["global_balanced_acc"] == 2
    assert s["best_round"]["global_acc"] == 1
