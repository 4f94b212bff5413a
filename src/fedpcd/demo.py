"""``fedpcd demo``: FedAvg and the five papers' methods on one label-skew setting, a table that explains
itself and a curve plot titled with the setting."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpcd.backends import resume_run, run_experiment
from fedpcd.config import Config
from fedpcd.config_input import shipped_configs
from fedpcd.engine.rundir import RunDir
from fedpcd.report.stats import last_mean, swing
from fedpcd.resolve import load_config
from fedpcd.run_format import HEADLINE, METRICS, PA_G
from fedpcd.utils import text_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# FedAvg and the five papers' methods with their library defaults, but FedSC's CPDR weight (see FEDSC_NOTE).
DEMO_METHODS: list[tuple[str, list[str]]] = [
    ("fedavg", []),
    ("fedgela", []),
    ("fedmr", []),
    ("fednh", []),
    ("fedsc", ["algorithm.cpdr_weight=0.01"]),
    ("fedssa", []),
]
WIDTH = 110  # printed paragraphs are wrapped to this width
LAST = 3  # the table averages each method over its last LAST evaluated rounds
FEDSSA_NOTE = (
    "FedSSA has no GA: its clients keep private feature extractors and share only classifier rows, so there "
    "is no global model to test."
)
FEDSC_NOTE = (
    "FedSC runs at CPDR weight 0.01 instead of the paper's 1: with the paper's L1-sum distance, ~d times a "
    "mean, weight 1 collapses training at this scale (Fashion-MNIST: docs/results/fedsc.md)."
)


def legend(cap: str = "") -> str:
    """What each column of the table measures (``cap``: a note on PA-G's ceiling, put after its text)."""
    return " ".join(f"{m.label}: {m.description}{cap if m is PA_G else ''}." for m in METRICS)


def setting_name(cfg: Config) -> str:
    """The demo's setting in one line, e.g. 'fmnist P10C2 (25% of the train set), simplecnn, 10 rounds x 1
    epoch, seed 0'."""
    params = cfg.partition.params()
    if cfg.partition.scheme == "pathological":
        split = f"P{cfg.clients}C{params['classes_per_client']}"
    else:
        shown = ", ".join(f"{k}={v}" for k, v in params.items() if v is not None)
        split = f"{cfg.clients} clients, {cfg.partition.scheme}" + (f" ({shown})" if shown else "")
    subset = f" ({cfg.dataset.train_fraction:.0%} of the train set)" if cfg.dataset.train_fraction < 1 else ""
    epochs = f"{cfg.local.epochs} epoch{'s' if cfg.local.epochs != 1 else ''}"
    model = cfg.model.name if isinstance(cfg.model.name, str) else "/".join(cfg.model.name)
    return f"{cfg.dataset.name} {split}{subset}, {model}, {cfg.rounds} rounds x {epochs}, seed {cfg.seed}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def leader_sentence(label: str, means: dict[str, float], swings: dict[str, float | None]) -> str:
    """Which method leads on a metric, by how much over the second, and whether that exceeds the leader's
    round-to-round swing (a lead below it is not a finding on one seed)."""
    ranked = sorted(means.items(), key=lambda kv: -kv[1])
    if not ranked:
        return f"{label}: no method has a value."
    best, value = ranked[0]
    if len(ranked) == 1:
        return f"{label}: only {best} has a value ({100 * value:.1f}%)."
    second, runner = ranked[1]
    lead = 100 * (value - runner)
    swing = swings.get(best)
    text = f"{label}: {best} leads with {100 * value:.1f}%, {lead:.1f} points above {second}"
    if swing is None:
        return text + "."
    verdict = "more than" if lead > 100 * swing else "within"
    return (
        f"{text}; its {label} moved by {100 * swing:.1f} points over those rounds, so the lead is {verdict} "
        "the round-to-round swing" + ("." if verdict == "more than" else " (not a finding on one seed).")
    )


def plot_demo_curves(curves: dict[str, list[dict[str, Any]]], title: str, path: Path) -> Figure:
    """GA and PA-split over rounds, one line per method, a legend per panel naming only its lines, one
    y-range for both panels."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from fedpcd.utils import atomic_write

    fig = Figure(figsize=(11, 4.4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, metric in zip(axes, HEADLINE, strict=False):
        for i, (name, records) in enumerate(curves.items()):  # one colour per method on both panels
            points = [(r["round"], 100 * r[metric.key]) for r in records if r.get(metric.key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", markersize=3, color=f"C{i}", label=name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(metric.label)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    axes[0].set_ylabel("accuracy (%)")
    fig.suptitle(title)
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110), mode="wb")
    return fig


def eta(trained: list[float], remaining: int) -> str:
    """' (about N min left ...)': the ``remaining`` methods (this one included) at the mean time of the
    methods trained so far in this call; empty before the first has finished."""
    if not trained:
        return ""
    seconds = remaining * sum(trained) / len(trained)
    left = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    done = f"the {len(trained)} finished" if len(trained) > 1 else "the one finished"
    methods = f"the {remaining} methods" if remaining > 1 else "the one method"
    return f" (demo ETA: about {left} for {methods} left, at the mean time of {done})"


def run_demo(out: Path, overrides: list[str], progress: bool = True) -> str:
    """Train each of DEMO_METHODS on the packaged demo config (plus ``overrides``) into ``out/<name>``, draw
    ``out/curves.png`` and return the printed report."""
    path = shipped_configs()["demo"]
    curves: dict[str, list[dict[str, Any]]] = {}
    trained: list[float] = []  # seconds of each method trained (not reused) in this call
    rows, means, swings = [], {m.key: {} for m in HEADLINE}, {m.key: {} for m in HEADLINE}
    for number, (name, params) in enumerate(DEMO_METHODS, 1):
        cfg = load_config(path, [f"algorithm.name={name}", *params, f"output_dir={out / name}", *overrides])
        run_dir = RunDir(out / name)  # a finished method is reused, an interrupted one resumed
        head = f"== method {number}/{len(DEMO_METHODS)}: {name}"
        reused = run_dir.summary.exists()
        if reused:
            print(f"{head}: reused finished run in {out / name}", file=sys.stderr)
        else:
            left = eta(trained, len(DEMO_METHODS) - number + 1)
            print(f"{head}: {setting_name(cfg)}{left}", file=sys.stderr)
        started = time.monotonic()
        summary = resume_run(out / name, progress) if run_dir.holds_run() else run_experiment(cfg, progress)
        if not reused:
            trained.append(time.monotonic() - started)
        records = run_dir.records()
        label = " ".join([name, *(p.removeprefix("algorithm.") for p in params)])
        curves[label] = records
        for key in means:
            if (mean := last_mean(records, key, LAST)) is not None:
                means[key][label] = mean
                swings[key][label] = swing(records, key, LAST)
        row = [_pct(last_mean(records, m.key, LAST)) for m in METRICS]
        rows.append([label, *row, f"{summary['wall_s']:.1f}"])
    evaluated = min(len(r) for r in curves.values())
    classes = next(
        (len(r["global_class_acc"]) for rs in curves.values() for r in rs if "global_class_acc" in r), 0
    )
    held = (
        cfg.partition.params().get("classes_per_client") if cfg.partition.scheme == "pathological" else None
    )
    cap = (
        f": a client holding {held} of {classes} classes can reach only ~{100 * held / classes:.0f}% there, "
        "whatever the method"
        if held and classes
        else ""
    )
    lines = [
        f"Setting: {setting_name(cfg)}.",
        f"Accuracies in %, each the mean over the last {min(LAST, evaluated)} evaluated rounds "
        f"(of {evaluated}; personal models are the round's participants').",
        text_table(rows, ["algorithm", *(m.label for m in METRICS), "wall s"]),
        "",
        *(
            textwrap.fill(text, WIDTH)
            for text in [
                legend(cap),
                *(leader_sentence(m.label, means[m.key], swings[m.key]) for m in HEADLINE),
                FEDSSA_NOTE,
                FEDSC_NOTE,
            ]
        ),
        "",
    ]
    plot_demo_curves(curves, setting_name(cfg), out / "curves.png")
    lines.append(f"runs in {out}; GA and PA-split over rounds: {out / 'curves.png'}")
    return "\n".join(lines)
