"""Per-class test accuracy of finished runs' global models, and where one class's test samples go.

    python benchmarks/class_accuracy.py RUN_DIR [RUN_DIR ...] [--confusion C [C ...]]

Each run needs its checkpoint (the final global state). Prints one row per run: the global model's accuracy
on each class of the full test set (%), then, for every class C of --confusion, the histogram of its test
samples' predicted classes. docs/results/fedgela.md uses it to show which classes FedGELA loses on
Dirichlet(0.1) and to which neighbours.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fedpcd.engine import load_finished
from fedpcd.engine.metrics import per_class_accuracy, predict


def global_predictions(run_dir: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(predictions, labels, classes) of the run's final global model on the full test set."""
    fed, algorithm, checkpoint = load_finished(run_dir)
    predictor = algorithm.global_predictor(fed.model_for(0), checkpoint["server"])
    if predictor is None:
        raise SystemExit(f"{run_dir}: {fed.config.algorithm.name} has no global model")
    return predict(predictor, fed.dataset.normalized("test")), fed.dataset.test_y, fed.dataset.num_classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--confusion", type=int, nargs="*", default=[], metavar="C")
    args = parser.parse_args()
    width = max(len(r.name) for r in args.runs)
    for run in args.runs:
        pred, y, classes = global_predictions(run)
        row = per_class_accuracy(pred, y, classes)
        print(f"{run.name:<{width}}  " + " ".join(f"{100 * v:5.1f}" for v in row.tolist()))
        for c in args.confusion:
            counts = torch.bincount(pred[y == c], minlength=classes).tolist()
            print(f"{'':<{width}}  class {c} predicted as: {counts}")


if __name__ == "__main__":
    main()
