"""Simulator inputs from a TOML file: `load_sim_config(path) -> SimConfig`, the section
dataclasses it reads (`LinkSpec`, `DecodeSpec`, `CacheSpec`, `RouterSpec`, `ControllerSpec`,
`RebalancerSpec`, `SaturationSpec`, `ReportSpec`, `DeploymentSpec`) and `with_overrides` (the
command line's --seed, --requests, --rate).

A simulation config names a plan config (`prfaas plan`'s input: hardware profiles, decode
constants, the input-length distribution, the output length) and adds what a steady-state
model leaves out. Sections (docs/simulator.md explains every key):

    plan = "…/plans/x.toml"   relative to this file
    [workload]      arrivals = "poisson" | "gamma" | "trace", rate, burstiness, requests, seed,
                    path (trace), output_len;  [workload.prefix] groups, zipf, shared_len
    [link]          schedule = [[time_s, gbps], …], latency_s or rtt_ms, handoff_s, layerwise,
                    chunks, rdma_gbps
    [decode]        step_fixed_fraction
    [cache]         block_len, prfaas_blocks, pd_blocks, prfaas_disk_blocks, pd_disk_blocks,
                    disk_gb_per_s, decode_blocks                  (optional: prefix caches)
    [router]        prfaas_max_queue, bandwidth_abundant, control_period_s, decode_aware
    [controller]    threshold_step, window, rate_memory_s, every `ControllerConfig` field
    [rebalancer]    period_s, switch_s, drain_timeout_s, every `RebalancerConfig` field
    [saturation]    requests, probes, backlog_scale               (optional: capacity search)
    [report]        bin_s
    [deployments.NAME]  prfaas, pd_prefill, pd_decode, threshold, controller, rebalancer,
                        bandwidth_abundant, prfaas_max_queue

Each section is read into a frozen dataclass whose fields are its keys (`toml_config.build`;
`[workload]` into `sim/workload.py`'s `WorkloadSpec`); values are validated in `__post_init__`.
Errors are `ConfigError`s naming the file and key, like the plan config's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.plan_config import PlanConfig, load_plan_config
from prfaas_jax.policy.live_model import LiveProfiles
from prfaas_jax.policy.rebalancer import RebalancerConfig
from prfaas_jax.policy.threshold_controller import ControllerConfig, threshold_candidates
from prfaas_jax.policy.wire_choice import AdaptiveWireConfig
from prfaas_jax.sim.workload import Arrivals, TraceRecord, WorkloadSpec, read_trace, trace_rate
from prfaas_jax.toml_config import Where, build, keys_of, located, read, split, toml_key, value

SECTIONS = ("plan", "workload", "link", "decode", "cache", "router", "controller")
SECTIONS += ("rebalancer", "saturation", "report", "deployments", "wire")


@dataclass(frozen=True)
class LinkSpec:
    schedule: tuple[tuple[float, float], ...]  # (from time s, Gbps), first at 0
    latency_s: float = 0.0  # propagation delay: a state arrives this long after its last byte
    # The round trip, as a cluster config's `[link] rtt_ms`: > 0 replaces latency_s by half of
    # it (the simulator's link is bytes, not packets: no loss or jitter here).
    rtt_ms: float = 0.0
    handoff_s: float = 0.0  # fixed cost of handing any state to decode (both routes)
    layerwise: bool = True  # transfer overlaps prefill, layer by layer
    chunks: int = 60  # pieces the state is produced in (≈ layers)
    rdma_gbps: float = 800.0  # PD prefill → decode, never shared or contended (Eq. 4)

    def __post_init__(self) -> None:
        if not self.schedule or self.schedule[0][0] != 0.0:
            raise ValueError("the bandwidth schedule must start at time 0")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(self.schedule)):
            raise ValueError("the bandwidth schedule's times must increase")
        if any(not (0 < gbps < math.inf) for _, gbps in self.schedule):
            raise ValueError("the bandwidth schedule's Gbps must be positive")
        if self.chunks < 1 or not self.rdma_gbps > 0 or min(self.latency_s, self.handoff_s) < 0:
            raise ValueError("need chunks ≥ 1, rdma_gbps > 0, latency_s ≥ 0 and handoff_s ≥ 0")
        if self.rtt_ms < 0:
            raise ValueError("rtt_ms must be ≥ 0")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2e3 if self.rtt_ms else self.latency_s


@dataclass(frozen=True)
class DecodeSpec:
    step_fixed_fraction: float = 1.0  # f of DecodeInstance's step time (sim/cluster.py)

    def __post_init__(self) -> None:
        if not 0 < self.step_fixed_fraction <= 1:
            raise ValueError(
                f"step_fixed_fraction must be in (0, 1], got {self.step_fixed_fraction:g}"
            )


@dataclass(frozen=True)
class CacheSpec:
    prfaas_blocks: int
    pd_blocks: int
    block_len: int = 512  # tokens per hash_id (Mooncake's traces use 512)
    # The disk tier below each cluster's host pool (0: none), and the rate a prefix is read back.
    prfaas_disk_blocks: int = 0
    pd_disk_blocks: int = 0
    disk_gb_per_s: float = 2.0
    # The decode workers' pool of received states (0: they share the PD pool, one per cluster).
    decode_blocks: int = 0

    def __post_init__(self) -> None:
        capacities = (
            self.prfaas_blocks,
            self.pd_blocks,
            self.prfaas_disk_blocks,
            self.pd_disk_blocks,
            self.decode_blocks,
        )
        if self.block_len < 1 or min(capacities) < 0 or not self.disk_gb_per_s > 0:
            raise ValueError("need block_len ≥ 1, capacities ≥ 0 and disk_gb_per_s > 0")


@dataclass(frozen=True)
class RouterSpec:
    prfaas_max_queue: int = 4
    bandwidth_abundant: bool = False
    control_period_s: float = 1.0
    # Decode-aware routing (policy/routing.py): the decode pool's prefixes count as local ones.
    decode_aware: bool = False

    def __post_init__(self) -> None:
        if self.prfaas_max_queue < 1 or not self.control_period_s > 0:
            raise ValueError("need prfaas_max_queue ≥ 1 and control_period_s > 0")


@dataclass(frozen=True)
class ControllerSpec:
    """The policy's keys, every `ControllerConfig` field but `candidates`, share the table; the
    candidates are every `threshold_step` tokens up to the longest input length."""

    config: ControllerConfig
    threshold_step: int = 1000
    window: int = 256  # TrafficWindow size (requests)
    rate_memory_s: float = 60.0

    def __post_init__(self) -> None:
        if self.window < 1 or not self.rate_memory_s >= self.config.rate_horizon_s:
            raise ValueError("need window ≥ 1 and rate_memory_s ≥ rate_horizon_s")


@dataclass(frozen=True)
class RebalancerSpec:
    """The policy's keys, every `RebalancerConfig` field, share the table."""

    config: RebalancerConfig
    period_s: float = 10.0
    switch_s: float = 5.0  # drained node to serving in its new role
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.period_s > 0 or min(self.switch_s, self.drain_timeout_s) < 0:
            raise ValueError("need period_s > 0 and switch_s, drain_timeout_s ≥ 0")


@dataclass(frozen=True)
class SaturationSpec:
    requests: int = 20_000
    probes: int = 8
    backlog_scale: float = 2.0  # a rate keeps up when ≤ backlog_scale · √requests wait

    def __post_init__(self) -> None:
        if self.requests < 100 or self.probes < 1 or not self.backlog_scale > 0:
            raise ValueError("need requests ≥ 100, probes ≥ 1 and backlog_scale > 0")


@dataclass(frozen=True)
class ReportSpec:
    bin_s: float = 10.0  # time-series bin

    def __post_init__(self) -> None:
        if not self.bin_s > 0:
            raise ValueError(f"bin_s must be positive, got {self.bin_s:g}")


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    threshold: float  # ±inf when one prefill stage takes everything
    num_pd_decode: int = field(metadata=toml_key("pd_decode"))
    num_prfaas: int = field(default=0, metadata=toml_key("prfaas"))
    num_pd_prefill: int = field(default=0, metadata=toml_key("pd_prefill"))
    use_controller: bool = field(default=True, metadata=toml_key("controller"))
    use_rebalancer: bool = field(default=True, metadata=toml_key("rebalancer"))
    bandwidth_abundant: bool | None = None  # None: [router]'s
    prfaas_max_queue: int | None = None  # None: [router]'s
    adaptive_wire: bool = False  # [wire]'s policy narrows states while the link runs hot

    def __post_init__(self) -> None:
        if min(self.num_prfaas, self.num_pd_prefill) < 0 or self.num_pd_decode < 1:
            raise ValueError("need pd_decode ≥ 1 and prfaas, pd_prefill ≥ 0")
        if self.num_prfaas + self.num_pd_prefill < 1:
            raise ValueError("prfaas or pd_prefill must be ≥ 1: nothing would prefill")
        if self.prfaas_max_queue is not None and self.prfaas_max_queue < 1:
            raise ValueError("prfaas_max_queue must be ≥ 1")


@dataclass(frozen=True)
class SimConfig:
    path: Path
    plan: PlanConfig
    profiles: LiveProfiles
    workload: WorkloadSpec
    link: LinkSpec
    router: RouterSpec
    deployments: tuple[DeploymentSpec, ...]
    decode_fixed_fraction: float = 1.0
    cache: CacheSpec | None = None
    controller: ControllerSpec | None = None
    rebalancer: RebalancerSpec | None = None
    saturation: SaturationSpec | None = None
    bin_s: float = 10.0
    wire: AdaptiveWireConfig | None = None  # [wire]: policy/wire_choice.py


def _workload(
    table: dict[str, object], where: Where, plan: PlanConfig, block_len: int, directory: Path
) -> WorkloadSpec:
    """`[workload]`: the lengths come from the plan; rate and requests default to a trace's."""
    own_keys = keys_of(WorkloadSpec, "lengths", "block_len", "trace")
    own, extra = split(table, where, own_keys, ("path",))
    defaults: dict[str, object] = {
        "arrivals": Arrivals.POISSON,
        "output_len": round(plan.model.output_len),
    }
    trace: tuple[TraceRecord, ...] = ()
    if value(own, "arrivals", Arrivals, where, default=Arrivals.POISSON) is Arrivals.TRACE:
        trace = read_trace(directory / value(extra, "path", str, where))
        defaults |= {"rate": trace_rate(trace), "requests": len(trace)}
    computed = {"lengths": plan.model.lengths, "block_len": block_len, "trace": trace}
    return build(WorkloadSpec, defaults | own, where, **computed)


def _controller(table: object, where: Where, plan: PlanConfig) -> ControllerSpec:
    own_keys = keys_of(ControllerSpec, "config")
    own, policy = split(table, where, own_keys, keys_of(ControllerConfig, "candidates"))
    step = value(own, "threshold_step", int, where, default=ControllerSpec.threshold_step)
    with located(where):
        candidates = tuple(threshold_candidates(step, int(plan.model.lengths.support[1])))
    config = build(ControllerConfig, policy, where, candidates=candidates)
    return build(ControllerSpec, own, where, config=config)


def _rebalancer(table: object, where: Where) -> RebalancerSpec:
    own_keys = keys_of(RebalancerSpec, "config")
    own, policy = split(table, where, own_keys, keys_of(RebalancerConfig))
    return build(RebalancerSpec, own, where, config=build(RebalancerConfig, policy, where))


def _deployment(table: object, where: Where, name: str) -> DeploymentSpec:
    own_keys = keys_of(DeploymentSpec, "name", "threshold")
    own, extra = split(table, where, own_keys, ("threshold",))
    spec = build(DeploymentSpec, own, where, name=name, threshold=math.inf)
    if spec.num_prfaas and spec.num_pd_prefill:
        return dataclasses.replace(spec, threshold=value(extra, "threshold", float, where))
    # With one prefill stage t is forced: everything local (+∞) or everything remote (−∞).
    return dataclasses.replace(spec, threshold=-math.inf) if spec.num_prfaas else spec


def _profiles(plan: PlanConfig) -> LiveProfiles:
    deployment = plan.model.deployment
    assert deployment.prfaas is not None  # a plan config always has a PrfaaS cluster
    return LiveProfiles(
        prfaas_prefill_s=deployment.prfaas.prefill_s,
        pd_prefill_s=deployment.local.prefill_s,
        kv_size_mib=deployment.kv_size_mib,
        decode_max_batch_size=deployment.decode_max_batch_size,
        decode_step_s=deployment.decode_step_s,
    )


def _parse(path: Path, doc: dict[str, object]) -> SimConfig:
    where = Where(str(path))
    (doc,) = split(doc, where, SECTIONS)
    plan = load_plan_config(path.parent / value(doc, "plan", str, where))

    def table(name: str) -> dict[str, object]:
        return value(doc, name, dict, where, default={})

    # Without a schedule the link runs at the plan's egress bandwidth throughout.
    link = {"schedule": [[0.0, plan.model.deployment.egress_gbps]], **table("link")}
    link_spec = build(LinkSpec, link, where.at("link"))
    decode = build(DecodeSpec, table("decode"), where.at("decode"))
    cache = build(CacheSpec, doc["cache"], where.at("cache")) if "cache" in doc else None
    block_len = CacheSpec.block_len if cache is None else cache.block_len
    workload_table = value(doc, "workload", dict, where)
    workload = _workload(workload_table, where.at("workload"), plan, block_len, path.parent)
    controller = rebalancer = saturation = None
    if "controller" in doc:
        controller = _controller(doc["controller"], where.at("controller"), plan)
    if "rebalancer" in doc:
        rebalancer = _rebalancer(doc["rebalancer"], where.at("rebalancer"))
    if "saturation" in doc:
        saturation = build(SaturationSpec, doc["saturation"], where.at("saturation"))
    report = build(ReportSpec, table("report"), where.at("report"))
    wire = build(AdaptiveWireConfig, doc["wire"], where.at("wire")) if "wire" in doc else None
    deployments = value(doc, "deployments", dict, where)
    if not deployments:
        raise where.at("deployments").error("needs at least one deployment")
    return SimConfig(
        path=path,
        plan=plan,
        profiles=_profiles(plan),
        workload=workload,
        link=link_spec,
        router=build(RouterSpec, table("router"), where.at("router")),
        deployments=tuple(
            _deployment(spec, where.at("deployments").at(name), name)
            for name, spec in deployments.items()
        ),
        decode_fixed_fraction=decode.step_fixed_fraction,
        cache=cache,
        controller=controller,
        rebalancer=rebalancer,
        saturation=saturation,
        bin_s=report.bin_s,
        wire=wire,
    )


def load_sim_config(path: str | Path) -> SimConfig:
    """Reads a simulation TOML (module docstring); the plan it names is read too."""
    path = Path(path)
    return _parse(path, read(path, "simulation config"))


def with_overrides(
    config: SimConfig,
    *,
    seed: int | None = None,
    requests: int | None = None,
    rate: float | None = None,
) -> SimConfig:
    """The config with the command line's --seed, --requests and --rate applied."""
    given = {"seed": seed, "requests": requests, "rate": rate}
    try:
        workload = dataclasses.replace(
            config.workload, **{k: v for k, v in given.items() if v is not None}
        )
    except ValueError as err:
        raise ConfigError(f"{config.path}: {err}") from None
    return dataclasses.replace(config, workload=workload)
