"""Distributions of the uncached input length L: `LengthDistribution` and two implementations.

Exposes the `LengthDistribution` protocol, which gives the routing statistics of a threshold t
(arXiv 2604.15039 §3.4, Table 4):

    p(t)       = P(L > t)              fraction of requests offloaded to PrfaaS
    l_long(t)  = E[L | L > t]          mean PrfaaS length
    l_short(t) = E[L | L ≤ t]          mean PD-prefill length
    E[f(L) | L > t],  E[f(L) | L ≤ t]  for a `Profile` f, e.g. the mean prefill time E[T(L) | L > t]

and two distributions that compute all of them exactly from partial moments
M_k(a, b) = E[L^k · 1{a < L ≤ b}]:

- `TruncatedLogNormal(mu, sigma, min_len, max_len)`: ln L ~ N(μ, σ²) conditioned on
  min_len ≤ L ≤ max_len. With z(x) = (ln x − μ)/σ and Φ the standard normal CDF,
      M_k(a, b) = exp(kμ + k²σ²/2) · [Φ(z(b) − kσ) − Φ(z(a) − kσ)] / [Φ(z(max)) − Φ(z(min))]
  (a, b clipped to the support), since L^k·φ(z) = exp(kμ + k²σ²/2)·φ(z − kσ).
- `EmpiricalLengths(lengths)`: the lengths of a trace, each with weight 1/n; M_k is a difference
  of exact integer prefix sums of l^k over the sorted lengths.
"""

from __future__ import annotations

import abc
import bisect
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Protocol

from prfaas_jax.policy.profiles import Profile


class LengthDistribution(Protocol):
    """Routing statistics of the uncached input length L for a threshold t (tokens)."""

    @property
    def support(self) -> tuple[float, float]:
        """The smallest and largest length L can take."""
        ...

    def tail_prob(self, t: float) -> float:
        """p(t) = P(L > t)."""
        ...

    def mean_above(self, t: float) -> float:
        """E[L | L > t]; ValueError when P(L > t) = 0."""
        ...

    def mean_below(self, t: float) -> float:
        """E[L | L ≤ t]; ValueError when P(L ≤ t) = 0."""
        ...

    def expect_above(self, f: Profile, t: float) -> float:
        """E[f(L) | L > t]; ValueError when P(L > t) = 0."""
        ...

    def expect_below(self, f: Profile, t: float) -> float:
        """E[f(L) | L ≤ t]; ValueError when P(L ≤ t) = 0."""
        ...


class _FromPartialMoments(abc.ABC):
    """Every `LengthDistribution` method, written in terms of `partial_moment`."""

    @abc.abstractmethod
    def partial_moment(self, k: int, a: float, b: float) -> float:
        """M_k(a, b) = E[L^k · 1{a < L ≤ b}]."""

    def tail_prob(self, t: float) -> float:
        return self.partial_moment(0, t, math.inf)

    def mean_above(self, t: float) -> float:
        return self._conditional(self.partial_moment(1, t, math.inf), t, math.inf)

    def mean_below(self, t: float) -> float:
        return self._conditional(self.partial_moment(1, -math.inf, t), -math.inf, t)

    def expect_above(self, f: Profile, t: float) -> float:
        return self._conditional(self._expect_between(f, t, math.inf), t, math.inf)

    def expect_below(self, f: Profile, t: float) -> float:
        return self._conditional(self._expect_between(f, -math.inf, t), -math.inf, t)

    def _expect_between(self, f: Profile, a: float, b: float) -> float:
        return sum(
            c * self.partial_moment(k, lo, hi)
            for lo, hi, coeffs in f.pieces(a, b)
            for k, c in enumerate(coeffs)
            if c != 0.0
        )

    def _conditional(self, moment: float, a: float, b: float) -> float:
        mass = self.partial_moment(0, a, b)
        if mass <= 0.0:
            raise ValueError(f"no requests have a length in ({a:g}, {b:g}]")
        return moment / mass


def _normal_cdf(z: float) -> float:
    # erfc keeps relative precision deep in the lower tail, where 1 + erf(z/√2) cancels.
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _normal_mass(za: float, zb: float) -> float:
    """Φ(zb) − Φ(za) for za ≤ zb; mirrored when both are above 0, where Φ ≈ 1 would cancel."""
    if za > 0.0:
        return _normal_cdf(-za) - _normal_cdf(-zb)
    return _normal_cdf(zb) - _normal_cdf(za)


@dataclass(frozen=True)
class TruncatedLogNormal(_FromPartialMoments):
    """ln L ~ N(mu, sigma²) conditioned on min_len ≤ L ≤ max_len (lengths in tokens)."""

    mu: float
    sigma: float
    min_len: float
    max_len: float
    _mass: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"sigma must be positive and mu finite, got {self.mu}, {self.sigma}")
        if not 0 < self.min_len < self.max_len < math.inf:
            raise ValueError(
                f"need 0 < min_len < max_len < inf, got {self.min_len} and {self.max_len}"
            )
        mass = _normal_mass(self._z(self.min_len), self._z(self.max_len))
        if mass <= 0.0:
            raise ValueError(
                f"ln-normal({self.mu}, {self.sigma}) has no mass on "
                f"[{self.min_len}, {self.max_len}]"
            )
        object.__setattr__(self, "_mass", mass)

    @property
    def support(self) -> tuple[float, float]:
        return (self.min_len, self.max_len)

    def _z(self, x: float) -> float:
        return (math.log(x) - self.mu) / self.sigma

    def partial_moment(self, k: int, a: float, b: float) -> float:
        a, b = max(a, self.min_len), min(b, self.max_len)
        if a >= b:
            return 0.0
        shift = k * self.sigma
        scale = math.exp(k * self.mu + 0.5 * shift * shift)
        return scale * _normal_mass(self._z(a) - shift, self._z(b) - shift) / self._mass


@dataclass(frozen=True)
class EmpiricalLengths(_FromPartialMoments):
    """The uncached input lengths of a trace (tokens), each request weighted 1/n."""

    lengths: tuple[int, ...]
    _prefix_sums: dict[int, tuple[int, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("an empirical length distribution needs at least one length")
        try:
            # operator.index accepts numpy integers but refuses floats: lengths are token counts.
            lengths = sorted(operator.index(l) for l in self.lengths)
        except TypeError:
            raise ValueError("empirical lengths must be integers (token counts)") from None
        if lengths[0] < 0:
            raise ValueError(f"empirical lengths must be non-negative, got {lengths[0]}")
        object.__setattr__(self, "lengths", tuple(lengths))

    @property
    def support(self) -> tuple[float, float]:
        return (float(self.lengths[0]), float(self.lengths[-1]))

    def _powers_prefix(self, k: int) -> tuple[int, ...]:
        # Integer sums are exact, so M_k(a, b) = (S[j_b] − S[j_a]) / n loses nothing to
        # cancellation even for l² and l³ of 128K-token requests; built once per power k.
        if k not in self._prefix_sums:
            self._prefix_sums[k] = (0, *itertools.accumulate(l**k for l in self.lengths))
        return self._prefix_sums[k]

    def partial_moment(self, k: int, a: float, b: float) -> float:
        if a >= b:
            return 0.0
        sums = self._powers_prefix(k)
        j_a = bisect.bisect_right(self.lengths, a)
        j_b = bisect.bisect_right(self.lengths, b)
        return (sums[j_b] - sums[j_a]) / len(self.lengths)
