"""The grammar of the ``fedpcd`` command line: the global options and one subparser per command
(``COMMANDS``), and :func:`parse_args`, which also takes KEY=VALUE overrides anywhere between the options.
Only the standard library loads here: ``fedpcd --help`` answers without torch."""

from __future__ import annotations

import argparse

from fedpcd._version import __version__

DESCRIPTION = "The ``fedpcd`` command line. User errors exit with code 2 and one line on stderr."
CONFIG_HELP = "YAML config file, or the name of a shipped config (`fedpcd list configs`), e.g. example"
INIT_FILE = "fedpcd.yaml"  # what `fedpcd init` writes
PROGRESS_BARS = ("run", "demo")  # the commands whose -q also hides the progress bar
Subparsers = argparse._SubParsersAction  # what ArgumentParser.add_subparsers returns


def _jobs(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or auto, got {text[:40]!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text[:40]!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``fedpcd`` parser: global options, then one subparser per command (``COMMANDS``), each taking
    -v/-q after the command too."""
    from fedpcd.utils import plain_text

    parser = argparse.ArgumentParser(prog="fedpcd", description=plain_text(DESCRIPTION))
    parser.add_argument("--version", action="version", version=f"fedpcd {__version__}")
    _add_verbosity(parser, quiet_note="; run, demo: no progress bar")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        command = add_command(sub)
        note = "; no progress bar" if command.prog.split()[1] in PROGRESS_BARS else ""
        _add_verbosity(command, "sub_", note)
    return parser


def _run_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd run``."""
    parser = sub.add_parser("run", help="run one experiment")
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an interrupted run; with rounds=N, extend a finished one",
    )
    parser.add_argument(
        "--allow-config-change",
        nargs="+",
        default=[],
        metavar="KEY[=VALUE]",
        help="with --resume: go on although config.yaml changed these keys since the checkpoint, or set them "
        "(KEY=VALUE) (only rounds, engine.checkpoint_every, engine.threads, dataset.download); more rounds "
        "need no flag: fedpcd run --resume RUN_DIR rounds=N",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. partition.beta=0.1"
    )
    return parser


def _partition_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd partition``."""
    parser = sub.add_parser("partition", help="build and describe a partition only")
    parser.add_argument("--config", help=CONFIG_HELP)
    parser.add_argument("--json", help="write partition.json here")
    parser.add_argument("--plot", help="write a client x class heatmap PNG here")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser


def _sweep_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd sweep``."""
    parser = sub.add_parser("sweep", help="a grid of runs from a sweep file (resumable)")
    parser.add_argument(
        "--config",
        required=True,
        help="config with a top-level 'sweep:' mapping of key -> list: a file, or the name of a shipped one "
        "(`fedpcd list configs`), e.g. repro/fednh-fmnist",
    )
    parser.add_argument(
        "--jobs",
        type=_jobs,
        metavar="N|auto",
        help="runs at once: with --launcher local, worker processes (default auto: as many runs as the "
        "cores hold, each with its engine.workers; 1: one after another in this process); Ray: default one "
        "per CPU of the cluster; Slurm: jobs queued or running (default all)",
    )
    parser.add_argument(
        "--launcher",
        default="local",
        metavar="{local,ray,slurm}",
        help="where the runs execute: local (this machine), ray (a Ray cluster), slurm (Slurm jobs through "
        'submitit); ray and slurm need pip install "fedpcd[cluster]"',
    )
    parser.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="with --launcher ray: the address of a running Ray cluster (host:port; default RAY_ADDRESS, "
        "else one is started on this machine for the sweep)",
    )
    parser.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --launcher slurm, repeatable: partition=NAME, time=MINUTES per run (default 60), cpus=N, "
        "mem=GB, gpus=N; cluster=local runs the jobs on this machine instead",
    )
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their status only")
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run into docs/results/runs although src/fedpcd has uncommitted changes (the runs record it)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    return parser


def _report_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd report``."""
    parser = sub.add_parser("report", help="tables and plots from finished runs")
    parser.add_argument("runs_dir", help="folder searched for run directories")
    parser.add_argument(
        "--out",
        help="write the report here: a folder (report.md and its figures inside; cells.csv too for runs of "
        "several methods and settings) or a .md file (figures in the folder of the same name beside it)",
    )
    parser.add_argument(
        "--print",
        action="store_true",
        help="with --out: also print the markdown (without --out it is always printed)",
    )
    parser.add_argument("--title", help="a '# TITLE' heading on top of the markdown")
    parser.add_argument("--notes", metavar="FILE", help="markdown put under the title (setup, caveats)")
    parser.add_argument(
        "--last",
        type=_positive_int,
        default=5,
        help="average each run over its last N evaluated rounds (all of them where it has fewer)",
    )
    parser.add_argument(
        "--rounds-to",
        type=float,
        nargs="+",
        default=[],
        metavar="X",
        help="add columns R<X>%%: the first round at which GA reaches X%% (FedSC's convergence view)",
    )
    parser.add_argument(
        "--paired-with",
        metavar="ALGORITHM",
        help="add GA and PA-split differences to this algorithm's run of the same setting and seed",
    )
    parser.add_argument(
        "--swing",
        action="store_true",
        help="add a 'GA swing' column: max - min of GA over the last N rounds (round-to-round stability)",
    )
    parser.add_argument(
        "--best",
        action="store_true",
        help="add a 'GA best' column: each run's highest GA over all rounds (FedGELA's code's protocol)",
    )
    parser.add_argument(
        "--geometry",
        action="store_true",
        help="add class-mean angles (FedGELA Fig. 3): global model over all classes, personal models over "
        "held and missing classes; those a run recorded (geometry: true), else rebuilt from its checkpoint "
        "(one extra local update per client)",
    )
    return parser


def _list_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd list``."""
    parser = sub.add_parser(
        "list", help="algorithms, datasets, partition schemes and models; `list configs`: the shipped configs"
    )
    parser.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="one algorithm, model, dataset or partition scheme: its paper, a one-line description and its "
        "parameters with their types and defaults; `configs`: the configs fedpcd ships, which --config takes "
        "by name",
    )
    return parser


def _demo_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd demo``."""
    parser = sub.add_parser("demo", help="a short comparison of methods on Fashion-MNIST P10C2")
    parser.add_argument("--out", help="folder for the demo's runs (default runs/demo-<time>)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. rounds=2")
    return parser


def _init_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd init``."""
    parser = sub.add_parser("init", help=f"write {INIT_FILE}: every config key with its default, commented")
    parser.add_argument(
        "dir", nargs="?", default=".", metavar="DIR", help="the folder to write it in (default: this one)"
    )
    return parser


def _config_command(sub: Subparsers) -> argparse.ArgumentParser:
    """The parser of ``fedpcd config``; returns its one action's, ``config show``."""
    parser = sub.add_parser("config", help="show the resolved config")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="print the resolved config as YAML: every key, defaults filled (a run's config.yaml); of a "
        "sweep file, each run's config as a YAML document of its own",
    )
    show.add_argument("--config", help=f"{CONFIG_HELP} (default: none, every key at its default)")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rounds=5")
    return show


COMMANDS = (
    _run_command,
    _partition_command,
    _sweep_command,
    _report_command,
    _list_command,
    _demo_command,
    _init_command,
    _config_command,
)


def _add_verbosity(parser: argparse.ArgumentParser, prefix: str = "", quiet_note: str = "") -> None:
    """-v/--verbose and -q/--quiet, counted: before the command (``prefix`` "") and after it (``"sub_"``);
    :func:`parse_args` adds the two counts up."""
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
