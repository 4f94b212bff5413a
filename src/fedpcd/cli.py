"""The ``fedpcd`` command line (CONTRACT.md). User errors exit with code 2 and one line on stderr."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from fedpcd.errors import UserError

# FedAvg and the five papers' methods with their library defaults, but FedSC's CPDR weight: the paper's 1
# collapses FedSC at this CPU scale (docs/results/fedsc.md), 0.01 trains.
DEMO_METHODS = [
    ("fedavg", []),
    ("fedgela", []),
    ("fedmr", []),
    ("fednh", []),
    ("fedsc", ["algorithm.cpdr_weight=0.01"]),
    ("fedssa", []),
]


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*["-" * w for w in widths])] + [fmt.format(*r) for r in rows]
    )


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


SHOWN = [
    ("global_acc", "GA"),
    ("personal_acc", "PA-split"),
    ("pa_l", "PA-L"),
    ("pa_v", "PA-V"),
    ("pa_global", "PA-G"),
    ("personal_acc_worst10", "PA worst10%"),
]


def _summary_table(summary: dict[str, Any]) -> str:
    rows = [[label, _pct(summary["final"].get(key)), _pct(summary["best"].get(key))] for key, label in SHOWN]
    return _table(rows, ["metric (%)", "final", "best"])


def cmd_run(args: argparse.Namespace) -> None:
    from fedpcd.config import load_config
    from fedpcd.engine import resume_run, run_experiment

    if args.resume:
        if args.config or args.overrides:
            raise UserError("--resume takes only the run directory; its config.yaml is used as written")
        summary = resume_run(args.resume, progress=not args.quiet)
        out = args.resume
    else:
        if not args.config and not args.overrides:
            raise UserError("fedpcd run needs --config FILE (and/or KEY=VALUE overrides) or --resume RUN_DIR")
        config = load_config(args.config, args.overrides)
        summary = run_experiment(config, progress=not args.quiet)
        out = config.output_dir
    print(_summary_table(summary))
    print(f"run directory: {out}  ({summary['wall_s']:.1f} s)")


def cmd_partition(args: argparse.Namespace) -> None:
    from fedpcd.config import load_config
    from fedpcd.data.datasets import load_dataset
    from fedpcd.data.partition import make_partition
    from fedpcd.data.stats import partition_json, partition_table, plot_partition
    from fedpcd.utils import atomic_write_text

    cfg = load_config(args.config, args.overrides)
    ds = load_dataset(
        cfg.dataset.name, cfg.dataset.root, cfg.dataset.train_fraction, cfg.seed, cfg.dataset.download
    )
    train_y, test_y = ds.train_y.numpy(), ds.test_y.numpy()
    part = make_partition(
        train_y, test_y, cfg.clients, cfg.partition.scheme, cfg.partition.params(), cfg.seed, ds.num_classes
    )
    print(partition_table(part, train_y, test_y))
    if args.json:
        atomic_write_text(args.json, json.dumps(partition_json(part, train_y, test_y)))
        print(f"wrote {args.json}")
    if args.plot:
        plot_partition(part, train_y, args.plot)
        print(f"wrote {args.plot}")


def cmd_sweep(args: argparse.Namespace) -> None:
    from fedpcd.sweep import expand_sweep, run_status, run_sweep

    if args.dry_run:
        for cfg in expand_sweep(args.config, args.overrides):
            print(f"{run_status(cfg):<7} {cfg.output_dir}")
        return
    run_sweep(args.config, args.overrides, jobs=args.jobs)


def cmd_report(args: argparse.Namespace) -> None:
    from fedpcd.report import write_report

    text = write_report(
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
    print(text, end="")
    if args.out:
        from fedpcd.report import output_paths

        markdown, figures = output_paths(args.out)
        print(f"wrote {markdown} (figures and CSV in {figures})")


def cmd_list(args: argparse.Namespace) -> None:
    from fedpcd.algorithms import ALGORITHMS
    from fedpcd.data.datasets import DATASETS
    from fedpcd.data.partition import PARTITIONERS
    from fedpcd.models import MODELS

    def first_line(obj: Any) -> str:
        return (obj.__doc__ or "").strip().splitlines()[0] if obj.__doc__ else ""

    for kind, reg in [
        ("algorithm", ALGORITHMS),
        ("dataset", DATASETS),
        ("partition", PARTITIONERS),
        ("model", MODELS),
    ]:
        for name in reg.names():
            print(f"{kind:<10} {name:<14} {first_line(reg.get(name))}")


def cmd_demo(args: argparse.Namespace) -> None:
    from fedpcd.config import load_config
    from fedpcd.engine import run_experiment

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(args.out or f"runs/demo-{stamp}")
    demo_file = resources.files("fedpcd") / "configs" / "demo.yaml"
    rows = []
    with resources.as_file(demo_file) as path:
        for name, params in DEMO_METHODS:
            cfg = load_config(
                path, [f"algorithm.name={name}", *params, f"output_dir={root / name}", *args.overrides]
            )
            print(
                f"== {name}: {cfg.dataset.name} {cfg.partition.scheme} {cfg.clients} clients, "
                f"{cfg.rounds} rounds",
                file=sys.stderr,
            )
            s = run_experiment(cfg, progress=not args.quiet)
            label = " ".join([name, *(p.removeprefix("algorithm.") for p in params)])
            rows.append([label] + [_pct(s["final"].get(k)) for k, _ in SHOWN] + [f"{s['wall_s']:.1f}"])
    print(_table(rows, ["algorithm"] + [label for _, label in SHOWN] + ["wall s"]))
    print(f"runs in {root}; accuracies in %, last round; PA = personal models of the round's participants")
    from fedpcd.report import load_runs, plot_curves

    plot_curves(load_runs(root), root / "curves.png")
    print(f"GA and PA-split over rounds: {root / 'curves.png'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedpcd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one experiment")
    run.add_argument("--config", help="YAML config file")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. partition.beta=0.1"
    )
    run.set_defaults(func=cmd_run)

    part = sub.add_parser("partition", help="build and describe a partition only")
    part.add_argument("--config", help="YAML config file")
    part.add_argument("--json", help="write partition.json here")
    part.add_argument("--plot", help="write a client x class heatmap PNG here")
    part.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    part.set_defaults(func=cmd_partition)

    sweep = sub.add_parser("sweep", help="a grid of runs from a sweep file (resumable)")
    sweep.add_argument(
        "--config", required=True, help="config with a top-level 'sweep:' mapping of key -> list"
    )
    sweep.add_argument(
        "--jobs", type=int, default=1, help="runs in parallel (processes; 1 torch thread each)"
    )
    sweep.add_argument("--dry-run", action="store_true", help="list the runs and their status only")
    sweep.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    sweep.set_defaults(func=cmd_sweep)

    report = sub.add_parser("report", help="tables and plots from finished runs")
    report.add_argument("runs_dir", help="folder searched for run directories")
    report.add_argument(
        "--out",
        help="write the report here: a folder (report.md, curves, partitions, cells.csv inside) or a .md "
        "file (figures in the folder of the same name beside it)",
    )
    report.add_argument("--title", help="a '# TITLE' heading on top of the markdown")
    report.add_argument("--notes", metavar="FILE", help="markdown put under the title (setup, caveats)")
    report.add_argument(
        "--last", type=int, default=5, help="average each run over its last N evaluated rounds"
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

    lst = sub.add_parser("list", help="algorithms, datasets, partition schemes and models")
    lst.set_defaults(func=cmd_list)

    demo = sub.add_parser("demo", help="a short comparison of methods on Fashion-MNIST P10C2")
    demo.add_argument("--out", help="folder for the demo's runs (default runs/demo-<time>)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. rounds=2")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may stand anywhere between the options
    if extra and (not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        args.func(args)
    except UserError as exc:
        print(f"fedpcd: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("fedpcd: interrupted (resume with 'fedpcd run --resume RUN_DIR')", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
