"""A run: its config, its folder and the checkpoint it goes on from, decided once, before any data is loaded.

:meth:`Run.create` starts a run of a config (its ``output_dir`` must not hold another one);
:meth:`Run.resume` continues the run in a folder (or in a config's ``output_dir``) with the folder's own
config.yaml, reading and checking its checkpoint once. Whether a folder holds "the same run" is answered
by one function, :func:`changes_since`: the differences between the recorded config's identity
(``canonical_config``: what a run computes, not where it lives or who watches it) and a config's. A Run owns
its folder (:class:`~fedpcd.engine.rundir.RunDir`: files, lock, atomic writes) and, while open
(:meth:`Run.open`), its run.log. Both backends, the API, the command line and sweeps open runs only here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedpcd.algorithms import Algorithm, build_algorithm
from fedpcd.config import Config
from fedpcd.config_identity import check_allowed_changes, describe_changes, dump_config
from fedpcd.engine.checkpoint import (
    changes_since,
    check_checkpoint,
    checkpoint_rounds,
)
from fedpcd.engine.federation import Federation, build_federation, resolve_device, set_threads
from fedpcd.engine.privacy import check_privacy
from fedpcd.engine.robust import check_robust
from fedpcd.engine.rundir import RunDir
from fedpcd.engine.server_opt import check_server_optimizer
from fedpcd.errors import UserError
from fedpcd.logs import LOGGER, run_log
from fedpcd.resolve import load_config, load_run_config

__all__ = ["Run", "load_finished"]


class Run:
    """One run: its resolved ``config``, its ``folder`` and the ``checkpoint`` it continues from (None: it
    starts at round 0). Make one with :meth:`create` or :meth:`resume`."""

    def __init__(
        self, config: Config, folder: RunDir, checkpoint: dict[str, Any] | None, restart: bool
    ) -> None:
        self.config = config
        self.folder = folder
        self.checkpoint = checkpoint
        self.restart = restart  # a resumed run without a checkpoint yet: round 0 again, config.yaml kept

    @property
    def path(self) -> Path:
        """The run's directory."""
        return self.folder.path

    @property
    def resumed(self) -> bool:
        """Whether the run goes on from an earlier attempt (a checkpoint, or a restart): its trackers too."""
        return self.checkpoint is not None or self.restart

    @classmethod
    def create(cls, config: Config) -> Run:
        """A new run of ``config``; its ``output_dir`` is refused if it holds another run or files fedpcd did
        not write for this one (:meth:`RunDir.check_new`)."""
        folder = RunDir(config.output_dir)
        folder.check_new(config)
        return cls(config, folder, None, restart=False)

    @classmethod
    def resume(
        cls, target: str | Path | Config, allow: Sequence[str] = (), changes: Sequence[str] = ()
    ) -> Run:
        """The run in folder ``target`` continued with its own config.yaml, from its last checkpoint (read
        and checked here, once).

        ``target`` a Config: the run in its ``output_dir``, which must have been made with that config
        (:func:`changes_since`, else a UserError naming the differences); a folder without a started run
        gives :meth:`create`'s run. ``allow``: the ``RESUME_CHANGES`` keys config.yaml may have changed
        since the checkpoint; ``changes``: ``KEY=VALUE`` items of those keys (each one allowed by
        being given) written into config.yaml first, e.g. ``rounds=30``, which extends a finished run: N
        must exceed the rounds done. A run without a checkpoint restarts from round 0; a finished one is
        :attr:`finished`."""
        if isinstance(target, Config):
            if not _started(target):
                return cls.create(target)
            target = target.output_dir
        allow = check_allowed_changes(allow, changes)
        folder = RunDir(Path(target))
        folder.check_links()
        folder.check_resumable()
        config = load_run_config(folder.config, [f"output_dir={folder.path}", *changes])
        checkpoint = None
        if folder.checkpoint.exists():
            checkpoint = folder.load_checkpoint(resolve_device(config.engine.device))
        if any(item.partition("=")[0] == "rounds" for item in changes):
            _check_more_rounds(folder, config, checkpoint)
        if checkpoint is not None:
            check_checkpoint(checkpoint, folder, config, allow)
        if changes:
            dump_config(load_run_config(folder.config, list(changes)), folder.config)
        run = cls(config, folder, checkpoint, restart=True)
        if run.finished:
            return run
        if checkpoint is None:
            LOGGER.warning(
                "%s has no checkpoint (stopped before its first one): restarting it from round 0", run.path
            )
        else:
            _check_extension(run)
        return run

    @property
    def finished(self) -> bool:
        """Whether the run has finished its rounds (summary.json, and no checkpoint before its last round)."""
        if not self.folder.summary.exists():
            return False
        return self.checkpoint is None or self.checkpoint["round"] >= self.config.rounds

    def summary(self) -> dict[str, Any]:
        """A finished run's summary.json, logging that there is nothing to run."""
        summary = self.folder.read_summary()
        LOGGER.info(
            "%s: already finished (%s rounds); nothing to run (extend it with: fedpcd run --resume %s "
            "rounds=N)",
            self.path,
            summary.get("rounds", "?"),
            self.path,
        )
        return summary

    @contextmanager
    def open(self, federation: Federation | None = None) -> Iterator[Federation]:
        """The run's set-up on every backend, each check before the data is loaded: torch threads, the
        privacy, robust-aggregation and server-optimiser settings; then, with the folder locked, a stale
        summary.json dropped (a finished run given more rounds) and, logging to its run.log
        (:func:`fedpcd.logs.run_log`) for the rest of the block, the federation (``federation``: already
        built by the caller). Both re-entrant: a Flower simulation's ServerApp thread opens the run again."""
        set_threads(self.config)
        check_privacy(self.config)
        check_robust(self.config)
        check_server_optimizer(self.config)
        with self.folder.lock():
            if self.checkpoint is not None and self.checkpoint["round"] < self.config.rounds:
                self.folder.discard_summary()
            with run_log(self.path):
                yield federation if federation is not None else build_federation(self.config)


def _started(config: Config) -> bool:
    """Whether ``config``'s output_dir holds a started run (its config.yaml or a checkpoint); one made with
    another config (by :func:`changes_since`) is a UserError naming the differences."""
    folder = RunDir(config.output_dir)
    if not folder.config.is_file():
        return folder.checkpoint.exists()  # a checkpoint alone: Run.resume says why it cannot go on
    theirs = load_run_config(folder.config, [f"output_dir={folder.path}"])
    changes = changes_since(theirs, config)
    if changes:
        raise UserError(
            f"output_dir {folder.path} holds a run of another config ({describe_changes(changes)}); resume "
            "continues a run with its own config.yaml: give that config, or set output_dir to a new folder"
        )
    return True


def _check_more_rounds(folder: RunDir, config: Config, checkpoint: dict[str, Any] | None) -> None:
    """Refuse a resume's ``rounds=N`` that is not above the rounds done (the checkpoint's round, else
    summary.json's): it would not extend the run."""
    done = checkpoint["round"] if checkpoint is not None else None
    if done is None and folder.summary.exists():
        done = folder.read_summary().get("rounds")
    if done is not None and config.rounds <= done:
        raise UserError(
            f"rounds={config.rounds} does not extend {folder.path}: it has run {done} rounds; give more than "
            f"{done}"
        )


def _check_extension(run: Run) -> None:
    """Refuse to go on with another ``rounds`` than the checkpoint's where the algorithm's rounds depend on
    the total (its ``total_rounds_use``): the longer run would not equal one of that many rounds."""
    assert run.checkpoint is not None
    config, old = run.config, checkpoint_rounds(run.checkpoint)
    if old in (None, config.rounds):
        return
    use = build_algorithm(config.algorithm.name, config.algorithm.params()).total_rounds_use()
    if use is not None:
        raise UserError(
            f"{run.path}: algorithm {config.algorithm.name!r} cannot go on with rounds {old} -> "
            f"{config.rounds}: {use}, so the longer run would not equal one made with that many rounds from "
            "the start; start a new run"
        )


def load_finished(run_dir: str | Path) -> tuple[Federation, Algorithm, dict[str, Any]]:
    """A finished run for analysis: its federation (data and partition rebuilt from its config.yaml), its
    algorithm and its last checkpoint (``server``, ``client_states``, ``round``), which must be one of that
    config (``checkpoint.check_checkpoint``)."""
    folder = RunDir(Path(run_dir))
    if not folder.checkpoint.exists():
        raise UserError(
            f"no checkpoint in {folder.path}: this needs the run's final state (archived runs lack it)"
        )
    config = load_config(folder.config, [f"output_dir={folder.path}"])
    set_threads(config)
    fed = build_federation(config)
    state = folder.load_checkpoint(fed.device)
    check_checkpoint(state, folder, config)
    return fed, fed.new_algorithm(), state
