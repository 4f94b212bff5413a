"""The numbers of ``fedpcd report``'s cells: a run's mean over its last ``last`` evaluated rounds (GA of
FedAvg swings by several points between rounds under label skew, so one round is noise), its GA swing (max -
min over the same rounds: the stability FedGELA and FedNH discuss), the first round reaching a target (the
convergence view of FedSC's Table 3), its mean traffic, and "mean ± std" over seeds."""

from __future__ import annotations

import statistics
from typing import Any

from fedpcd.report.read import Run


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


def last_rounds_phrase(runs: list[Run], last: int, explain: bool = True) -> str:
    """'the last N evaluated rounds' with the N the runs actually have (a run with fewer uses them all);
    ``explain`` adds why N differs from ``last`` where it does."""
    used = sorted({min(last, len(r.records)) for r in runs}) or [last]
    n = str(used[0]) if len(used) == 1 else f"{used[0]}-{used[-1]}"
    phrase = f"the last {n} evaluated round{'' if used == [1] else 's'}"
    if explain and (used[-1] < last or len(used) > 1):
        phrase += f" (of --last {last}: a run with fewer evaluated rounds is averaged over all of them)"
    return phrase
