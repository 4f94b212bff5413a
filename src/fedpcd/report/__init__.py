"""``fedpcd report``: tables and plots from finished run directories.

Runs that differ only in their seed form one row; each metric is the mean over the last ``last`` evaluated
rounds of a run (GA of FedAvg swings by several points between rounds under label skew, so one round is
noise), then mean +- standard deviation over seeds. The columns that tell rows apart are the config keys
whose values differ between rows. Optionally, the convergence view of FedSC's Table 3: R_x, the first
round at which GA reaches x%, averaged over the seeds that reach it; and paired differences to a reference
algorithm: each run minus the reference run that differs from it only in the algorithm (same seed, same
partition and initial weights), which removes the seed-to-seed spread shared by both; and the GA swing,
max - min of GA over the same last rounds (how far the global model jumps between rounds: the stability
FedGELA and FedNH discuss); and the class-mean angles of FedGELA's Fig. 3 (``fedpcd.report.geometry``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedpcd.errors import UserError

METRICS = [
    ("global_acc", "GA"),
    ("personal_acc", "PA-split"),
    ("pa_l", "PA-L"),
    ("pa_v", "PA-V"),
    ("pa_global", "PA-G"),
]
IGNORED = {"seed", "output_dir"}
# run_geometry's angles: the global model over all classes; personal models over held / missing classes
GEOMETRY_COLUMNS = {"angle_all": "∠all°", "angle_held": "∠held°", "angle_missing": "∠missing°"}
TRAFFIC = ["kB up/rnd", "kB down/rnd"]  # mean bytes per round, all participants together


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, Any]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "then":
            out.update(_flatten(value, name + "."))
        else:
            out[name] = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
    return out


def current_form(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config with the keys added since it was written filled with their defaults, so runs made
    by an older fedpcd group with new ones (unchanged if it no longer validates)."""
    from fedpcd.config import config_from_dict

    try:
        return config_from_dict(config).to_dict()
    except UserError:
        return config


def load_runs(root: str | Path) -> list[Run]:
    """Every finished run (a folder with summary.json) below ``root``."""
    root = Path(root)
    if not root.exists():
        raise UserError(f"runs folder not found: {root}")
    runs = []
    for summary_path in sorted(root.rglob("summary.json")):
        folder = summary_path.parent
        config = _read(folder / "config.yaml", yaml.safe_load)
        records = _read(folder / "metrics.jsonl", _json_lines)
        summary = _read(summary_path, json.loads)
        if not isinstance(config, dict) or not isinstance(summary, dict):
            raise UserError(f"{folder} is not a fedpcd run directory (config.yaml or summary.json malformed)")
        runs.append(Run(folder, current_form(config), records, summary))
    if not runs:
        raise UserError(f"no finished runs (folders with summary.json) below {root}")
    return runs


def unfinished_runs(root: str | Path) -> list[str]:
    """Run folders below ``root`` (a config.yaml) without a summary.json, relative to ``root``, sorted."""
    root = Path(root)
    return sorted(
        p.parent.relative_to(root).as_posix()
        for p in root.rglob("config.yaml")
        if not (p.parent / "summary.json").exists()
    )


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _read(path: Path, parse: Callable[[str], Any]) -> Any:
    """A run file parsed by ``parse``; a missing or corrupt file is a UserError naming it."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read {path}: {type(exc).__name__}: {exc}".splitlines()[0]) from None


def last_values(records: list[dict[str, Any]], key: str, last: int) -> list[float]:
    """``key`` of the last ``last`` evaluated rounds that have it."""
    return [r[key] for r in records if r.get(key) is not None][-last:]


def last_mean(records: list[dict[str, Any]], key: str, last: int) -> float | None:
    """Mean of ``key`` over the last ``last`` evaluated rounds that have it (None if none do)."""
    values = last_values(records, key, last)
    return sum(values) / len(values) if values else None


def swing(records: list[dict[str, Any]], key: str, last: int) -> float | None:
    """max - min of ``key`` over the last ``last`` evaluated rounds that have it (None if fewer than two)."""
    values = last_values(records, key, last)
    return max(values) - min(values) if len(values) > 1 else None


def rounds_to_target(records: list[dict[str, Any]], key: str, target: float) -> int | None:
    """The first evaluated round whose ``key`` is >= ``target`` (a fraction); None if none is."""
    for record in records:
        if record.get(key) is not None and record[key] >= target:
            return int(record["round"])
    return None


def rounds_cell(rounds: list[int | None]) -> str:
    """Mean first round over the seeds that reached the target; "(k/n)" unless all did; "-" if none did."""
    reached = [r for r in rounds if r is not None]
    if not reached:
        return "-"
    text = f"{statistics.fmean(reached):.1f}"
    return text if len(reached) == len(rounds) else f"{text} ({len(reached)}/{len(rounds)})"


def _without_algorithm(run: Run) -> str:
    """A run's whole setting but its algorithm (seed included): runs equal in it form a pair."""
    flat = _flatten(run.config)
    return json.dumps(
        {k: v for k, v in flat.items() if k != "output_dir" and not k.startswith("algorithm.")},
        sort_keys=True,
        default=str,
    )


def reference_runs(runs: list[Run], algorithm: str) -> dict[str, Run]:
    """The runs of ``algorithm`` by their setting apart from the algorithm (see ``_without_algorithm``)."""
    names = sorted({r.config["algorithm"]["name"] for r in runs})
    if algorithm not in names:
        raise UserError(f"no runs of algorithm {algorithm!r} to pair with; the runs have: {', '.join(names)}")
    refs: dict[str, Run] = {}
    for run in runs:
        if run.config["algorithm"]["name"] == algorithm:
            key = _without_algorithm(run)
            if key in refs:
                raise UserError(
                    f"runs {refs[key].path} and {run.path} are both {algorithm!r} in the same setting; "
                    "pair with an algorithm that has one variant"
                )
            refs[key] = run
    return refs


def mean_bytes(records: list[dict[str, Any]], key: str) -> float:
    """Mean communication of an evaluated round (``bytes_up`` or ``bytes_down``, all participants)."""
    return statistics.fmean(r[key] for r in records) if records else 0.0


def mean_std(values: list[float], signed: bool = False, scale: float = 100.0) -> str:
    """Fractions as "mean ± std" in % (``scale`` 1: as they are), two decimals ("-" if empty, no std for one
    value); ``signed`` puts a sign on the mean (for differences)."""
    if not values:
        return "-"
    mean = f"{scale * statistics.fmean(values):{'+' if signed else ''}.2f}"
    if len(values) == 1:
        return mean
    return f"{mean} ± {scale * statistics.stdev(values):.2f}"


def group_runs(runs: list[Run]) -> tuple[list[str], dict[tuple, list[Run]]]:
    """Group seeds of the same setting; returns the config keys that differ between groups and the groups."""
    flat = [{k: v for k, v in _flatten(r.config).items() if k not in IGNORED} for r in runs]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    groups: dict[tuple, list[Run]] = {}
    for run, f in zip(runs, flat, strict=True):
        groups.setdefault(tuple(f.get(k) for k in varying), []).append(run)
    return varying, groups


def _defaults(section: str, main_key: str, main: Any) -> dict[str, Any]:
    """The resolved default parameters of a partition scheme, model or algorithm."""
    from fedpcd.config import config_from_dict

    try:
        return _flatten({section: config_from_dict({section: {main_key: main}}).to_dict()[section]})
    except UserError:
        return {}


def setting_columns(varying: list[str], key: tuple) -> dict[str, str]:
    """One readable cell per varying config section, e.g. partition -> 'dirichlet beta=0.1' (non-defaults)."""
    values = dict(zip(varying, key, strict=True))
    defaults: dict[str, Any] = {}
    for name, value in values.items():
        section, _, sub = name.partition(".")
        if sub in ("name", "scheme"):
            defaults.update(_defaults(section, sub, value))
    cells: dict[str, list[str]] = {}
    for name, value in values.items():
        section, _, sub = name.partition(".")
        if value is None or (sub not in ("name", "scheme") and defaults.get(name, object()) == value):
            continue
        text = str(value) if sub in ("", "name", "scheme") else f"{sub}={value}"
        cells.setdefault(section, []).insert(
            0 if sub in ("name", "scheme") else len(cells.get(section, [])), text
        )
    sections = dict.fromkeys(name.partition(".")[0] for name in varying)
    return {section: " ".join(cells.get(section, [])) or "-" for section in sections}


def report_table(
    runs: list[Run],
    last: int = 5,
    rounds_to: Sequence[float] = (),
    paired_with: str | None = None,
    with_swing: bool = False,
    geometry: bool = False,
    with_best: bool = False,
) -> str:
    """A markdown table: one row per setting, metrics as mean ± std over seeds of the last-rounds mean;
    one "R<x>%" column per GA percentage x of ``rounds_to`` (``rounds_to_target``, ``rounds_cell``);
    with ``paired_with``, GA and PA-split minus those of that algorithm's run in the same setting and seed
    (``reference_runs``), mean ± std over the paired seeds, in points; ``with_swing``, a "GA swing" column
    (``swing`` over the same last rounds, mean ± std over seeds); ``with_best``, a "GA best" column (the
    highest GA of each run over all its rounds, mean ± std over seeds: the protocol of FedGELA's code and of
    papers that report the best round); ``geometry``, the class-mean angles of
    ``fedpcd.report.geometry.run_geometry`` in degrees (runs without a checkpoint are left out of them)."""
    for x in rounds_to:
        if not 0.0 < x <= 100.0:
            raise UserError(f"rounds-to target {x:g} is not a GA percentage in (0, 100]")
    refs = reference_runs(runs, paired_with) if paired_with is not None else {}
    varying, groups = group_runs(runs)
    sections = list(dict.fromkeys(name.partition(".")[0] for name in varying))
    targets = [f"R{x:g}%" for x in rounds_to]
    deltas = [f"Δ{label} vs {paired_with}" for _, label in METRICS[:2]] if paired_with is not None else []
    header = [
        *sections,
        "seeds",
        *(label for _, label in METRICS),
        *deltas,
        *(["GA swing"] if with_swing else []),
        *(["GA best"] if with_best else []),
        *(GEOMETRY_COLUMNS.values() if geometry else []),
        *targets,
        "rounds",
        *TRAFFIC,
        "wall s",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, members in groups.items():
        cells = list(setting_columns(varying, key).values()) + [str(len(members))]
        for metric, _ in METRICS:
            vals = [m for m in (last_mean(r.records, metric, last) for r in members) if m is not None]
            cells.append(mean_std(vals))
        if paired_with is not None:
            pairs = [(run, refs.get(_without_algorithm(run))) for run in members]
            for metric, _ in METRICS[:2]:
                diffs = []
                for run, ref in pairs:
                    mine = last_mean(run.records, metric, last)
                    theirs = last_mean(ref.records, metric, last) if ref is not None else None
                    if mine is not None and theirs is not None:
                        diffs.append(mine - theirs)
                cells.append(mean_std(diffs, signed=True))
        if with_swing:
            cells.append(
                mean_std(
                    [v for v in (swing(r.records, "global_acc", last) for r in members) if v is not None]
                )
            )
        if with_best:
            every = [last_values(r.records, "global_acc", len(r.records)) for r in members]
            cells.append(mean_std([max(v) for v in every if v]))
        if geometry:
            from fedpcd.engine.rundir import RunDir  # torch and the data: only when asked
            from fedpcd.report.geometry import run_geometry

            angles = [run_geometry(r.path) for r in members if RunDir(r.path).checkpoint.exists()]
            for key in GEOMETRY_COLUMNS:
                cells.append(mean_std([a[key] for a in angles if a[key] is not None], scale=1.0))
        for x in rounds_to:
            cells.append(rounds_cell([rounds_to_target(r.records, "global_acc", x / 100) for r in members]))
        cells.append(str(members[0].summary["rounds"]))
        for direction in ("bytes_up", "bytes_down"):
            cells.append(f"{statistics.fmean(mean_bytes(r.records, direction) for r in members) / 1e3:.1f}")
        cells.append(f"{statistics.fmean(r.summary['wall_s'] for r in members):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(runs: list[Run], path: str | Path) -> None:
    """GA and PA-split over rounds, mean over seeds, one line per setting."""
    from matplotlib.figure import Figure

    from fedpcd.utils import atomic_write

    varying, groups = group_runs(runs)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for key, members in groups.items():
        label = ", ".join(setting_columns(varying, key).values()) or "run"
        for ax, (metric, title) in zip(axes, METRICS[:2], strict=False):
            by_round: dict[int, list[float]] = {}
            for run in members:
                for r in run.records:
                    if r.get(metric) is not None:
                        by_round.setdefault(r["round"], []).append(r[metric])
            rounds = sorted(by_round)
            ax.plot(rounds, [100 * statistics.fmean(by_round[t]) for t in rounds], label=label)
            ax.set_title(title)
            ax.set_xlabel("round")
            ax.set_ylabel("accuracy (%)")
    axes[0].legend(fontsize=7)
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110), mode="wb")


def output_paths(out: str | Path) -> tuple[Path, Path]:
    """(markdown file, figures folder) of ``--out``: a folder gets report.md inside; a path ending in .md is
    the markdown file itself, its figures in the folder of the same stem beside it (docs/leaderboard.md and
    docs/leaderboard/)."""
    out = Path(out)
    if out.suffix == ".md":
        return out, out.with_suffix("")
    return out / "report.md", out


def write_report(
    root: str | Path,
    out: str | Path | None = None,
    last: int = 5,
    rounds_to: Sequence[float] = (),
    paired_with: str | None = None,
    with_swing: bool = False,
    geometry: bool = False,
    with_best: bool = False,
    title: str | None = None,
    notes: str | Path | None = None,
) -> str:
    """Print-ready markdown for the runs below ``root``; with ``out``, also written there with its figures
    (see ``output_paths``). Runs of several methods in several settings also get the papers' layout
    (``fedpcd.report.paper``: methods x settings tables, communication, per-setting curves, partitions).
    ``title`` becomes a heading and the markdown file ``notes`` a preamble under it."""
    from fedpcd.report.paper import METHOD_SECTION, build_grid, paper_sections

    runs = load_runs(root)
    table = report_table(runs, last, rounds_to, paired_with, with_swing, geometry, with_best)
    note = ""
    if paired_with is not None:
        note += (
            f" Δ vs {paired_with}: each run minus the {paired_with} run of the same setting and seed,"
            " mean ± std over seeds, in points."
        )
    if with_swing:
        note += f" GA swing: max - min of GA over those {last} rounds, in points."
    if with_best:
        note += " GA best: each run's highest GA over all its rounds."
    if geometry:
        note += (
            " ∠: mean angle in degrees between centred class means on the test set: the global model over all"
            " classes, each client's personal model over the classes it holds / lacks (FedGELA Fig. 3;"
            " an ETF has 96.38 for 10 classes)."
        )
    if rounds_to:
        note += " R<x>%: the first round with GA >= x%, mean over the seeds reaching it ((k/n): k of n did)."
    intro = (
        f"Runs below `{root}`: metrics in %, mean ± std over seeds of each run's mean over its last "
        f"{last} evaluated rounds.{note}\n\n"
    )
    markdown, figures = output_paths(out) if out is not None else (None, None)
    varying, _ = group_runs(runs)
    sections = {k.partition(".")[0] for k in varying}
    paper = ""
    if METHOD_SECTION in sections and len(sections) > 1:
        grid = build_grid(runs)
        paper = paper_sections(
            grid, last, figures, lambda p: p.relative_to(markdown.parent).as_posix() if markdown else str(p)
        )
        text = intro + paper + f"\n## All runs\n\n{table}\n"
    else:
        text = intro + table + "\n"
        if len(runs) == 1 and figures is not None:
            from fedpcd.report.paper import run_class_heatmap

            if run_class_heatmap(runs[0], figures / "classes.png"):
                rel = (figures / "classes.png").relative_to(markdown.parent).as_posix()
                text += f"\n![accuracy per class]({rel})\n"
    if notes is not None:
        try:
            text = Path(notes).read_text().strip() + "\n\n" + text
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the notes file {notes}: {exc}") from exc
    unfinished = unfinished_runs(root)
    if unfinished:
        text += (
            "\nRuns without a summary (failed, or still running), left out above: "
            + ", ".join(f"`{p}`" for p in unfinished)
            + "\n"
        )
    if title:
        text = f"# {title}\n\n{text}"
    if out is not None:
        from fedpcd.utils import atomic_write_text

        atomic_write_text(markdown, text)
        if not paper:
            plot_curves(runs, figures / "curves.png")
    return text
