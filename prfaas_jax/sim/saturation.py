"""A deployment's saturation throughput (its capacity), analytic and simulated: `analytic_point`
and `saturation_search`.

`analytic_point` evaluates the paper's Eqs. 3–6 (`policy.throughput_model`) for exactly the
deployment simulated: its N_prfaas / N_p / N_d, its threshold, the link's starting bandwidth and
the plan's length distribution, so `lambda_max` is the Λ_max the simulation is checked against.

`saturation_search` measures the same quantity by simulation: the highest offered rate λ the
deployment keeps up with. A probe simulates `requests` arrivals at rate λ (the same requests at
every rate: time is rescaled, common random numbers) and stops at the last arrival; the rate
keeps up when at most `backlog_scale · √requests` requests are then still waiting (for a
prefill, on a link or for a decode slot). Below saturation (ρ = 1 − δ) the backlog is a
queue's stationary length, O(1/δ) whatever the run's length; above it (ρ = 1 + δ) it grows like
δ·requests. A threshold of order √requests balances the two errors, so the boundary is found
to about ±1/√requests in ρ (±0.7% for 20,000 requests). The search brackets the boundary
starting from [Λ_max/2, 3Λ_max/2] (widening until it holds), then bisects `probes` times and
reports the highest rate that kept up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from prfaas_jax.policy.throughput_model import (
    Cluster,
    Deployment,
    OperatingPoint,
    ThroughputModel,
)
from prfaas_jax.sim.config import (
    DeploymentSpec,
    SaturationSpec,
    SimConfig,
    with_overrides,
)
from prfaas_jax.sim.simulator import Simulator

MAX_WIDENINGS = 6


def analytic_point(config: SimConfig, deployment: DeploymentSpec) -> OperatingPoint:
    """Eqs. 3–6 for the simulated deployment (module docstring)."""
    plan = config.plan.model
    profiles = config.profiles
    prfaas = None
    if deployment.num_prfaas:
        prfaas = Cluster(deployment.num_prfaas, profiles.prfaas_prefill_s, gpus_per_instance=1)
    local = Cluster(
        max(deployment.num_pd_prefill + deployment.num_pd_decode, 1),
        profiles.pd_prefill_s,
        gpus_per_instance=1,
    )
    model = ThroughputModel(
        Deployment(
            local=local,
            decode_max_batch_size=profiles.decode_max_batch_size,
            decode_step_s=profiles.decode_step_s,
            kv_size_mib=profiles.kv_size_mib,
            prfaas=prfaas,
            egress_gbps=config.link.schedule[0][1] if prfaas is not None else 0.0,
        ),
        plan.lengths,
        float(config.workload.output_len),
        plan.stage_time,
    )
    return model.evaluate(deployment.threshold, deployment.num_pd_prefill, deployment.num_pd_decode)


@dataclass(frozen=True)
class Probe:
    rate: float
    backlog: int
    keeps_up: bool


@dataclass(frozen=True)
class Saturation:
    max_throughput: float  # the highest probed rate that kept up (requests/s)
    probes: tuple[Probe, ...]
    simulated_requests: int


def saturation_search(
    config: SimConfig,
    deployment: DeploymentSpec,
    spec: SaturationSpec,
    *,
    guess: float,
    on_probe: Callable[[Probe], None] | None = None,
) -> Saturation:
    """The highest rate `deployment` keeps up with (module docstring); `guess` centres the
    first bracket (the analytic Λ_max)."""
    if not (guess > 0 and math.isfinite(guess)):
        raise ValueError(f"the saturation search needs a positive finite guess, got {guess}")
    probes: list[Probe] = []
    simulated = 0
    probe_config = with_overrides(config, requests=spec.requests)
    limit = spec.backlog_scale * math.sqrt(spec.requests)

    def probe(rate: float) -> bool:
        nonlocal simulated
        result = Simulator(probe_config, deployment, rate=rate, stop_at_last_arrival=True).run()
        simulated += result.num_arrived
        done = Probe(rate, result.backlog, result.backlog <= limit)
        probes.append(done)
        if on_probe is not None:
            on_probe(done)
        return done.keeps_up

    low, high = 0.5 * guess, 1.5 * guess
    for _ in range(MAX_WIDENINGS):
        if probe(low):
            break
        low, high = low / 2, low
    for _ in range(MAX_WIDENINGS):
        if not probe(high):
            break
        low, high = high, high * 2
    for _ in range(spec.probes):
        middle = 0.5 * (low + high)
        if probe(middle):
            low = middle
        else:
            high = middle
    best = max((p.rate for p in probes if p.keeps_up), default=0.0)
    return Saturation(best, tuple(probes), simulated)
