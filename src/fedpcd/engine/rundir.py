"""The run directory of CONTRACT.md and the per-round metric record both backends write.

``config.yaml`` (resolved), ``partition.json``, ``metrics.jsonl`` (one object per evaluated round),
``summary.json`` and ``checkpoint/state.pt``. Every file is written atomically; a directory that already
holds a run is never overwritten (resume it, or choose another ``output_dir``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fedpcd.config import Config, dump_config
from fedpcd.engine.metrics import summarize
from fedpcd.errors import UserError
from fedpcd.utils import atomic_write, atomic_write_text

PERSONAL_KEYS = {"personal_acc": "pa_split", "pa_l": "pa_l", "pa_v": "pa_v", "pa_global": "pa_global"}
ACCURACY_KEYS = ["global_acc"] + [f"{k}{s}" for k in PERSONAL_KEYS for s in ("", "_weighted", "_worst10")]
PERSONAL_EVAL = (
    "participants"  # whose personal models are evaluated: the round's participants, after training
)


def round_record(
    rnd: int,
    global_acc: float | None,
    replies: Sequence[dict[str, Any]],
    evals: Sequence[dict[str, Any] | None],
    client_ids: Sequence[int],
    bytes_up: int,
    bytes_down: int,
    wall_s: float,
) -> dict[str, Any]:
    """One metrics.jsonl object from a round's replies and the participants' personal metrics."""
    weights = [float(r["num_samples"]) for r in replies]
    record: dict[str, Any] = {"round": rnd, "global_acc": global_acc}
    for out_key, client_key in PERSONAL_KEYS.items():
        stats = summarize([e[client_key] if e else None for e in evals], weights)
        record[out_key] = stats["mean"]
        record[f"{out_key}_weighted"] = stats["weighted"]
        record[f"{out_key}_worst10"] = stats["worst10"]
    losses = [
        (r["train_loss"], w) for r, w in zip(replies, weights, strict=True) if r.get("train_loss") is not None
    ]
    record["train_loss"] = sum(v * w for v, w in losses) / sum(w for _, w in losses) if losses else None
    record.update(
        bytes_up=int(bytes_up),
        bytes_down=int(bytes_down),
        wall_s=round(wall_s, 4),
        personal_eval=PERSONAL_EVAL,
        clients=[int(k) for k in client_ids],
        client_pa_split=[e["pa_split"] if e else None for e in evals],
    )
    return record


def summary_of(records: Sequence[dict[str, Any]], wall_s: float, rounds: int) -> dict[str, Any]:
    """summary.json: the last evaluated round ('final') and the best value of each accuracy over rounds."""
    final = (
        {k: v for k, v in records[-1].items() if k not in ("clients", "client_pa_split")} if records else {}
    )
    best: dict[str, Any] = {}
    best_round: dict[str, int] = {}
    for key in ACCURACY_KEYS:
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


class RunDir:
    """Writes one run's directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint" / "state.pt"

    def create(self, config: Config, partition_json: dict[str, Any]) -> None:
        """Start a fresh run directory; refuse one that already holds a run."""
        if (self.path / "metrics.jsonl").exists() or (self.path / "summary.json").exists():
            raise UserError(
                f"output_dir {self.path} already holds a run; use 'fedpcd run --resume {self.path}' "
                "or set output_dir to a new folder"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        dump_config(config, self.path / "config.yaml")
        atomic_write_text(self.path / "partition.json", json.dumps(partition_json))
        atomic_write_text(self.path / "metrics.jsonl", "")

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def records(self, up_to_round: int | None = None) -> list[dict[str, Any]]:
        path = self.path / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        rows = [json.loads(line) for line in lines if line.strip()]
        return [r for r in rows if up_to_round is None or r["round"] <= up_to_round]

    def truncate(self, up_to_round: int) -> list[dict[str, Any]]:
        """Drop records after the checkpointed round (they are recomputed identically on resume)."""
        rows = self.records(up_to_round)
        atomic_write_text(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        atomic_write(self.checkpoint, lambda fh: torch.save(state, fh), mode="wb")

    def load_checkpoint(self) -> dict[str, Any]:
        if not self.checkpoint.exists():
            raise UserError(f"no checkpoint in {self.path}: nothing to resume (expected {self.checkpoint})")
        return torch.load(self.checkpoint, weights_only=False)

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2))
