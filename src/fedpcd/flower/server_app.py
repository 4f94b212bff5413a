"""The Flower ServerApp of every registered algorithm: the engine's round loop with ClientApps as clients.

:func:`serve` finds the SuperNodes (``fedpcd.flower.discovery``: Flower node ids are random; a query round
maps them to partition ids = client ids), then runs :func:`fedpcd.engine.rounds.run_rounds` on the
:class:`~fedpcd.engine.run.Run`, the round loop of the local backend too, with a
:class:`~fedpcd.flower.grid_executor.GridExecutor` as its executor: the same sampling, screening,
aggregation, evaluation, records, checkpoints and resume.

Two ways in:
- :func:`make_server_app` with a Run, for the in-process simulation (:func:`fedpcd.flower.run_flower`);
- the module-level ``app`` for ``flwr run`` (``flower-app/pyproject.toml``); it reads the run config keys
  ``config-file`` (a fedpcd YAML; relative paths are tried against the working directory, then the app
  directory), ``overrides`` (space-separated ``KEY=VALUE`` fedpcd overrides), ``node-timeout`` (seconds;
  the round timeout is the config's ``flower.round_timeout``), ``adapt-clients`` (true: ``clients``
  follows the number of SuperNodes) and ``resume`` (true: continue the run in the config's ``output_dir``
  from its checkpoint).
"""

from __future__ import annotations

import logging
import shlex
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedpcd.flower import _env

_env.set_offline_defaults()

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedpcd.config import Config  # noqa: E402
from fedpcd.engine.federation import Federation  # noqa: E402
from fedpcd.engine.rounds import RoundObserver, run_rounds  # noqa: E402
from fedpcd.engine.run import Run  # noqa: E402
from fedpcd.errors import UserError  # noqa: E402
from fedpcd.flower import secagg  # noqa: E402
from fedpcd.flower.discovery import (  # noqa: E402
    Interrupted,
    PollingGrid,
    discover,
    federation_size,
    fit_to_federation,
)
from fedpcd.flower.grid_executor import GridExecutor  # noqa: E402
from fedpcd.flower.protocol import config_text  # noqa: E402
from fedpcd.observers import Callback, round_observers  # noqa: E402
from fedpcd.resolve import load_config  # noqa: E402
from fedpcd.run_format import headline  # noqa: E402

LOG = logging.getLogger("flwr")


def serve(
    grid: Grid,
    target: Config | Run,
    *,
    federation: Federation | None = None,
    observers: Sequence[RoundObserver] | None = None,
    progress: bool = False,
    node_timeout: float = 300.0,
    round_timeout: float | None = None,
    stop: threading.Event | None = None,
    adapt_clients: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """The whole run on the server side: discovery, then the engine's round loop with the ClientApps as its
    executor (:class:`~fedpcd.flower.grid_executor.GridExecutor`); returns the summary.

    ``target``: the run (opened by the caller, in-process) or, for ``flwr run``, its config: a new run, or
    with ``resume`` the run in its ``output_dir`` continued from its checkpoint (the nodes get their client
    states back). The first SuperNode's ``num-partitions`` is checked against ``clients`` at once
    (``adapt_clients``, for a new run from a config: the config follows the federation's size instead). A
    ClientApp that raises or does not reply within ``round_timeout`` seconds (None: the config's
    ``flower.round_timeout``) is left out of its round
    (engine/guard.py); ``stop`` set from another thread ends the run at the next poll
    (``discovery.Interrupted``). ``observers``: the round loop's (default: the trackers and no progress
    bar); a log line per evaluated round is added. The run directory is locked while the run lasts."""
    fast = PollingGrid(grid, stop=stop)
    config = target.config if isinstance(target, Run) else target
    adapt = adapt_clients and isinstance(target, Config) and not resume
    config = fit_to_federation(config, federation_size(fast, node_timeout), adapt)
    if isinstance(target, Run):
        run = target
    else:
        run = Run.resume(config) if resume else Run.create(config)
        config = run.config
    if observers is None:
        observers = round_observers(config, progress)
    LOG.info("fedpcd: run directory %s", Path(config.output_dir).resolve())
    with run.open(federation) as fed:
        secure = None
        if config.privacy.secagg is not None:  # W defaults to the largest client's training set
            largest = max(client.num_samples for client in fed.clients)
            secure = secagg.workflow_params(config.privacy.secagg, largest)
        text = config_text(config)
        nodes = discover(fast, config.clients, node_timeout, text)
        timeout = config.flower.round_timeout if round_timeout is None else round_timeout
        executor = GridExecutor(fast, nodes, text, fed.device, timeout, secure, config.seed)

        def log(record: dict[str, Any]) -> None:
            shown = " ".join(f"{label}={value}" for label, value in headline(record).items())
            LOG.info("round %d: %s, %.2f s", record["round"], shown, record["wall_s"])

        return run_rounds(run, fed, executor, [*observers, Callback(log)], progress=progress)


def _find_file(name: str, grid: Grid) -> Path:
    path = Path(name).expanduser()
    if path.is_absolute() or path.exists():
        return path
    try:  # the app directory Flower unpacked this run's FAB into
        from flwr.common.config import get_project_dir

        run = grid.run
        app_dir = get_project_dir(run.fab_id, run.fab_version, run.fab_hash)
        if (app_dir / path).exists():
            return app_dir / path
    except Exception:  # noqa: BLE001 - fall back to the search path
        pass
    for entry in sys.path:
        if entry and (Path(entry) / path).is_file() and (Path(entry) / "pyproject.toml").is_file():
            return Path(entry) / path
    return path


def config_from_run_config(run_config: Any, grid: Grid) -> Config:
    """The fedpcd Config from ``flwr run``'s run config (``config-file`` and ``overrides``)."""
    if "round-timeout" in run_config:  # the run config's key before the setting moved into the config
        raise UserError(
            "the run config's round-timeout is now the fedpcd setting flower.round_timeout: "
            'set it in the config file or as overrides = "flower.round_timeout=SECONDS"'
        )
    name = str(run_config.get("config-file", "") or "")
    overrides = shlex.split(str(run_config.get("overrides", "") or ""))
    return load_config(_find_file(name, grid) if name else None, overrides + ["backend=flower"])


def make_server_app(
    run: Run | None = None,
    *,
    federation: Federation | None = None,
    observers: Sequence[RoundObserver] | None = None,
    progress: bool = False,
    result: dict[str, Any] | None = None,
    on_finish: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> ServerApp:
    """A ServerApp running ``run`` (None: a run of the config in ``flwr run``'s run config).

    The summary goes to ``result["summary"]`` when a dict is given (in the simulation the ServerApp runs
    in a thread of the caller's process); ``on_finish`` is called after the last round, while the
    ClientApps are still up; ``stop`` set ends the run at the ServerApp's next poll; ``observers``: the
    round loop's (:func:`serve`)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = context.run_config
        try:
            summary = serve(
                grid,
                run if run is not None else config_from_run_config(run_config, grid),
                federation=federation,
                observers=observers,
                progress=progress,
                node_timeout=float(run_config.get("node-timeout", 300.0)),
                stop=stop,
                adapt_clients=run is None and bool(run_config.get("adapt-clients", True)),
                resume=bool(run_config.get("resume", False)),
            )
        except Interrupted:  # in-process, stopped by a signal: run_flower raises it once Flower has returned
            return
        except UserError as exc:
            if run is not None:  # in-process (fedpcd run backend=flower): the caller reports it
                raise
            LOG.error("fedpcd: error: %s", exc)  # `flwr run`: one line, not a traceback
            return
        if result is not None:
            result["summary"] = summary
        if on_finish is not None:
            on_finish()

    return server_app


app = make_server_app()
