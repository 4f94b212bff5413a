"""Running a sweep's grid: which runs to run, each run handed to a launcher (``fedpcd.launchers``: this
process, a pool of worker processes, Ray, Slurm), what became of each (done, failed, skipped: one line each,
the progress line, its index row), and the closing line. A launcher only runs ``run_one``; everything else
here is the same for each."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fedpcd.config import Config
from fedpcd.errors import RunInUseError, UserError, clip
from fedpcd.run_format import ALLOW_DIRTY, code_version
from fedpcd.sweep.grid import expand_sweep
from fedpcd.sweep.index import SQLITE_SIDE_FILES, index_path, write_index
from fedpcd.sweep.progress import PROGRESS_EVERY, Progress, heartbeat
from fedpcd.sweep.status import SKIP_REASONS, run_status
from fedpcd.utils import refuse_link, show_path, show_text

if TYPE_CHECKING:
    from fedpcd.launchers import Launcher

RunOutcome = Callable[[], tuple[str, float | None, float]]  # a run's result (``run_one``'s), or its exception


def run_one(config_data: dict[str, Any], resume: bool) -> tuple[str, float | None, float]:
    """Run or resume one run of the grid: its folder, its summary's wall time (None: another process
    finished it meanwhile) and the seconds it took here (data loading included: what the ETA needs)."""
    from fedpcd.backends import resume_run, run_experiment

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

    for suffix in ("", *SQLITE_SIDE_FILES):
        refuse_link(index.with_name(index.name + suffix))
    for cfg in configs:
        refuse_link(cfg.output_dir)


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


JOB_BYTES = 1 << 30  # a sweep worker's memory: torch's runtime, its run's dataset (CIFAR's train set ~0.6 GB)


def auto_jobs(configs: list[Config]) -> tuple[int, str]:
    """``--jobs auto`` with the local launcher: (runs at once, why). Runs side by side keep every core busy
    where one run's worker pool would not (a short run keeps one process; a pool's processes wait for the
    round's slowest client and for the evaluation), so: as many as the usable cores hold, each run taking its
    ``engine.workers`` cores (``auto``: one, and the cores left to it), capped by the runs and the free memory
    (``JOB_BYTES`` a worker). One (this process, one run after another) for Flower runs, whose Ray takes the
    whole machine, and for runs on a GPU."""
    import psutil
    import torch

    from fedpcd.procs_guard import usable_cores

    if not configs:
        return 1, "no runs to do"
    if any(c.backend != "local" for c in configs):
        return 1, "Flower runs: each takes the machine's cores"
    if torch.cuda.is_available() and any(c.engine.device != "cpu" for c in configs):
        return 1, "runs on a GPU"
    cores = usable_cores()
    per_run = max(1 if c.engine.workers == "auto" else int(c.engine.workers) for c in configs)
    memory = int(psutil.virtual_memory().available // JOB_BYTES)
    limits = {
        cores // per_run: f"{cores} usable core{'s' * (cores > 1)}",
        len(configs): f"{len(configs)} run{'s' * (len(configs) > 1)} to do",
        memory: "memory",
    }
    jobs = max(1, min(limits))
    return jobs, limits.get(jobs, "memory")


def run_sweep(
    path: str | Path,
    overrides: list[str] | None = None,
    jobs: int | Literal["auto"] | None = None,
    launcher: str = "local",
    address: str | None = None,
    slurm: list[str] | None = None,
    allow_dirty: bool = False,
) -> list[Config]:
    """Run every unfinished run of the grid; returns the grid's configs.

    ``launcher`` says where (``fedpcd.launchers``): ``local`` runs them in this process, or in ``jobs``
    worker processes (None or ``auto``: as many as the machine holds, :func:`auto_jobs`); ``ray`` as
    Ray tasks on the cluster at ``address`` (default: one started here); ``slurm`` as Slurm jobs (``slurm``:
    its ``KEY=VALUE`` options); ``jobs`` caps the runs at once (None or ``auto``: no cap).
    A failing run is reported on stderr and left as it is; the others go on; a run that cannot run now (held
    by another fedpcd process, 'stuck' or 'broken', see ``run_status``) is skipped with a line saying why.
    Returns when every run of the grid is finished at the end (whoever finished it); otherwise raises one
    UserError counting the failed, skipped and finished runs, so the command exits 2 and a rerun retries
    (resumes) them. The index (``write_index``) is written before any run: an output_dir that cannot hold it
    stops the sweep at once. A sweep into the archive (``ARCHIVE``) refuses a checkout with uncommitted
    changes to ``src/fedpcd`` unless ``allow_dirty`` (then its runs record it: ``code_version``).
    """
    from fedpcd.launchers import LocalLauncher, make_launcher

    configs = expand_sweep(path, overrides)
    check_archive_clean(Path(configs[0].output_dir).parent, allow_dirty)
    index = index_path(path, overrides)
    check_sweep_links(index, configs)
    given = None if jobs == "auto" else jobs
    runner = make_launcher(launcher, given, address, slurm, index.parent)
    todo, skipped = _plan(configs)
    if launcher == "local" and given is None:
        at_once, why = auto_jobs([cfg for cfg, _ in todo])
        runner = LocalLauncher(at_once, why) if at_once > 1 else None
    write_index(index, configs)
    done = len(configs) - len(todo) - len(skipped)
    outcomes = _Outcomes(index, configs, skipped, Progress(len(configs), done, len(todo), 1))
    _execute(todo, runner, outcomes)
    _conclude(configs, outcomes)
    return configs


def _plan(configs: list[Config]) -> tuple[list[tuple[Config, bool]], list[str]]:
    """The runs to run (each with whether it resumes) and the folders skipped (``SKIP_REASONS``, a line
    each), then a line counting them."""
    todo, skipped = [], []
    for cfg in configs:
        status = run_status(cfg)
        if status in SKIP_REASONS:
            skipped.append(cfg.output_dir)
            print(f"skip {show_text(cfg.output_dir)}: {SKIP_REASONS[status]}")
        elif status != "done":
            todo.append((cfg, status == "resume"))
    print(f"sweep: {len(configs)} runs, {len(configs) - len(todo)} finished or skipped, {len(todo)} to run")
    return todo, skipped


class _Outcomes:
    """What became of the runs of this sweep: the failed and skipped folders, the index writes that failed,
    and the progress line; :meth:`record` is called as each run ends."""

    def __init__(self, index: Path, configs: list[Config], skipped: list[str], progress: Progress) -> None:
        self.index, self.configs, self.progress = index, configs, progress
        self.skipped = skipped
        self.failed: list[str] = []
        self.index_errors: list[str] = []

    def record(self, out: str, outcome: RunOutcome) -> None:
        """The run in ``out`` ended: a line saying how (``outcome()`` returns its result or raises its
        exception), the progress line, and its index row."""
        try:
            _, wall, seconds = outcome()
        except RunInUseError as exc:  # another sweep on the same folder runs it: not a failure of the run
            self.skipped.append(out)
            self.progress.end(out, "skipped")
            print(f"skip {show_text(clip(str(exc), 300))}", flush=True)
        except Exception as exc:  # one run's failure must not stop the others
            self.failed.append(out)
            self.progress.end(out, "failed")
            first = str(exc).splitlines()[0] if str(exc) else ""
            line = f"FAILED {out}: {type(exc).__name__}: {clip(first, 300)}"
            print(show_text(line), file=sys.stderr, flush=True)
        else:
            self.progress.end(out, "done", seconds if wall is not None else None)
            note = f"{wall:.0f} s" if wall is not None else "finished meanwhile by another process"
            print(f"done {show_text(out)} ({note})", flush=True)
        print(self.progress.line(), flush=True)
        try:
            write_index(self.index, [c for c in self.configs if c.output_dir == out])
        except UserError as exc:  # the runs matter more than their index (said at the end; rebuilt later)
            self.index_errors.append(str(exc))


def _execute(todo: list[tuple[Config, bool]], runner: Launcher | None, outcomes: _Outcomes) -> None:
    """Run ``todo``: one after another in this process without a launcher, else through ``runner``; the
    progress line printed every ``PROGRESS_EVERY`` seconds meanwhile."""
    from fedpcd.data.datasets import keep_datasets

    progress = outcomes.progress
    if runner is None or not todo:
        keep_datasets(True)  # the runs load their dataset once
        try:
            with heartbeat(progress, PROGRESS_EVERY):
                for cfg, resume in todo:
                    progress.start(cfg)
                    outcomes.record(cfg.output_dir, lambda c=cfg, r=resume: run_one(c.to_dict(), r))
        finally:
            keep_datasets(False)
        return
    with runner:
        progress.jobs = runner.parallel
        print(runner.describe(), flush=True)
        with heartbeat(progress, PROGRESS_EVERY):
            _run_launched(todo, runner, outcomes)


def _conclude(configs: list[Config], outcomes: _Outcomes) -> None:
    """Bring the index up to date and say how the sweep ended: a line when every run is finished, else a
    UserError counting the failed, skipped and otherwise unfinished runs, naming a few of each."""
    index, index_errors = outcomes.index, outcomes.index_errors
    statuses = {c.output_dir: run_status(c) for c in configs}
    if index_errors:  # bring the index up to date with the runs, if it can be written now
        with contextlib.suppress(UserError):
            write_index(index, configs)
            index_errors.clear()
    unfinished = [c.output_dir for c in configs if statuses[c.output_dir] != "done"]
    if not unfinished and not index_errors:
        print(f"sweep: all {len(configs)} runs finished")
        return
    if not unfinished:
        raise UserError(f"sweep: all {len(configs)} runs finished, but {index_errors[-1]}")
    root = Path(configs[0].output_dir).parent
    failed = [d for d in dict.fromkeys(outcomes.failed) if d in unfinished]
    skipped = [d for d in dict.fromkeys(outcomes.skipped) if d in unfinished and d not in failed]
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
    outcomes: _Outcomes,
) -> None:
    """Run ``todo`` through ``launcher``, ``launcher.slots`` at a time (in order), calling ``outcomes.record``
    as each ends; a run counts as running once the launcher says it started. A run whose process died
    (``launcher.lost``: a kill, a plugin ending the process) runs once more, on a fresh worker (resuming
    from its checkpoint); lost again, it is a failed run."""
    queue = list(reversed(todo))
    active: dict[Any, tuple[Config, bool]] = {}
    retried: set[str] = set()
    while queue or active:
        while queue and (launcher.slots is None or len(active) < launcher.slots):
            cfg, resume = queue.pop()
            active[launcher.submit(run_one, cfg.to_dict(), resume)] = (cfg, resume)
        ended, running = launcher.wait(list(active), timeout=1.0)
        for handle in running:
            outcomes.progress.start(active[handle][0])
        for handle in ended:
            cfg, resume = active.pop(handle)
            if launcher.lost(handle) and cfg.output_dir not in retried:
                retried.add(cfg.output_dir)
                print(f"retry {show_text(cfg.output_dir)}: its worker process died; once more", flush=True)
                queue.append((cfg, resume))
                continue
            outcomes.record(cfg.output_dir, lambda h=handle: launcher.result(h))
