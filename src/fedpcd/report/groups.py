"""Which runs belong together in ``fedpcd report``: the seeds of one setting form a group (the config keys
that differ between groups name it), and a run is paired with the reference algorithm's run that differs
from it only in the algorithm (same seed, same partition and initial weights), which removes the
seed-to-seed spread both share."""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from fedpcd.errors import UserError
from fedpcd.report.read import Run, flatten
from fedpcd.run_format import code_key, same_code

IGNORED = {"seed", "output_dir"}


def without_algorithm(run: Run, method_keys: frozenset[str] = frozenset()) -> str:
    """A run's whole setting but its algorithm (seed included), and but ``method_keys``: runs equal in it
    form a pair."""
    items = run.setting_json  # json.dumps(kept, sort_keys=True) from the items' texts, in key order
    kept = (text for k, text in items.items() if not k.startswith("algorithm.") and k not in method_keys)
    return "{" + ", ".join(kept) + "}"


def preset_keys(run: Run) -> frozenset[str]:
    """The keys outside ``algorithm.`` that the run's preset sets and the run has at the preset's value
    (e.g. the released code's gradient clipping): they belong to the method, as its own options do."""
    from fedpcd.presets import preset_values

    section = run.config.get("algorithm", {})
    if section.get("preset") is None:
        return frozenset()
    flat = run.flat
    values = preset_values(section["name"], section["preset"])
    return frozenset(k for k, v in values.items() if not k.startswith("algorithm.") and flat.get(k) == v)


def same_setting(run: Run, other: Run, vary: frozenset[str] = frozenset()) -> bool:
    """Whether two runs differ only in their method (algorithm, and what their presets set) and in the
    config keys ``vary``."""
    keys = vary | preset_keys(run) | preset_keys(other)
    return without_algorithm(run, keys) == without_algorithm(other, keys)


def paired_run(run: Run, refs: dict[str, Run]) -> Run | None:
    """``run``'s reference run among ``refs`` (``reference_runs``): the one in the same setting and seed."""
    ref = refs.get(without_algorithm(run))
    if ref is not None or not preset_keys(run):
        return ref
    return next((r for r in refs.values() if same_setting(run, r)), None)


def reference_runs(runs: list[Run], algorithm: str) -> dict[str, Run]:
    """The runs of ``algorithm`` without a preset by their setting apart from the algorithm (see
    ``without_algorithm``): a preset makes another method (``fedavg preset=fedadam``), paired as any other."""
    names = sorted({r.config["algorithm"]["name"] for r in runs})
    if algorithm not in names:
        raise UserError(f"no runs of algorithm {algorithm!r} to pair with; the runs have: {', '.join(names)}")
    refs: dict[str, Run] = {}
    for run in runs:
        if run.config["algorithm"]["name"] == algorithm and run.config["algorithm"].get("preset") is None:
            key = without_algorithm(run)
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
        mine, theirs = run.code, ref.code
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


def group_runs(runs: list[Run]) -> tuple[list[str], dict[tuple, list[Run]]]:
    """Group seeds of the same setting; returns the config keys that differ between groups and the groups."""
    flat = [{k: v for k, v in r.setting.items() if k not in IGNORED} for r in runs]
    keys = sorted({k for f in flat for k in f})
    texts = [r.setting_json for r in runs]  # a key a run lacks is null, as json.dumps(None)
    varying = [k for k in keys if len({t.get(k, f"{json.dumps(k)}: null") for t in texts}) > 1]
    groups: dict[tuple, list[Run]] = {}
    for run, f in zip(runs, flat, strict=True):
        groups.setdefault(tuple(f.get(k) for k in varying), []).append(run)
    return varying, groups


def _defaults(section: str, main_key: str, main: Any) -> dict[str, Any]:
    """The resolved default parameters of a partition scheme, model or algorithm."""
    return dict(_resolved_defaults(section, main_key, json.dumps(main)))


@functools.cache  # a report asks for the same few components once per group
def _resolved_defaults(section: str, main_key: str, main: str) -> tuple[tuple[str, Any], ...]:
    from fedpcd.resolve import config_from_dict

    try:
        config = config_from_dict({section: {main_key: json.loads(main)}})
    except UserError:
        return ()
    return tuple(flatten({section: config.to_dict()[section]}).items())


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
        from fedpcd.presets import preset_values

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
