"""The throughput model fed with live traffic: what both scheduler timescales re-solve.

Exposes `LiveProfiles` (hardware and model constants of a running cluster), `ClusterShape`
(instances per role), `TrafficWindow` (the recent requests: uncached lengths, output lengths,
arrival times), `live_model` (a `ThroughputModel` of Eqs. 3–6 on the window's empirical
lengths) and `solve_threshold`.

`solve_threshold` is the short-timescale search of the paper's §3.4.3: among candidate
thresholds t it maximises Λ_max (Eq. 6, ties to the most prefill headroom, then the smallest t,
as `search.best_point`), subject to the link carrying the traffic that is actually arriving:

    demand(t) = Λ_obs · p(t) · E[S_kv(L) | L > t]  ≤  target_utilization · B_out

where Λ_obs is the observed arrival rate. Eq. 3 already caps Θ_prfaas by B_out / S_kv; the
demand term adds the headroom a live link needs, since a link run at Λ_max is a link at 100 %.
When no candidate meets the bound, the one with the least demand wins.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from prfaas_jax.policy.length_distribution import EmpiricalLengths
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.throughput_model import (
    BITS_PER_MIB,
    Cluster,
    Deployment,
    OperatingPoint,
    ThroughputModel,
)


@dataclass(frozen=True)
class LiveProfiles:
    """Per-request costs of the live cluster (seconds, MiB), as the throughput model takes them."""

    prfaas_prefill_s: Profile
    pd_prefill_s: Profile
    kv_size_mib: Profile
    decode_max_batch_size: int
    decode_step_s: float


@dataclass(frozen=True)
class ClusterShape:
    """Instances per role; PrfaaS instances never change role."""

    num_prfaas: int
    num_pd_prefill: int
    num_pd_decode: int

    def __post_init__(self) -> None:
        if min(self.num_prfaas, self.num_pd_prefill, self.num_pd_decode) < 0:
            raise ValueError(f"instance counts must be ≥ 0, got {self}")
        if self.num_pd_decode < 1 or self.num_pd_prefill + self.num_prfaas < 1:
            raise ValueError(f"a cluster needs a decode and a prefill instance, got {self}")

    @property
    def num_local(self) -> int:
        return self.num_pd_prefill + self.num_pd_decode

    def moved(self, to_prefill: int) -> ClusterShape:
        """This shape with `to_prefill` PD nodes moved decode → prefill (negative: back)."""
        return ClusterShape(
            self.num_prfaas, self.num_pd_prefill + to_prefill, self.num_pd_decode - to_prefill
        )


class TrafficWindow:
    """The last `size` requests (arrival time, uncached length, output length) for the length
    statistics, and every arrival time of the last `rate_memory_s` seconds for the rate."""

    def __init__(self, size: int = 256, rate_memory_s: float = 60.0) -> None:
        if size < 1 or not rate_memory_s > 0:
            raise ValueError(f"need size ≥ 1 and rate_memory_s > 0, got {size}, {rate_memory_s}")
        self._requests: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=size)
        self._arrivals: collections.deque[float] = collections.deque()
        self.rate_memory_s = rate_memory_s

    def record(self, now: float, uncached_len: int, output_len: int) -> None:
        if uncached_len < 1 or output_len < 1:
            raise ValueError(f"lengths must be ≥ 1, got {uncached_len} and {output_len}")
        self._requests.append((now, uncached_len, output_len))
        self._arrivals.append(now)
        while self._arrivals and self._arrivals[0] <= now - self.rate_memory_s:
            self._arrivals.popleft()

    def __len__(self) -> int:
        return len(self._requests)

    def lengths(self) -> EmpiricalLengths:
        return EmpiricalLengths(tuple(length for _, length, _ in self._requests))

    def mean_output_len(self) -> float:
        return sum(out for _, _, out in self._requests) / len(self._requests)

    def arrival_rate(self, now: float, horizon_s: float) -> float:
        """Requests per second that arrived in (now − horizon_s, now]."""
        if not 0 < horizon_s <= self.rate_memory_s:
            raise ValueError(f"horizon_s must be in (0, {self.rate_memory_s}], got {horizon_s}")
        recent = sum(1 for at in self._arrivals if now - horizon_s < at <= now)
        return recent / horizon_s


def bytes_per_s_to_gbps(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1e9


def live_model(
    profiles: LiveProfiles,
    shape: ClusterShape,
    traffic: TrafficWindow,
    egress_bytes_per_s: float,
) -> ThroughputModel:
    """Eqs. 3–6 for `shape`, with the window's lengths and mean output length."""
    if not len(traffic):
        raise ValueError("the traffic window is empty: nothing to model")
    prfaas = None
    if shape.num_prfaas:
        prfaas = Cluster(shape.num_prfaas, profiles.prfaas_prefill_s, gpus_per_instance=1)
    deployment = Deployment(
        local=Cluster(max(shape.num_local, 1), profiles.pd_prefill_s, gpus_per_instance=1),
        decode_max_batch_size=profiles.decode_max_batch_size,
        decode_step_s=profiles.decode_step_s,
        kv_size_mib=profiles.kv_size_mib,
        prfaas=prfaas,
        egress_gbps=bytes_per_s_to_gbps(egress_bytes_per_s) if prfaas is not None else 0.0,
    )
    return ThroughputModel(deployment, traffic.lengths(), traffic.mean_output_len())


@dataclass(frozen=True)
class ThresholdSolution:
    """The chosen t, its operating point and the link load it predicts."""

    threshold: float
    point: OperatingPoint
    demand_bytes_per_s: float  # Λ_obs · p · E[S_kv | L > t]
    meets_target: bool


def solve_threshold(
    model: ThroughputModel,
    shape: ClusterShape,
    candidates: Sequence[float],
    *,
    arrival_rate: float,
    egress_bytes_per_s: float,
    target_utilization: float,
) -> ThresholdSolution:
    """The best candidate t (module docstring)."""
    if not candidates:
        raise ValueError("no candidate thresholds")
    if shape.num_prfaas == 0 or shape.num_pd_prefill == 0:
        # One prefill stage only: t is forced (everything local, or everything remote).
        forced = math.inf if shape.num_prfaas == 0 else -math.inf
        point = model.evaluate(forced, shape.num_pd_prefill, shape.num_pd_decode)
        demand = arrival_rate * point.routing.offload_fraction * (point.routing.kv_mib or 0.0)
        return ThresholdSolution(forced, point, demand * BITS_PER_MIB / 8, True)
    limit = target_utilization * egress_bytes_per_s
    best, best_rank = None, None
    for t in candidates:
        point = model.evaluate(t, shape.num_pd_prefill, shape.num_pd_decode)
        routing = point.routing
        demand = arrival_rate * routing.offload_fraction * (routing.kv_mib or 0.0)
        demand_bytes = demand * BITS_PER_MIB / 8
        prfaas_bound, pd_bound, _ = point.bounds
        meets = demand_bytes <= limit
        # Feasible first; then Λ_max and headroom; infeasible ones by least demand.
        rank = (
            (meets, point.lambda_max, min(prfaas_bound, pd_bound))
            if meets
            else (
                meets,
                -demand_bytes,
                0.0,
            )
        )
        if best_rank is None or rank > best_rank:
            best, best_rank = ThresholdSolution(t, point, demand_bytes, meets), rank
    assert best is not None
    return best
