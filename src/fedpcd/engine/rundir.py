"""The run directory of CONTRACT.md and the per-round metric record both backends write.

``config.yaml`` (resolved), ``partition.json``, ``metrics.jsonl`` (one object per evaluated round, strict
JSON), ``summary.json`` and ``checkpoint/state.pt``. Every file but metrics.jsonl (appended a line at a time)
is written atomically (temp file, fsync, rename); the checkpoint also holds the metrics so far, so a resume
rewrites metrics.jsonl from it. A directory that already holds a run is never overwritten (resume it, or
choose another ``output_dir``), and a run holds an advisory lock (``.lock``) on its directory while it runs.
Checkpoints load with ``torch.load(weights_only=True)``: a run directory never executes code.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpcd.config import Config, dump_config
from fedpcd.engine.metrics import summarize
from fedpcd.errors import RunInUseError, UserError
from fedpcd.utils import atomic_write, atomic_write_text

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no lock
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"
RUN_MARKERS = ("metrics.jsonl", "summary.json", "checkpoint/state.pt")
CHECKPOINT_FORMAT = 2  # 2: + metrics so far and global RNG states (format 1: server, client_states, wall_s)
_HELD: dict[Path, int] = {}  # run directories whose lock this process holds -> nesting depth

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
    extra_global: dict[str, float | None] | None = None,
    global_class_acc: list[float | None] | None = None,
) -> dict[str, Any]:
    """One metrics.jsonl object from a round's replies and the participants' personal metrics.

    ``extra_global``: the accuracies of an algorithm's extra global predictors (``global_acc_<name>``);
    ``global_class_acc``: the global model's accuracy per class (``global_evaluation``)."""
    weights = [float(r["num_samples"]) for r in replies]
    record: dict[str, Any] = {"round": rnd, "global_acc": global_acc}
    for name, acc in (extra_global or {}).items():
        record[f"global_acc_{name}"] = acc
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
        global_class_acc=global_class_acc,
    )
    return record


def summary_of(records: Sequence[dict[str, Any]], wall_s: float, rounds: int) -> dict[str, Any]:
    """summary.json: the last evaluated round ('final') and the best value of each accuracy over rounds."""
    final = (
        {k: v for k, v in records[-1].items() if k not in ("clients", "client_pa_split")} if records else {}
    )
    best: dict[str, Any] = {}
    best_round: dict[str, int] = {}
    extra = [k for k in dict.fromkeys(k for r in records for k in r) if k.startswith("global_acc_")]
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


class RunDir:
    """One run's directory: creation, an advisory lock, metrics, checkpoints and the summary."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint" / "state.pt"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    def holds_run(self) -> bool:
        """Whether the folder holds (part of) a run: metrics, a summary or a checkpoint."""
        return any((self.path / name).exists() for name in RUN_MARKERS)

    def check_new(self) -> None:
        """Refuse an output_dir that is a file or already holds a run (never overwritten silently)."""
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"output_dir {self.path} is a file, not a folder; set output_dir to a folder")
        if self.holds_run():
            raise UserError(
                f"output_dir {self.path} already holds a run; use 'fedpcd run --resume {self.path}' "
                "or set output_dir to a new folder"
            )

    def mkdir(self) -> None:
        """Create the folder; a path that is a file, or one that cannot be created, is a UserError."""
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"output_dir {self.path} is a file, not a folder; set output_dir to a folder")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create output_dir {self.path}: {exc.strerror or exc}") from None

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an advisory lock on the run directory (``.lock``, fcntl) for the block.

        A second fedpcd process that runs or resumes the same directory gets a :class:`RunInUseError`
        naming the holder's pid. The lock goes with its process (a killed run leaves no stale lock);
        re-entrant within one process."""
        self.mkdir()
        key = self.path.resolve()
        if key in _HELD:  # held by this process already (e.g. run_flower, then its ServerApp thread)
            _HELD[key] += 1
            try:
                yield
            finally:
                if key in _HELD:  # the outer holder may have let go first (an interrupted run)
                    _HELD[key] -= 1
            return
        path = self.path / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as exc:
            raise UserError(f"output_dir {self.path} is not writable: {exc.strerror or exc}") from None
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    raise RunInUseError(
                        f"{self.path} is in use by another fedpcd process (pid {holder}); wait for it to "
                        "finish or stop it, or set output_dir to another folder"
                    ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _HELD[key] = 1
            try:
                yield
            finally:
                del _HELD[key]
        finally:
            os.close(fd)  # releases the lock

    def create(self, config: Config, partition_json: dict[str, Any], restart: bool = False) -> None:
        """Start a fresh run directory; refuse one that already holds a run (``restart``: rewrite the files
        of a run that was interrupted before its first checkpoint)."""
        if not restart:
            self.check_new()
        self.mkdir()
        try:
            dump_config(config, self.path / "config.yaml")
            atomic_write_text(self.path / "partition.json", json.dumps(partition_json))
            atomic_write_text(self.metrics, "")
        except OSError as exc:
            raise UserError(f"cannot write to output_dir {self.path}: {exc.strerror or exc}") from None

    def append(self, record: dict[str, Any]) -> None:
        """Append one round's record to metrics.jsonl (strict JSON: a NaN or infinity is refused)."""
        line = record_line(record)
        with open(self.metrics, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()

    def records(self, up_to_round: int | None = None) -> list[dict[str, Any]]:
        """metrics.jsonl's records (up to a round); a torn last line (a kill mid-write) is ignored, any
        other line that is not a JSON object is a UserError naming the file and line."""
        return [r for r in read_records(self.metrics) if up_to_round is None or r["round"] <= up_to_round]

    def rewrite(self, records: Sequence[dict[str, Any]]) -> None:
        """Replace metrics.jsonl with these records (atomically)."""
        atomic_write_text(self.metrics, "".join(record_line(r) for r in records))

    def truncate(self, up_to_round: int) -> list[dict[str, Any]]:
        """Drop records after the checkpointed round (they are recomputed identically on resume)."""
        rows = self.records(up_to_round)
        self.rewrite(rows)
        return rows

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write the checkpoint with every tensor moved to the CPU, so that it loads on any machine."""
        from fedpcd.engine.federation import to_device

        cpu_state = to_device(state, "cpu")
        atomic_write(self.checkpoint, lambda fh: torch.save(cpu_state, fh), mode="wb")
        for stale in self.checkpoint.parent.glob(f".{self.checkpoint.name}.*"):  # temp files of killed writes
            stale.unlink(missing_ok=True)

    def load_checkpoint(self, map_location: torch.device | str | None = None) -> dict[str, Any]:
        """The last checkpoint; ``map_location`` puts its tensors on a device (e.g. the run's).

        Loaded with ``torch.load(weights_only=True)``: tensors and plain data only, never code, so a run
        directory from elsewhere cannot execute anything. Anything else is a UserError naming the file."""
        return load_checkpoint_file(self.checkpoint, map_location)

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2, allow_nan=False))

    def read_summary(self) -> dict[str, Any]:
        """summary.json; a corrupt one is a UserError naming it."""
        path = self.path / "summary.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise UserError(f"{path} is not a fedpcd summary (a JSON object)")
        return data


def record_line(record: dict[str, Any]) -> str:
    """One metrics.jsonl line; strict JSON (a non-finite number is a bug the divergence guard missed)."""
    try:
        return json.dumps(record, allow_nan=False) + "\n"
    except ValueError:
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        raise RuntimeError(f"round {record.get('round')}: non-finite metric(s) {bad} in the record") from None


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file ([] when missing). A last line without its newline that does not
    parse is a write cut short by a kill and is ignored; any other bad line is a UserError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # the unterminated last line: torn by a kill
                break
            raise UserError(f"{path} line {i} is not valid JSON: the file is corrupt") from None
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            raise UserError(f"{path} line {i} is not a fedpcd metrics record (needs an integer 'round')")
        rows.append(row)
    return rows


def load_checkpoint_file(path: str | Path, map_location: torch.device | str | None = None) -> dict[str, Any]:
    """A checkpoint file, loaded with ``weights_only=True`` and checked for the keys a resume needs."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"no checkpoint in {path.parent.parent}: nothing to resume (expected {path})")
    try:
        state = torch.load(path, weights_only=True, map_location=map_location)
    except Exception as exc:  # noqa: BLE001 - unpickling refused, truncated or foreign file: all one answer
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot load checkpoint {path}: {reason[:200]} (only tensors and plain data are loaded, never "
            "code; delete the checkpoint folder to restart the run)"
        ) from None
    if not isinstance(state, dict) or not all(k in state for k in ("round", "server", "client_states")):
        raise UserError(f"{path} is not a fedpcd checkpoint (needs 'round', 'server' and 'client_states')")
    if not isinstance(state["round"], int) or not isinstance(state["client_states"], dict):
        raise UserError(f"{path} is not a fedpcd checkpoint (bad 'round' or 'client_states')")
    return state


def checkpoint_state(
    rnd: int,
    server: dict[str, Any],
    client_states: Mapping[int, Any],
    wall_s: float,
    records: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """What ``--resume`` needs after round ``rnd``: server and client states, the metrics so far (so a
    metrics.jsonl line torn or written after the checkpoint never matters) and the global RNG states.

    ``client_states``: a dict, or a store with ``to_dict()`` (engine/state_store.py)."""
    to_dict = getattr(client_states, "to_dict", None)
    return {
        "format": CHECKPOINT_FORMAT,
        "round": int(rnd),
        "server": server,
        "client_states": to_dict() if callable(to_dict) else dict(client_states),
        "wall_s": float(wall_s),
        "metrics": "".join(record_line(r) for r in records),
        "rng": rng_state(),
    }


def checkpoint_records(state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The metrics a checkpoint holds (None for checkpoints written before they held them)."""
    text = state.get("metrics")
    if not isinstance(text, str):
        return None
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rng_state() -> dict[str, Any]:
    """The global torch, numpy and Python RNG states, as tensors and plain data (weights_only-loadable).

    The engine itself never draws from them (every random choice comes from a generator seeded with
    (seed, round, client)); they are kept so that code which does (a user's algorithm) resumes identically."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any] | None) -> None:
    """Restore the global RNG states saved by :func:`rng_state` (no-op for None)."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            int(np_state["pos"]),
            int(np_state["has_gauss"]),
            float(np_state["cached_gaussian"]),
        )
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
