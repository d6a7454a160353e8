"""Per-request cost profiles as functions of the input length l: `Profile`.

A profile is what the throughput model needs to know about hardware and model for one length:
the prefill time T_prefill(l) in seconds, or the KV-cache size S_kv(l) in MiB (2^20 bytes).
`Profile` is a piecewise polynomial in l, built in one of two ways:

- `Profile.polynomial(coeffs)`: f(l) = Σ_k c_k·l^k for every l — a fitted profile, e.g. the
  quadratic T_prefill(l) = a + b·l + c·l² of docs/planning.md, "Calibration of the case study";
- `Profile.table(lengths, values)`: linear interpolation between measured points, continued
  along the first and last segments outside them (e.g. paper Table 5's S_kv at 1K…128K).

Keeping every profile piecewise polynomial makes expectations exact: E[f(L); a < L ≤ b] is a
sum of partial moments E[L^k; lo < L ≤ hi] over the pieces (see `length_distribution.py`), so
the E[T(L)] form of the throughput model needs no quadrature.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """f(l) = Σ_k coeffs[i][k]·l^k on piece i; piece i covers (knots[i-1], knots[i]].

    There is one more piece than knots; the first piece extends to −∞ and the last to +∞.
    """

    knots: tuple[float, ...]
    coeffs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if len(self.coeffs) != len(self.knots) + 1:
            raise ValueError(
                f"a profile with {len(self.knots)} knots needs {len(self.knots) + 1} pieces, "
                f"got {len(self.coeffs)}"
            )
        if any(not piece for piece in self.coeffs):
            raise ValueError("every profile piece needs at least one coefficient")
        if any(not math.isfinite(c) for piece in self.coeffs for c in piece):
            raise ValueError("profile coefficients must be finite")
        if any(b <= a for a, b in itertools.pairwise(self.knots)):
            raise ValueError(f"profile knots must increase strictly, got {list(self.knots)}")

    @classmethod
    def polynomial(cls, coeffs: Sequence[float]) -> Profile:
        """f(l) = coeffs[0] + coeffs[1]·l + coeffs[2]·l² + … for every l."""
        return cls(knots=(), coeffs=(tuple(float(c) for c in coeffs),))

    @classmethod
    def table(cls, lengths: Sequence[float], values: Sequence[float]) -> Profile:
        """Linear interpolation through (lengths[i], values[i]), extended linearly at both ends."""
        if len(lengths) != len(values):
            raise ValueError(
                f"a profile table needs as many values as lengths, got {len(values)} values "
                f"for {len(lengths)} lengths"
            )
        if len(lengths) < 2:
            raise ValueError("a profile table needs at least two points")
        if any(b <= a for a, b in itertools.pairwise(lengths)):
            raise ValueError(f"profile table lengths must increase strictly, got {list(lengths)}")
        segments = []
        for (x0, y0), (x1, y1) in itertools.pairwise(zip(lengths, values, strict=True)):
            slope = (y1 - y0) / (x1 - x0)
            segments.append((y0 - slope * x0, slope))
        return cls(knots=tuple(float(x) for x in lengths[1:-1]), coeffs=tuple(segments))

    def __call__(self, l: float) -> float:
        # bisect_left puts a knot itself in the piece to its left: pieces are (a, b].
        coeffs = self.coeffs[bisect.bisect_left(self.knots, l)]
        value = 0.0
        for c in reversed(coeffs):
            value = value * l + c
        return value

    def pieces(self, lo: float, hi: float) -> Iterator[tuple[float, float, tuple[float, ...]]]:
        """The pieces overlapping (lo, hi], clipped to it: (piece_lo, piece_hi, coeffs)."""
        edges = itertools.pairwise((-math.inf, *self.knots, math.inf))
        for (left, right), coeffs in zip(edges, self.coeffs, strict=True):
            a, b = max(left, lo), min(right, hi)
            if a < b:
                yield a, b, coeffs
