"""The local backend: the round loop of engine/rounds.py with the in-process ``LocalExecutor`` (one model
object per architecture reused for every client, a client without state reset to the architecture's seeded
initial weights; with ``engine.workers`` > 1 a pool of worker processes).

Reliability (engine/guard.py, engine/update_policy.py, engine/run.py): a client that raises is left out of
its round with a warning; a non-finite reply stops the run (or, with ``engine.on_divergence: drop``, is left
out); the run holds a lock on its directory, checkpoints every ``engine.checkpoint_every`` rounds (server
and client states, the metrics so far, the global RNG states) and a resumed run continues from the last
checkpoint to the same metrics.jsonl as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedpcd.engine.executor import LocalExecutor
from fedpcd.engine.pool import worker_count
from fedpcd.engine.rounds import RoundObserver, run_rounds
from fedpcd.engine.run import Run


def run_local(run: Run, observers: Sequence[RoundObserver] = (), progress: bool = True) -> dict[str, Any]:
    """Run (or go on with) ``run`` in this process; writes the run directory and returns the summary. Each
    round goes to the ``observers`` (:func:`fedpcd.engine.rounds.run_rounds`)."""
    with run.open() as fed:
        adaptive = run.config.engine.workers == "auto"
        executor = LocalExecutor(fed, worker_count(fed), adaptive=adaptive)
        try:
            return run_rounds(run, fed, executor, observers, progress=progress)
        finally:
            executor.close()
