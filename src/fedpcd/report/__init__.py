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

import contextlib
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpcd.config_identity import run_setting
from fedpcd.errors import UserError, clip
from fedpcd.run_format import CODE, GA, HEADLINE, REPORTED, RunFiles, code_key, same_code
from fedpcd.run_schema import Record, Summary, check
from fedpcd.utils import parse_json, path_error, read_json, read_user_text, show_path

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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _readable_partition(part: Any) -> bool:
    if not isinstance(part, dict) or not isinstance(part.get("scheme"), str):
        return False
    if any(key in part and not _is_number(part[key]) for key in ("beta", "rho", "classes_per_client")):
        return False
    return part.get("then") is None or _readable_partition(part["then"])


def _readable_config(config: dict[str, Any]) -> bool:
    """Whether a config that no longer validates still has, well-typed, the keys the report reads."""
    algorithm = config.get("algorithm")
    if not isinstance(algorithm, dict) or not isinstance(algorithm.get("name"), str):
        return False
    whole = [config.get("seed"), config.get("clients")]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in whole):
        return False
    return _readable_partition(config.get("partition"))


def current_form(config: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """A run's config with the keys added since it was written filled with their defaults, so runs made
    by an older fedpcd group with new ones (as written if it no longer validates but still has the keys the
    report reads; otherwise a UserError naming ``path``)."""
    from fedpcd.resolve import config_from_dict

    try:
        return config_from_dict(config).to_dict()
    except UserError as exc:
        reason = str(exc)
    plain = json.loads(json.dumps(config, default=str))  # YAML dates and the like as text
    if not _readable_config(plain):
        raise UserError(f"config file {show_path(path)} is not a fedpcd run config: {clip(reason, 160)}")
    return plain


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl as records; a line that is not a record the schema admits
    (``fedpcd.run_schema.Record``) is one line naming the file, the line number and the field."""
    path = Path(path)
    records = []
    lengths = set()
    for number, line in enumerate(read_user_text(path, "metrics file", links=False).splitlines(), 1):
        if not line.strip():
            continue
        where = f"metrics file {show_path(path)} line {number}"
        record = check(Record, parse_json(line, where, lines=False), where)
        if record.get("global_class_acc") is not None:
            lengths.add(len(record["global_class_acc"]))
        records.append(record)
    if len(lengths) > 1:
        raise UserError(f"metrics file {show_path(path)}: 'global_class_acc' changes length between rounds")
    return records


def read_summary(path: str | Path) -> dict[str, Any]:
    """A run's summary.json; anything the summary schema (``fedpcd.run_schema.Summary``) refuses is one line
    naming the file and the field."""
    summary = read_json(path, "summary file", links=False)
    return check(Summary, summary, f"summary file {show_path(path)} is not a fedpcd summary")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError) as exc:
        raise path_error(path, exc, "read") from None


def load_runs(root: str | Path) -> list[Run]:
    """Every finished run (a folder with summary.json) below ``root``; a run file that is missing, unreadable
    or malformed is one line naming it."""
    from fedpcd.config_input import read_yaml  # aliases, deep nesting and huge numbers refused

    root = Path(root)
    if not _exists(root):
        raise UserError(f"runs folder not found: {show_path(root)}")
    runs = []
    for files in RunFiles.finished_below(root):
        config = current_form(read_yaml(files.config, links=False), files.config)
        records = read_metrics(files.metrics)
        runs.append(Run(files.path, config, records, read_summary(files.summary)))
    if not runs:
        raise UserError(f"no finished runs (folders with summary.json) below {show_path(root)}")
    return runs


def refuse_duplicates(runs: list[Run]) -> None:
    """A one-line UserError when two runs have the same config (seed included): one run counted twice,
    e.g. a copy filed under another grid point's name."""
    seen: dict[str, Path] = {}
    for run in runs:
        key = json.dumps(run_setting(run.config), sort_keys=True, default=str)
        if key in seen:
            raise UserError(
                f"runs {show_path(seen[key])} and {show_path(run.path)} have the same config (seed "
                "included): one run counted twice; remove the one whose folder name is not its config"
            )
        seen[key] = run.path


def unfinished_runs(root: str | Path) -> list[tuple[str, str]]:
    """Run folders below ``root`` (a config.yaml) without a summary.json, sorted: (path relative to ``root``,
    why it stopped from its stopped.json, e.g. ``stopped in round 13: DivergenceError``, or "")."""
    root = Path(root)
    return sorted(
        (files.path.relative_to(root).as_posix(), _stopped_note(files.stopped))
        for files in RunFiles.started_below(root)
        if not files.summary.exists()
    )


def _stopped_note(path: Path) -> str:
    try:
        stopped = read_json(path, "stopped file", links=False)
        return f"stopped in round {int(stopped['round'])}: {stopped['error']}"
    except (UserError, ValueError, TypeError, KeyError):  # absent or not fedpcd's
        return ""


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


def _without_algorithm(run: Run, method_keys: frozenset[str] = frozenset()) -> str:
    """A run's whole setting but its algorithm (seed included), and but ``method_keys``: runs equal in it
    form a pair."""
    flat = _flatten(run_setting(run.config))
    return json.dumps(
        {k: v for k, v in flat.items() if not k.startswith("algorithm.") and k not in method_keys},
        sort_keys=True,
        default=str,
    )


def _preset_keys(run: Run) -> frozenset[str]:
    """The keys outside ``algorithm.`` that the run's preset sets and the run has at the preset's value
    (e.g. the released code's gradient clipping): they belong to the method, as its own options do."""
    from fedpcd.algorithms.presets import preset_values

    section = run.config.get("algorithm", {})
    if section.get("preset") is None:
        return frozenset()
    flat = _flatten(run.config)
    values = preset_values(section["name"], section["preset"])
    return frozenset(k for k, v in values.items() if not k.startswith("algorithm.") and flat.get(k) == v)


def same_setting(run: Run, other: Run, vary: frozenset[str] = frozenset()) -> bool:
    """Whether two runs differ only in their method (algorithm, and what their presets set) and in the
    config keys ``vary``."""
    keys = vary | _preset_keys(run) | _preset_keys(other)
    return _without_algorithm(run, keys) == _without_algorithm(other, keys)


def paired_run(run: Run, refs: dict[str, Run]) -> Run | None:
    """``run``'s reference run among ``refs`` (``reference_runs``): the one in the same setting and seed."""
    ref = refs.get(_without_algorithm(run))
    if ref is not None or not _preset_keys(run):
        return ref
    return next((r for r in refs.values() if same_setting(run, r)), None)


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


def code_mismatches(runs: list[Run], algorithm: str) -> list[str]:
    """The paired comparisons with ``algorithm`` whose two runs were not made by one code version (their
    summaries' ``code`` records differ; pairs of runs that both predate the record are not checked)."""
    refs = reference_runs(runs, algorithm)
    out = []
    for run in runs:
        ref = paired_run(run, refs)
        if ref is None or ref is run:
            continue
        mine, theirs = run.summary.get(CODE), ref.summary.get(CODE)
        if (mine is not None or theirs is not None) and not same_code(mine, theirs):
            pair = f"`{run.path.name}` ({_code_label(mine)}) vs `{ref.path.name}` ({_code_label(theirs)})"
            out.append(pair)
    return out


def _code_label(code: dict[str, Any] | None) -> str:
    key = code_key(code)
    if key is None:
        return "code not recorded"
    results, commit, dirty, diff = key
    state = (f" +dirty (diff {diff[:8]})" if diff else " +dirty") if dirty else ""
    return f"results {results}, " + (f"commit {commit[:12]}{state}" if commit else "no commit")


def mean_bytes(records: list[dict[str, Any]], key: str) -> float:
    """Mean communication of an evaluated round (``bytes_up`` or ``bytes_down``, all participants; a run
    written before traffic was recorded counts 0)."""
    return statistics.fmean(r.get(key) or 0 for r in records) if records else 0.0


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
    flat = [{k: v for k, v in _flatten(run_setting(r.config)).items() if k not in IGNORED} for r in runs]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    groups: dict[tuple, list[Run]] = {}
    for run, f in zip(runs, flat, strict=True):
        groups.setdefault(tuple(f.get(k) for k in varying), []).append(run)
    return varying, groups


def _defaults(section: str, main_key: str, main: Any) -> dict[str, Any]:
    """The resolved default parameters of a partition scheme, model or algorithm."""
    from fedpcd.resolve import config_from_dict

    try:
        return _flatten({section: config_from_dict({section: {main_key: main}}).to_dict()[section]})
    except UserError:
        return {}


def setting_columns(varying: list[str], key: tuple, algorithm: str | None = None) -> dict[str, str]:
    """One readable cell per varying config section, e.g. partition -> 'dirichlet beta=0.1' (non-defaults;
    with a preset, the algorithm's keys at the preset's value are left to its name: 'fedgela
    preset=official'; ``algorithm``: the runs' algorithm where its name is not among the varying keys)."""
    values = dict(zip(varying, key, strict=True))
    defaults: dict[str, Any] = {}
    for name, value in values.items():
        section, _, sub = name.partition(".")
        if sub in ("name", "scheme"):
            defaults.update(_defaults(section, sub, value))
    name = values.get("algorithm.name", algorithm)
    if values.get("algorithm.preset") is not None and name is not None:
        from fedpcd.algorithms.presets import preset_values

        with contextlib.suppress(UserError):  # a preset renamed since the run: its keys shown
            preset = preset_values(name, values["algorithm.preset"])
            defaults.update({k: v for k, v in preset.items() if k.startswith("algorithm.")})
    cells: dict[str, list[str]] = {}
    for name, value in values.items():
        section, _, sub = name.partition(".")
        if (value is None and defaults.get(name) is None) or (
            sub not in ("name", "scheme") and defaults.get(name, object()) == value
        ):
            continue
        text = str(value) if sub in ("", "name", "scheme") else f"{sub}={value}"
        cells.setdefault(section, []).insert(
            0 if sub in ("name", "scheme") else len(cells.get(section, [])), text
        )
    sections = dict.fromkeys(name.partition(".")[0] for name in varying)
    return {section: " ".join(cells.get(section, [])) or "-" for section in sections}


def method_columns(varying: list[str], key: tuple, run: Run) -> dict[str, str]:
    """:func:`setting_columns` of a group of runs like ``run``, its algorithm's cell naming the preset keys
    the config overrides (``fedgela preset=official (overrides local.grad_clip)``: not the preset's method,
    ``fedpcd.labels.method_overrides``)."""
    from fedpcd.labels import overrides_suffix

    cells = setting_columns(varying, key, run.config["algorithm"]["name"])
    if "algorithm" in cells:
        cells["algorithm"] += overrides_suffix(run.config)
    return cells


def all_geometries(runs: list[Run]) -> dict[Path, dict[str, float | None]]:
    """``run_geometry`` of every run that kept its checkpoint, with a progress bar (a local update per client
    and run: minutes for a large folder)."""
    from tqdm import tqdm

    from fedpcd.report.geometry import run_geometry  # torch and the data: only when asked

    with_checkpoint = [r.path for r in runs if RunFiles(r.path).checkpoint.exists()]
    return {
        p: run_geometry(p) for p in tqdm(with_checkpoint, desc="class-mean angles", unit="run", leave=False)
    }


def last_rounds_phrase(runs: list[Run], last: int, explain: bool = True) -> str:
    """'the last N evaluated rounds' with the N the runs actually have (a run with fewer uses them all);
    ``explain`` adds why N differs from ``last`` where it does."""
    used = sorted({min(last, len(r.records)) for r in runs}) or [last]
    n = str(used[0]) if len(used) == 1 else f"{used[0]}-{used[-1]}"
    phrase = f"the last {n} evaluated round{'' if used == [1] else 's'}"
    if explain and (used[-1] < last or len(used) > 1):
        phrase += f" (of --last {last}: a run with fewer evaluated rounds is averaged over all of them)"
    return phrase


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
    deltas = [f"Δ{m.label} vs {paired_with}" for m in HEADLINE] if paired_with is not None else []
    header = [
        *sections,
        "seeds",
        *(m.label for m in REPORTED),
        *deltas,
        *(["GA swing"] if with_swing else []),
        *(["GA best"] if with_best else []),
        *(GEOMETRY_COLUMNS.values() if geometry else []),
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
            for key in GEOMETRY_COLUMNS:
                cells.append(mean_std([a[key] for a in angles if a[key] is not None], scale=1.0))
        for x in rounds_to:
            cells.append(rounds_cell([rounds_to_target(r.records, GA.key, x / 100) for r in members]))
        cells.append(str(members[0].summary["rounds"]))
        for direction in ("bytes_up", "bytes_down"):
            cells.append(f"{statistics.fmean(mean_bytes(r.records, direction) for r in members) / 1e3:.1f}")
        cells.append(f"{statistics.fmean(r.summary['wall_s'] for r in members):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(runs: list[Run], path: str | Path) -> None:
    """GA and PA-split over rounds, mean over seeds, one line per setting."""
    import pandas as pd
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from fedpcd.utils import atomic_write

    varying, groups = group_runs(runs)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for key, members in groups.items():
        label = ", ".join(method_columns(varying, key, members[0]).values()) or "run"
        records = pd.DataFrame.from_records([r for run in members for r in run.records])
        for ax, metric in zip(axes, HEADLINE, strict=False):
            values = records.reindex(columns=["round", metric.key]).dropna()
            means = values.groupby("round")[metric.key].agg(statistics.fmean)  # over the seeds, by round
            if len(means):  # a method without this metric (no global model: no GA) gets no line and no entry
                ax.plot(means.index, 100 * means, label=label)
            ax.set_title(metric.label)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
            ax.set_ylabel("accuracy (%)")
    for ax in axes:
        if ax.has_data():
            ax.legend(fontsize=7)
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110), mode="wb")
