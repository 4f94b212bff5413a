"""The ``fedpcd`` command line: one handler per command (``HANDLERS``; the grammar is ``fedpcd.cli_args``)
and :func:`main`, which turns a user error into one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedpcd.cli_args import INIT_FILE, parse_args
from fedpcd.errors import Terminated, UserError, interrupt_behind
from fedpcd.procs_guard import (
    out_of_memory_line,
    stop_signals_raise,
    usable_cores,
)  # at start: under a memory limit a late import fails
from fedpcd.utils import show_text

# Only the standard library and fedpcd's light modules load at import: `fedpcd --help`, a missing config,
# `init` and `list configs` answer without torch; each command imports what it needs once its input is read.


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _summary_table(summary: dict[str, Any]) -> str:
    """The final and best value of every metric of the table, in %; for a DP run then the privacy spent by the
    whole run, its final ``dp_epsilon`` (not a %)."""
    from fedpcd.run_format import METRICS
    from fedpcd.utils import text_table

    final, best = summary["final"], summary["best"]
    rows = [[m.label, _pct(final.get(m.key)), _pct(best.get(m.key))] for m in METRICS]
    if final.get("dp_epsilon") is not None:
        rows.append(["DP epsilon", f"{final['dp_epsilon']:.4g}", "-"])
    return text_table(rows, ["metric (%)", "final", "best"])


def cmd_run(args: argparse.Namespace) -> None:
    summary, out = _resume(args) if args.resume else _start(args)
    print(_summary_table(summary))
    print(f"run directory: {show_text(out)}  ({summary['wall_s']:.1f} s)")


def _start(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``fedpcd run --config FILE KEY=VALUE...``: the summary and the run's folder."""
    from fedpcd.data.sources import check_files
    from fedpcd.resolve import load_config

    if not args.config and not args.overrides:
        raise UserError("fedpcd run needs --config FILE (and/or KEY=VALUE overrides) or --resume RUN_DIR")
    if args.allow_config_change:
        raise UserError("--allow-config-change goes with --resume RUN_DIR")
    config = load_config(args.config, args.overrides)
    check_files(config.dataset.name, config.dataset.root, config.dataset.download)
    from fedpcd.backends import run_experiment

    args.resume_hint = f"fedpcd run --resume {config.output_dir}"
    return run_experiment(config, progress=not args.quiet), config.output_dir


def _resume(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``fedpcd run --resume RUN_DIR [rounds=N] [--allow-config-change KEY[=VALUE]...]``: the summary and the
    run's folder."""
    # --allow-config-change KEY=VALUE sets the key too; nargs="+" also takes the overrides after it
    allow = [item for item in args.allow_config_change if "=" not in item]
    changes = [*args.overrides, *(item for item in args.allow_config_change if "=" in item)]
    unflagged = [item for item in args.overrides if item.partition("=")[0] != "rounds"]
    if args.config or unflagged:
        raise UserError(
            "--resume takes the run directory and its config.yaml as written; of the overrides only "
            "rounds=N (more rounds: the run is extended), others with --allow-config-change KEY=VALUE"
        )
    from fedpcd.config_identity import check_allowed_changes
    from fedpcd.run_format import RunFiles

    # a key no resume may change, then a folder that is no run: told before torch is imported
    check_allowed_changes(allow, changes)
    RunFiles(args.resume).check_resumable()
    from fedpcd.backends import resume_run

    args.resume_hint = f"fedpcd run --resume {args.resume}"
    summary = resume_run(args.resume, progress=not args.quiet, allow_changes=allow, changes=changes)
    return summary, args.resume


def cmd_partition(args: argparse.Namespace) -> None:
    from fedpcd.data.sources import check_files
    from fedpcd.resolve import load_config
    from fedpcd.utils import atomic_write_text, check_writable

    cfg = load_config(args.config, args.overrides)
    check_files(cfg.dataset.name, cfg.dataset.root, cfg.dataset.download)
    from fedpcd.data.datasets import load_configured
    from fedpcd.data.partition import make_partition
    from fedpcd.data.stats import partition_json, partition_table, plot_partition

    for target in (args.json, args.plot):  # a folder there, or a file on the way: before loading the data
        if target:
            check_writable(target)
    ds = load_configured(cfg)
    train_y, test_y = ds.train_y.numpy(), ds.test_y.numpy()
    params = cfg.partition.params()
    part = make_partition(
        train_y, test_y, cfg.clients, cfg.partition.scheme, params, cfg.seed, ds.num_classes, ds.groups
    )
    print(partition_table(part, train_y, test_y))
    if args.json:
        atomic_write_text(args.json, json.dumps(partition_json(part, train_y, test_y)))
        print(f"wrote {show_text(args.json)}")
    if args.plot:
        plot_partition(part, train_y, args.plot)
        print(f"wrote {show_text(args.plot)}")


def cmd_sweep(args: argparse.Namespace) -> None:
    from fedpcd.sweep.grid import expand_sweep
    from fedpcd.sweep.run import run_sweep
    from fedpcd.sweep.status import run_status

    if args.dry_run:
        for cfg in expand_sweep(args.config, args.overrides):
            print(f"{run_status(cfg):<7} {show_text(cfg.output_dir)}")
        return
    where = [] if args.launcher == "local" else ["--launcher", args.launcher]
    where += [*(["--address", args.address] if args.address else []), *(f"--slurm={s}" for s in args.slurm)]
    where += ["--allow-dirty"] if args.allow_dirty else []
    args.resume_hint = " ".join(["fedpcd sweep --config", args.config, *where, *args.overrides])
    run_sweep(
        args.config, args.overrides, args.jobs, args.launcher, args.address, args.slurm, args.allow_dirty
    )


def cmd_report(args: argparse.Namespace) -> None:
    from fedpcd.report.document import make_report

    report = make_report(
        args.runs_dir,
        args.out,
        last=args.last,
        rounds_to=args.rounds_to,
        paired_with=args.paired_with,
        with_swing=args.swing,
        geometry=args.geometry,
        with_best=args.best,
        title=args.title,
        notes=args.notes,
        workers=usable_cores(),  # the figures drawn by one process per core
    )
    if args.print or not args.out:
        print(report.markdown, end="")
    for path in report.files:  # the files this report wrote, the markdown first
        print(f"wrote {show_text(path)}")


def cmd_list(args: argparse.Namespace) -> None:
    from fedpcd.listing import list_components, list_configs

    if args.name == "configs":
        list_configs()
    elif args.name is not None:
        from fedpcd.catalog import rendered_description, rendered_unknown, unknown_name

        if rendered_unknown(args.name):  # its line without importing the components or the config schema
            from fedpcd.config_input import shipped_configs

            raise UserError(unknown_name(args.name, shipped_configs()))
        text = rendered_description(args.name)  # a shipped component or section: as rendered
        if text is None:
            from fedpcd.components import describe  # plugins, hf:NAME, no rendering: imported

            text = describe(args.name)
        print(text)
    else:
        list_components()


def cmd_demo(args: argparse.Namespace) -> None:
    from fedpcd.config_input import shipped_configs
    from fedpcd.resolve import load_config
    from fedpcd.utils import check_writable

    root = Path(args.out or f"runs/demo-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    # a file at --out or a mistyped override: told before torch is imported and before any method trains
    check_writable(root, folder=True)
    load_config(shipped_configs()["demo"], args.overrides)
    from fedpcd.demo import run_demo

    args.resume_hint = f"fedpcd demo --out {root} (finished methods are skipped)"
    print(run_demo(root, args.overrides, progress=not args.quiet))


def cmd_init(args: argparse.Namespace) -> None:
    from fedpcd.config_input import shipped_configs
    from fedpcd.utils import atomic_write_text, show_path

    target = Path(args.dir) / INIT_FILE
    if target.exists() or target.is_symlink():
        raise UserError(
            f"{show_path(target)} already exists; fedpcd init leaves it as it is (remove it, or give "
            "another DIR)"
        )
    atomic_write_text(target, shipped_configs()["example"].read_text(encoding="utf-8"))
    print(
        f"wrote {show_path(target)}: every config key with its default; run it with: fedpcd run --config "
        f"{show_path(target)}"
    )


def cmd_config_show(args: argparse.Namespace) -> None:
    from fedpcd.config_identity import config_yaml
    from fedpcd.config_input import read_yaml
    from fedpcd.resolve import load_config

    if args.config and "sweep" in read_yaml(args.config):  # every run of the grid, one YAML document each
        from fedpcd.sweep.grid import expand_sweep

        configs = expand_sweep(args.config, args.overrides)
        for i, config in enumerate(configs, 1):
            print(f"--- # run {i} of {len(configs)}\n{config_yaml(config)}", end="")
        return
    print(config_yaml(load_config(args.config, args.overrides)), end="")


HANDLERS = {
    "run": cmd_run,
    "partition": cmd_partition,
    "sweep": cmd_sweep,
    "report": cmd_report,
    "list": cmd_list,
    "demo": cmd_demo,
    "init": cmd_init,
    "config": cmd_config_show,  # its one action, show
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with _terminate_as_interrupt():
            from fedpcd import logs

            logs.setup(args.verbose - args.quiet)
            if getattr(args, "config", None):  # a file, else a shipped config's name
                from fedpcd.config_input import config_path

                args.config = config_path(args.config)
            HANDLERS[args.command](args)
    except UserError as exc:
        print(f"fedpcd: error: {show_text(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as exc:  # Ctrl-C, or Terminated by one of STOP_SIGNALS
        return _interrupted(args, exc)
    except (MemoryError, ImportError, RuntimeError, SystemError) as exc:  # memory ran out? else re-raised
        interrupt = interrupt_behind(exc)
        if interrupt is not None:  # a library's error that stands for a Ctrl-C or stop signal
            return _interrupted(args, interrupt)
        line = out_of_memory_line(exc)
        if line is None:
            raise
        print(f"fedpcd: error: {line}", file=sys.stderr)
        return 2
    except OSError as exc:  # one the commands did not turn into a line of their own
        line = show_text(_os_error_line(exc, getattr(args, "resume_hint", None)))
        print(f"fedpcd: error: {line}", file=sys.stderr)
        return 2
    return 0


def _interrupted(args: argparse.Namespace, exc: KeyboardInterrupt) -> int:
    """The line of a command stopped by Ctrl-C or a stop signal, and its exit status (130; 128 + signal)."""
    hint = getattr(args, "resume_hint", None)
    print(show_text(f"fedpcd: interrupted{f' (resume with: {hint})' if hint else ''}"), file=sys.stderr)
    return 128 + int(exc.signum) if isinstance(exc, Terminated) else 130


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM, SIGHUP and SIGQUIT raise :class:`Terminated` in the main thread for the block (elsewhere: no
    change): each ends a command as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = stop_signals_raise()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _os_error_line(exc: OSError, hint: str | None) -> str:
    """An OSError as one line: the path (or the resource), the system's cause and what to do."""
    from fedpcd.engine.rundir import os_advice
    from fedpcd.utils import show_path

    cause = exc.strerror or type(exc).__name__
    what = f"cannot access {show_path(exc.filename)}: {cause}" if exc.filename is not None else cause
    resume = f"; then resume with: {hint}" if hint and exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"{what}; {os_advice(exc)}{resume}"


if __name__ == "__main__":
    sys.exit(main())
