"""Partition statistics: count matrices, a readable table, a JSON summary and a heatmap."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedpcd.data.partition import Partition, _count_matrix
from fedpcd.utils import atomic_write

_MAX_CLASS_COLUMNS = 20
_TOP_CLASSES = 5


def count_matrix(indices: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[K, C] int64: entry (k, c) is how many of client k's indices carry label c."""
    return _count_matrix(indices, labels, num_classes)


def partition_table(partition: Partition, train_labels: np.ndarray, test_labels: np.ndarray) -> str:
    """A text table, one row per client: id, #train, #test, #classes (held in train) and the per-class train
    counts (all classes for C <= 20, else the client's top classes as ``class:count``); then a totals line."""
    train = partition.train_counts(train_labels)
    test = partition.test_counts(test_labels)
    num_clients, num_classes = train.shape
    wide = num_classes <= _MAX_CLASS_COLUMNS
    id_w = max(len("client"), len(str(max(num_clients - 1, 0))), len("total"))
    n_w = max(len("#train"), len(str(int(train.sum()))), len(str(int(test.sum()))))
    cls_w = max(len("#cls"), len(str(num_classes)))
    cell_w = max(len(str(int(train.max(initial=0)))), len(str(num_classes - 1))) if wide else 0
    total_cell_w = max(cell_w, len(str(int(train.sum(axis=0).max(initial=0)))))

    def row(ident: str, n_train: int, n_test: int, n_cls: int, counts: np.ndarray, width: int) -> str:
        head = f"{ident:>{id_w}}  {n_train:>{n_w}}  {n_test:>{n_w}}  {n_cls:>{cls_w}}"
        if wide:
            cells = " ".join(f"{int(v):>{width}}" for v in counts)
        else:
            top = [c for c in np.argsort(-counts, kind="stable")[:_TOP_CLASSES] if counts[c] > 0]
            cells = " ".join(f"{int(c)}:{int(counts[c])}" for c in top)
            if int((counts > 0).sum()) > len(top):
                cells += " ..."
        return f"{head}  {cells}".rstrip()

    if wide:
        classes = " ".join(f"{c:>{total_cell_w}}" for c in range(num_classes))
        title = "train counts per class: " if num_classes else ""
    else:
        classes = ""
        title = f"top {_TOP_CLASSES} classes (class:train count)"
    header = f"{'client':>{id_w}}  {'#train':>{n_w}}  {'#test':>{n_w}}  {'#cls':>{cls_w}}  {title}".rstrip()
    lines = [header]
    if wide and num_classes:
        lines.append(f"{'':>{id_w}}  {'':>{n_w}}  {'':>{n_w}}  {'':>{cls_w}}  {classes}")
    for k in range(num_clients):
        lines.append(
            row(
                str(k),
                int(train[k].sum()),
                int(test[k].sum()),
                int((train[k] > 0).sum()),
                train[k],
                total_cell_w,
            )
        )
    totals = train.sum(axis=0)
    lines.append(
        row("total", int(train.sum()), int(test.sum()), int((totals > 0).sum()), totals, total_cell_w)
    )
    sizes = train.sum(axis=1)
    if num_clients:
        lines.append(
            f"{num_clients} clients, {num_classes} classes; train size per client min {int(sizes.min())} / "
            f"mean {sizes.mean():.1f} / max {int(sizes.max())}; classes per client "
            f"min {int((train > 0).sum(axis=1).min())} / max {int((train > 0).sum(axis=1).max())}"
        )
    return "\n".join(lines)


def partition_json(partition: Partition, train_labels: np.ndarray, test_labels: np.ndarray) -> dict:
    """``{"num_classes": C, "clients": [{"id": k, "train_counts": [...], "test_counts": [...]}, ...]}`` with
    plain Python ints (JSON-ready)."""
    train = partition.train_counts(train_labels)
    test = partition.test_counts(test_labels)
    return {
        "num_classes": int(partition.num_classes),
        "clients": [
            {
                "id": k,
                "train_counts": [int(v) for v in train[k]],
                "test_counts": [int(v) for v in test[k]],
            }
            for k in range(len(partition.train))
        ],
    }


def plot_partition(partition: Partition, train_labels: np.ndarray, path: str | Path) -> None:
    """Write a client x class heatmap of train counts as a PNG (Agg, no global pyplot state), atomically."""
    plot_counts(partition.train_counts(train_labels), path)


def plot_counts(counts: np.ndarray, path: str | Path, title: str = "") -> None:
    """Write the heatmap of a [clients, classes] train-count matrix (e.g. partition.json's) as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = np.asarray(counts)
    num_clients, num_classes = counts.shape
    width = float(np.clip(3.5 + 0.09 * num_classes, 6.0, 14.0))
    height = float(np.clip(2.5 + 0.09 * num_clients, 4.0, 12.0))
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    heading = f"train samples: {num_clients} clients x {num_classes} classes"
    ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=10)  # two lines: fits narrow plots
    for axis, n in ((ax.xaxis, num_classes), (ax.yaxis, num_clients)):
        if n <= 30:
            axis.set_ticks(range(n))
    if num_clients * num_classes <= 400 and num_clients and num_classes:
        threshold = counts.max() / 2 if counts.max() else 1
        fontsize = 7 if num_clients * num_classes > 100 else 8
        for k in range(num_clients):
            for c in range(num_classes):
                if counts[k, c]:
                    colour = "black" if counts[k, c] > threshold else "white"
                    ax.text(
                        c,
                        k,
                        str(int(counts[k, c])),
                        ha="center",
                        va="center",
                        fontsize=fontsize,
                        color=colour,
                        in_layout=False,  # inside its cell: the layout need not measure it
                    )
    fig.colorbar(image, ax=ax, label="samples")
    fig.tight_layout()
    atomic_write(path, lambda fh: fig.savefig(fh, format="png"), mode="wb")
