"""What one simulation run records: `SimResult` (per-request times, time series, policy actions),
with `Sample` (one row of the time series) and `RoleChangeRecord`.

Per request (indexed by request id): arrival, prefill end, first token, finish, whether it was
offloaded to PrfaaS, its uncached length, its output length, the bytes its state took to
decode, its cached prefix (and how much of it was read back from a disk tier) and whether a
decode worker's prefix kept it local. Every `bin_s` of simulated time a `Sample`: the link's
cumulative bytes offered and sent, its capacity, the threshold t, requests outstanding at
PrfaaS and PD prefill, requests waiting for a decode slot and the PD prefill/decode split.
Plus every threshold change (the controller's `ThresholdUpdate`s), every role change (applied
or abandoned), the prefix caches' token hit rates, and — for a run that stops at its last
arrival — the backlog then. The simulator hands it these values; the result never reads the
simulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

from prfaas_jax.policy.rebalancer import RoleChange
from prfaas_jax.policy.threshold_controller import ThresholdUpdate
from prfaas_jax.sim.config import DeploymentSpec

if TYPE_CHECKING:
    from prfaas_jax.sim.workload import Request


@dataclass(frozen=True)
class Sample:
    """The cluster at one instant: one row of `SimResult.series` (keys: `SERIES`)."""

    time_s: float
    sent_bytes: float
    offered_bytes: float
    capacity_gbps: float
    threshold: float
    prfaas_queue: int
    pd_prefill_queue: int
    decode_waiting: int
    num_pd_prefill: int
    num_pd_decode: int


SERIES = tuple(f.name for f in fields(Sample))


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
    recall_loss: np.ndarray  # what each request's wire precision cost (0: native)
    cached_len: np.ndarray  # prompt tokens reused from a cached prefix
    disk_cached_len: np.ndarray  # of those, read back from a disk tier
    decode_local: np.ndarray  # kept off the link by a decode worker's prefix (decode-aware)
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
            recall_loss=np.zeros(num_requests),
            cached_len=np.zeros(num_requests, dtype=np.int64),
            disk_cached_len=np.zeros(num_requests, dtype=np.int64),
            decode_local=np.zeros(num_requests, dtype=bool),
        )

    def routed(self, req: Request, now: float) -> None:
        i = req.rid
        self.arrival[i] = now
        self.offloaded[i] = req.offloaded
        self.uncached_len[i] = req.uncached_len
        self.output_len[i] = req.output_len

    def cached(self, rid: int, cached_len: int, disk_len: int, decode_local: bool) -> None:
        """What request ``rid`` reuses, how much of it from disk, and whether a decode
        worker's prefix kept it local."""
        self.cached_len[rid], self.disk_cached_len[rid] = cached_len, disk_len
        self.decode_local[rid] = decode_local

    def completed(self, req: Request, now: float) -> None:
        i = req.rid
        self.prefill_end[i] = req.prefill_end
        self.first_token[i] = req.first_token
        self.finish[i] = now
        self.kv_bytes[i] = req.kv_bytes
        self.recall_loss[i] = req.recall_loss

    def sample(self, row: Sample) -> None:
        for key, value in zip(SERIES, astuple(row), strict=True):
            self.series[key].append(float(value))

    def close(
        self,
        last: Sample,
        *,
        num_arrived: int,
        num_finished: int,
        backlog: int,
        threshold_updates: Sequence[ThresholdUpdate],
        role_changes: Sequence[RoleChangeRecord],
        cache_hit_rate: dict[str, float],
    ) -> None:
        """Closing bookkeeping once the loop has stopped; `last` is the cluster then."""
        self.num_arrived, self.num_finished, self.backlog = num_arrived, num_finished, backlog
        done = self.finish[~np.isnan(self.finish)]
        self.end_s = float(done.max()) if done.size else last.time_s
        self.sent_bytes, self.offered_bytes = last.sent_bytes, last.offered_bytes
        self.threshold_updates = list(threshold_updates)
        self.role_changes = list(role_changes)
        self.cache_hit_rate = dict(cache_hit_rate)
        if not self.series["time_s"] or self.series["time_s"][-1] < last.time_s:
            self.sample(last)
