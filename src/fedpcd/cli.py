"""The ``fedpcd`` command line. User errors exit with code 2 and one line on stderr."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import itertools
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedpcd import __version__
from fedpcd.errors import STOP_SIGNALS, Terminated, UserError
from fedpcd.procs_guard import (
    out_of_memory_line,
    stop_signals_raise,
)  # at start: under a memory limit a late import fails
from fedpcd.utils import show_text

# Only the standard library and fedpcd's light modules load at import: `fedpcd --help`, a missing config,
# `init` and `list configs` answer without torch; each command imports what it needs once its input is read.

INIT_FILE = "fedpcd.yaml"  # what `fedpcd init` writes


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
    from fedpcd.config import load_config

    if args.resume:
        # --allow-config-change KEY=VALUE sets the key too; nargs="+" also takes the overrides after it
        allow = [item for item in args.allow_config_change if "=" not in item]
        changes = [*args.overrides, *(item for item in args.allow_config_change if "=" in item)]
        unflagged = [item for item in args.overrides if item.partition("=")[0] != "rounds"]
        if args.config or unflagged:
            raise UserError(
                "--resume takes the run directory and its config.yaml as written; of the overrides only "
                "rounds=N (more rounds: the run is extended), others with --allow-config-change KEY=VALUE"
            )
        from fedpcd.engine import resume_run

        args.resume_hint = f"fedpcd run --resume {args.resume}"
        summary = resume_run(args.resume, progress=not args.quiet, allow_changes=allow, changes=changes)
        out = args.resume
    else:
        if not args.config and not args.overrides:
            raise UserError("fedpcd run needs --config FILE (and/or KEY=VALUE overrides) or --resume RUN_DIR")
        if args.allow_config_change:
            raise UserError("--allow-config-change goes with --resume RUN_DIR")
        config = load_config(args.config, args.overrides)
        from fedpcd.engine import run_experiment

        args.resume_hint = f"fedpcd run --resume {config.output_dir}"
        summary = run_experiment(config, progress=not args.quiet)
        out = config.output_dir
    print(_summary_table(summary))
    print(f"run directory: {show_text(out)}  ({summary['wall_s']:.1f} s)")


def cmd_partition(args: argparse.Namespace) -> None:
    from fedpcd.config import load_config
    from fedpcd.utils import atomic_write_text, check_writable

    cfg = load_config(args.config, args.overrides)
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
    )
    if args.print or not args.out:
        print(report.markdown, end="")
    for path in report.files:  # the files this report wrote, the markdown first
        print(f"wrote {show_text(path)}")


def cmd_list(args: argparse.Namespace) -> None:
    if args.name == "configs":
        _list_configs()
        return
    if args.name is not None:
        from fedpcd.api import describe  # an unknown name is answered before any component is imported

        print(describe(args.name))
        return

    from fedpcd.catalog import catalog  # the names and docstrings read from the source: no torch
    from fedpcd.utils import plain_text

    for kind, label in [
        ("algorithm", "algorithm"),
        ("dataset", "dataset"),
        ("partition scheme", "partition"),
        ("model", "model"),
    ]:
        for name, doc in catalog(kind).items():
            head = f"{label:<10} {name:<14} "
            print(head + shorten(plain_text(doc.strip()), LIST_WIDTH - len(head)))


def _list_configs() -> None:
    """Each shipped config's name (what ``--config`` takes) and its leading comment's first sentence."""
    from fedpcd.config_input import shipped_configs
    from fedpcd.utils import plain_text

    shipped = shipped_configs()
    width = max(map(len, shipped)) + 2
    for name, path in shipped.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        comment = [line.lstrip("#").strip() for line in itertools.takewhile(_is_comment, lines)]
        print(f"{name:<{width}}" + shorten(plain_text("\n".join(comment)), LIST_WIDTH - width))


def _is_comment(line: str) -> bool:
    return line.startswith("#")


LIST_WIDTH = 120  # `fedpcd list` lines are at most this long
# a full stop after these ends no sentence
_ABBREVIATIONS = ("e.g.", "i.e.", "al.", "Eq.", "Eqs.", "Sec.", "App.", "Fig.", "Tab.", "cf.", "vs.", "tech.")


def _balanced(text: str) -> bool:
    return text.count("(") == text.count(")") and text.count("``") % 2 == 0


def shorten(doc: str, width: int) -> str:
    """A docstring's first sentence on one line of at most ``width`` characters: whole if it fits, else cut
    after its last clause (', ', '; ', ': ') outside brackets where that keeps three quarters of it, else
    after its last whole word (outside brackets where that keeps half of it, a bracket then closed after the
    ellipsis), and marked with an ellipsis."""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    for i, char in enumerate(text):  # the first sentence: up to a full stop before a capital or the end
        if char == "." and (i + 1 == len(text) or text[i + 1 : i + 3].strip()[:1].isupper()):
            word = text[: i + 1].rsplit(" ", 1)[-1].lstrip("(")
            if not word.endswith(_ABBREVIATIONS) and _balanced(text[: i + 1]):
                text = text[: i + 1]
                break
    if len(text) <= width:
        return text
    room = width - 2  # the ellipsis, and a bracket closed after it
    clauses = [i for i in range(room) if text[i : i + 2] in (", ", "; ", ": ") and _balanced(text[:i])]
    words = [i for i in range(room + 1) if text[i] == " " and _balanced(text[:i])]
    cut = next((i for i in reversed(clauses) if i >= 3 * width // 4), None)  # a whole clause, if long
    cut = cut or next((i for i in reversed(words) if i >= width // 2), None)
    if cut is None:  # inside a long bracket: its last whole word, then the bracket closed
        cut = text[: room + 1].rfind(" ")
    kept = text[: cut if cut > 0 else room].rstrip(" ,;:")
    return kept + "…" + ")" * (kept.count("(") - kept.count(")"))


def cmd_demo(args: argparse.Namespace) -> None:
    from fedpcd.demo import run_demo

    root = Path(args.out or f"runs/demo-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
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
    from fedpcd.config import config_yaml, load_config
    from fedpcd.config_input import read_yaml

    if args.config and "sweep" in read_yaml(args.config):  # every run of the grid, one YAML document each
        from fedpcd.sweep.grid import expand_sweep

        configs = expand_sweep(args.config, args.overrides)
        for i, config in enumerate(configs, 1):
            print(f"--- # run {i} of {len(configs)}\n{config_yaml(config)}", end="")
        return
    print(config_yaml(load_config(args.config, args.overrides)), end="")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text[:40]!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from fedpcd.utils import plain_text

    parser = argparse.ArgumentParser(prog="fedpcd", description=plain_text(__doc__ or ""))
    parser.add_argument("--version", action="version", version=f"fedpcd {__version__}")
    _add_verbosity(parser, quiet_note="; run, demo: no progress bar")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one experiment")
    run.add_argument("--config", help=CONFIG_HELP)
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an interrupted run; with rounds=N, extend a finished one",
    )
    run.add_argument(
        "--allow-config-change",
        nargs="+",
        default=[],
        metavar="KEY[=VALUE]",
        help="with --resume: go on although config.yaml changed these keys since the checkpoint, or set them "
        "(KEY=VALUE) (only rounds, engine.checkpoint_every, engine.threads, dataset.download); more rounds "
        "need no flag: fedpcd run --resume RUN_DIR rounds=N",
    )
    run.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. partition.beta=0.1"
    )
    run.set_defaults(func=cmd_run)

    part = sub.add_parser("partition", help="build and describe a partition only")
    part.add_argument("--config", help=CONFIG_HELP)
    part.add_argument("--json", help="write partition.json here")
    part.add_argument("--plot", help="write a client x class heatmap PNG here")
    part.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    part.set_defaults(func=cmd_partition)

    sweep = sub.add_parser("sweep", help="a grid of runs from a sweep file (resumable)")
    sweep.add_argument(
        "--config",
        required=True,
        help="config with a top-level 'sweep:' mapping of key -> list: a file, or the name of a shipped one "
        "(`fedpcd list configs`), e.g. repro/fednh-fmnist",
    )
    sweep.add_argument(
        "--jobs",
        type=_positive_int,
        metavar="N",
        help="runs at once: worker processes with --launcher local (default 1: in this process); Ray: "
        "default one per CPU of the cluster; Slurm: jobs queued or running (default all)",
    )
    sweep.add_argument(
        "--launcher",
        default="local",
        metavar="{local,ray,slurm}",
        help="where the runs execute: local (this machine), ray (a Ray cluster), slurm (Slurm jobs through "
        'submitit); ray and slurm need pip install "fedpcd[cluster]"',
    )
    sweep.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="with --launcher ray: the address of a running Ray cluster (host:port; default RAY_ADDRESS, "
        "else one is started on this machine for the sweep)",
    )
    sweep.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --launcher slurm, repeatable: partition=NAME, time=MINUTES per run (default 60), cpus=N, "
        "mem=GB, gpus=N; cluster=local runs the jobs on this machine instead",
    )
    sweep.add_argument("--dry-run", action="store_true", help="list the runs and their status only")
    sweep.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run into docs/results/runs although src/fedpcd has uncommitted changes (the runs record it)",
    )
    sweep.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    sweep.set_defaults(func=cmd_sweep)

    report = sub.add_parser("report", help="tables and plots from finished runs")
    report.add_argument("runs_dir", help="folder searched for run directories")
    report.add_argument(
        "--out",
        help="write the report here: a folder (report.md and its figures inside; cells.csv too for runs of "
        "several methods and settings) or a .md file (figures in the folder of the same name beside it)",
    )
    report.add_argument(
        "--print",
        action="store_true",
        help="with --out: also print the markdown (without --out it is always printed)",
    )
    report.add_argument("--title", help="a '# TITLE' heading on top of the markdown")
    report.add_argument("--notes", metavar="FILE", help="markdown put under the title (setup, caveats)")
    report.add_argument(
        "--last",
        type=_positive_int,
        default=5,
        help="average each run over its last N evaluated rounds (all of them where it has fewer)",
    )
    report.add_argument(
        "--rounds-to",
        type=float,
        nargs="+",
        default=[],
        metavar="X",
        help="add columns R<X>%%: the first round at which GA reaches X%% (FedSC's convergence view)",
    )
    report.add_argument(
        "--paired-with",
        metavar="ALGORITHM",
        help="add GA and PA-split differences to this algorithm's run of the same setting and seed",
    )
    report.add_argument(
        "--swing",
        action="store_true",
        help="add a 'GA swing' column: max - min of GA over the last N rounds (round-to-round stability)",
    )
    report.add_argument(
        "--best",
        action="store_true",
        help="add a 'GA best' column: each run's highest GA over all rounds (FedGELA's code's protocol)",
    )
    report.add_argument(
        "--geometry",
        action="store_true",
        help="add class-mean angles (FedGELA Fig. 3): global model over all classes, personal models over "
        "held and missing classes; needs the runs' checkpoints (one extra local update per client)",
    )
    report.set_defaults(func=cmd_report)

    lst = sub.add_parser(
        "list", help="algorithms, datasets, partition schemes and models; `list configs`: the shipped configs"
    )
    lst.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="one algorithm, model, dataset or partition scheme: its paper, a one-line description and its "
        "parameters with their types and defaults; `configs`: the configs fedpcd ships, which --config takes "
        "by name",
    )
    lst.set_defaults(func=cmd_list)

    demo = sub.add_parser("demo", help="a short comparison of methods on Fashion-MNIST P10C2")
    demo.add_argument("--out", help="folder for the demo's runs (default runs/demo-<time>)")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. rounds=2")
    demo.set_defaults(func=cmd_demo)

    init = sub.add_parser("init", help=f"write {INIT_FILE}: every config key with its default, commented")
    init.add_argument(
        "dir", nargs="?", default=".", metavar="DIR", help="the folder to write it in (default: this one)"
    )
    init.set_defaults(func=cmd_init)

    config = sub.add_parser("config", help="show the resolved config")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="print the resolved config as YAML: every key, defaults filled (a run's config.yaml); of a "
        "sweep file, each run's config as a YAML document of its own",
    )
    show.add_argument("--config", help=f"{CONFIG_HELP} (default: none, every key at its default)")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rounds=5")
    show.set_defaults(func=cmd_config_show)

    for name, command in [*((n, p) for n, p in sub.choices.items() if n != "config"), ("show", show)]:
        _add_verbosity(command, "sub_", "; no progress bar" if name in ("run", "demo") else "")
    return parser


CONFIG_HELP = "YAML config file, or the name of a shipped config (`fedpcd list configs`), e.g. example"


def _add_verbosity(parser: argparse.ArgumentParser, prefix: str = "", quiet_note: str = "") -> None:
    """-v/--verbose and -q/--quiet, counted: before the command (``prefix`` "") and after it (``"sub_"``);
    :func:`main` adds the two counts up."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        dest=f"{prefix}verbose",
        help="more messages (repeatable)",
    )
    parser.add_argument(
        "-q", "--quiet", action="count", default=0, dest=f"{prefix}quiet", help=f"fewer messages{quiet_note}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments; a malformed one: argparse's usage line and exit code 2."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may stand anywhere between the options
    if extra and (not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    args.verbose += args.sub_verbose
    args.quiet += args.sub_quiet  # run and demo: no progress bar
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with _terminate_as_interrupt():
            from fedpcd import logs

            logs.setup(args.verbose - args.quiet)
            if getattr(args, "config", None):  # a file, else a shipped config's name
                from fedpcd.config_input import config_path

                args.config = config_path(args.config)
            args.func(args)
    except UserError as exc:
        print(f"fedpcd: error: {show_text(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except (
        KeyboardInterrupt,
        SystemExit,
    ) as exc:  # Ctrl-C, STOP_SIGNALS; in a Flower run: SystemExit(signum)
        if isinstance(exc, SystemExit) and exc.code not in STOP_SIGNALS:
            raise
        hint = getattr(args, "resume_hint", None)
        print(show_text(f"fedpcd: interrupted{f' (resume with: {hint})' if hint else ''}"), file=sys.stderr)
        if isinstance(exc, Terminated):
            return 128 + int(exc.signum)
        return 130 if isinstance(exc, KeyboardInterrupt) else int(exc.code)  # type: ignore[arg-type]
    except (MemoryError, ImportError, RuntimeError, SystemError) as exc:  # memory ran out? else re-raised
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
