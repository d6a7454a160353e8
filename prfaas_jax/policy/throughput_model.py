"""The paper's steady-state throughput model of PrfaaS-PD (arXiv 2604.15039 §3.4, Eqs. 3–8).

Exposes the equations as functions of plain numbers, and `ThroughputModel`, which evaluates
them for a `Deployment`, a `LengthDistribution` of uncached input lengths and a threshold t:

    Θ_prfaas = min(N_prfaas / T_prfaas(l_long), B_out / S_kv(l_long))   (3) prfaas_throughput
    Θ_pd-p   = N_p / T_pd(l_short)                                      (4) pd_prefill_throughput
    Θ_pd-d   = N_d · BS_max / (T_decode · L_out)                        (5) pd_decode_throughput
    Λ_max    = min(Θ_prfaas / p, Θ_pd-p / (1 − p), Θ_pd-d)              (6) min of stage_bounds
    Θ_prfaas / p = Θ_pd-p / (1 − p)       at the optimal t              (7) prefill_imbalance
    Θ_prfaas + Θ_pd-p = Θ_pd-d            at the optimal N_p / N_d      (8) producer_consumer_gap

with p = P(L > t), l_long = E[L | L > t], l_short = E[L | L ≤ t]. A term of Eq. 6 whose stage
carries no traffic (p = 0 or p = 1) is +∞, which also covers the two baselines: homogeneous PD
(no PrfaaS cluster, p = 0) and naive heterogeneous (every prefill on PrfaaS, p = 1).

`StageTime` says how a stage's service time is read, the one modelling choice the paper leaves
implicit: `EXPECTED` uses E[T(L) | class] (and E[S_kv(L) | L > t]); `AT_MEAN` uses T(E[L | class])
as Eqs. 3–4 are printed. A server's throughput is the reciprocal of its *mean* service time, and
T_prefill is convex in l, so T(E[L]) ≤ E[T(L)] (Jensen) and `AT_MEAN` overstates throughput; the
paper's Θ_prfaas = 1.61 (Table 6, `planning/paper_tables.py`) matches E[T(L)] (docs/planning.md,
"Calibration of the case study").

Units: lengths in tokens, times in s, S_kv in MiB (2^20 bytes), bandwidth in Gbps (1e9 bit/s).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from prfaas_jax.policy.length_distribution import LengthDistribution
from prfaas_jax.policy.profiles import Profile

BITS_PER_MIB = 8 * 2**20


def gbps_to_mib_per_s(gbps: float) -> float:
    return gbps * 1e9 / BITS_PER_MIB


def mib_per_s_to_gbps(mib_per_s: float) -> float:
    return mib_per_s * BITS_PER_MIB / 1e9


def prfaas_throughput(
    num_instances: int, prefill_s: float, egress_gbps: float, kv_mib: float
) -> float:
    """Eq. 3: the slower of PrfaaS compute and the egress link, in requests/s."""
    return min(num_instances / prefill_s, gbps_to_mib_per_s(egress_gbps) / kv_mib)


def pd_prefill_throughput(num_instances: int, prefill_s: float) -> float:
    """Eq. 4: PD-prefill is compute-bound (intra-cluster RDMA is never the bottleneck)."""
    return num_instances / prefill_s


def pd_decode_throughput(
    num_instances: int, max_batch_size: int, step_s: float, output_len: float
) -> float:
    """Eq. 5: each decode instance finishes max_batch_size requests per step_s · output_len."""
    return num_instances * max_batch_size / (step_s * output_len)


class StageTime(enum.Enum):
    """How a prefill stage's service time is computed from the lengths routed to it."""

    EXPECTED = "expected"  # E[T(L) | class]: the mean service time a queue actually sees
    AT_MEAN = "at_mean"  # T(E[L | class]): Eqs. 3–4 as printed


@dataclass(frozen=True)
class StageThroughputs:
    """Θ of each stage in requests/s; None for a prefill stage that receives no requests."""

    prfaas: float | None
    pd_prefill: float | None
    pd_decode: float


def stage_bounds(p: float, stages: StageThroughputs) -> tuple[float, float, float]:
    """Eq. 6 terms (Θ_prfaas/p, Θ_pd-p/(1−p), Θ_pd-d); +∞ for a stage that carries no traffic."""
    prfaas = math.inf if p == 0.0 or stages.prfaas is None else stages.prfaas / p
    pd_prefill = math.inf if p == 1.0 or stages.pd_prefill is None else stages.pd_prefill / (1 - p)
    return (prfaas, pd_prefill, stages.pd_decode)


def prefill_imbalance(p: float, stages: StageThroughputs) -> float:
    """Eq. 7 residual Θ_prfaas/p − Θ_pd-p/(1−p): > 0 means t could be lowered."""
    prfaas, pd_prefill, _ = stage_bounds(p, stages)
    return prfaas - pd_prefill


def producer_consumer_gap(stages: StageThroughputs) -> float:
    """Eq. 8 residual Θ_prfaas + Θ_pd-p − Θ_pd-d: > 0 means prefill outpaces decode."""
    return (stages.prfaas or 0.0) + (stages.pd_prefill or 0.0) - stages.pd_decode


@dataclass(frozen=True)
class Cluster:
    """A homogeneous group of instances: its size, prefill profile T_prefill(l) and cost."""

    num_instances: int
    prefill_s: Profile
    gpus_per_instance: int = 8
    gpu_cost: float = 1.0

    def __post_init__(self) -> None:
        if self.num_instances < 1 or self.gpus_per_instance < 1:
            raise ValueError("a cluster needs at least one instance of at least one GPU")
        if not self.gpu_cost > 0:
            raise ValueError(f"gpu_cost must be positive, got {self.gpu_cost}")

    @property
    def cost(self) -> float:
        return self.num_instances * self.gpus_per_instance * self.gpu_cost


@dataclass(frozen=True)
class Deployment:
    """A local PD cluster (N_p + N_d instances), optionally with a PrfaaS cluster and its link."""

    local: Cluster
    decode_max_batch_size: int
    decode_step_s: float
    kv_size_mib: Profile
    prfaas: Cluster | None = None
    egress_gbps: float = 0.0

    def __post_init__(self) -> None:
        if self.decode_max_batch_size < 1 or not self.decode_step_s > 0:
            raise ValueError("decode needs max_batch_size ≥ 1 and a positive step time")
        if self.prfaas is not None and not self.egress_gbps > 0:
            raise ValueError(f"PrfaaS egress must be positive, got {self.egress_gbps} Gbps")

    @property
    def cost(self) -> float:
        return self.local.cost + (self.prfaas.cost if self.prfaas is not None else 0.0)


@dataclass(frozen=True)
class Routing:
    """What threshold t does to the workload; the per-class fields are None for an empty class."""

    threshold: float
    offload_fraction: float  # p = P(L > t)
    mean_long_len: float | None  # E[L | L > t]
    mean_short_len: float | None  # E[L | L ≤ t]
    prfaas_prefill_s: float | None  # service time of an offloaded request on PrfaaS
    pd_prefill_s: float | None  # service time of a kept request on PD-prefill
    kv_mib: float | None  # KV shipped per offloaded request


@dataclass(frozen=True)
class OperatingPoint:
    """One (t, N_p, N_d) evaluated: stage throughputs, Λ_max and the egress actually used."""

    routing: Routing
    num_prfaas: int
    num_pd_prefill: int
    num_pd_decode: int
    stages: StageThroughputs
    lambda_max: float
    egress_gbps: float  # p · Λ_max · S_kv: the link load when arrivals run at Λ_max

    @property
    def bounds(self) -> tuple[float, float, float]:
        return stage_bounds(self.routing.offload_fraction, self.stages)


@dataclass(frozen=True)
class ThroughputModel:
    """Eqs. 3–6 for one deployment and workload; `routing_at` is per t, `operate` per split."""

    deployment: Deployment
    lengths: LengthDistribution
    output_len: float
    stage_time: StageTime = StageTime.EXPECTED

    def __post_init__(self) -> None:
        if not self.output_len > 0:
            raise ValueError(f"output_len must be positive, got {self.output_len}")

    def routing_at(self, t: float) -> Routing:
        p = self.lengths.tail_prob(t)
        long_len = short_len = prfaas_s = pd_s = kv_mib = None
        if p > 0:
            prfaas = self.deployment.prfaas
            if prfaas is None:
                raise ValueError(
                    f"threshold {t:g} offloads requests but there is no PrfaaS cluster"
                )
            long_len = self.lengths.mean_above(t)
            prfaas_s = self._stage_value(prfaas.prefill_s, t, long_len, above=True)
            kv_mib = self._stage_value(self.deployment.kv_size_mib, t, long_len, above=True)
        if p < 1:
            short_len = self.lengths.mean_below(t)
            pd_s = self._stage_value(self.deployment.local.prefill_s, t, short_len, above=False)
        return Routing(t, p, long_len, short_len, prfaas_s, pd_s, kv_mib)

    def _stage_value(self, f: Profile, t: float, mean_len: float, *, above: bool) -> float:
        if self.stage_time is StageTime.AT_MEAN:
            return f(mean_len)
        return self.lengths.expect_above(f, t) if above else self.lengths.expect_below(f, t)

    def operate(self, routing: Routing, num_pd_prefill: int, num_pd_decode: int) -> OperatingPoint:
        deployment = self.deployment
        if min(num_pd_prefill, num_pd_decode) < 0:
            raise ValueError("instance counts must be non-negative")
        if num_pd_prefill + num_pd_decode > deployment.local.num_instances:
            raise ValueError(
                f"{num_pd_prefill} + {num_pd_decode} instances exceed the local cluster's "
                f"{deployment.local.num_instances}"
            )
        num_prfaas = deployment.prfaas.num_instances if deployment.prfaas is not None else 0
        prfaas = pd_prefill = None
        if routing.prfaas_prefill_s is not None and routing.kv_mib is not None:
            prfaas = prfaas_throughput(
                num_prfaas, routing.prfaas_prefill_s, deployment.egress_gbps, routing.kv_mib
            )
        if routing.pd_prefill_s is not None:
            pd_prefill = pd_prefill_throughput(num_pd_prefill, routing.pd_prefill_s)
        pd_decode = pd_decode_throughput(
            num_pd_decode,
            deployment.decode_max_batch_size,
            deployment.decode_step_s,
            self.output_len,
        )
        stages = StageThroughputs(prfaas, pd_prefill, pd_decode)
        lambda_max = min(stage_bounds(routing.offload_fraction, stages))
        offloaded_mib_per_s = routing.offload_fraction * lambda_max * (routing.kv_mib or 0.0)
        return OperatingPoint(
            routing=routing,
            num_prfaas=num_prfaas,
            num_pd_prefill=num_pd_prefill,
            num_pd_decode=num_pd_decode,
            stages=stages,
            lambda_max=lambda_max,
            egress_gbps=mib_per_s_to_gbps(offloaded_mib_per_s),
        )

    def evaluate(self, t: float, num_pd_prefill: int, num_pd_decode: int) -> OperatingPoint:
        return self.operate(self.routing_at(t), num_pd_prefill, num_pd_decode)
