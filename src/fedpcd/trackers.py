"""Experiment trackers (``tracking.loggers``): every metrics.jsonl row and the resolved config mirrored to a
CSV file, TensorBoard, Weights & Biases or MLflow (the extra ``fedpcd[trackers]``; docs/trackers.md).

The round loop opens them with :func:`open_trackers` once the run directory exists, calls
:meth:`Trackers.log` with each record after writing it to metrics.jsonl and :meth:`Trackers.close` with the
summary at the end (an exception leaving the ``with`` block closes them as failed). What each receives:

- ``csv``: ``metrics.csv``, a row per record and a column per key (in order of first appearance; a key
  first seen later widens the header, earlier rows are empty there), lists as JSON text, None empty.
- ``tensorboard``, ``wandb``, ``mlflow``: the record's finite numbers as scalars at step = round; None,
  text, booleans and lists (client ids, per-client and per-class accuracies) are skipped (metrics.jsonl and
  metrics.csv keep them). The summary's numbers go under ``summary.<dotted key>``
  (``summary.final.global_acc``) at the last logged step; the config as TensorBoard text ``config``, the
  W&B run config, MLflow params (dotted keys, values as JSON text but for strings).

By default everything stays in the run directory: W&B runs offline under ``wandb/`` (its caches too), MLflow
writes a SQLite store ``mlflow.db`` (which MLflow 3 opens as it is, unlike its file store), and neither sends
telemetry (environment defaults, set only while the trackers are open and only where the environment does not
set them). ``trackers.json`` keeps each logger's run id and the last round it logged: a resumed run continues
the same tracker runs and logs only the rounds after that one, never a step twice.

A kill can land between a tracker's write and the checkpoint (or trackers.json), so on resume the files the
run owns are rebuilt from the checkpointed metrics, which the round loop has put back into metrics.jsonl
before it opens the trackers: ``metrics.csv`` is rewritten from them, ``tensorboard/`` gets one event file of
them (the older event files removed) and an offline W&B run one ``wandb/offline-run-*`` folder of them under
the same run id (its older folders removed), so each step appears exactly once after any kill. An MLflow run
and an online W&B run cannot drop a logged point: on resume MLflow's logged steps are read back from the run
and a step already there is not logged again; W&B online drops a step below the last one it holds.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import importlib.util
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from fedpcd.config import Config
from fedpcd.config_identity import config_yaml, flatten
from fedpcd.errors import UserError
from fedpcd.run_format import RunFiles
from fedpcd.run_read import read_metrics
from fedpcd.utils import quiet, read_json, refuse_link

INSTALL = "pip install 'fedpcd[trackers]'"
# logger -> the module it needs
PACKAGES = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
SQL_STORE = ("sqlalchemy", "alembic")  # what MLflow's SQLite store needs besides mlflow-skinny
LAST = "last_round"  # trackers.json: the last round a logger logged


def scalars(tree: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record or summary by dotted key (nested mappings flattened; None, text,
    booleans and lists skipped)."""
    return {
        key: float(value)
        for key, value in flatten(tree).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def _step_values(record: dict[str, Any]) -> dict[str, float]:
    """A record's scalars but its round (the step they are logged at)."""
    return {key: value for key, value in scalars(record).items() if key != "round"}


def check_trackers(config: Config) -> None:
    """A one-line UserError if a configured logger's package is not installed, or for MLflow's SQLite store
    (the default) SQLAlchemy or Alembic (nothing is imported)."""
    tracking = config.tracking
    for name in tracking.loggers:
        module = PACKAGES[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise UserError(
                f"tracking.loggers lists {name!r}, but the package {module!r} is not installed; {INSTALL}"
            )
        if name == "mlflow" and (tracking.mlflow_uri or "sqlite:").startswith("sqlite:"):
            for module in SQL_STORE:
                if importlib.util.find_spec(module) is None:
                    raise UserError(
                        f"tracking.loggers lists 'mlflow', whose SQLite store needs the package {module!r}, "
                        f"which is not installed; {INSTALL}"
                    )


def _run_records(run: RunFiles) -> list[dict[str, Any]]:
    """The records of the run's metrics.jsonl: on resume, the checkpoint's (the round loop rewrote it)."""
    return read_metrics(run.metrics, resuming=True) if run.metrics.exists() else []


def _write(run: RunFiles, path: Path, write: Any) -> None:
    """Write a tracker file of the run atomically, never through a symbolic link (``engine/rundir.py``)."""
    from fedpcd.engine.rundir import safe_write

    safe_write(path, write, root=run.path)


class _Logger(Protocol):
    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self, summary: dict[str, float], step: int, failed: bool) -> None: ...


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (list, dict)) else value


class _Csv:
    """``metrics.csv``: appended a row at a time; rewritten (atomically) when a record brings a new key, and
    on resume from the checkpointed records (``records``)."""

    def __init__(
        self, run: RunFiles, config: Config, entry: dict[str, Any], records: list[dict[str, Any]]
    ) -> None:
        self.run, self.path = run, run.metrics_csv
        self.columns: list[str] = []
        self.rows: list[dict[str, Any]] = []
        if entry[LAST] or self.path.exists():
            self._rewrite([{key: _cell(value) for key, value in r.items()} for r in records])
        entry[LAST] = records[-1]["round"] if records else 0

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.columns = list(dict.fromkeys(key for row in rows for key in row))

        def write(fh: Any) -> None:
            if self.columns:
                writer = csv.DictWriter(fh, self.columns, lineterminator="\n")
                writer.writeheader()
                writer.writerows(rows)

        _write(self.run, self.path, write)

    def log(self, step: int, record: dict[str, Any]) -> None:
        from fedpcd.engine.rundir import open_no_follow, writing

        row = {key: _cell(value) for key, value in record.items()}
        if any(key not in self.columns for key in row):
            self._rewrite([*self.rows, row])
            return
        self.rows.append(row)
        fd = open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with writing(self.path), open(fd, "a", newline="", encoding="utf-8") as fh:
            csv.DictWriter(fh, self.columns, lineterminator="\n").writerow(row)

    def close(self, summary: dict[str, float], step: int, failed: bool) -> None:
        """Nothing to close (summary.json lies beside it)."""


class _TensorBoard:
    """``tensorboard/``: ``torch.utils.tensorboard.SummaryWriter`` event files; on resume the old ones are
    replaced by one file of the checkpointed records (``records``), then the run goes on in it."""

    def __init__(
        self, run: RunFiles, config: Config, entry: dict[str, Any], records: list[dict[str, Any]]
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        from fedpcd.engine.rundir import writing

        refuse_link(run.tensorboard)
        with writing(run.tensorboard):  # a resume: every step from the checkpointed records only
            if run.tensorboard.is_dir():
                for old in run.tensorboard.iterdir():
                    if "tfevents" in old.name and not old.is_dir():
                        old.unlink()
        self.writer = SummaryWriter(log_dir=str(run.tensorboard))
        # config.yaml as a Markdown code block
        text = "".join(f"    {line}\n" for line in config_yaml(config).splitlines())
        self.writer.add_text("config", text, 0)
        for record in records:
            self.log(record["round"], record)
        entry[LAST] = records[-1]["round"] if records else 0

    def log(self, step: int, record: dict[str, Any]) -> None:
        for key, value in _step_values(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, summary: dict[str, float], step: int, failed: bool) -> None:
        for key, value in summary.items():
            self.writer.add_scalar(key, value, step)
        self.writer.close()


def _remove_offline_runs(run: RunFiles, run_id: str) -> None:
    """Remove the run directory's offline W&B folders of the W&B run ``run_id`` (never through a link)."""
    from fedpcd.engine.rundir import writing

    refuse_link(run.wandb)
    with writing(run.wandb):
        for folder in run.wandb.glob(f"offline-run-*-{glob.escape(run_id)}"):
            if folder.is_symlink() or not folder.is_dir():
                folder.unlink()
            else:
                shutil.rmtree(folder)


class _Wandb:
    """A W&B run (offline by default) in ``wandb/``, each round's values committed at once. A resumed run
    reopens its id: offline, its folders are replaced by one of the checkpointed records (``records``), then
    the run goes on in it; online, W&B continues the run it holds."""

    def __init__(
        self, run: RunFiles, config: Config, entry: dict[str, Any], records: list[dict[str, Any]]
    ) -> None:
        import wandb

        tracking = config.tracking
        continued = "id" in entry and tracking.wandb_mode == "online"
        if "id" in entry and not continued:
            _remove_offline_runs(run, entry["id"])
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, reinit="create_new")
        self.run = wandb.init(
            dir=run.wandb.parent,  # W&B writes into <dir>/wandb
            mode=tracking.wandb_mode,
            project=tracking.project,
            group=tracking.group,
            name=run.path.name,
            config=config.to_dict(),
            id=entry.get("id"),
            resume="allow" if "id" in entry else None,
            settings=settings,
        )
        entry["id"] = self.run.id
        if not continued:  # a new run or an offline one rebuilt: the rounds before the checkpoint of a resume
            for record in records:
                self.log(record["round"], record)
            entry[LAST] = records[-1]["round"] if records else 0

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(_step_values(record), step=step, commit=True)  # not held back until the next step

    def close(self, summary: dict[str, float], step: int, failed: bool) -> None:
        import wandb

        self.run.summary.update(summary)
        self.run.finish(exit_code=1 if failed else 0)
        if wandb.run is None:  # no other run of this process open: stop W&B's service (next run: a fresh one)
            wandb.teardown()


def mlflow_uri(config: Config, run: RunFiles) -> str:
    """The MLflow tracking URI of a run: ``tracking.mlflow_uri``, by default the run directory's SQLite store
    ``sqlite:///<run>/mlflow.db``."""
    from mlflow.utils.file_utils import path_to_local_sqlite_uri

    return config.tracking.mlflow_uri or path_to_local_sqlite_uri(run.mlflow_db)


class _MLflow:
    """An MLflow run in :func:`mlflow_uri`, in the experiment ``tracking.project``, tagged ``group``;
    params: the flattened config. A resume whose run is gone from the store starts a new run with the
    checkpointed records (``records``)."""

    def __init__(
        self, run: RunFiles, config: Config, entry: dict[str, Any], records: list[dict[str, Any]]
    ) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

        from fedpcd.engine.rundir import create_regular_file

        tracking = config.tracking
        if tracking.mlflow_uri is None:
            create_regular_file(run.mlflow_db)  # never SQLite through a link
        with quiet(logging.getLogger("mlflow.store.db.utils")):  # its INFO lines on creating the tables
            self.client = MlflowClient(tracking_uri=mlflow_uri(config, run))
        self.logged: dict[str, set[int]] = {}  # metric key -> the steps the run holds already
        if "run_id" in entry:
            try:
                self.client.update_run(entry["run_id"], status="RUNNING")
                self.run_id = entry["run_id"]
                keys = self.client.get_run(self.run_id).data.metrics
                self.logged = {
                    key: {m.step for m in self.client.get_metric_history(self.run_id, key)} for key in keys
                }
                return
            except MlflowException:  # gone from the store: a new run from here on
                entry.clear()
                entry[LAST] = 0
        found = self.client.get_experiment_by_name(tracking.project)  # an earlier run's (a shared store)
        experiment = found.experiment_id if found else self.client.create_experiment(tracking.project)
        tags = {"group": tracking.group} if tracking.group else None
        self.run_id = self.client.create_run(experiment, run_name=run.path.name, tags=tags).info.run_id
        entry["run_id"] = self.run_id
        params = [
            Param(key, value if isinstance(value, str) else json.dumps(value))
            for key, value in flatten(config.to_dict()).items()
        ]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])
        for record in records:  # a resume: the rounds before its checkpoint
            self.log(record["round"], record)
        entry[LAST] = records[-1]["round"] if records else 0

    def _metrics(self, values: dict[str, float], step: int) -> None:
        """Log ``values`` at ``step``, but those the run holds at that step already (a resume after a kill
        between this write and trackers.json)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items() if step not in self.logged.get(k, ())]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._metrics(_step_values(record), step)

    def close(self, summary: dict[str, float], step: int, failed: bool) -> None:
        if summary:
            self._metrics(summary, step)
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


OPENERS: dict[str, type[_Csv | _TensorBoard | _Wandb | _MLflow]] = {
    "csv": _Csv,
    "tensorboard": _TensorBoard,
    "wandb": _Wandb,
    "mlflow": _MLflow,
}


def _environment(run: RunFiles) -> dict[str, str]:
    """The tracker libraries' environment defaults: quiet, no telemetry, caches in the run directory."""
    return {
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CACHE_DIR": str(run.wandb.resolve() / "cache"),
        "WANDB_DATA_DIR": str(run.wandb.resolve() / "data"),
        "WANDB_ARTIFACT_DIR": str(run.wandb.resolve() / "artifacts"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


@contextlib.contextmanager
def _environ_defaults(values: dict[str, str]) -> Iterator[None]:
    """Set the variables of ``values`` that the environment lacks, for the block."""
    added = [key for key in values if key not in os.environ]
    os.environ.update({key: values[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _read_state(path: Path) -> dict[str, dict[str, Any]]:
    data = read_json(path, "tracker state file")
    fine = isinstance(data, dict) and all(
        isinstance(entry, dict)
        and type(entry.get(LAST)) is int
        and entry[LAST] >= 0
        and all(isinstance(v, str) for k, v in entry.items() if k != LAST)
        for entry in data.values()
    )
    if not fine:
        raise UserError(
            f"{path} is not a fedpcd tracker state file (logger -> run id and {LAST}); delete it to log to "
            "new tracker runs"
        )
    return data


class Trackers:
    """The open loggers of one run; a context manager. With no loggers configured it does nothing and
    imports nothing.

    ``resume``: continue the tracker runs named in the run directory's trackers.json (a resumed run);
    otherwise new tracker runs start."""

    def __init__(self, config: Config, run_dir: str | Path, resume: bool = False) -> None:
        self._loggers: dict[str, _Logger] = {}
        self._stack = contextlib.ExitStack()
        self._summary: dict[str, float] = {}
        self._failed = False
        self._closed = False
        self._run = RunFiles(run_dir)
        self._state: dict[str, dict[str, Any]] = {}
        if not config.tracking.loggers:
            return
        check_trackers(config)
        if resume and self._run.trackers.exists():
            self._state = _read_state(self._run.trackers)
        records = _run_records(self._run) if resume else []
        self._stack.enter_context(_environ_defaults(_environment(self._run)))
        try:
            for name in config.tracking.loggers:
                entry = self._state.setdefault(name, {LAST: 0})
                self._loggers[name] = OPENERS[name](self._run, config, entry, records)
                self._stack.callback(self._close_one, self._loggers[name], entry)
            self._save()
        except BaseException:
            self._close(None, failed=True)
            raise

    def _save(self) -> None:
        text = json.dumps(self._state, indent=1, sort_keys=True) + "\n"
        _write(self._run, self._run.trackers, lambda fh: fh.write(text))

    def _close_one(self, logger: _Logger, entry: dict[str, Any]) -> None:
        logger.close(self._summary, entry[LAST], self._failed)

    def log(self, record: dict[str, Any]) -> None:
        """Mirror one metrics.jsonl record to every logger that has not logged its round yet."""
        step = record["round"]
        todo = [name for name in self._loggers if step > self._state[name][LAST]]
        for name in todo:
            self._loggers[name].log(step, record)
            self._state[name][LAST] = step
        if todo:
            self._save()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close every logger (once), after logging the summary's numbers (``summary.<key>``)."""
        self._close(summary, failed=False)

    def _close(self, summary: dict[str, Any] | None, failed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._summary = {f"summary.{k}": v for k, v in scalars(summary or {}).items()}
        self._failed = failed
        self._stack.close()  # every logger, last opened first, even if one fails; then the environment

    def __enter__(self) -> Trackers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(None, failed=kind is not None)


def open_trackers(config: Config, run_dir: Path, resume: bool = False) -> Trackers:
    """The configured loggers of ``config.tracking`` opened for the (existing) run directory ``run_dir``; a
    UserError naming the extra to install if one's package is missing. ``resume``: continue the tracker runs
    of an interrupted run (logging only rounds after the last each logged)."""
    return Trackers(config, run_dir, resume)
