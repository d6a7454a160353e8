"""The sections of a toy-cluster config, one frozen dataclass each: `ModelSection`,
`EngineSection`, `FakeSection`, `InstancesSection`, `LinkSection`, `RouterSection`,
`ControllerSection`, `RebalancerSection`, `ProfileSection`, `PrefixCacheSection`,
`SecuritySection` and `ChaosSection`.

Each field's default is the value a config that omits the key gets, and its type is the type
the reader checks (serving/cluster_config.py, which reads the TOML file into these and
validates them). Separate from that reader because most serving modules need one section
(security, chaos, the link) and none of the parsing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from prfaas_jax.policy.rebalancer import RebalancerConfig


@dataclass(frozen=True)
class ModelSection:
    preset: str
    seed: int = 0
    impl: str = "chunk"
    engine: str = "jax"


@dataclass(frozen=True)
class EngineSection:
    max_len: int = 512  # state capacity of a decode slot (prompt + new tokens)
    chunk_len: int = 128
    buckets: tuple[int, ...] = (16, 32, 64, 128)
    max_slots: int = 8
    frame_bytes: int = 16384  # largest codec frame: the link shaper's granularity
    compile_cache: bool = True  # share compiled executables between worker processes
    prefill_mesh: str = ""  # device mesh of prefill engines, e.g. "tensor=4" ("": one device)
    decode_mesh: str = ""  # of decode engines; may differ: states are layout-free on the wire
    max_prefill_queue: int = 64  # per prefill worker: requests waiting for or on its engine
    max_pending_states: int = 0  # per decode worker: states held outside a slot (0: see below)


@dataclass(frozen=True)
class FakeSection:
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0


@dataclass(frozen=True)
class InstancesSection:
    prfaas_prefill: int = 1
    pd_prefill: int = 1
    pd_decode: int = 1


@dataclass(frozen=True)
class LinkSection:
    bandwidth_mbps: float = 16.0  # the PrfaaS cluster's egress, 1e6 bit/s
    latency_ms: float = 5.0
    burst_kib: float = 16.0
    schedule: tuple[tuple[float, float], ...] = ()  # (seconds after start, bandwidth factor)
    repeat_s: float = 0.0  # > 0: the schedule repeats with this period

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8


@dataclass(frozen=True)
class RouterSection:
    threshold: float = 64.0
    prfaas_max_queue: int = 4
    bandwidth_abundant: bool = False
    control_period_s: float = 0.5
    request_timeout_s: float = 120.0
    max_attempts: int = 4  # per request: the first attempt and up to 3 retries after faults
    retry_wait_s: float = 30.0  # how long a retry waits for a live instance (e.g. a restart)
    stall_timeout_s: float = 30.0  # an attempt silent this long (hung worker or link) is retried
    metrics_port: int = 0  # 0: any free port
    max_in_flight: int = 256  # requests admitted at once; more are RESOURCE_EXHAUSTED
    ttft_slo_s: float = 0.0  # refuse a request whose predicted TTFT exceeds this (0: off)


@dataclass(frozen=True)
class ControllerSection:
    enabled: bool = True
    threshold_step: int = 16
    window: int = 256
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # ControllerConfig fields


@dataclass(frozen=True)
class RebalancerSection:
    enabled: bool = False
    period_s: float = 5.0
    drain_timeout_s: float = 60.0
    config: RebalancerConfig = dataclasses.field(default_factory=RebalancerConfig)


@dataclass(frozen=True)
class ProfileSection:
    prfaas_prefill_s: tuple[float, ...] = (0.002, 1.0e-4)
    pd_prefill_s: tuple[float, ...] = (0.005, 2.5e-4)
    decode_step_s: float = 0.01


@dataclass(frozen=True)
class PrefixCacheSection:
    enabled: bool = False  # off by default: existing clusters route exactly as before
    capacity_mib: float = 64.0  # host-memory budget per prefill worker, KV and states together
    block_size: int = 16  # tokens per KV block (the match granularity of attention layers)
    checkpoint_every: int = 4  # linear-state checkpoint every this many blocks, and at prompt end

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_mib * 2**20)


@dataclass(frozen=True)
class SecuritySection:
    """Paths only: the key and the token are read by the processes that use them, so neither
    ever sits in a config object that might be printed or logged."""

    ca_cert: str = ""  # PEM: the CA that signs every node (and client) certificate
    cert: str = ""  # PEM: this node's certificate, presented as server and as client
    key: str = ""  # PEM: its private key
    token_file: str = ""  # a file holding the router's bearer token ("": no token auth)

    @property
    def tls(self) -> bool:
        return bool(self.cert)


@dataclass(frozen=True)
class ChaosSection:
    """Faults the prefill workers inject into their own state transfers (serving/worker/faults.py)."""

    corrupt_frame_prob: float = 0.0  # flip one byte of one data frame: the receiver's CRC fails
    drop_transfer_prob: float = 0.0  # cancel the push midway, as a dead link would
    seed: int = 0  # each worker draws from seed + a hash of its name

    @property
    def enabled(self) -> bool:
        return self.corrupt_frame_prob > 0 or self.drop_transfer_prob > 0
