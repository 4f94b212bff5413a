"""The run directory (docs/design.md section 5): creation, an advisory lock, metrics, checkpoints, summary.

:class:`RunDir` writes the files whose names :class:`fedpcd.run_format.RunFiles` holds: the resolved config,
the partition, ``metrics.jsonl`` (one object per evaluated round, strict JSON; ``engine/records.py``), the
summary and the checkpoint (``engine/checkpoint.py``). Every file but metrics.jsonl (appended a line at a
time) is written atomically (temp file, fsync, rename); the checkpoint also holds the metrics so far, so a
resume rewrites metrics.jsonl from it. A directory that already holds a run is never overwritten (resume it,
or choose another ``output_dir``), nor is a folder holding files fedpcd did not write for the same config, and
a run holds an advisory lock on its directory while it runs. Run-folder writes never follow a symbolic link
(a folder whose entries are links is refused), and a write that fails (a full disk) is one line naming the
file, with everything written before it kept.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fedpcd.config import Config
from fedpcd.config_identity import config_yaml, describe_changes
from fedpcd.engine.checkpoint import changes_since, load_checkpoint_file
from fedpcd.engine.records import record_line
from fedpcd.errors import RunInUseError, UserError, reraise_interrupt
from fedpcd.logs import LOGGER
from fedpcd.resolve import load_config
from fedpcd.run_format import CODE, RunFiles, code_version
from fedpcd.run_read import read_metrics
from fedpcd.run_schema import Summary, check
from fedpcd.utils import atomic_write, read_json, refuse_link

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no lock
    fcntl = None  # type: ignore[assignment]

_HELD: dict[Path, int] = {}  # run directories whose lock this process holds -> nesting depth


def write_error(path: str | Path, exc: OSError, what: str = "") -> UserError:
    """The one line for a failed write: the file (``what`` names it, e.g. 'the sweep index ') and the cause
    (e.g. 'No space left on device')."""
    return UserError(f"cannot write {what}{path}: {exc.strerror or exc}")


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an OSError of the block (writing ``path``) into :func:`write_error`."""
    try:
        yield
    except OSError as exc:
        raise write_error(path, exc) from None


def open_no_follow(path: str | Path, flags: int, mode: int = 0o666, what: str = "") -> int:
    """``os.open`` that never follows a symbolic link at ``path`` (a UserError); other failures as
    :func:`write_error` (``what``: the file's name for it)."""
    no_follow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    refuse_link(path)  # where O_NOFOLLOW is missing; with it, a link put there now is refused below
    try:
        return os.open(path, flags | no_follow, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path)
        raise write_error(path, exc, what) from None


def create_regular_file(path: str | Path, what: str = "") -> None:
    """Create ``path`` empty if it is missing, never through a symbolic link (a UserError), and refuse one
    that is not a regular file (a FIFO, a device, a folder): what a file opened by another library (SQLite)
    must be before that library opens it."""
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), what=what)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(
                f"cannot write {what}{path}: it is not a regular file; remove it, or set output_dir to a new "
                "folder"
            )
    finally:
        os.close(fd)


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


LOW_SPACE = 64 * 1024 * 1024  # free bytes under which a failed write is put down to a full disk


def save_tensors(obj: Any, fh: Any) -> None:
    """``torch.save`` into the open file ``fh``. torch's zip writer reports a short write (a full disk) as a
    RuntimeError ('[enforce fail at inline_container.cc]'): that becomes the OSError it stands for
    (No space left on device where the disk is nearly full, else Input/output error), so the caller's write
    fails with one line naming the file. A Ctrl-C or stop signal during the write stays what it is."""
    try:
        torch.save(obj, fh)
    except RuntimeError as exc:
        reraise_interrupt(exc)
        if "inline_container" not in str(exc) and "PytorchStreamWriter" not in str(exc):
            raise
        try:
            vfs = os.fstatvfs(fh.fileno())
            full = vfs.f_bavail * vfs.f_frsize < LOW_SPACE
        except OSError:
            full = False
        code = errno.ENOSPC if full else errno.EIO
        raise OSError(code, os.strerror(code)) from None


def os_advice(exc: OSError) -> str:
    """What to do about an OSError, by its cause (a clause to put after the message)."""
    advice = {
        errno.ENOSPC: "free space on that disk, or set output_dir to another one; what was written is kept",
        errno.EDQUOT: "free space within your quota, or set output_dir to another disk",
        errno.EACCES: "give this user access to it, or choose another path",
        errno.EPERM: "give this user access to it, or choose another path",
        errno.EROFS: "it is on a read-only file system: choose another path",
        errno.ENAMETOOLONG: "a name in the path is over 255 bytes (or the whole path too long): shorten it",
        errno.EMFILE: "too many open files: raise the limit (ulimit -n) or run fewer jobs at once",
        errno.ENFILE: "too many open files on this machine: close some programs or run fewer jobs at once",
        errno.ENOMEM: "out of memory: free memory, or make the run smaller",
    }
    return advice.get(exc.errno or 0, "check the path and the disk")


class RunDir(RunFiles):
    """One run's directory: creation, an advisory lock, metrics, checkpoints and the summary (its file names:
    :class:`RunFiles`)."""

    def _write(self, path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
        safe_write(path, write, mode, root=self.path)

    def _write_text(self, path: Path, text: str) -> None:
        self._write(path, lambda fh: fh.write(text))

    def check_links(self) -> None:
        """Refuse the folder if any of its run entries (lock, config, metrics, checkpoint, client states...)
        is a symbolic link: writing there would change the file or folder it points to."""
        for path in self.entries():
            refuse_link(path)

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
        present = [p.name for p in self.written() if os.path.lexists(p)]
        if config is None or not present:
            return
        path = self.config
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
            changes = changes_since(theirs, config)
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
        path = self.lock_file
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
                LOGGER.warning(
                    "cleared the stale lock of process %s in %s (it ended without releasing it)",
                    stale,
                    self.path,
                )
            with writing(path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._remove_stale_temps()
            _HELD[key] = 1
            try:
                yield
            finally:
                del _HELD[key]
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)  # released cleanly (still held while emptied)
        finally:
            os.close(fd)  # releases the lock

    def _remove_stale_temps(self) -> None:
        """Remove the temp files of atomic writes (``.config.yaml.*.tmp``, ...) that a process killed while
        writing left in the folder: with the lock held, no other process is writing them."""
        prefixes = tuple(f".{p.name}." for p in self.written() if p.parent == self.path)
        for temp in self.path.glob(".*.tmp"):  # atomic_write's temp files: .NAME.RANDOM.tmp
            if temp.name.startswith(prefixes):
                temp.unlink(missing_ok=True)

    def create(self, config: Config, partition_json: dict[str, Any], restart: bool = False) -> None:
        """Start a fresh run directory; refuse one that already holds a run (``restart``: rewrite the files
        of a run that was interrupted before its first checkpoint)."""
        if not restart:
            self.check_new(config)
        self.mkdir()
        partition = json.dumps(partition_json)
        if restart:  # the config.yaml the resume read is kept as written; a partition.json must be this run's
            self._check_own(self.partition, partition)
        if not (restart and self.config.is_file()):
            self._write_text(self.config, config_yaml(config))
        self._write_text(self.partition, partition)
        self._write_text(self.metrics, "")

    def _check_own(self, path: Path, text: str) -> None:
        """Refuse to replace ``path`` unless it is missing or holds ``text`` (what this run writes there)."""
        try:
            same = not os.path.lexists(path) or path.read_text(encoding="utf-8") == text
        except (OSError, UnicodeDecodeError):
            same = False
        if not same:
            raise UserError(
                f"{path} is not the one this run writes (another partition, or written by hand); fedpcd "
                "never overwrites files it did not write for this run: move it away, or set output_dir to a "
                "new folder"
            )

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
        return [
            r
            for r in read_metrics(self.metrics, resuming=True)
            if up_to_round is None or r["round"] <= up_to_round
        ]

    def rewrite(self, records: Sequence[dict[str, Any]]) -> None:
        """Replace metrics.jsonl with these records (atomically)."""
        self._write_text(self.metrics, "".join(record_line(r) for r in records))

    def truncate(self, up_to_round: int) -> list[dict[str, Any]]:
        """Drop records after the checkpointed round (they are recomputed identically on resume)."""
        rows = self.records(up_to_round)
        self.rewrite(rows)
        return rows

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write the checkpoint with every tensor moved to the CPU, so that it loads on any machine."""
        from fedpcd.engine.federation import to_device

        cpu_state = to_device(state, "cpu")
        self._write(self.checkpoint, lambda fh: save_tensors(cpu_state, fh), mode="wb")
        with writing(self.checkpoint_dir):
            for stale in self.checkpoint_dir.glob(f".{self.checkpoint.name}.*"):  # of killed writes
                stale.unlink(missing_ok=True)

    def load_checkpoint(self, map_location: torch.device | str | None = None) -> dict[str, Any]:
        """The last checkpoint; ``map_location`` puts its tensors on a device (e.g. the run's).

        Loaded with ``torch.load(weights_only=True)``: tensors and plain data only, never code, so a run
        directory from elsewhere cannot execute anything. Anything else is a UserError naming the file."""
        if not self.checkpoint.exists():
            raise UserError(f"no checkpoint in {self.path}: nothing to resume (expected {self.checkpoint})")
        return load_checkpoint_file(self.checkpoint, map_location)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write summary.json (atomically, strict JSON)."""
        self._write_text(self.summary, json.dumps(summary, indent=2, allow_nan=False))

    def discard_summary(self) -> None:
        """Remove summary.json (a finished run that goes on to more rounds: its summary is stale)."""
        with writing(self.summary):
            self.summary.unlink(missing_ok=True)

    def write_stopped(self, rnd: int, exc: Exception) -> None:
        """Record in stopped.json that round ``rnd`` raised ``exc``, with the code that ran (as summary.json
        records it), so a report can tell which commit a stopped run's verdict comes from (best effort: a
        failure to write it must not hide ``exc``)."""
        stopped = {"round": rnd, "error": type(exc).__name__, "message": str(exc), CODE: code_version()}
        with contextlib.suppress(OSError, UserError):
            self._write_text(self.stopped, json.dumps(stopped, indent=2))

    def discard_stopped(self) -> None:
        """Remove stopped.json (the run goes on)."""
        with writing(self.stopped):
            self.stopped.unlink(missing_ok=True)

    def read_summary(self) -> dict[str, Any]:
        """summary.json; a corrupt one is a UserError naming it."""
        path = self.summary
        return check(Summary, read_json(path, "summary file", links=False), f"summary file {path}")
