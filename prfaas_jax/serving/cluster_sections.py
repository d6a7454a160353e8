"""The sections of a toy-cluster config, one frozen dataclass each: `ModelSection`,
`EngineSection`, `FakeSection`, `InstancesSection`, `LinkSection`, `RouterSection`,
`ControllerSection`, `RebalancerSection`, `ProfileSection`, `PrefixCacheSection`,
`SecuritySection`, `FaultsSection`, `HostsSection` (with its `Endpoint`s) and `NodeClassSection`
(one `[node_classes.NAME]` table); `EngineKind`, the `[model] engine` choice, `Allocator`, the
`[engine] allocator` one, and `PdMode`, the `[instances] pd_mode` one.
`SecuritySection.check_bind` applies the rule beyond loopback (serving/bind_rule.py).

Each field's default is the value a config that omits the key gets, and its type is the type
the reader checks (`toml_config.build`, called by serving/cluster_config.py). Each section
checks its values in `__post_init__`, naming the key; `[security]`'s files are checked by the
reader, which resolves them against the config's folder. Separate from that reader because
most serving modules need one section (security, faults, the link) and none of the parsing.
The module is over 450 lines because it holds every section, each with its checks, and a
config's sections are read side by side.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass

from prfaas_jax.config import Impl
from prfaas_jax.errors import ConfigError
from prfaas_jax.policy.rebalancer import RebalancerConfig
from prfaas_jax.policy.threshold_controller import ControllerConfig
from prfaas_jax.serving.bind_rule import PLAINTEXT_FIX, bind_refusal
from prfaas_jax.wire_precision import WirePrecision


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


class EngineKind(enum.StrEnum):
    JAX = "jax"  # the model in JAX
    FAKE = "fake"  # engine/fake.py: tokens computable by hand, timed by [fake]


class PdMode(enum.StrEnum):
    """How the PD cluster's instances share the work (`[instances] pd_mode`)."""

    DISAGGREGATED = "disaggregated"  # pd_prefill instances push states to pd_decode ones
    # every PD instance prefills local prompts in its own decode steps (serving/worker/mixed.py)
    MIXED = "mixed"


class Allocator(enum.StrEnum):
    """Where a decode engine keeps its requests' states (`[engine] allocator`)."""

    SLOTS = "slots"  # engine/decode.py: max_slots slots of max_len positions each
    PAGED = "paged"  # engine/paged_decode.py: pages of one block pool, as many as a state needs


@dataclass(frozen=True)
class ModelSection:
    preset: str
    seed: int = 0
    impl: Impl = Impl.CHUNK
    engine: EngineKind = EngineKind.JAX


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
    prfaas_mesh: str = ""  # of PrfaaS prefill engines, a bigger instance ("": prefill_mesh)
    # > 1: a prefill's last chunk runs as this many groups of layers, each group's states
    # shipped while the next computes (layer-wise streaming); 1: the chunk runs whole
    layer_groups: int = 1
    max_prefill_queue: int = 64  # per prefill worker: requests waiting for or on its engine
    # per prefill worker: waiting one-chunk prompts (no cached prefix) that share an engine
    # call, at most this many rows and prompt tokens together; 1: every prompt alone
    prefill_batch_rows: int = 8
    prefill_batch_tokens: int = 4096
    max_pending_states: int = 0  # per decode worker: states held outside a slot (0: see below)
    # per worker: freed state memory kept mapped for the next states (engine/host_memory.py)
    state_pool_mib: float = 4096.0
    allocator: Allocator = Allocator.SLOTS  # of the JAX decode engine
    block_size: int = 16  # paged: the requested attention block (engine/page_layout.py)
    num_pages: int = 0  # paged: pages of the pool (0: as many as max_slots slots' bytes)

    def __post_init__(self) -> None:
        _check(self.max_len >= 2, "engine.max_len", "must be ≥ 2")
        _check(self.chunk_len >= 1, "engine.chunk_len", "must be ≥ 1")
        buckets = list(self.buckets)
        ok = bool(buckets) and buckets == sorted(set(buckets)) and buckets[0] >= 1
        _check(ok, "engine.buckets", "must be increasing positive sizes")
        _check(self.max_slots >= 1, "engine.max_slots", "must be ≥ 1")
        _check(self.max_prefill_queue >= 1, "engine.max_prefill_queue", "must be ≥ 1")
        _check(self.prefill_batch_rows >= 1, "engine.prefill_batch_rows", "must be ≥ 1")
        _check(self.prefill_batch_tokens >= 1, "engine.prefill_batch_tokens", "must be ≥ 1")
        _check(self.max_pending_states >= 0, "engine.max_pending_states", "must be ≥ 0")
        _check(self.frame_bytes >= 1024, "engine.frame_bytes", "must be ≥ 1024")
        _check(self.layer_groups >= 1, "engine.layer_groups", "must be ≥ 1")
        _check(self.state_pool_mib >= 0, "engine.state_pool_mib", "must be ≥ 0")
        _check(self.block_size >= 1, "engine.block_size", "must be ≥ 1")
        _check(self.num_pages >= 0, "engine.num_pages", "must be ≥ 0")
        paged_mesh = self.allocator is Allocator.PAGED and bool(self.decode_mesh)
        _check(not paged_mesh, "engine.decode_mesh", "the paged decode engine runs on one device")

    @property
    def prfaas_prefill_mesh(self) -> str:
        """The mesh of a PrfaaS instance's prefill engine."""
        return self.prfaas_mesh or self.prefill_mesh


@dataclass(frozen=True)
class FakeSection:
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    # Prefill hands its state over in chunks of this many tokens, as the JAX engine does with
    # [engine] chunk_len (so a prefix cache gets checkpoints inside a prompt); 0: one chunk.
    chunk_len: int = 0

    def __post_init__(self) -> None:
        ok = min(self.prefill_s_per_token, self.decode_step_s) >= 0
        _check(ok, "fake", "prefill_s_per_token and decode_step_s must be ≥ 0")
        _check(self.chunk_len >= 0, "fake.chunk_len", "must be ≥ 0")


@dataclass(frozen=True)
class InstancesSection:
    prfaas_prefill: int = 1
    pd_prefill: int = 1
    pd_decode: int = 1
    # JAX processes per PrfaaS prefill instance: > 1 spans its mesh ([engine] prfaas_mesh, else
    # prefill_mesh) over them (engine/spmd.py), each process holding devices / prfaas_processes.
    prfaas_processes: int = 1
    # The node class (a `[node_classes.NAME]`: CPU quota and cores, set by cgroups) of each
    # instance of the PrfaaS cluster and of the PD cluster; "": the machine as it is.
    prfaas_class: str = ""
    pd_class: str = ""
    # "mixed": the pd_decode instances prefill the PD cluster's prompts in their decode steps,
    # and there is no pd_prefill instance
    pd_mode: PdMode = PdMode.DISAGGREGATED

    def __post_init__(self) -> None:
        _check(min(self.prfaas_prefill, self.pd_prefill) >= 0, "instances", "counts must be ≥ 0")
        _check(self.prfaas_processes >= 1, "instances.prfaas_processes", "must be ≥ 1")
        _check(self.pd_decode >= 1, "instances.pd_decode", "must be ≥ 1")
        ok = self.prfaas_prefill + self.pd_prefill >= 1 or self.mixed
        _check(ok, "instances", "need a prefill instance")
        ok = not (self.mixed and self.pd_prefill)
        _check(ok, "instances.pd_prefill", 'must be 0 with pd_mode = "mixed"')

    @property
    def mixed(self) -> bool:
        """Whether the PD instances prefill and decode in one step (`pd_mode = "mixed"`)."""
        return self.pd_mode is PdMode.MIXED


@dataclass(frozen=True)
class NodeClassSection:
    """How fast a node of this class is: the share of CPU time its processes get (`cpu_quota`
    cores: the CFS quota over `period_ms`) and the cores they may run on (`cpus`, a cpuset
    list such as "0" or "0-1,3"). Each instance of the class gets a cgroup of its own with
    these limits, so instances never take each other's time (serving/cluster/cgroups.py)."""

    cpus: str
    cpu_quota: float
    period_ms: float = 20.0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", self.cpus):
            raise ValueError(f'cpus: expected a CPU list such as "0" or "0-1,3", got {self.cpus!r}')
        if not self.cpu_quota > 0:
            raise ValueError(f"cpu_quota: must be > 0 cores, got {self.cpu_quota:g}")
        if not 1.0 <= self.period_ms <= 1000.0:
            raise ValueError(f"period_ms: must be in [1, 1000], got {self.period_ms:g}")

    @property
    def cpu_list(self) -> tuple[int, ...]:
        """The cores of `cpus`, in order."""
        cores: list[int] = []
        for part in self.cpus.split(","):
            low, _, high = part.partition("-")
            cores += range(int(low), int(high or low) + 1)
        return tuple(sorted(set(cores)))


@dataclass(frozen=True)
class LinkSection:
    bandwidth_mbps: float = 16.0  # the PrfaaS cluster's egress, 1e6 bit/s
    latency_ms: float = 5.0  # one-way delay, added by the sender (unless rtt_ms is set)
    # The link in packets (serving/cluster/wan.py; under --netns a delay line TCP sees, else
    # only the delay applies, in the sender): the round trip (both ways; > 0 replaces
    # latency_ms), the standard deviation of extra one-way delay, the long-run share of
    # packets lost, the mean packets per loss burst, and whether jitter may reorder packets.
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_percent: float = 0.0
    loss_burst: float = 1.0
    reorder: bool = False
    burst_kib: float = 16.0
    schedule: tuple[tuple[float, float], ...] = ()  # (seconds after start, bandwidth factor)
    repeat_s: float = 0.0  # > 0: the schedule repeats with this period
    streams: int = 1  # TCP connections a state crossing the link is striped over
    # How a PrfaaS worker's push encodes the state it sends to decode (prfaas_jax/
    # wire_precision.py): "native", one encoding for every tensor ("bf16"), or per kind
    # ("state=bf16,kv=int8"). Prefix-cache exports stay exact: their copies are reused.
    precision: str = "native"
    # Every push (PrfaaS and PD) sends its frames on a TCP connection of its own beside
    # PushState, which then carries only the control (serving/transfer/data_path.py); false:
    # the frames go as PushState's messages.
    data_path: bool = True

    def __post_init__(self) -> None:
        _check(self.bandwidth_mbps > 0, "link.bandwidth_mbps", "must be positive")
        try:
            WirePrecision.parse(self.precision)
        except ValueError as err:
            raise ConfigError(f"link.precision: {err}") from None
        _check(1 <= self.streams <= 16, "link.streams", "must be in [1, 16]")
        ok = self.latency_ms >= 0 and self.burst_kib > 0
        _check(ok, "link", "needs latency_ms ≥ 0 and burst_kib > 0")
        _check(self.rtt_ms >= 0 and self.jitter_ms >= 0, "link", "needs rtt_ms, jitter_ms ≥ 0")
        _check(0 <= self.loss_percent < 100, "link.loss_percent", "must be in [0, 100)")
        _check(self.loss_burst >= 1, "link.loss_burst", "must be ≥ 1 (packets)")
        times = [at for at, _ in self.schedule]
        ok = times == sorted(times) and all(at >= 0 and f > 0 for at, f in self.schedule)
        _check(ok, "link.schedule", "must be [at_s ≥ 0, factor > 0] pairs in time order")
        _check(self.repeat_s >= 0, "link.repeat_s", "must be ≥ 0")
        ok = not self.schedule or not self.repeat_s or times[-1] < self.repeat_s
        _check(ok, "link.repeat_s", "must exceed the last schedule time")

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    @property
    def wire_precision(self) -> WirePrecision:
        return WirePrecision.parse(self.precision)

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_ms / 2e3 if self.rtt_ms else self.latency_ms / 1e3

    @property
    def in_packets(self) -> bool:
        """Whether the link asks for what only a packet path can do — a round trip, jitter or
        loss — so `--netns` puts the delay line of serving/cluster/wan.py in it."""
        return bool(self.rtt_ms or self.jitter_ms or self.loss_percent)


@dataclass(frozen=True)
class RouterSection:
    threshold: float = 64.0
    prfaas_max_queue: int = 4
    # The prefix-cache rule (policy/routing.py): "auto" picks per request from the link's
    # utilisation and the predicted move vs recompute time; "scarce" / "abundant" fix it.
    cache_rule: str = "auto"
    # Answer the rule's cached lengths from an index of the instances' cache events
    # (serving/router/cache_feed.py); false: ask every prefill instance per request.
    cache_index: bool = True
    # Count a prefix as copied to whichever instance of its cluster is picked, so a hot prefix
    # spreads by load (policy/routing.py, hot-prefix replication); false: by own cache only.
    replicate_prefixes: bool = True
    # Decode-aware routing (policy/routing.py): decode workers keep the states they receive,
    # checkpoints included, in their node's prefix pool, and the threshold rule counts their
    # prefixes as local ones; false: their cache only trims the bytes a transfer ships.
    decode_aware: bool = False
    control_period_s: float = 0.5
    request_timeout_s: float = 120.0
    max_attempts: int = 4  # per request: the first attempt and up to 3 retries after faults
    retry_wait_s: float = 30.0  # how long a retry waits for a live instance (e.g. a restart)
    stall_timeout_s: float = 30.0  # an attempt silent this long (hung worker or link) is retried
    metrics_port: int = 0  # 0: any free port
    max_in_flight: int = 256  # requests admitted at once; more are RESOURCE_EXHAUSTED
    ttft_slo_s: float = 0.0  # refuse a request whose predicted TTFT exceeds this (0: off)

    def __post_init__(self) -> None:
        _check(self.threshold >= 0, "router.threshold", "must be ≥ 0")
        _check(self.prfaas_max_queue >= 1, "router.prfaas_max_queue", "must be ≥ 1")
        rules = ("auto", "scarce", "abundant")
        _check(self.cache_rule in rules, "router.cache_rule", f"must be one of {rules}")
        _check(self.control_period_s > 0, "router.control_period_s", "must be positive")
        _check(self.request_timeout_s > 0, "router.request_timeout_s", "must be positive")
        _check(self.max_attempts >= 1, "router.max_attempts", "must be ≥ 1")
        _check(self.retry_wait_s >= 0, "router.retry_wait_s", "must be ≥ 0")
        _check(self.stall_timeout_s > 0, "router.stall_timeout_s", "must be positive")
        _check(0 <= self.metrics_port < 65536, "router.metrics_port", "must be a port number")
        _check(self.max_in_flight >= 1, "router.max_in_flight", "must be ≥ 1")
        _check(self.ttft_slo_s >= 0, "router.ttft_slo_s", "must be ≥ 0")


@dataclass(frozen=True)
class ControllerSection:
    """The policy's keys, every `ControllerConfig` field but `candidates`, share the table; the
    candidates are every `threshold_step` tokens up to `engine.max_len`."""

    config: ControllerConfig
    enabled: bool = True
    threshold_step: int = 16
    window: int = 256

    def __post_init__(self) -> None:
        _check(self.threshold_step >= 1, "controller.threshold_step", "must be ≥ 1")
        _check(self.window >= 1, "controller.window", "must be ≥ 1")


@dataclass(frozen=True)
class RebalancerSection:
    """The policy's keys, every `RebalancerConfig` field, share the table."""

    enabled: bool = False
    period_s: float = 5.0
    drain_timeout_s: float = 60.0
    config: RebalancerConfig = dataclasses.field(default_factory=RebalancerConfig)

    def __post_init__(self) -> None:
        _check(self.period_s > 0, "rebalancer.period_s", "must be positive")
        _check(self.drain_timeout_s > 0, "rebalancer.drain_timeout_s", "must be positive")


@dataclass(frozen=True)
class ProfileSection:
    prfaas_prefill_s: tuple[float, ...] = (0.002, 1.0e-4)
    pd_prefill_s: tuple[float, ...] = (0.005, 2.5e-4)
    decode_step_s: float = 0.01

    def __post_init__(self) -> None:
        for key in ("prfaas_prefill_s", "pd_prefill_s"):
            _check(bool(getattr(self, key)), f"profile.{key}", "needs at least one coefficient")
        _check(self.decode_step_s > 0, "profile.decode_step_s", "must be positive")


@dataclass(frozen=True)
class PrefixCacheSection:
    enabled: bool = False  # off by default: existing clusters route exactly as before
    capacity_mib: float = 64.0  # host-memory budget per prefill worker, KV and states together
    block_size: int = 16  # tokens per KV block (the match granularity of attention layers)
    checkpoint_every: int = 4  # linear-state checkpoint every this many blocks, and at prompt end
    # The disk tier (engine/prefix_disk.py): what host memory evicts spills to files under
    # <disk_dir>/<instance>, at most disk_capacity_mib per worker; "" : no disk tier.
    disk_dir: str = ""
    disk_capacity_mib: float = 1024.0

    def __post_init__(self) -> None:
        _check(self.capacity_mib >= 0, "prefix_cache.capacity_mib", "must be ≥ 0")
        _check(self.disk_capacity_mib >= 0, "prefix_cache.disk_capacity_mib", "must be ≥ 0")
        _check(self.block_size >= 1, "prefix_cache.block_size", "must be ≥ 1")
        _check(self.checkpoint_every >= 1, "prefix_cache.checkpoint_every", "must be ≥ 1")

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
    # Let servers listen beyond loopback without TLS and client authentication (a warning at
    # every start); off, such a server refuses to start (`bind_refusal`).
    allow_plaintext: bool = False

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    @property
    def paths(self) -> dict[str, str]:
        """The four path keys and their values."""
        return {k: getattr(self, k) for k in ("ca_cert", "cert", "key", "token_file")}

    def check_bind(self, host: str, what: str, *, tls: bool | None = None) -> str | None:
        """Whether a server `what` of a cluster with this section may listen on `host` (with
        TLS: `tls`, by default whether the section has certificates): a `ConfigError` (one line
        naming the fix) when `bind_refusal` refuses it, the warning to log at its start when
        `allow_plaintext` lets it, else None."""
        refusal = bind_refusal(host, what, tls=self.tls if tls is None else tls)
        if refusal is None:
            return None
        if not self.allow_plaintext:
            raise ConfigError(f"{refusal}: {PLAINTEXT_FIX}")
        return f"warning: {refusal} ([security] allow_plaintext = true)"


@dataclass(frozen=True, kw_only=True)
class FaultsSection:
    """Faults the prefill workers inject into their own state transfers
    (serving/transfer/faults.py)."""

    corrupt_frame_prob: float = 0.0  # flip one byte of one data frame: the receiver's CRC fails
    drop_transfer_prob: float = 0.0  # cancel the push midway, as a dead link would
    # Ship a well-formed state of zeros (right length, checksums and all): nothing on the wire
    # can tell, only the tokens decoded from it. A check that the checks can fail.
    blank_state_prob: float = 0.0
    seed: int = 0  # each worker draws from seed + a hash of its name

    def __post_init__(self) -> None:
        for key in ("corrupt_frame_prob", "drop_transfer_prob", "blank_state_prob"):
            _check(0 <= getattr(self, key) <= 1, f"faults.{key}", "must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        probs = (self.corrupt_frame_prob, self.drop_transfer_prob, self.blank_state_prob)
        return any(p > 0 for p in probs)


@dataclass(frozen=True)
class Endpoint:
    """Where a server listens: a host (an address of this machine, which is also the address
    the others dial) and a port (0: any free one, learned from the process's address file)."""

    host: str = "127.0.0.1"
    port: int = 0

    @classmethod
    def parse(cls, text: str, key: str) -> Endpoint:
        """``HOST`` or ``HOST:PORT``."""
        host, colon, port = text.rpartition(":")
        if not colon:
            host, port = text, "0"
        ok = bool(host) and not any(c.isspace() or c == ":" for c in host)
        ok = ok and port.isdigit() and int(port) < 65536
        _check(ok, key, f"expected HOST or HOST:PORT (IPv4 or a name), got {text!r}")
        return cls(host, int(port))

    def offset(self, index: int) -> Endpoint:
        """The endpoint of the ``index``-th instance sharing this one: the next ports up."""
        return Endpoint(self.host, self.port + index if self.port else 0)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class HostsSection:
    """`[hosts]`: where every server listens. `router` (its client port; the metrics endpoint
    binds the same host at `[router] metrics_port`), `prfaas` and `pd` (instance i of a cluster
    at PORT + i), or one instance by name (`"pd-1" = "10.0.0.3:50300"`). One box keeps the
    loopback defaults; across machines each entry is an address of the machine that runs it,
    with a port wherever another machine's `prfaas serve --only …` must find it."""

    router: Endpoint = Endpoint()
    prfaas: Endpoint = Endpoint()
    pd: Endpoint = Endpoint()
    instances: tuple[tuple[str, Endpoint], ...] = ()  # per-instance entries, by name

    def endpoint(self, name: str) -> Endpoint:
        """Instance ``name`` (``prfaas-<i>``, ``pd-<i>``) or ``router``: where it listens."""
        own = dict(self.instances).get(name)
        if own is not None:
            return own
        if name == "router":
            return self.router
        cluster, _, index = name.rpartition("-")
        return (self.prfaas if cluster == "prfaas" else self.pd).offset(int(index))
