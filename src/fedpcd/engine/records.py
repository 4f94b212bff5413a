"""The per-round metric record both backends write to metrics.jsonl, and summary.json from the records
(docs/design.md section 5; the metrics themselves: ``fedpcd.run_format.METRICS``, ``engine/metrics.py``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fedpcd.engine.metrics import summarize
from fedpcd.engine.tasks import ClientReply
from fedpcd.run_format import ACCURACY_KEYS, CLIENT_PA_SPLIT, GA, PA_SPLIT, PERSONAL, STATISTICS

PERSONAL_EVAL = (
    "participants"  # whose personal models are evaluated: the round's participants, after training
)


def round_record(
    rnd: int,
    global_acc: float | None,
    replies: Sequence[ClientReply],
    client_ids: Sequence[int],
    bytes_up: int,
    bytes_down: int,
    wall_s: float,
    extra_global: dict[str, float | None] | None = None,
    global_class_acc: list[float | None] | None = None,
) -> dict[str, Any]:
    """One metrics.jsonl object from a round's aggregated replies and their personal metrics (dicts keyed by
    the PERSONAL metrics' keys, ``engine.metrics.personal_metrics``; None when not evaluated).

    ``extra_global``: the accuracies of an algorithm's extra global predictors (``global_acc_<name>``);
    ``global_class_acc``: the global model's accuracy per class (``global_evaluation``)."""
    weights = [float(r.num_samples) for r in replies]
    evals = [r.metrics for r in replies]
    record: dict[str, Any] = {"round": rnd, GA.key: global_acc}
    for name, acc in (extra_global or {}).items():
        record[f"{GA.key}_{name}"] = acc
    for metric in PERSONAL:
        stats = summarize([e[metric.key] if e else None for e in evals], weights)
        for statistic, suffix in STATISTICS.items():
            record[metric.key + suffix] = stats[statistic]
    losses = [(r.train_loss, w) for r, w in zip(replies, weights, strict=True) if r.train_loss is not None]
    record["train_loss"] = sum(v * w for v, w in losses) / sum(w for _, w in losses) if losses else None
    record.update(
        bytes_up=int(bytes_up),
        bytes_down=int(bytes_down),
        wall_s=round(wall_s, 4),
        personal_eval=PERSONAL_EVAL,
        clients=[int(k) for k in client_ids],
        **{CLIENT_PA_SPLIT: [e[PA_SPLIT.key] if e else None for e in evals]},
        global_class_acc=global_class_acc,
    )
    return record


def summary_of(records: Sequence[dict[str, Any]], wall_s: float, rounds: int) -> dict[str, Any]:
    """summary.json: the last evaluated round ('final') and the best value of each accuracy over rounds."""
    final = {k: v for k, v in records[-1].items() if k not in ("clients", CLIENT_PA_SPLIT)} if records else {}
    best: dict[str, Any] = {}
    best_round: dict[str, int] = {}
    extra = [k for k in dict.fromkeys(k for r in records for k in r) if k.startswith(f"{GA.key}_")]
    for key in [*ACCURACY_KEYS, *extra]:
        scored = [(r[key], r["round"]) for r in records if r.get(key) is not None]
        if scored:
            best[key], best_round[key] = max(scored, key=lambda t: (t[0], -t[1]))
        else:
            best[key] = None
    return {
        "rounds": rounds,
        "wall_s": round(wall_s, 3),
        "final": final,
        "best": best,
        "best_round": best_round,
    }


def record_line(record: dict[str, Any]) -> str:
    """One metrics.jsonl line; strict JSON (a non-finite number is a bug the divergence guard missed)."""
    try:
        return json.dumps(record, allow_nan=False) + "\n"
    except ValueError:
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        raise RuntimeError(f"round {record.get('round')}: non-finite metric(s) {bad} in the record") from None
