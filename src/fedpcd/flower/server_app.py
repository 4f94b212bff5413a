"""The Flower ServerApp of every registered algorithm: a Strategy built from the algorithm's server hooks.

:class:`FedpcdStrategy` keeps the algorithm's server state and, each round, does what ``run_local`` does:
sample the participants (``sample_clients``; Flower's own sampling is unseeded), send each one its own
``payload_for(server, k)``, sort the replies by client id (weighted sums are not associative, so arrival
order would change the bits), ``aggregate``, compute generic accuracy (GA) on the full test set with
``global_predictor``, and write the round's record with ``round_record`` into the same run directory.
Personal metrics come back inside the train replies on evaluated rounds.

Flower node ids are random; a discovery (query) round first maps them to partition ids = client ids
(``fedpcd.flower.discovery``).

Two ways in:
- :func:`make_server_app` with a Config, for the in-process simulation (:func:`fedpcd.flower.run_flower`);
- the module-level ``app`` for ``flwr run`` (``flower-app/pyproject.toml``); it reads the run config keys
  ``config-file`` (a fedpcd YAML; relative paths are tried against the working directory, then the app
  directory), ``overrides`` (space-separated ``KEY=VALUE`` fedpcd overrides), ``node-timeout`` and
  ``round-timeout`` (seconds) and ``adapt-clients`` (true: ``clients`` follows the number of SuperNodes).
"""

from __future__ import annotations

import logging
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fedpcd.flower import _env

_env.set_offline_defaults()

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import Strategy  # noqa: E402
from tqdm import tqdm  # noqa: E402

from fedpcd.algorithms.base import tensor_bytes  # noqa: E402
from fedpcd.config import Config, load_config  # noqa: E402
from fedpcd.data.stats import partition_json  # noqa: E402
from fedpcd.engine.checkpoint import checkpoint_state  # noqa: E402
from fedpcd.engine.federation import (  # noqa: E402
    Federation,
    build_federation,
    global_evaluation,
    sample_clients,
    set_threads,
    to_device,
)
from fedpcd.engine.guard import screen_replies  # noqa: E402
from fedpcd.engine.records import round_record, summary_of  # noqa: E402
from fedpcd.engine.rundir import RunDir  # noqa: E402
from fedpcd.engine.simulation import aggregate_round, extra_global_accuracies, is_eval_round  # noqa: E402
from fedpcd.errors import UserError  # noqa: E402
from fedpcd.flower import records  # noqa: E402
from fedpcd.flower.discovery import PollingGrid, discover, federation_size, fit_to_federation  # noqa: E402
from fedpcd.flower.protocol import (  # noqa: E402
    PAYLOAD,
    PERSONAL,
    REPLY,
    TASK,
    config_text,
    raise_for_error,
)
from fedpcd.run_format import headline  # noqa: E402

LOG = logging.getLogger("flwr")


class FedpcdStrategy(Strategy):
    """Any registered algorithm as a Flower Strategy: its server hooks, fedpcd's sampling and bookkeeping."""

    def __init__(
        self,
        config: Config,
        fed: Federation,
        nodes: dict[int, int],
        run_dir: RunDir,
        progress: bool = False,
        round_timeout: float = 3600.0,
    ) -> None:
        self.config = config
        self.fed = fed
        self.nodes = nodes
        self.run_dir = run_dir
        self.algorithm = fed.new_algorithm()
        self.model = fed.model_for(0, fresh=True)
        self.server = self.algorithm.init_server(self.model)
        self.text = config_text(config)
        self.records: list[dict[str, Any]] = []
        self.wall = 0.0
        self.clients_keep_state = False
        self.round_timeout = round_timeout
        self._round: dict[str, Any] = {}
        self.bar = tqdm(
            total=config.rounds,
            disable=not progress,
            desc=f"{config.algorithm.name} (flower)",
            unit="round",
            leave=False,
        )

    def server_arrays(self) -> ArrayRecord:
        """The tensors of the server state as one ArrayRecord (what Flower's Result reports)."""
        return records.encode(self.server, "server").get("server.arrays", ArrayRecord())

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        t0 = time.perf_counter()
        evaluate = is_eval_round(server_round, self.config)
        ids = sample_clients(self.config.clients, self.config.participation, self.config.seed, server_round)
        messages, down = [], 0
        for k in ids:
            payload = self.algorithm.payload_for(self.server, k)
            down += tensor_bytes(payload)
            content = records.record_dict(**{PAYLOAD: payload})
            content[TASK] = ConfigRecord(
                {"round": server_round, "client-id": k, "evaluate": evaluate, "config": self.text}
            )
            messages.append(
                Message(
                    content,
                    message_type=MessageType.TRAIN,
                    dst_node_id=self.nodes[k],
                    group_id=str(server_round),
                )
            )
        self._round = {"t0": t0, "ids": ids, "evaluate": evaluate, "down": down}
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        info = self._round
        by_client: dict[int, tuple[dict[str, Any], dict[str, Any] | None]] = {}
        errors: dict[int, BaseException] = {}
        client_of = {node: k for k, node in self.nodes.items()}
        client_s = 0.0  # the slowest ClientApp's own time (training + personal evaluation)
        for msg in replies:
            if msg.has_error():  # the ClientApp raised: left out (engine/guard.py); a UserError stops the run
                k = client_of.get(msg.metadata.src_node_id, -1)
                try:
                    raise_for_error(msg, f"round {server_round}: client {k}")
                except UserError:
                    raise
                except RuntimeError as exc:
                    errors[k] = exc
                continue
            task = msg.content[TASK]
            k = int(task["client-id"])
            if self.nodes.get(k) != msg.metadata.src_node_id:
                raise RuntimeError(f"round {server_round}: reply for client {k} came from an unexpected node")
            reply = to_device(records.decode(msg.content, REPLY), self.fed.device)  # CPU tensors off the wire
            by_client[k] = (reply, records.get(msg.content, PERSONAL))
            client_s = max(client_s, float(task.get("client-s", 0.0)))
            self.clients_keep_state |= bool(task.get("has-state", False))
        ids = info["ids"]  # sorted: aggregation order = client id order, exactly as in run_local
        for k in ids:
            if k not in by_client and k not in errors:
                errors[k] = TimeoutError(f"no reply within the round timeout ({self.round_timeout:g} s)")
        screened = screen_replies(
            self.config,
            server_round,
            ids,
            [by_client[k][0] if k in by_client else None for k in ids],
            [errors.get(k) for k in ids],
        )
        kept_ids = [ids[i] for i in screened.kept]
        replies_ = [by_client[k][0] for k in kept_ids]
        evals = [by_client[k][1] for k in kept_ids]
        up = sum(tensor_bytes(by_client[k][0]) for k in ids if k in by_client)
        self.server = aggregate_round(
            self.algorithm, self.config, server_round, self.server, replies_, kept_ids
        )
        ga, ga_classes, extra = None, None, {}
        if info["evaluate"]:
            ga, ga_classes = global_evaluation(self.algorithm, self.model, self.fed, self.server)
            extra = extra_global_accuracies(self.algorithm, self.fed, self.server)
        round_wall = time.perf_counter() - info["t0"]
        self.wall += round_wall
        metrics = MetricRecord({"round-s": round_wall, "slowest-client-s": client_s})
        if info["evaluate"]:
            record = round_record(
                server_round,
                ga,
                replies_,
                evals,
                kept_ids,
                up,
                info["down"],
                round_wall,
                extra,
                ga_classes,
            )
            if len(kept_ids) < len(ids):
                record["left_out"] = sorted({*screened.failed, *screened.diverged})
            self.run_dir.append(record)
            self.records.append(record)
            metrics.update(
                {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            )
            shown = headline(record)
            LOG.info(
                "round %d: %s, %.2f s (slowest ClientApp %.2f s)",
                server_round,
                " ".join(f"{label}={value}" for label, value in shown.items()),
                round_wall,
                client_s,
            )
            self.bar.set_postfix(shown)
        self._checkpoint(server_round)
        self.bar.update(1)
        return (self.server_arrays() if server_round == self.config.rounds else None), metrics

    def _checkpoint(self, rnd: int) -> None:
        """The local backend's checkpoint, while it is complete: client states live on the nodes."""
        every = self.config.engine.checkpoint_every
        if not every or not (rnd % every == 0 or rnd == self.config.rounds):
            return
        if self.clients_keep_state:
            self.run_dir.checkpoint.unlink(missing_ok=True)  # incomplete without the nodes' states
            return
        state = checkpoint_state(rnd, self.server, {}, self.wall, self.records, self.config)
        self.run_dir.save_checkpoint(state)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No separate evaluation messages: personal metrics come with the train replies."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        cfg = self.config
        LOG.info(
            "\t├── fedpcd algorithm %r, %d clients, participation %s, %d rounds",
            cfg.algorithm.name,
            cfg.clients,
            cfg.participation,
            cfg.rounds,
        )

    def finish(self) -> dict[str, Any]:
        """Write summary.json (as run_local does) and return it."""
        self.bar.close()
        summary = summary_of(self.records, self.wall, self.config.rounds)
        self.run_dir.write_summary(summary)
        return summary


def serve(
    grid: Grid,
    config: Config,
    *,
    federation: Federation | None = None,
    progress: bool = False,
    node_timeout: float = 300.0,
    round_timeout: float = 3600.0,
    stop: threading.Event | None = None,
    adapt_clients: bool = False,
) -> dict[str, Any]:
    """The whole run on the server side: discovery, the rounds, the run directory; returns the summary.

    The first SuperNode's ``num-partitions`` is checked against ``clients`` at once (``adapt_clients``: the
    config follows the federation's size instead). A ClientApp that raises or does not reply within
    ``round_timeout`` seconds is left out of its round (engine/guard.py); ``stop`` set from another thread
    ends the run at the next poll (``discovery.Interrupted``). The run directory is locked while the run
    lasts."""
    fast = PollingGrid(grid, stop=stop)
    config = fit_to_federation(
        config, federation_size(fast, node_timeout), adapt_clients and federation is None
    )
    set_threads(config)
    fed = federation if federation is not None else build_federation(config)
    run_dir = RunDir(config.output_dir)
    run_dir.check_new()
    LOG.info("fedpcd: run directory %s", run_dir.path.resolve())
    with run_dir.lock():
        nodes = discover(fast, config.clients, node_timeout, config_text(config))
        train_y, test_y = fed.dataset.train_y.numpy(), fed.dataset.test_y.numpy()
        run_dir.create(config, partition_json(fed.partition, train_y, test_y))
        strategy = FedpcdStrategy(config, fed, nodes, run_dir, progress=progress, round_timeout=round_timeout)
        strategy.start(
            grid=fast,
            initial_arrays=strategy.server_arrays(),
            num_rounds=config.rounds,
            timeout=round_timeout,
        )
        return strategy.finish()


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
    name = str(run_config.get("config-file", "") or "")
    overrides = shlex.split(str(run_config.get("overrides", "") or ""))
    return load_config(_find_file(name, grid) if name else None, overrides + ["backend=flower"])


def make_server_app(
    config: Config | None = None,
    *,
    federation: Federation | None = None,
    progress: bool = False,
    result: dict[str, Any] | None = None,
    on_finish: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> ServerApp:
    """A ServerApp running ``config`` (None: read it from ``flwr run``'s run config).

    The summary goes to ``result["summary"]`` when a dict is given (in the simulation the ServerApp runs
    in a thread of the caller's process); ``on_finish`` is called after the last round, while the
    ClientApps are still up; ``stop`` set ends the run at the ServerApp's next poll."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        rc = context.run_config
        try:
            summary = serve(
                grid,
                config if config is not None else config_from_run_config(rc, grid),
                federation=federation,
                progress=progress,
                node_timeout=float(rc.get("node-timeout", 300.0)),
                round_timeout=float(rc.get("round-timeout", 3600.0)),
                stop=stop,
                adapt_clients=config is None and bool(rc.get("adapt-clients", True)),
            )
        except UserError as exc:
            if config is not None:  # in-process (fedpcd run backend=flower): the caller reports it
                raise
            LOG.error("fedpcd: error: %s", exc)  # `flwr run`: one line, not a traceback
            return
        if result is not None:
            result["summary"] = summary
        if on_finish is not None:
            on_finish()

    return server_app


app = make_server_app()
