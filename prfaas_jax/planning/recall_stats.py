"""Statistics of recall over seeds: `t_cdf`, `t_quantile`, `mean_interval` (Student t) and
`welch` (Welch's unequal-variance t-test).

Pure Python, no SciPy: Student's t distribution through the regularized incomplete beta
function, I_x(a, b), by its continued fraction (Lentz's method), which converges in a few
dozen terms for the degrees of freedom a handful of seeds gives. The quantile is the CDF
inverted by bisection: monotone, and exact to far below the digits a recall table prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_TINY = 1e-300


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # The fraction converges fast below the mean of the beta distribution; above it, by symmetry.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = ``p`` (0 < p < 1)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def _mean_var(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else math.nan
    return mean, var


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided confidence interval (``low`` = ``high`` = NaN from one value)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return self.high - self.mean


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` and its Student-t interval, mean ± t_{(1+c)/2, n−1} · s / √n."""
    if not values:
        raise ValueError("an interval needs at least one value")
    mean, var = _mean_var(values)
    n = len(values)
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    half = t_quantile((1.0 + confidence) / 2.0, n - 1) * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n)


@dataclass(frozen=True)
class Welch:
    """Welch's t-test of two samples: the statistic, the Welch–Satterthwaite degrees of freedom
    and the two-sided p-value."""

    t: float
    df: float
    p: float


def welch(a: Sequence[float], b: Sequence[float]) -> Welch:
    """Welch's two-sided t-test of equal means (each sample ≥ 2 values). Two samples without
    spread are as different as their means: p = 0 when they differ, 1 when equal."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's test needs at least two values per sample")
    mean_a, var_a = _mean_var(a)
    mean_b, var_b = _mean_var(b)
    va, vb = var_a / len(a), var_b / len(b)
    if va + vb == 0.0:
        same = mean_a == mean_b
        return Welch(
            0.0 if same else math.copysign(math.inf, mean_a - mean_b), math.inf, float(same)
        )
    t = (mean_a - mean_b) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return Welch(t, df, 2.0 * t_cdf(-abs(t), df))
