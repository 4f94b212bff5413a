"""What a run directory holds, named once (docs/design.md sections 5 and 6): its files and its metrics.

[`RunFiles`][fedpcd.run_format.RunFiles] is the only code that knows the run directory's file names; the
engine's `fedpcd.engine.rundir.RunDir` (writing, locking, checkpoints) extends it, and the readers of runs
(`fedpcd report`, `fedpcd sweep`, the CLI's summary table) use it directly. `METRICS` is the one table of
the accuracies every consumer shows, each a [`Metric`][fedpcd.run_format.Metric]: their keys in
`metrics.jsonl` and `summary.json` (kept as archived runs have them), their labels and what each measures.

No torch here: the report, the sweep and `fedpcd --help` start without loading it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpcd._version import __version__
from fedpcd.errors import UserError


class RunFiles:
    """The paths of one run directory's files (nothing is read or written here).

    Args:
        path: The run directory.
    """

    _CONFIG = "config.yaml"
    _PARTITION = "partition.json"
    _METRICS = "metrics.jsonl"
    _SUMMARY = "summary.json"
    _STOPPED = "stopped.json"
    _CHECKPOINT_DIR = "checkpoint"
    _CHECKPOINT = "state.pt"
    _CLIENT_STATES = "client_states"
    _LOCK = ".lock"
    _RUN_LOG = "run.log"
    _TRACKERS = "trackers.json"
    _METRICS_CSV = "metrics.csv"
    _TENSORBOARD = "tensorboard"
    _WANDB = "wandb"
    _MLFLOW_DB = "mlflow.db"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def config(self) -> Path:
        """``config.yaml``: the resolved config (every key, defaults filled)."""
        return self.path / self._CONFIG

    @property
    def partition(self) -> Path:
        """``partition.json``: every client's train and local test counts per class."""
        return self.path / self._PARTITION

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``: one record per evaluated round."""
        return self.path / self._METRICS

    @property
    def summary(self) -> Path:
        """``summary.json``: written when the run finishes."""
        return self.path / self._SUMMARY

    @property
    def stopped(self) -> Path:
        """``stopped.json``: the round and error that stopped the run before its last round (removed when the
        run goes on)."""
        return self.path / self._STOPPED

    @property
    def checkpoint_dir(self) -> Path:
        """The folder of the checkpoint."""
        return self.path / self._CHECKPOINT_DIR

    @property
    def checkpoint(self) -> Path:
        """``checkpoint/state.pt``: what a resume needs."""
        return self.checkpoint_dir / self._CHECKPOINT

    @property
    def client_states(self) -> Path:
        """``client_states/``: one file per client with ``engine.client_state: disk``."""
        return self.path / self._CLIENT_STATES

    @property
    def lock_file(self) -> Path:
        """``.lock``: the advisory lock of the process running the run."""
        return self.path / self._LOCK

    @property
    def run_log(self) -> Path:
        """``run.log``: the log of every process that ran the run, appended to (``fedpcd.logs.run_log``)."""
        return self.path / self._RUN_LOG

    @property
    def trackers(self) -> Path:
        """``trackers.json``: the experiment trackers' run ids and the last round each logged
        (``fedpcd.trackers``)."""
        return self.path / self._TRACKERS

    @property
    def metrics_csv(self) -> Path:
        """``metrics.csv``: the metrics.jsonl records as a table (``tracking.loggers: [csv]``)."""
        return self.path / self._METRICS_CSV

    @property
    def tensorboard(self) -> Path:
        """``tensorboard/``: TensorBoard's event files (``tracking.loggers: [tensorboard]``)."""
        return self.path / self._TENSORBOARD

    @property
    def wandb(self) -> Path:
        """``wandb/``: the Weights & Biases run files (``tracking.loggers: [wandb]``)."""
        return self.path / self._WANDB

    @property
    def mlflow_db(self) -> Path:
        """``mlflow.db``: the default MLflow store, SQLite (``tracking.loggers: [mlflow]``)."""
        return self.path / self._MLFLOW_DB

    def markers(self) -> tuple[Path, ...]:
        """The files whose presence means the folder holds (part of) a run."""
        return (self.metrics, self.summary, self.checkpoint)

    def written(self) -> tuple[Path, ...]:
        """Every file and folder a run writes (but the lock and run.log, which a run that stopped before its
        first files leaves too)."""
        return (
            self.config,
            self.partition,
            self.metrics,
            self.summary,
            self.stopped,
            self.checkpoint_dir,
            self.client_states,
            self.trackers,
            self.metrics_csv,
            self.tensorboard,
            self.wandb,
            self.mlflow_db,
        )

    def entries(self) -> tuple[Path, ...]:
        """Every entry a run writes through, lock and run.log included: none may be a symbolic link."""
        return (self.lock_file, self.run_log, *self.written(), self.checkpoint)

    def holds_run(self) -> bool:
        """Whether the folder holds (part of) a run: metrics, a summary or a checkpoint."""
        return any(p.exists() for p in self.markers())

    def check_resumable(self) -> None:
        """Refuse a folder without config.yaml, saying why it cannot be resumed (reads only which files exist:
        ``fedpcd run --resume`` tells it before importing torch)."""
        if self.config.is_file():
            return
        if self.checkpoint.exists():
            raise UserError(f"{self.path} has a checkpoint but no config.yaml: it cannot be resumed")
        if self.lock_file.exists() and not self.holds_run():  # killed while it started: nothing to resume yet
            raise UserError(
                f"{self.path} was stopped before its run started (no config.yaml yet): start it again with "
                "the same fedpcd run command (same config and output_dir)"
            )
        raise UserError(
            f"no checkpoint in {self.path}: nothing to resume (not a fedpcd run directory: no config.yaml)"
        )

    @classmethod
    def finished_below(cls, root: str | Path) -> list[RunFiles]:
        """Every finished run below a folder: the run folders with a summary.

        Args:
            root: The folder to search, at any depth.

        Returns:
            Their files, in the sorted order of their summary paths.
        """
        return [cls(p.parent) for p in sorted(Path(root).rglob(cls._SUMMARY))]

    @classmethod
    def started_below(cls, root: str | Path) -> list[RunFiles]:
        """Every started run below a folder: the run folders with a config.yaml, finished or not.

        Args:
            root: The folder to search, at any depth.

        Returns:
            Their files, in no particular order.
        """
        return [cls(p.parent) for p in Path(root).rglob(cls._CONFIG)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


# ----- the metrics ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One accuracy of the records.

    Attributes:
        key: Its key in metrics.jsonl and summary.json (`"global_acc"`).
        label: Its label in tables and plots (`"GA"`).
        description: What it measures, in a few words.
    """

    key: str
    label: str
    description: str


GA = Metric("global_acc", "GA", "the global model on the full, balanced test set")
GA_BALANCED = Metric(
    "global_balanced_acc",
    "GA-bal",
    "the global model's balanced accuracy: the mean per-class recall over the test set's classes",
)
PA_SPLIT = Metric(
    "personal_acc",
    "PA-split",
    "each client's personal model on its own local test split (its classes, in its proportions)",
)
PA_L = Metric(
    "pa_l",
    "PA-L",
    "personal models on the full test set, samples weighted by the client's train label distribution "
    "(FedNH PM(L))",
)
PA_V = Metric(
    "pa_v",
    "PA-V",
    "personal models on the full test set, the samples of the client's classes (FedNH PM(V))",
)
PA_G = Metric("pa_global", "PA-G", "personal models on the full test set, every class counted")

# how a personal metric is reported over the participants: engine.metrics.summarize's statistic -> key suffix
STATISTICS = {"mean": "", "weighted": "_weighted", "worst10": "_worst10"}
PA_WORST10 = Metric(
    PA_SPLIT.key + STATISTICS["worst10"], "PA worst10%", "PA-split of the worst 10% of clients"
)

METRICS = (GA, PA_SPLIT, PA_L, PA_V, PA_G, PA_WORST10)  # the table (the summary tables of run and demo)
PERSONAL = (PA_SPLIT, PA_L, PA_V, PA_G)  # per client (each participant's), then over the participants
REPORTED = (GA, *PERSONAL)  # the columns of `fedpcd report`
HEADLINE = (GA, PA_SPLIT)  # the curves, paired differences, progress bars and the Flower log
ACCURACY_KEYS = (
    GA.key,
    GA_BALANCED.key,
    *(m.key + suffix for m in PERSONAL for suffix in STATISTICS.values()),
)
CLIENT_PA_SPLIT = "client_pa_split"  # a record's PA-split of each kept participant, in the order of "clients"
# the class-mean angles in degrees (``geometry: true``: the last record; ``fedpcd.engine.metrics``) -> label:
# the global model over all classes; the personal models over the classes their clients hold / lack
ANGLES = {"angle_all": "∠all°", "angle_held": "∠held°", "angle_missing": "∠missing°"}


def headline(record: dict[str, Any]) -> dict[str, str]:
    """The headline metrics (GA, PA-split) of one round, for a progress line or a log.

    Args:
        record: One record of metrics.jsonl.

    Returns:
        `{label: value}`, each value with 3 decimals, "-" when the record has none.
    """
    return {m.label: "-" if record.get(m.key) is None else f"{record[m.key]:.3f}" for m in HEADLINE}


def headline_text(record: dict[str, Any]) -> str:
    """[`headline`][fedpcd.run_format.headline] as one line of log text.

    Args:
        record: One record of metrics.jsonl.

    Returns:
        `GA=0.512 PA-split=0.801`, say.
    """
    return " ".join(f"{label}={value}" for label, value in headline(record).items())


# The results-compatibility number: raised whenever a change to fedpcd alters the numbers of any run for the
# same config on the same machine (a refactor that keeps them bitwise keeps it). Two runs whose summaries
# name different numbers, or different commits with either one unknown, were not made by one code version.
RESULTS_VERSION = 1
CODE = "code"  # summary.json's record of the code that made the run (:func:`code_version`)


ALLOW_DIRTY = (
    "FEDPCD_ALLOW_DIRTY"  # set to 1 (``fedpcd sweep --allow-dirty``): the runs record that they were let
)


def _git(here: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(here), *args], capture_output=True, timeout=10)


def diff_hash(here: Path) -> str | None:
    """SHA-256 (hex) of the uncommitted changes to the checkout's folder ``here``: its ``git diff HEAD``,
    then each untracked (not ignored) file's path and content; None where git cannot tell, ``""`` for
    none.

    Args:
        here: A folder of a git checkout (the package's own).
    """
    diff = _git(here, "diff", "HEAD", "--binary", "--", ".")
    untracked = _git(here, "ls-files", "--others", "--exclude-standard", "-z", "--", ".")
    if diff.returncode != 0 or untracked.returncode != 0:
        return None
    names = sorted(n for n in untracked.stdout.decode("utf-8", "surrogateescape").split("\0") if n)
    if not diff.stdout and not names:
        return ""
    digest = hashlib.sha256(diff.stdout)
    for name in names:
        digest.update(b"\0" + name.encode("utf-8", "surrogateescape") + b"\0")
        with contextlib.suppress(OSError):  # removed meanwhile: its name still counts
            digest.update((here / name).read_bytes())
    return digest.hexdigest()


def code_version() -> dict[str, Any]:
    """The code that is running, as summary.json records it.

    Returns:
        `{"fedpcd": version, "commit": commit, "dirty": dirty, "diff": diff, "results": RESULTS_VERSION}`:
            the git commit of the checkout (None when installed from a wheel: then no `dirty` or `diff`),
            whether `src/fedpcd` has uncommitted changes (untracked files included) and the SHA-256 of them
            ([`diff_hash`][fedpcd.run_format.diff_hash]; None when clean), `"allow_dirty": true` where a sweep
            was let run on a dirty tree (`--allow-dirty`), and the results-compatibility number, raised
            whenever a change alters a run's numbers. Records written before the flag and the hash had
            `"<commit>+dirty"` instead (still read: [`code_key`][fedpcd.run_format.code_key]).
    """
    here = Path(__file__).resolve().parent
    record: dict[str, Any] = {"fedpcd": __version__, "commit": None}
    try:
        head = _git(here, "rev-parse", "HEAD")
        diff = diff_hash(here) if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        diff = None
    if diff is not None:
        record.update(commit=head.stdout.decode().strip(), dirty=diff != "", diff=diff or None)
        if diff and os.environ.get(ALLOW_DIRTY) == "1":
            record["allow_dirty"] = True
    return {**record, "results": RESULTS_VERSION}


def code_key(code: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """A code record as (results number, commit, dirty, diff hash), old records (`"<commit>+dirty"`, diff
    unknown) included; None for none.

    Args:
        code: A summary's code record, or None.
    """
    if code is None:
        return None
    commit = code.get("commit")
    dirty, diff = bool(code.get("dirty")), code.get("diff")
    if isinstance(commit, str) and commit.endswith("+dirty"):
        commit, dirty = commit.removesuffix("+dirty"), True
    return (code.get("results"), commit, dirty, diff)


def same_code(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two summaries' code records name one code version: the same results number, the same commit,
    and the same uncommitted changes (none, or the same diff hash; two old `"+dirty"` records of one commit,
    whose diff is unknown, count as the same, as they always did).

    Args:
        a: One summary's record (its `"code"` entry, [`code_version`][fedpcd.run_format.code_version]),
            or None for a run made before summaries had it.
        b: The other's.

    Returns:
        True for the same code version; False when they differ or either is None (known to match nothing).
    """
    key_a, key_b = code_key(a), code_key(b)
    return key_a is not None and key_a == key_b


def comparable(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str | None:
    """Why two runs' numbers may differ by code, in a few words; None when both come from the same clean
    commit with the same results number.

    Args:
        a: One summary's code record ([`code_version`][fedpcd.run_format.code_version]) or None.
        b: The other's.

    Returns:
        None, or "no commit recorded", "results numbers 1, 2", "runs from commits 5e1e752, 553556a"
            or "dirty tree".
    """
    key_a, key_b = code_key(a), code_key(b)
    if key_a is None or key_b is None or key_a[1] is None or key_b[1] is None:
        return "no commit recorded"
    if key_a[0] != key_b[0]:
        return f"results numbers {key_a[0]}, {key_b[0]}"
    if key_a[1] != key_b[1]:
        return f"runs from commits {key_a[1][:7]}, {key_b[1][:7]}"
    if key_a[2] or key_b[2]:
        return "dirty tree"
    return None
