"""Throughput-optimal configuration search (arXiv 2604.15039 §3.4.2, §4.2): `search` → `Plan`.

Exposes `threshold_grid` and `local_splits` (the candidates), `sweep` (every candidate
evaluated), `best_point`, the two baselines `homogeneous_pd` and `naive_heterogeneous`, and
`search`, which returns a `Plan`.

The decision variables are the threshold t and the split N_p + N_d = N_local. The paper's
optimality conditions, Eq. 7 (Θ_prfaas/p = Θ_pd-p/(1−p)) and Eq. 8 (Θ_prfaas + Θ_pd-p = Θ_pd-d),
describe the optimum only when both prefill stages bind; with integer instance counts, decode or
the link can bind instead. So, like the paper's case study, the search is exhaustive: every split
for every t of a fine grid, maximising Eq. 6's Λ_max. Routing statistics depend on t alone, so
each t is routed once and shared by all splits. Ties (when decode binds across a range of t) go
to the point with the most prefill headroom, min(Θ_prfaas/p, Θ_pd-p/(1−p)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prfaas_jax.policy.length_distribution import LengthDistribution
from prfaas_jax.policy.throughput_model import OperatingPoint, ThroughputModel


def threshold_grid(lengths: LengthDistribution, step: int) -> tuple[int, ...]:
    """Every multiple of `step` tokens strictly inside the support, so that 0 < p(t) < 1."""
    if step < 1:
        raise ValueError(f"threshold step must be at least 1 token, got {step}")
    lower, upper = lengths.support
    first, last = math.floor(lower / step) + 1, math.ceil(upper / step) - 1
    return tuple(k * step for k in range(first, last + 1))


def local_splits(num_local: int) -> tuple[tuple[int, int], ...]:
    """Every (N_p, N_d) with N_p + N_d = num_local and both at least 1."""
    return tuple((n_p, num_local - n_p) for n_p in range(1, num_local))


def sweep(
    model: ThroughputModel,
    thresholds: Sequence[float],
    splits: Sequence[tuple[int, int]],
) -> tuple[tuple[OperatingPoint, ...], ...]:
    """Operating points indexed [threshold][split]."""
    rows = []
    for t in thresholds:
        routing = model.routing_at(t)
        rows.append(tuple(model.operate(routing, n_p, n_d) for n_p, n_d in splits))
    return tuple(rows)


def _rank(point: OperatingPoint) -> tuple[float, float]:
    prfaas_bound, pd_prefill_bound, _ = point.bounds
    return (point.lambda_max, min(prfaas_bound, pd_prefill_bound))


def best_point(points: Sequence[OperatingPoint]) -> OperatingPoint:
    """The highest Λ_max; among equals, the most prefill headroom; then the first."""
    if not points:
        raise ValueError("no operating points to choose from")
    return max(points, key=_rank)


def homogeneous_pd(model: ThroughputModel) -> OperatingPoint:
    """Baseline: every instance in one PD cluster, nothing offloaded, best N_p/N_d split."""
    routing = model.routing_at(math.inf)
    splits = local_splits(model.deployment.local.num_instances)
    return best_point([model.operate(routing, n_p, n_d) for n_p, n_d in splits])


def naive_heterogeneous(model: ThroughputModel) -> OperatingPoint:
    """Baseline: every prefill on the PrfaaS cluster, every local instance decodes."""
    return model.operate(model.routing_at(-math.inf), 0, model.deployment.local.num_instances)


@dataclass(frozen=True)
class Plan:
    """The best PrfaaS-PD configuration, the two baselines, and the surface searched."""

    best: OperatingPoint
    homogeneous_pd: OperatingPoint
    naive_heterogeneous: OperatingPoint
    cost: float  # of the PrfaaS-PD deployment (the naive baseline uses the same GPUs)
    homogeneous_cost: float
    grid: tuple[tuple[OperatingPoint, ...], ...] = field(repr=False, compare=False)

    @property
    def speedup_vs_homogeneous(self) -> float:
        return self.best.lambda_max / self.homogeneous_pd.lambda_max

    @property
    def speedup_vs_naive(self) -> float:
        return self.best.lambda_max / self.naive_heterogeneous.lambda_max

    @property
    def equal_cost_speedup_vs_homogeneous(self) -> float:
        """Λ_max per unit of GPU cost, relative to the homogeneous baseline."""
        return self.speedup_vs_homogeneous * self.homogeneous_cost / self.cost


def search(
    model: ThroughputModel,
    baseline: ThroughputModel,
    *,
    thresholds: Sequence[float],
    splits: Sequence[tuple[int, int]] | None = None,
) -> Plan:
    """Exhaustive search over thresholds × splits of `model`; `baseline` has no PrfaaS cluster.

    `splits` defaults to every split of the local cluster with N_p, N_d ≥ 1.
    """
    if not thresholds:
        raise ValueError("the search needs at least one threshold")
    if splits is None:
        splits = local_splits(model.deployment.local.num_instances)
    grid = sweep(model, thresholds, splits)
    return Plan(
        best=best_point([point for row in grid for point in row]),
        homogeneous_pd=homogeneous_pd(baseline),
        naive_heterogeneous=naive_heterogeneous(model),
        cost=model.deployment.cost,
        homogeneous_cost=baseline.deployment.cost,
        grid=grid,
    )
