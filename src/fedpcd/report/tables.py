"""``fedpcd report``'s table: one row per setting (the seeds of a setting grouped, ``fedpcd.report.groups``),
each metric the mean over a run's last evaluated rounds, then mean ± std over seeds
(``fedpcd.report.stats``); optional columns: paired differences to a reference algorithm, the GA swing, the
best GA, the first round reaching a GA target, and the class-mean angles of FedGELA's Fig. 3
(recorded by ``geometry: true``, else rebuilt by ``fedpcd.report.geometry``, imported only then: it needs
torch and the data)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from fedpcd.errors import UserError
from fedpcd.report.groups import group_runs, method_columns, paired_run, reference_runs
from fedpcd.report.read import Run
from fedpcd.report.stats import (
    last_mean,
    last_values,
    mean_bytes,
    mean_std,
    rounds_cell,
    rounds_to_target,
    swing,
)
from fedpcd.run_format import ANGLES, GA, HEADLINE, REPORTED, RunFiles

TRAFFIC = ["kB up/rnd", "kB down/rnd"]  # mean bytes per round, all participants together


def all_geometries(runs: list[Run]) -> dict[Path, dict[str, float | None]]:
    """Each run's class-mean angles: those its last record holds (``geometry: true``), else
    ``run_geometry``'s from its checkpoint (a local update per client and run: minutes for a large folder,
    with a progress bar); a run with neither has none."""
    recorded = {r.path: {k: r.records[-1][k] for k in ANGLES} for r in runs if _has_angles(r)}
    rebuilt = [r.path for r in runs if r.path not in recorded and RunFiles(r.path).checkpoint.exists()]
    if rebuilt:
        from tqdm import tqdm

        from fedpcd.report.geometry import run_geometry  # torch and the data: only when needed

        for path in tqdm(rebuilt, desc="class-mean angles", unit="run", leave=False):
            recorded[path] = run_geometry(path)
    return recorded


def _has_angles(run: Run) -> bool:
    return bool(run.records) and all(key in run.records[-1] for key in ANGLES)


def check_rounds_to(rounds_to: Sequence[float]) -> None:
    """Refuse a rounds-to target that is not a GA percentage in (0, 100]."""
    for x in rounds_to:
        if not 0.0 < x <= 100.0:
            raise UserError(f"rounds-to target {x:g} is not a GA percentage in (0, 100]")


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
    papers that report the best round); ``geometry``, the class-mean angles in degrees
    (:func:`all_geometries`: runs with neither recorded angles nor a checkpoint are left out of them)."""
    check_rounds_to(rounds_to)
    refs = reference_runs(runs, paired_with) if paired_with is not None else {}
    varying, groups = group_runs(runs)
    sections = list(dict.fromkeys(name.partition(".")[0] for name in varying))
    targets = [f"R{x:g}%" for x in rounds_to]
    deltas = [f"Δ{m.label} vs {paired_with}" for m in HEADLINE] if paired_with is not None else []
    header = [
        *sections,
        "seeds",
        *(m.label for m in REPORTED),
        *deltas,
        *(["GA swing"] if with_swing else []),
        *(["GA best"] if with_best else []),
        *(ANGLES.values() if geometry else []),
        *targets,
        "rounds",
        *TRAFFIC,
        "wall s",
    ]
    geometries = all_geometries(runs) if geometry else {}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, members in groups.items():
        cells = list(method_columns(varying, key, members[0]).values()) + [str(len(members))]
        for metric in REPORTED:
            vals = [v for v in (last_mean(r.records, metric.key, last) for r in members) if v is not None]
            cells.append(mean_std(vals))
        if paired_with is not None:
            pairs = [(run, paired_run(run, refs)) for run in members]
            for metric in HEADLINE:
                diffs = []
                for run, ref in pairs:
                    mine = last_mean(run.records, metric.key, last)
                    theirs = last_mean(ref.records, metric.key, last) if ref is not None else None
                    if mine is not None and theirs is not None:
                        diffs.append(mine - theirs)
                cells.append(mean_std(diffs, signed=True))
        if with_swing:
            cells.append(
                mean_std([v for v in (swing(r.records, GA.key, last) for r in members) if v is not None])
            )
        if with_best:
            every = [last_values(r.records, GA.key, len(r.records)) for r in members]
            cells.append(mean_std([max(v) for v in every if v]))
        if geometry:
            angles = [geometries[r.path] for r in members if r.path in geometries]
            for key in ANGLES:
                cells.append(mean_std([a[key] for a in angles if a[key] is not None], scale=1.0))
        for x in rounds_to:
            cells.append(rounds_cell([rounds_to_target(r.records, GA.key, x / 100) for r in members]))
        cells.append(str(members[0].summary["rounds"]))
        for direction in ("bytes_up", "bytes_down"):
            cells.append(f"{statistics.fmean(mean_bytes(r.records, direction) for r in members) / 1e3:.1f}")
        cells.append(f"{statistics.fmean(r.summary['wall_s'] for r in members):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
