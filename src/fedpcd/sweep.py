"""``fedpcd sweep``: a grid of runs from one file, resumable.

A sweep file is a normal config plus a top-level ``sweep:`` mapping of (dotted) keys to lists of values;
a value that is a mapping replaces that whole section. The grid is the product of the lists, and each run
goes to ``<output_dir>/<name>``, its name built from the swept values::

    output_dir: runs/repro/fmnist
    sweep:
      partition: [{scheme: pathological, classes_per_client: 2}, {scheme: dirichlet, beta: 0.1}]
      algorithm: [{name: fedavg}, {name: fedprox, mu: 0.01}]
      seed: [0, 1, 2]

A grid holds at most ``MAX_RUNS`` (100,000) runs: a larger one is refused in one line, counted before any
run is built.

The reserved axis ``setting`` varies several keys together: each value is a mapping of (dotted) keys to
values, applied at once, with an optional ``label`` that names it in the folder (e.g. P5C2 needs both
``clients: 5`` and its partition)::

    sweep:
      setting:
        - {label: P10C2, partition: {scheme: pathological, classes_per_client: 2}}
        - {label: P5C2, clients: 5, partition: {scheme: pathological, classes_per_client: 2}}

Every sweep keeps ``<output_dir>/index.sqlite``, one row per run of the grid (its config and summary as JSON
plus the headline numbers as columns), updated as runs finish; see ``write_index``. With ``tracking.loggers``,
each run is its own tracker run, grouped under the name of the sweep's output_dir (``tracking.group`` unless
the file sets it).

Running the sweep again skips finished runs and resumes interrupted ones from their checkpoints. A run that
fails (an exception, e.g. a diverging method) is reported and the sweep goes on with the others; so is a run
that cannot be run now (held by another fedpcd process, started without a checkpoint, or with a corrupt
summary.json). A run whose worker process died (killed, or a plugin ended it) runs once more on a fresh
worker, then counts as failed. The sweep succeeds (exit code 0) when every run of its grid is finished at its
end, whoever finished it; otherwise it ends with one line counting the runs that failed, were skipped and
finished. While it runs, a progress line (runs finished, running with their last evaluated round, failed, and
an ETA from the wall times of the runs finished so far) is printed as each run ends and every
``PROGRESS_EVERY`` seconds between.

Where the runs execute is the launcher's business (``fedpcd.launchers``: this process, a pool of worker
processes, Ray, Slurm): it only runs ``_run_one``; everything above is the same for each.

fedpcd never writes through a symbolic link in a sweep folder: an ``index.sqlite`` (or its SQLite side
files) or a run folder that is a link is refused with one line before anything runs, as links in a run
folder are (``engine/rundir.py``); the sweep's ``output_dir`` itself is the user's path and may be a link.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
import re
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpcd.config import Config
from fedpcd.config_input import merge_dicts, parse_overrides, read_yaml
from fedpcd.errors import RunInUseError, UserError, clip
from fedpcd.labels import warn_overrides
from fedpcd.resolve import config_from_dict
from fedpcd.run_format import ALLOW_DIRTY, GA, PA_SPLIT, RunFiles, code_version
from fedpcd.utils import make_folder, path_error, show_path, show_text

if TYPE_CHECKING:
    from fedpcd.launchers import Launcher

MAIN_KEYS = ("name", "scheme")
PROGRESS_EVERY = 60.0  # seconds between two progress lines while no run ends
SETTING = "setting"  # the axis whose values are mappings of several keys set together
MAX_RUNS = 100_000  # runs of one sweep's grid (counted before any is built)


def _label(key: str, value: Any) -> str:
    if key == SETTING:
        return str(value["label"]) if "label" in value else _plain(value)
    leaf = key.split(".")[-1]
    if isinstance(value, dict):
        main = next((str(value[k]) for k in MAIN_KEYS if k in value), leaf)
        rest = "".join(f"-{k}{_plain(v)}" for k, v in value.items() if k not in MAIN_KEYS)
        return main + rest
    return f"{leaf}{_plain(value)}"


def _plain(value: Any) -> str:
    if isinstance(value, dict):
        return "-".join(f"{k}{_plain(v)}" for k, v in value.items())
    return str(value)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = copy.deepcopy(value)


def expand_sweep(path: str | Path, overrides: list[str] | None = None) -> list[Config]:
    """The resolved configs of a sweep file's grid (overrides apply to every run)."""
    raw = read_yaml(path)
    grid = raw.pop("sweep", None)
    if not isinstance(grid, dict) or not grid:
        raise UserError(
            f"{path} has no 'sweep:' mapping of keys to lists of values; see 'fedpcd sweep --help'"
        )
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"sweep key {key!r} in {path} must map to a non-empty list of values")
        if key == SETTING and not all(isinstance(v, dict) for v in values):
            raise UserError(f"every value of the sweep axis 'setting' in {path} must be a mapping of keys")
    count = math.prod(len(values) for values in grid.values())
    if count > MAX_RUNS:
        axes = " x ".join(f"{len(values)} {clip(str(key), 40)}" for key, values in grid.items())
        raise UserError(
            f"the sweep in {show_path(path)} has {count:,} runs ({axes}), over the limit of {MAX_RUNS:,}; "
            "split it into several sweep files"
        )
    extra = parse_overrides(overrides or [])
    base = merge_dicts(raw, extra)
    root = Path(base.get("output_dir", "runs/sweep"))
    configs, names, said = [], set(), set()
    for combo in itertools.product(*grid.values()):
        run = copy.deepcopy(base)
        for key, value in zip(grid, combo, strict=True):
            if key == SETTING:
                for sub_key, sub_value in value.items():
                    if sub_key != "label":
                        _set(run, sub_key, sub_value)
            else:
                _set(run, key, value)
        name = re.sub(
            r"[^A-Za-z0-9.=_-]+", "", "_".join(_label(k, v) for k, v in zip(grid, combo, strict=True))
        )
        if name.strip(".") == "":  # "", "." or "..": not a folder of its own below output_dir
            raise UserError(
                f"a run of the sweep in {path} would get the folder name {name!r}, not a folder below "
                f"{root}; give its setting a label of letters, digits, '=', '_' or '-'"
            )
        if name in names:
            raise UserError(f"two runs of the sweep in {path} would share the folder name {name!r}")
        names.add(name)
        run["output_dir"] = str(root / name)
        tracking = run.get("tracking")
        if isinstance(tracking, dict) and tracking.get("loggers"):  # its runs group as the sweep in trackers
            tracking.setdefault("group", (root.resolve().name or "sweep")[:128])
        configs.append(config_from_dict(run))
        warn_overrides(configs[-1].to_dict(), {"config file": run, "command line": extra}, said)
    return configs


def run_status(config: Config) -> str:
    """'done' (a readable summary.json), 'broken' (a summary.json that is not one: corrupt or cut short),
    'resume' (started: a checkpoint, or only its config.yaml when it was stopped before its first checkpoint,
    which ``resume_run`` restarts from round 0), 'new', or 'stuck' (run files but no config.yaml: it cannot be
    resumed)."""
    run = RunFiles(config.output_dir)
    try:
        if run.summary.exists():
            return "done" if _summary(config) is not None else "broken"
        if run.checkpoint.exists() or run.config.is_file():
            return "resume"
        return "stuck" if run.metrics.exists() else "new"
    except OSError as exc:  # e.g. a folder on the way that cannot be searched
        raise path_error(run.path, exc, "read the run folder") from None


def _summary(config: Config) -> dict[str, Any] | None:
    """The run's summary.json as a dict; None where it is missing or is not a fedpcd summary."""
    from fedpcd.report import read_summary

    try:
        return read_summary(RunFiles(config.output_dir).summary)
    except UserError:
        return None


SKIP_REASONS = {
    "stuck": "started but has no checkpoint; delete the folder to rerun it",
    "broken": "its summary.json is corrupt (not a fedpcd summary); delete the folder to rerun it",
}


def _run_one(config_data: dict[str, Any], resume: bool) -> tuple[str, float | None, float]:
    """Run or resume one run of the grid: its folder, its summary's wall time (None: another process
    finished it meanwhile) and the seconds it took here (data loading included: what the ETA needs)."""
    from fedpcd.backends import resume_run, run_experiment
    from fedpcd.engine.rundir import refuse_link

    t0 = time.perf_counter()
    config = Config.model_validate(config_data)
    refuse_link(config.output_dir)  # again: a link may have been put there since the sweep started
    status = run_status(config)  # again: another sweep on the same folder may have started or finished it
    if status == "done":
        return config.output_dir, None, time.perf_counter() - t0
    if status in SKIP_REASONS:
        raise UserError(f"{config.output_dir} {SKIP_REASONS[status]}")
    summary = (
        resume_run(config.output_dir, progress=False)
        if resume or status == "resume"
        else run_experiment(config, progress=False)
    )
    return config.output_dir, summary["wall_s"], time.perf_counter() - t0


def check_sweep_links(index: Path, configs: list[Config]) -> None:
    """Refuse a sweep folder where what fedpcd writes (the index, its SQLite side files, the run folders) is
    a symbolic link, dangling or not: writing there would change what it points to."""
    from fedpcd.engine.rundir import refuse_link

    for suffix in ("", *SQLITE_SIDE_FILES):
        refuse_link(index.with_name(index.name + suffix))
    for cfg in configs:
        refuse_link(cfg.output_dir)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class _Progress:
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
def _heartbeat(progress: _Progress, every: float) -> Iterator[None]:
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


def _names(dirs: list[str], root: Path, limit: int = 3) -> str:
    """A few run folders by their name in the sweep ('a, b, c and 4 more')."""
    names = [Path(d).name if Path(d).parent == root else d for d in dirs]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(clip(n, 60) for n in names[:limit]) + more


ARCHIVE = ("docs", "results", "runs")  # the repository's archived runs: made by committed code only


def check_archive_clean(root: Path, allow_dirty: bool) -> None:
    """Refuse (one UserError line) a sweep folder ``root`` inside the archive (``ARCHIVE``) while the running
    checkout has uncommitted changes, unless ``allow_dirty``, which its runs then record."""
    parts = Path(os.path.abspath(root)).parts
    inside = any(parts[i : i + len(ARCHIVE)] == ARCHIVE for i in range(len(parts)))
    if not inside or not code_version().get("dirty"):
        return
    if not allow_dirty:
        raise UserError(
            f"{show_path(root)} is in the archive of runs ({'/'.join(ARCHIVE)}) and src/fedpcd has "
            "uncommitted changes; commit them first, or give --allow-dirty (the runs record it)"
        )
    os.environ[ALLOW_DIRTY] = "1"  # read by code_version here and in the workers this process starts


def run_sweep(
    path: str | Path,
    overrides: list[str] | None = None,
    jobs: int | None = None,
    launcher: str = "local",
    address: str | None = None,
    slurm: list[str] | None = None,
    allow_dirty: bool = False,
) -> list[Config]:
    """Run every unfinished run of the grid; returns the grid's configs.

    ``launcher`` says where (``fedpcd.launchers``): ``local`` runs them in this process, or in ``jobs``
    worker processes; ``ray`` as Ray tasks on the cluster at ``address`` (default: one started here);
    ``slurm`` as Slurm jobs (``slurm``: its ``KEY=VALUE`` options); ``jobs`` caps the runs at once.
    A failing run is reported on stderr and left as it is; the others go on; a run that cannot run now (held
    by another fedpcd process, 'stuck' or 'broken', see ``run_status``) is skipped with a line saying why.
    Returns when every run of the grid is finished at the end (whoever finished it); otherwise raises one
    UserError counting the failed, skipped and finished runs, so the command exits 2 and a rerun retries
    (resumes) them. The index (``write_index``) is written before any run: an output_dir that cannot hold it
    stops the sweep at once. A sweep into the archive (``ARCHIVE``) refuses a checkout with uncommitted
    changes to ``src/fedpcd`` unless ``allow_dirty`` (then its runs record it: ``code_version``).
    """
    from fedpcd.launchers import make_launcher

    configs = expand_sweep(path, overrides)
    check_archive_clean(Path(configs[0].output_dir).parent, allow_dirty)
    index = index_path(path, overrides)
    check_sweep_links(index, configs)
    runner = make_launcher(launcher, jobs, address, slurm, index.parent)
    todo, skipped = [], []
    for cfg in configs:
        status = run_status(cfg)
        if status in SKIP_REASONS:
            skipped.append(cfg.output_dir)
            print(f"skip {show_text(cfg.output_dir)}: {SKIP_REASONS[status]}")
        elif status != "done":
            todo.append((cfg, status == "resume"))
    print(f"sweep: {len(configs)} runs, {len(configs) - len(todo)} finished or skipped, {len(todo)} to run")
    write_index(index, configs)
    failed: list[str] = []
    index_errors: list[str] = []
    progress = _Progress(len(configs), len(configs) - len(todo) - len(skipped), len(todo), 1)

    def finished(out: str, outcome: Callable[[], tuple[str, float | None, float]]) -> None:
        try:
            _, wall, seconds = outcome()
        except RunInUseError as exc:  # another sweep on the same folder runs it: not a failure of the run
            skipped.append(out)
            progress.end(out, "skipped")
            print(f"skip {show_text(clip(str(exc), 300))}", flush=True)
        except Exception as exc:  # one run's failure must not stop the others
            failed.append(out)
            progress.end(out, "failed")
            first = str(exc).splitlines()[0] if str(exc) else ""
            line = f"FAILED {out}: {type(exc).__name__}: {clip(first, 300)}"
            print(show_text(line), file=sys.stderr, flush=True)
        else:
            progress.end(out, "done", seconds if wall is not None else None)
            note = f"{wall:.0f} s" if wall is not None else "finished meanwhile by another process"
            print(f"done {show_text(out)} ({note})", flush=True)
        print(progress.line(), flush=True)
        try:
            write_index(index, [c for c in configs if c.output_dir == out])
        except UserError as exc:  # the runs matter more than their index (said at the end; rebuilt later)
            index_errors.append(str(exc))

    if runner is None or not todo:
        with _heartbeat(progress, PROGRESS_EVERY):
            for cfg, resume in todo:
                progress.start(cfg)
                finished(cfg.output_dir, lambda c=cfg, r=resume: _run_one(c.to_dict(), r))
    else:
        with runner:
            progress.jobs = runner.parallel
            print(runner.describe(), flush=True)
            with _heartbeat(progress, PROGRESS_EVERY):
                _run_launched(todo, runner, progress, finished)
    statuses = {c.output_dir: run_status(c) for c in configs}
    if index_errors:  # bring the index up to date with the runs, if it can be written now
        with contextlib.suppress(UserError):
            write_index(index, configs)
            index_errors.clear()
    unfinished = [c.output_dir for c in configs if statuses[c.output_dir] != "done"]
    if not unfinished and not index_errors:
        print(f"sweep: all {len(configs)} runs finished")
        return configs
    if not unfinished:
        raise UserError(f"sweep: all {len(configs)} runs finished, but {index_errors[-1]}")
    root = Path(configs[0].output_dir).parent
    failed = [d for d in dict.fromkeys(failed) if d in unfinished]
    skipped = [d for d in dict.fromkeys(skipped) if d in unfinished and d not in failed]
    other = [d for d in unfinished if d not in failed and d not in skipped]  # changed by another process
    groups = [
        (dirs, what)
        for dirs, what in ((failed, "failed"), (skipped, "skipped"), (other, "unfinished"))
        if dirs
    ]
    counts = ", ".join(f"{len(dirs)} {what}" for dirs, what in groups[1:])
    listed = "; ".join(f"{what}: {_names(dirs, root)}" for dirs, what in groups)
    raise UserError(
        f"sweep: {len(groups[0][0])} of {len(configs)} runs {groups[0][1]}, {counts + ', ' if counts else ''}"
        f"{len(configs) - len(unfinished)} finished ({listed}); the lines above say why; rerun the same "
        "command to retry"
    )


def _run_launched(
    todo: list[tuple[Config, bool]],
    launcher: Launcher,
    progress: _Progress,
    finished: Callable[[str, Callable[[], tuple[str, float | None, float]]], None],
) -> None:
    """Run ``todo`` through ``launcher``, ``launcher.slots`` at a time (in order), calling ``finished`` as
    each ends; a run counts as running once the launcher says it started. A run whose process died
    (``launcher.lost``: a kill, a plugin ending the process) runs once more, on a fresh worker (resuming
    from its checkpoint); lost again, it is a failed run."""
    queue = list(reversed(todo))
    active: dict[Any, tuple[Config, bool]] = {}
    retried: set[str] = set()
    while queue or active:
        while queue and (launcher.slots is None or len(active) < launcher.slots):
            cfg, resume = queue.pop()
            active[launcher.submit(_run_one, cfg.to_dict(), resume)] = (cfg, resume)
        ended, running = launcher.wait(list(active), timeout=1.0)
        for handle in running:
            progress.start(active[handle][0])
        for handle in ended:
            cfg, resume = active.pop(handle)
            if launcher.lost(handle) and cfg.output_dir not in retried:
                retried.add(cfg.output_dir)
                print(f"retry {show_text(cfg.output_dir)}: its worker process died; once more", flush=True)
                queue.append((cfg, resume))
                continue
            finished(cfg.output_dir, lambda h=handle: launcher.result(h))


# ----- the results index ----------------------------------------------------------------------------------
# SQLite rather than Parquet: it is in Python's standard library (no pyarrow), transactional (a sweep killed
# while writing never leaves a torn index), updated row by row as runs finish without rewriting the file, and
# read by the sqlite3 shell, pandas.read_sql or any SQL client.

INDEX_FILE = "index.sqlite"  # in the sweep's output_dir, next to the runs' folders
SQLITE_SIDE_FILES = ("-journal", "-wal", "-shm")  # what SQLite writes beside a database
# the headline numbers as columns <when>_<name>, e.g. final_ga: name -> metric (names kept from before the
# metric table; users query them), when: the summary's "final" (last evaluated round) or "best"
INDEX_METRICS = {"ga": GA, "pa": PA_SPLIT}
INDEX_WHEN = ("final", "best")
INDEX_COLUMNS = {
    "output_dir": "TEXT PRIMARY KEY",
    "status": "TEXT",  # done | broken | resume | stuck | new (run_status)
    "algorithm": "TEXT",
    "dataset": "TEXT",
    "partition": "TEXT",  # the partition section as JSON
    "clients": "INTEGER",
    "participation": "REAL",
    "seed": "INTEGER",
    "rounds": "INTEGER",
    **{f"{when}_{name}": "REAL" for when in INDEX_WHEN for name in INDEX_METRICS},
    "wall_s": "REAL",
    "config": "TEXT",  # the resolved config as JSON
    "summary": "TEXT",  # summary.json as written (NULL until the run is done)
}


def index_path(path: str | Path, overrides: list[str] | None = None) -> Path:
    """``<output_dir>/index.sqlite`` of a sweep file."""
    raw = merge_dicts(read_yaml(path), parse_overrides(overrides or []))
    return Path(raw.get("output_dir", "runs/sweep")) / INDEX_FILE


def index_row(config: Config) -> dict[str, Any]:
    """One index row: the run's status, config and (once done) its summary's headline numbers."""
    status = run_status(config)
    summary = _summary(config) if status == "done" else None
    parts = {when: (summary or {}).get(when) for when in INDEX_WHEN}
    parts = {when: part if isinstance(part, dict) else {} for when, part in parts.items()}
    return {
        "output_dir": config.output_dir,
        "status": status,
        "algorithm": config.algorithm.name,
        "dataset": config.dataset.name,
        "partition": json.dumps(config.to_dict()["partition"], sort_keys=True),
        "clients": config.clients,
        "participation": config.participation,
        "seed": config.seed,
        "rounds": config.rounds,
        **{
            f"{when}_{name}": parts[when].get(metric.key)
            for when in INDEX_WHEN
            for name, metric in INDEX_METRICS.items()
        },
        "wall_s": (summary or {}).get("wall_s"),
        "config": json.dumps(config.to_dict(), sort_keys=True),
        "summary": json.dumps(summary, sort_keys=True) if summary is not None else None,
    }


def write_index(path: Path, configs: list[Config]) -> None:
    """Insert or replace the rows of ``configs`` in the SQLite index at ``path`` (one transaction). A folder
    that cannot hold it, or a file there that is not such an index (corrupt, read-only), is one line naming
    it: the index only mirrors the run folders, so deleting it loses nothing."""
    from fedpcd.engine.rundir import create_regular_file, refuse_link

    make_folder(path.parent, target=path)
    for suffix in SQLITE_SIDE_FILES:  # SQLite opens these itself: none may be a link
        refuse_link(path.with_name(path.name + suffix))
    create_regular_file(path, "the sweep index ")  # never through a link (dangling or not), nor a FIFO
    rows = [index_row(c) for c in configs]
    columns = ", ".join(f"{name} {kind}" for name, kind in INDEX_COLUMNS.items())
    marks = ", ".join(f":{name}" for name in INDEX_COLUMNS)
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as db, db:
            db.execute(f"CREATE TABLE IF NOT EXISTS runs ({columns})")
            db.executemany(f"INSERT OR REPLACE INTO runs VALUES ({marks})", rows)
    except sqlite3.Error as exc:
        cause = clip(str(exc))
        if "unable to open" in cause:  # SQLite does not say why: ask the system
            try:
                os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o666))
            except OSError as why:
                cause = why.strerror or cause
        damaged = not isinstance(exc, sqlite3.OperationalError) or "columns" in cause  # not a lock or mode
        hint = "; delete it: the next sweep writes it anew from the run folders" if damaged else ""
        raise UserError(f"cannot write the sweep index {show_path(path)}: {cause}{hint}") from None
    except OSError as exc:
        raise path_error(path, exc, "write the sweep index") from None
