"""The sweep's progress line: runs finished, running (with their last evaluated round), failed and skipped,
and an ETA from the wall times of the runs finished so far; printed as each run ends and, by ``heartbeat``,
every ``PROGRESS_EVERY`` seconds between."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

from fedpcd.config import Config
from fedpcd.errors import clip
from fedpcd.run_format import RunFiles

PROGRESS_EVERY = 60.0  # seconds between two progress lines while no run ends


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class Progress:
    """The grid's progress: counts, the running runs' last evaluated rounds and an ETA (a line)."""

    def __init__(self, total: int, done: int, todo: int, jobs: int | None) -> None:
        self.total, self.done, self.todo = total, done, todo
        self.jobs = jobs  # runs at once, for the ETA; None: the runs running now (a Slurm queue decides)
        self.failed = self.skipped = 0
        self.times: list[float] = []  # seconds each run of this sweep took
        self.running: dict[str, int] = {}  # output_dir -> rounds of its config
        self._lock = threading.Lock()

    def start(self, cfg: Config) -> None:
        with self._lock:
            self.running[cfg.output_dir] = cfg.rounds

    def end(self, out: str, outcome: str, seconds: float | None = None) -> None:
        """A run ended: 'done' (after ``seconds``), 'failed' or 'skipped'."""
        with self._lock:
            self.running.pop(out, None)
            self.todo -= 1
            if outcome == "done":
                self.done += 1
                if seconds is not None:
                    self.times.append(seconds)
            elif outcome == "failed":
                self.failed += 1
            else:
                self.skipped += 1

    def line(self) -> str:
        with self._lock:  # a run handed to a launcher runs once its process holds the run's lock: a
            # process pool marks one queued run more than it has workers as running
            running = {out: total for out, total in self.running.items() if _holds_lock(out)}
            parts = [f"{self.done}/{self.total} finished", f"{len(running)} running"]
            if self.failed:
                parts.append(f"{self.failed} failed")
            if self.skipped:
                parts.append(f"{self.skipped} skipped")
            if not self.todo:
                eta = ""
            elif self.times:
                at_once = min(self.jobs or max(1, len(running)), self.todo)
                left = self.todo * sum(self.times) / len(self.times) / at_once
                eta = f"; ETA {_minutes(left)}"
            else:
                eta = "; ETA after the first run ends"
        rounds = ", ".join(
            f"{clip(Path(out).name, 40)} round {_last_round(out)}/{total}" for out, total in running.items()
        )
        return f"sweep: {', '.join(parts)}{f' ({rounds})' if rounds else ''}{eta}"


def _holds_lock(out: str) -> bool:
    """Whether a process holds the run's lock now (its pid is in ``.lock``, emptied on release)."""
    try:
        return RunFiles(out).lock_file.stat().st_size > 0
    except OSError:
        return False


def _last_round(out: str) -> int:
    """The last evaluated round in a running run's metrics.jsonl (0 before the first)."""
    try:
        with open(RunFiles(out).metrics, "rb") as fh:
            lines = fh.read().splitlines()
        return int(json.loads(lines[-1])["round"]) if lines else 0
    except (OSError, ValueError, KeyError, TypeError):  # a line being written, or no file yet
        return 0


@contextlib.contextmanager
def heartbeat(progress: Progress, every: float) -> Iterator[None]:
    """Print the progress line every ``every`` seconds during the block (a daemon thread)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            print(progress.line(), flush=True)

    thread = threading.Thread(target=beat, name="fedpcd-sweep-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
