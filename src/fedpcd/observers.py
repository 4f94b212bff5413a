"""What watches a run's rounds, built above the engine and passed to its round loop
(:class:`fedpcd.engine.rounds.RoundObserver`): the progress bar, the trackers (``tracking.loggers``,
:mod:`fedpcd.trackers`) and a caller's per-round callback."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from fedpcd.config import Config
from fedpcd.engine.rounds import RecordHook, RoundObserver
from fedpcd.engine.run import Run
from fedpcd.run_format import headline
from fedpcd.trackers import Trackers, check_trackers, open_trackers

__all__ = ["Callback", "ProgressBar", "TrackerObserver", "round_observers"]


class ProgressBar:
    """A tqdm bar over the run's rounds, the last evaluated round's headline metrics beside it."""

    def __init__(self, desc: str, show: bool = True) -> None:
        self.desc, self.show = desc, show
        self.bar: tqdm | None = None

    def start(self, run: Run, first: int) -> None:
        self.bar = tqdm(
            total=run.config.rounds,
            initial=first,
            disable=not self.show,
            desc=self.desc,
            unit="round",
            leave=False,
        )

    def round(self, rnd: int, record: dict[str, Any] | None) -> None:
        assert self.bar is not None
        if record is not None:
            self.bar.set_postfix(headline(record))
        self.bar.update(1)

    def stop(self, summary: dict[str, Any] | None) -> None:
        if self.bar is not None:
            self.bar.close()


class TrackerObserver:
    """The run's trackers (``tracking.loggers``): their packages checked when made, the tracker runs opened
    once the run's folder holds its files (continued for a resumed run), every record mirrored to them."""

    def __init__(self, config: Config) -> None:
        check_trackers(config)
        self.config = config
        self.trackers: Trackers | None = None

    def start(self, run: Run, first: int) -> None:
        self.trackers = open_trackers(self.config, run.path, resume=run.resumed)

    def round(self, rnd: int, record: dict[str, Any] | None) -> None:
        if record is not None and self.trackers is not None:
            self.trackers.log(record)

    def stop(self, summary: dict[str, Any] | None) -> None:
        if self.trackers is None:
            return
        if summary is None:  # the run stopped on an error: the tracker runs are marked failed
            self.trackers.__exit__(RuntimeError, None, None)
        else:
            self.trackers.close(summary)


class Callback:
    """A caller's function called with each evaluated round's record (``fedpcd.run(on_round=...)``)."""

    def __init__(self, on_record: RecordHook) -> None:
        self.on_record = on_record

    def start(self, run: Run, first: int) -> None:
        """Nothing to prepare."""

    def round(self, rnd: int, record: dict[str, Any] | None) -> None:
        if record is not None:
            self.on_record(record)

    def stop(self, summary: dict[str, Any] | None) -> None:
        """Nothing to release."""


def round_observers(
    config: Config, progress: bool = True, on_record: RecordHook | None = None
) -> list[RoundObserver]:
    """A run's observers, in the order each round reaches them: the progress bar (shown with
    ``progress``; its label the algorithm's name, with ``(flower)`` on the Flower backend), the trackers,
    then ``on_record``."""
    flower = " (flower)" if config.backend == "flower" else ""
    observers: list[RoundObserver] = [
        ProgressBar(config.algorithm.name + flower, progress),
        TrackerObserver(config),
    ]
    if on_record is not None:
        observers.append(Callback(on_record))
    return observers
