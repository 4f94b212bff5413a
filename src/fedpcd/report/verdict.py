"""The one verdict scale of every report and results page: when a paired difference separates, and what a
comparison with a paper's margin may be called.

**Separation.** A method's per-seed differences to a reference run of the same setting and seed (same
partition and initial weights) separate from zero when a two-sided paired t-test rejects "mean difference
= 0" at level ``ALPHA`` with n - 1 degrees of freedom: |t| > t_{1-ALPHA/2, n-1}, t = mean / (std / sqrt(n)).
With 3 seeds that needs |t| > 4.30, with 5 seeds |t| > 2.78 (the old rule, |t| > 2, treated the seed spread
as known and let 3-seed differences with t = 2.5 pass). Fewer than 2 seeds, or a spread of 0 with a mean of
0, never separate; a spread of 0 with a non-zero mean does.

**Verdicts against a paper's claim** (``verdict``): "yes" needs separation in the paper's direction on at
least ``MIN_SEEDS`` seeds and at least ``MIN_MARGIN_FRACTION`` of the paper's margin; "direction only" the
same with a smaller margin; "not decided (N seeds)" a separation in the paper's direction on fewer seeds;
"no (opposite direction)" a separation against it; "no (within seed noise)" none. A paper claim of a tie
(margin 0) gets "yes" when the difference does not separate on at least ``MIN_SEEDS`` seeds.

What the scale cannot remove: archived runs are bitwise reproducible only on the same CPU and
floating-point path; on another host a chaotic training run (a pathological split, one epoch per round)
drifts within its seed noise, so a difference that separates only narrowly can fail to on another machine.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

ALPHA = 0.05  # two-sided level of the paired t-test
MIN_SEEDS = 5  # seeds a "yes" or "direction only" needs
MIN_MARGIN_FRACTION = 0.5  # share of the paper's margin a "yes" needs

VERDICTS = ("yes", "direction only", "not decided", "no (opposite direction)", "no (within seed noise)")


def t_statistic(diffs: Sequence[float]) -> float:
    """t = mean / (std / sqrt(n)) of paired differences (inf with no spread and a non-zero mean, 0 for none).

    Args:
        diffs: Per-seed paired differences, at least 2.
    """
    mean = statistics.fmean(diffs)
    spread = statistics.stdev(diffs) / math.sqrt(len(diffs))
    if spread == 0:
        return 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean / spread


@functools.cache  # a report asks for the same few seed counts thousands of times
def critical_t(n: int) -> float:
    """The two-sided critical value t_{1-ALPHA/2, n-1} for ``n`` paired seeds (n >= 2): the inverse of
    Student's t distribution function, SciPy's ``special.stdtrit`` (what ``stats.t.ppf`` computes, without
    importing ``scipy.stats``: a second more per report)."""
    from scipy import special  # imported only where a verdict is computed, not on every report

    return float(special.stdtrit(n - 1, 1 - ALPHA / 2))


def separation(diffs: Sequence[float]) -> int:
    """+1 (-1) when paired differences are above (below) zero by the paired t-test, else 0 (always 0 for
    fewer than 2 seeds)."""
    if len(diffs) < 2:
        return 0
    t = t_statistic(diffs)
    if abs(t) <= critical_t(len(diffs)):
        return 0
    return 1 if t > 0 else -1


def verdict(diffs: Sequence[float], paper_margin: float | None, direction: int | None = None) -> str:
    """The verdict of paired differences (fractions or points, as ``paper_margin``) on a paper's claim.

    Args:
        diffs: Per-seed differences, method minus reference, in the unit of ``paper_margin``.
        paper_margin: The paper's own difference (its sign is the claimed direction; 0 claims a tie), or
            None for a claim of a direction without a number.
        direction: With ``paper_margin`` None, the claimed direction (+1 or -1): "yes" then needs the
            separation and the seeds only.

    Returns:
        One of ``VERDICTS`` ("not decided" followed by the seed count).
    """
    sign = separation(diffs)
    if paper_margin is None:
        claimed = int(math.copysign(1, direction or 0)) if direction else 0
        if not claimed:
            raise ValueError("a verdict needs a paper margin or a direction (+1 or -1)")
    else:
        claimed = 0 if paper_margin == 0 else int(math.copysign(1, paper_margin))
    enough = len(diffs) >= MIN_SEEDS
    if claimed == 0:
        if sign != 0:
            return "no (opposite direction)"
        return "yes" if enough else f"not decided ({len(diffs)} seeds)"
    if sign == 0:
        return "no (within seed noise)"
    if sign != claimed:
        return "no (opposite direction)"
    if not enough:
        return f"not decided ({len(diffs)} seeds)"
    if paper_margin is None:
        return "yes"
    reached = abs(statistics.fmean(diffs)) >= MIN_MARGIN_FRACTION * abs(paper_margin)
    return "yes" if reached else "direction only"
