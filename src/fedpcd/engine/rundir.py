"""The run directory (docs/design.md section 5) and the per-round metric record both backends write.

``config.yaml`` (resolved), ``partition.json``, ``metrics.jsonl`` (one object per evaluated round, strict
JSON), ``summary.json`` and ``checkpoint/state.pt``. Every file but metrics.jsonl (appended a line at a time)
is written atomically (temp file, fsync, rename); the checkpoint also holds the metrics so far, so a resume
rewrites metrics.jsonl from it. A directory that already holds a run is never overwritten (resume it, or
choose another ``output_dir``), nor is a folder holding files fedpcd did not write for the same config, and
a run holds an advisory lock (``.lock``) on its directory while it runs. Run-folder writes never follow a
symbolic link (a folder whose entries are links is refused), and a write that fails (a full disk) is one
line naming the file, with everything written before it kept.
Checkpoints load with ``torch.load(weights_only=True)``: a run directory never executes code. They hold the
resolved config (canonical JSON and its SHA-256): a resume with another config is refused, but for
``RESUME_CHANGES`` allowed explicitly.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpcd.config import (
    Config,
    canonical_config,
    config_changes,
    config_hash,
    config_yaml,
    describe_changes,
    load_config,
)
from fedpcd.engine.metrics import summarize
from fedpcd.errors import RunInUseError, UserError, clip, short
from fedpcd.utils import atomic_write

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no lock
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"
RUN_MARKERS = ("metrics.jsonl", "summary.json", "checkpoint/state.pt")
RUN_FILES = ("config.yaml", "partition.json", "metrics.jsonl", "summary.json", "checkpoint", "client_states")
RUN_ENTRIES = (LOCK_FILE, *RUN_FILES, "checkpoint/state.pt")  # never symbolic links
# 3: + the config (canonical JSON and SHA-256); 2: + metrics so far and global RNG states (1: server,
# client_states, wall_s)
CHECKPOINT_FORMAT = 3
# config keys a resume may change (with --allow-config-change): none changes what the rounds compute
RESUME_CHANGES = ("rounds", "engine.checkpoint_every", "engine.threads", "dataset.download")
_HELD: dict[Path, int] = {}  # run directories whose lock this process holds -> nesting depth

PERSONAL_KEYS = {"personal_acc": "pa_split", "pa_l": "pa_l", "pa_v": "pa_v", "pa_global": "pa_global"}
ACCURACY_KEYS = ["global_acc"] + [f"{k}{s}" for k in PERSONAL_KEYS for s in ("", "_weighted", "_worst10")]
PERSONAL_EVAL = (
    "participants"  # whose personal models are evaluated: the round's participants, after training
)


def refuse_link(path: str | Path) -> None:
    """A UserError if ``path`` is a symbolic link: fedpcd never writes through one in a run folder."""
    if os.path.islink(path):
        raise UserError(
            f"{path} is a symbolic link; fedpcd never writes through links in a run folder: replace it with "
            "the real file or folder, or set output_dir to a new folder"
        )


def write_error(path: str | Path, exc: OSError) -> UserError:
    """The one line for a failed write: the file and the cause (e.g. 'No space left on device')."""
    return UserError(f"cannot write {path}: {exc.strerror or exc}")


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an OSError of the block (writing ``path``) into :func:`write_error`."""
    try:
        yield
    except OSError as exc:
        raise write_error(path, exc) from None


def open_no_follow(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that never follows a symbolic link at ``path`` (a UserError); other failures as
    :func:`write_error`."""
    no_follow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    refuse_link(path)  # where O_NOFOLLOW is missing; with it, a link put there now is refused below
    try:
        return os.open(path, flags | no_follow, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path)
        raise write_error(path, exc) from None


def safe_write(
    path: str | Path, write: Callable[[Any], None], mode: str = "w", root: str | Path = ""
) -> None:
    """Write a run-folder file atomically (temp file beside it, then rename: never through a link at
    ``path``), refusing a link at ``path`` or at a folder between it and ``root``. An OSError (a full disk)
    is one line naming the file; the old file is kept and the temp file removed."""
    path = Path(path)
    try:
        parts = path.relative_to(root).parts if root else (path.name,)
    except ValueError:
        parts = (path.name,)
    base = path.parents[len(parts) - 1]
    for i in range(len(parts)):
        refuse_link(base.joinpath(*parts[: i + 1]))
    with writing(path):
        atomic_write(path, write, mode=mode)


def load_weights_only(
    path: str | Path, map_location: torch.device | str | None = None, what: str = "checkpoint", hint: str = ""
) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain data only, never code. A file that does not load
    is one line of our own naming it (never torch's advice to load it without that safeguard)."""
    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except Exception:  # noqa: BLE001 - refused by the safe unpickler, truncated or foreign: all one answer
        raise UserError(
            f"cannot load {what} {path}: it is corrupt, truncated or holds objects other than tensors and "
            f"plain data (only those are loaded, never code){hint}"
        ) from None


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

    def _write(self, name: str, write: Callable[[Any], None], mode: str = "w") -> None:
        safe_write(self.path / name, write, mode, root=self.path)

    def _write_text(self, name: str, text: str) -> None:
        self._write(name, lambda fh: fh.write(text))

    def check_links(self) -> None:
        """Refuse the folder if any of its run entries (lock, config, metrics, checkpoint, client states...)
        is a symbolic link: writing there would change the file or folder it points to."""
        for name in RUN_ENTRIES:
            refuse_link(self.path / name)

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint" / "state.pt"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    def holds_run(self) -> bool:
        """Whether the folder holds (part of) a run: metrics, a summary or a checkpoint."""
        return any((self.path / name).exists() for name in RUN_MARKERS)

    def check_new(self, config: Config | None = None) -> None:
        """Refuse an output_dir that is a file, has symbolic links for run entries or already holds a run;
        with ``config``, also one holding files a run writes (config.yaml, partition.json, ...) that are not
        those of a run of this same config stopped before its first round (never overwritten silently)."""
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"output_dir {self.path} is a file, not a folder; set output_dir to a folder")
        self.check_links()
        if self.holds_run():
            raise UserError(
                f"output_dir {self.path} already holds a run; use 'fedpcd run --resume {self.path}' "
                "or set output_dir to a new folder"
            )
        present = [name for name in RUN_FILES if os.path.lexists(self.path / name)]
        if config is None or not present:
            return
        path = self.path / "config.yaml"
        try:
            same = path.is_file() and path.read_text(encoding="utf-8") == config_yaml(config)
            theirs = None if same or not path.is_file() else load_config(path)
        except (OSError, UnicodeDecodeError, UserError):
            same, theirs = False, None
        if same:  # a run of this config stopped while writing its first files: started again
            return
        if theirs is None:
            what = f"{', '.join(present)}, not written by fedpcd for this run"
        else:
            changes = _changes(canonical_config(theirs), config)
            diff = describe_changes(changes) or "same settings, written for another output_dir or by hand"
            what = f"the config.yaml of another run ({diff})"
        raise UserError(
            f"output_dir {self.path} holds {what}; fedpcd never overwrites files it did not write for this "
            "run: set output_dir to a new or empty folder"
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
        naming the holder's pid. The lock goes with its process; the file holds the holder's pid and is
        emptied on release, so the lock of a process that died holding it is reported when cleared.
        Re-entrant within one process."""
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
        self.check_links()
        path = self.path / LOCK_FILE
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
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
            stale = os.pread(fd, 64, 0).decode(errors="replace").strip()
            if stale:  # a holder that releases empties the file: this one died holding it
                print(
                    f"fedpcd: cleared the stale lock of process {stale} in {self.path} (it ended without "
                    "releasing it)",
                    file=sys.stderr,
                )
            with writing(path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _HELD[key] = 1
            try:
                yield
            finally:
                del _HELD[key]
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)  # released cleanly (still held while emptied)
        finally:
            os.close(fd)  # releases the lock

    def create(self, config: Config, partition_json: dict[str, Any], restart: bool = False) -> None:
        """Start a fresh run directory; refuse one that already holds a run (``restart``: rewrite the files
        of a run that was interrupted before its first checkpoint)."""
        if not restart:
            self.check_new(config)
        self.mkdir()
        self._write_text("config.yaml", config_yaml(config))
        self._write_text("partition.json", json.dumps(partition_json))
        self._write_text("metrics.jsonl", "")

    def append(self, record: dict[str, Any]) -> None:
        """Append one round's record to metrics.jsonl (strict JSON: a NaN or infinity is refused)."""
        data = memoryview(record_line(record).encode("utf-8"))
        fd = open_no_follow(self.metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            with writing(self.metrics):
                while data:
                    data = data[os.write(fd, data) :]
        finally:
            os.close(fd)

    def records(self, up_to_round: int | None = None) -> list[dict[str, Any]]:
        """metrics.jsonl's records (up to a round); a torn last line (a kill mid-write) is ignored, any
        other line that is not a JSON object is a UserError naming the file and line."""
        return [r for r in read_records(self.metrics) if up_to_round is None or r["round"] <= up_to_round]

    def rewrite(self, records: Sequence[dict[str, Any]]) -> None:
        """Replace metrics.jsonl with these records (atomically)."""
        self._write_text("metrics.jsonl", "".join(record_line(r) for r in records))

    def truncate(self, up_to_round: int) -> list[dict[str, Any]]:
        """Drop records after the checkpointed round (they are recomputed identically on resume)."""
        rows = self.records(up_to_round)
        self.rewrite(rows)
        return rows

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write the checkpoint with every tensor moved to the CPU, so that it loads on any machine."""
        from fedpcd.engine.federation import to_device

        cpu_state = to_device(state, "cpu")
        self._write("checkpoint/state.pt", lambda fh: torch.save(cpu_state, fh), mode="wb")
        with writing(self.checkpoint.parent):
            for stale in self.checkpoint.parent.glob(f".{self.checkpoint.name}.*"):  # of killed writes
                stale.unlink(missing_ok=True)

    def load_checkpoint(self, map_location: torch.device | str | None = None) -> dict[str, Any]:
        """The last checkpoint; ``map_location`` puts its tensors on a device (e.g. the run's).

        Loaded with ``torch.load(weights_only=True)``: tensors and plain data only, never code, so a run
        directory from elsewhere cannot execute anything. Anything else is a UserError naming the file."""
        return load_checkpoint_file(self.checkpoint, map_location)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write_text("summary.json", json.dumps(summary, indent=2, allow_nan=False))

    def discard_summary(self) -> None:
        """Remove summary.json (a finished run that goes on to more rounds: its summary is stale)."""
        with writing(self.path / "summary.json"):
            (self.path / "summary.json").unlink(missing_ok=True)

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
    hint = "; delete the checkpoint folder to restart the run"
    state = load_weights_only(path, map_location, "checkpoint", hint)
    if not isinstance(state, dict) or not all(k in state for k in ("round", "server", "client_states")):
        raise UserError(f"{path} is not a fedpcd checkpoint (needs 'round', 'server' and 'client_states')")
    if (
        isinstance(state["round"], bool)
        or not isinstance(state["round"], int)
        or not isinstance(state["client_states"], dict)
        or not isinstance(state["server"], dict)
    ):
        raise UserError(f"{path} is not a fedpcd checkpoint (bad 'round', 'server' or 'client_states')")
    return state


def check_allowed_changes(keys: Sequence[str]) -> None:
    """Refuse ``--allow-config-change`` keys a resume may not change (only ``RESUME_CHANGES``)."""
    bad = [k for k in keys if k not in RESUME_CHANGES]
    if bad:
        raise UserError(
            f"--allow-config-change {clip(bad[0])}: a resumed run may change only "
            f"{', '.join(RESUME_CHANGES)} (rounds never below the checkpoint's round)"
        )


def _changes(old_text: str, config: Config) -> dict[str, tuple[Any, Any]]:
    return config_changes(json.loads(old_text), json.loads(canonical_config(config)))


def check_checkpoint(
    state: dict[str, Any], path: str | Path, config: Config, allow: Sequence[str] = ()
) -> None:
    """Refuse a checkpoint (loaded by :func:`load_checkpoint_file`) that does not belong to ``config``.

    Its config record must match ``config`` but for the ``allow``ed keys of ``RESUME_CHANGES`` (else a
    one-line ``key: old -> new`` diff; a checkpoint from before the record is not compared), and its fields
    must be in range: round in 0..rounds, client ids in 0..clients-1, wall time, metrics, format."""
    path = Path(path)
    fmt = state.get("format", 1)
    if isinstance(fmt, bool) or not isinstance(fmt, int) or not 1 <= fmt <= CHECKPOINT_FORMAT:
        raise UserError(
            f"{path}: checkpoint format {short(fmt)} is not one this fedpcd reads (1..{CHECKPOINT_FORMAT})"
        )
    if "config" in state or "config_sha256" in state:
        text, digest = state.get("config"), state.get("config_sha256")
        if not isinstance(text, str) or not isinstance(digest, str) or config_hash(text) != digest:
            raise UserError(f"{path}: the checkpoint's config record is corrupt (its SHA-256 does not match)")
        if digest != config_hash(canonical_config(config)):
            try:
                changes = _changes(text, config)
            except ValueError:
                raise UserError(f"{path}: the checkpoint's config record is not JSON") from None
            run, diff = path.parent.parent, describe_changes(changes)
            unsafe = [k for k in changes if k not in RESUME_CHANGES]
            if unsafe:
                raise UserError(
                    f"{run}/config.yaml changed since its checkpoint ({diff}); a run cannot go on with "
                    f"another {unsafe[0]}: restore config.yaml or start a new run (a resume may change only "
                    f"{', '.join(RESUME_CHANGES)})"
                )
            missing = [k for k in changes if k not in allow]
            if missing:
                raise UserError(
                    f"{run}/config.yaml changed since its checkpoint ({diff}); to go on with the change, add "
                    f"--allow-config-change {' '.join(missing)}"
                )
    rnd = state["round"]
    if not 0 <= rnd <= config.rounds:
        raise UserError(
            f"{path}: checkpoint round {rnd} is outside 0..{config.rounds} (rounds never go below the round "
            "a checkpoint was written at)"
        )
    bad = [k for k in state["client_states"] if isinstance(k, bool) or not isinstance(k, int)]
    bad += [k for k in state["client_states"] if k not in bad and not 0 <= k < config.clients]
    if bad:
        raise UserError(
            f"{path}: the checkpoint holds a state of client {short(bad[0])}, but clients are "
            f"0..{config.clients - 1}"
        )
    wall = state.get("wall_s", 0.0)
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not 0 <= wall < math.inf:
        raise UserError(f"{path}: the checkpoint's wall_s {short(wall)} is not a time in seconds")
    checkpoint_records(state, path)


def checkpoint_state(
    rnd: int,
    server: dict[str, Any],
    client_states: Mapping[int, Any],
    wall_s: float,
    records: Sequence[dict[str, Any]],
    config: Config | None = None,
) -> dict[str, Any]:
    """What ``--resume`` needs after round ``rnd``: server and client states, the metrics so far (so a
    metrics.jsonl line torn or written after the checkpoint never matters), the global RNG states and the
    run's ``config`` (canonical JSON and its SHA-256: a resume checks it against config.yaml).

    ``client_states``: a dict, or a store with ``to_dict()`` (engine/state_store.py)."""
    to_dict = getattr(client_states, "to_dict", None)
    state = {
        "format": CHECKPOINT_FORMAT,
        "round": int(rnd),
        "server": server,
        "client_states": to_dict() if callable(to_dict) else dict(client_states),
        "wall_s": float(wall_s),
        "metrics": "".join(record_line(r) for r in records),
        "rng": rng_state(),
    }
    if config is not None:
        state["config"] = canonical_config(config)
        state["config_sha256"] = config_hash(state["config"])
    return state


def checkpoint_records(
    state: dict[str, Any], path: str | Path = "the checkpoint"
) -> list[dict[str, Any]] | None:
    """The metrics a checkpoint holds (None for checkpoints written before they held them); a record that is
    not JSON, or whose round is out of order or after the checkpoint's, is a UserError naming ``path``."""
    text = state.get("metrics")
    if text is None:
        return None
    if not isinstance(text, str):
        raise UserError(f"{path}: the checkpoint's metrics are not text")
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(f"{path}: metrics line {i} in the checkpoint is not valid JSON") from None
        rnd = row.get("round") if isinstance(row, dict) else None
        last = rows[-1]["round"] if rows else 0
        if isinstance(rnd, bool) or not isinstance(rnd, int) or not last < rnd <= state["round"]:
            raise UserError(
                f"{path}: metrics line {i} in the checkpoint is not a record of a round in "
                f"{last + 1}..{state['round']}"
            )
        rows.append(row)
    return rows


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
    try:
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
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError):
        raise UserError("the checkpoint's random number generator states are corrupt") from None
