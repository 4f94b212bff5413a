"""The verdict scale (fedpcd.report.verdict): a paired t-test with n - 1 degrees of freedom, 5 seeds for a
"yes", half the paper's margin."""

import math
import statistics

import pytest
from scipy import stats

from fedpcd.report.verdict import critical_t, separation, t_statistic, verdict


def test_t_statistic_is_mean_over_standard_error():
    diffs = [0.01, 0.02, 0.03]
    assert t_statistic(diffs) == pytest.approx(0.02 / (0.01 / math.sqrt(3)))
    assert t_statistic([0.02, 0.02]) == math.inf
    assert t_statistic([0.0, 0.0]) == 0.0


def test_critical_values_are_students_t():
    assert critical_t(3) == pytest.approx(4.302652729911275)  # t_{0.975, 2}
    assert critical_t(5) == pytest.approx(2.7764451051977987)  # t_{0.975, 4}
    # the very numbers of scipy.stats' quantile function (archived verdicts were computed with it)
    assert all(critical_t(n) == float(stats.t.ppf(0.975, n - 1)) for n in range(2, 101))


@pytest.mark.parametrize(
    "diffs",
    [[0.01, 0.02, 0.03], [4.21, 2.0, 6.4], [0.5, 1.1, 0.2, 0.9, 0.4], [-3.0, -1.0, -2.5, -2.2, -0.1, -1.4]],
)
def test_separation_agrees_with_scipys_paired_test(diffs):
    p = stats.ttest_1samp(diffs, 0.0).pvalue
    expected = 0 if p >= 0.05 else (1 if statistics.fmean(diffs) > 0 else -1)
    assert separation(diffs) == expected


def test_three_seeds_with_t_between_2_and_4_3_do_not_separate():
    # FedMR's archived P10C2 difference: +4.21 +- 2.23 on 3 seeds, t = 3.3 (the old |t| > 2 rule passed it)
    diffs = [1.71, 6.00, 4.92]
    assert 2 < t_statistic(diffs) < critical_t(3)
    assert separation(diffs) == 0
    assert separation([0.05]) == 0  # one seed: never


def test_verdicts():
    five = [2.0, 2.5, 3.0, 2.2, 2.8]  # mean 2.5, separates
    assert verdict(five, 4.0) == "yes"  # 2.5 >= half of 4
    assert verdict(five, 6.0) == "direction only"  # 2.5 < 3
    assert verdict(five, -4.0) == "no (opposite direction)"
    assert verdict(five[:3], 4.0) == "not decided (3 seeds)"  # separates on 3 seeds: a yes needs 5
    assert verdict([1.0, -1.0, 0.5, -0.5, 0.2], 4.0) == "no (within seed noise)"
    assert verdict([1.0, -1.0, 0.5, -0.5, 0.2], 0.0) == "yes"  # a claimed tie that holds on 5 seeds
    assert verdict(five, 0.0) == "no (opposite direction)"


def test_a_claimed_direction_without_a_number():
    five = [2.0, 2.5, 3.0, 2.2, 2.8]
    assert verdict(five, None, direction=1) == "yes"  # no margin to reach
    assert verdict(five, None, direction=-1) == "no (opposite direction)"
    with pytest.raises(ValueError):
        verdict(five, None)
