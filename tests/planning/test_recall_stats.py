"""Student's t and Welch's test (planning/recall_stats.py) against closed forms: the t CDF with
1, 2 and 4 degrees of freedom has one (Cauchy for 1), its quantile too for 1 and 2, and the
printed t tables give the rest; the interval and the test are their formulas worked by hand."""

from __future__ import annotations

import math

import pytest

from prfaas_jax.planning.recall_stats import mean_interval, t_cdf, t_quantile, welch

CLOSED_CDF = {
    1: lambda t: 0.5 + math.atan(t) / math.pi,
    2: lambda t: 0.5 + t / (2 * math.sqrt(2 + t * t)),
    4: lambda t: (
        0.5 + 3 / 8 * (t / math.sqrt(1 + t * t / 4)) * (1 - t * t / (12 * (1 + t * t / 4)))
    ),
}


@pytest.mark.parametrize("df", sorted(CLOSED_CDF))
def test_t_cdf_is_the_closed_form(df):
    for t in (-30.0, -3.0, -0.5, 0.0, 0.3, 1.7, 4.7, 20.0):
        assert t_cdf(t, df) == pytest.approx(CLOSED_CDF[df](t), abs=1e-13)


def test_t_quantile_is_the_closed_form_and_the_printed_table():
    for p in (0.6, 0.9, 0.975, 0.995):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
        assert t_quantile(p, 2) == pytest.approx(
            (2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10
        )
        assert t_quantile(1 - p, 2) == pytest.approx(-t_quantile(p, 2), rel=1e-12)
    # Two-sided 95 % critical values of the printed tables (4 decimals).
    for df, table in ((3, 3.1824), (4, 2.7764), (10, 2.2281), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(table, abs=5e-5)


def test_interval_and_welch_by_hand():
    a, b = [0.90, 0.92, 0.95], [0.80, 0.85, 0.83]
    # Means 0.92333 and 0.82667, both sample variances (0.0019/3) / 2 = 0.000633.
    var = ((0.9 - 0.92333333) ** 2 + (0.92 - 0.92333333) ** 2 + (0.95 - 0.92333333) ** 2) / 2
    interval = mean_interval(a)
    half = (0.95 / math.sqrt(2 * 0.975 * 0.025)) * math.sqrt(var / 3)  # t_{0.975, 2}
    assert interval.mean == pytest.approx(0.92333333, abs=1e-8)
    assert (interval.low, interval.high) == pytest.approx((0.92333333 - half, 0.92333333 + half))
    test = welch(a, b)
    t = (0.92333333 - 0.82666667) / math.sqrt(2 * var / 3)
    # Equal variances and sizes: Welch–Satterthwaite gives n_a + n_b − 2 = 4.
    assert (test.t, test.df) == pytest.approx((t, 4.0), rel=1e-6)
    assert test.p == pytest.approx(2 * (1 - CLOSED_CDF[4](t)), rel=1e-6)
    assert 0.009 < test.p < 0.01
    # One value gives no interval; samples without spread differ exactly when their means do.
    assert math.isnan(mean_interval([0.5]).low)
    assert welch([1.0, 1.0], [1.0, 1.0]).p == 1.0
    assert welch([1.0, 1.0], [0.5, 0.5]).p == 0.0
