"""What one simulation run records: `SimResult` (per-request times, time series, policy actions).

Per request (indexed by request id): arrival, prefill end, first token, finish, whether it was
offloaded to PrfaaS, its uncached length, its output length and the bytes its state took to
decode. Every `bin_s` of simulated time: the link's cumulative bytes offered and sent, its
capacity, the threshold t, requests outstanding at PrfaaS and PD prefill, requests waiting for
a decode slot and the PD prefill/decode split. Plus every threshold change (the controller's
`ThresholdUpdate`s), every role change (applied or abandoned), the prefix caches' token hit
rates, and — for a run that stops at its last arrival — the backlog then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from prfaas_jax.policy.rebalancer import RoleChange
from prfaas_jax.policy.threshold_controller import ThresholdUpdate
from prfaas_jax.sim.config import DeploymentSpec

if TYPE_CHECKING:
    from prfaas_jax.sim.simulator import Simulator
    from prfaas_jax.sim.workload import Request

SERIES = (
    "time_s",
    "sent_bytes",
    "offered_bytes",
    "capacity_gbps",
    "threshold",
    "prfaas_queue",
    "pd_prefill_queue",
    "decode_waiting",
    "num_pd_prefill",
    "num_pd_decode",
)


@dataclass(frozen=True)
class RoleChangeRecord:
    at: float
    change: RoleChange
    applied: bool  # False: the drain timed out and the node kept its role


@dataclass
class SimResult:
    deployment: DeploymentSpec
    arrival: np.ndarray
    prefill_end: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    offloaded: np.ndarray
    uncached_len: np.ndarray
    output_len: np.ndarray
    kv_bytes: np.ndarray
    series: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SERIES})
    threshold_updates: list[ThresholdUpdate] = field(default_factory=list)
    role_changes: list[RoleChangeRecord] = field(default_factory=list)
    cache_hit_rate: dict[str, float] = field(default_factory=dict)
    num_arrived: int = 0
    num_finished: int = 0
    backlog: int = 0  # requests waiting anywhere when the run stopped
    end_s: float = 0.0
    sent_bytes: float = 0.0
    offered_bytes: float = 0.0

    @classmethod
    def empty(cls, deployment: DeploymentSpec, num_requests: int) -> SimResult:
        nan = np.full(num_requests, math.nan)
        return cls(
            deployment,
            arrival=nan.copy(),
            prefill_end=nan.copy(),
            first_token=nan.copy(),
            finish=nan.copy(),
            offloaded=np.zeros(num_requests, dtype=bool),
            uncached_len=np.zeros(num_requests, dtype=np.int64),
            output_len=np.zeros(num_requests, dtype=np.int64),
            kv_bytes=np.zeros(num_requests),
        )

    def routed(self, req: Request, now: float) -> None:
        i = req.rid
        self.arrival[i] = now
        self.offloaded[i] = req.offloaded
        self.uncached_len[i] = req.uncached_len
        self.output_len[i] = req.output_len

    def completed(self, req: Request, now: float) -> None:
        i = req.rid
        self.prefill_end[i] = req.prefill_end
        self.first_token[i] = req.first_token
        self.finish[i] = now
        self.kv_bytes[i] = req.kv_bytes

    def sample(self, sim: Simulator, now: float, prfaas_queue: int) -> None:
        row = (
            now,
            sim.link.sent_bytes,
            sim.link.offered_bytes,
            sim.link.capacity_bytes_per_s * 8 / 1e9,
            sim.threshold,
            prfaas_queue,
            sum(i.outstanding for i in sim.pd_prefill),
            sum(d.num_waiting for d in sim.decoders),
            len(sim.pd_prefill),
            len(sim.decoders),
        )
        for key, value in zip(SERIES, row, strict=True):
            self.series[key].append(float(value))

    def role_change(self, now: float, change: RoleChange, *, applied: bool) -> None:
        self.role_changes.append(RoleChangeRecord(now, change, applied))

    def close(self, sim: Simulator) -> None:
        """Closing bookkeeping once the loop has stopped."""
        self.num_arrived, self.num_finished = sim.n_arrived, sim.n_finished
        self.backlog = sim.backlog()
        done = self.finish[~np.isnan(self.finish)]
        self.end_s = float(done.max()) if done.size else sim.loop.now
        self.sent_bytes, self.offered_bytes = sim.link.sent_bytes, sim.link.offered_bytes
        if sim.controller is not None:
            self.threshold_updates = list(sim.controller.history)
        if sim.caches is not None:
            for kind, cache in sim.caches.items():
                rate = cache.hit_tokens / cache.lookup_tokens if cache.lookup_tokens else 0.0
                self.cache_hit_rate[kind.value] = rate
        if not self.series["time_s"] or self.series["time_s"][-1] < sim.loop.now:
            prfaas_queue = sum(i.outstanding for i in sim.prfaas)
            self.sample(sim, sim.loop.now, prfaas_queue)
