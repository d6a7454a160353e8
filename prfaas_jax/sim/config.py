"""Simulator inputs from a TOML file: `load_sim_config(path) -> SimConfig`, the section
dataclasses it holds (`LinkSpec`, `CacheSpec`, `RouterSpec`, `ControllerSpec`, `RebalancerSpec`,
`SaturationSpec`, `DeploymentSpec`) and `with_overrides` (the command line's --seed, --requests,
--rate).

A simulation config names a plan config (`prfaas plan`'s input: hardware profiles, decode
constants, the input-length distribution, the output length) and adds what a steady-state
model leaves out. Sections (docs/simulator.md explains every key):

    plan = "…/plans/x.toml"   relative to this file
    [workload]      arrivals = "poisson" | "gamma" | "trace", rate, burstiness, requests, seed,
                    path (trace), output_len;  [workload.prefix] groups, zipf, shared_len
    [link]          schedule = [[time_s, gbps], …], layerwise, chunks, rdma_gbps
    [decode]        step_fixed_fraction
    [cache]         block_len, prfaas_blocks, pd_blocks           (optional: prefix caches)
    [router]        prfaas_max_queue, bandwidth_abundant, control_period_s
    [controller]    threshold_step, window, rate_memory_s, every `ControllerConfig` field
    [rebalancer]    period_s, switch_s, drain_timeout_s, every `RebalancerConfig` field
    [saturation]    requests, probes, backlog_scale               (optional: capacity search)
    [report]        bin_s
    [deployments.NAME]  prfaas, pd_prefill, pd_decode, threshold, controller, rebalancer,
                        bandwidth_abundant, prfaas_max_queue

Each section is read into a frozen dataclass whose fields are its keys (`_read`); values are
validated in `__post_init__`. Errors are `ConfigError`s naming the file and key, like the plan
config's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tomllib
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TypeVar

from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.plan_config import PlanConfig, _Section, _values_of, load_plan_config
from prfaas_jax.policy.live_model import LiveProfiles
from prfaas_jax.policy.rebalancer import RebalancerConfig
from prfaas_jax.policy.threshold_controller import ControllerConfig, threshold_candidates
from prfaas_jax.sim.workload import PrefixSpec, WorkloadSpec, read_trace, trace_rate

T = TypeVar("T")
SECTIONS = ("plan", "workload", "link", "decode", "cache", "router", "controller")
SECTIONS += ("rebalancer", "saturation", "report", "deployments")


def _key(name: str) -> dict[str, str]:
    return {"key": name}


@dataclass(frozen=True)
class LinkSpec:
    schedule: tuple[tuple[float, float], ...]  # (from time s, Gbps), first at 0
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
        if self.chunks < 1 or not self.rdma_gbps > 0:
            raise ValueError("need chunks ≥ 1 and rdma_gbps > 0")


@dataclass(frozen=True)
class CacheSpec:
    prfaas_blocks: int
    pd_blocks: int
    block_len: int = 512  # tokens per hash_id (Mooncake's traces use 512)

    def __post_init__(self) -> None:
        if self.block_len < 1 or min(self.prfaas_blocks, self.pd_blocks) < 0:
            raise ValueError("need block_len ≥ 1 and capacities ≥ 0")


@dataclass(frozen=True)
class RouterSpec:
    prfaas_max_queue: int = 4
    bandwidth_abundant: bool = False
    control_period_s: float = 1.0

    def __post_init__(self) -> None:
        if self.prfaas_max_queue < 1 or not self.control_period_s > 0:
            raise ValueError("need prfaas_max_queue ≥ 1 and control_period_s > 0")


@dataclass(frozen=True)
class ControllerSpec:
    config: ControllerConfig
    threshold_step: int = 1000  # candidate thresholds step, 1 … max length
    window: int = 256  # TrafficWindow size (requests)
    rate_memory_s: float = 60.0

    def __post_init__(self) -> None:
        if self.window < 1 or not self.rate_memory_s >= self.config.rate_horizon_s:
            raise ValueError("need window ≥ 1 and rate_memory_s ≥ rate_horizon_s")


@dataclass(frozen=True)
class RebalancerSpec:
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
class DeploymentSpec:
    name: str
    threshold: float  # ±inf when one prefill stage takes everything
    num_pd_decode: int = field(metadata=_key("pd_decode"))
    num_prfaas: int = field(default=0, metadata=_key("prfaas"))
    num_pd_prefill: int = field(default=0, metadata=_key("pd_prefill"))
    use_controller: bool = field(default=True, metadata=_key("controller"))
    use_rebalancer: bool = field(default=True, metadata=_key("rebalancer"))
    bandwidth_abundant: bool | None = None  # None: [router]'s
    prfaas_max_queue: int | None = None  # None: [router]'s

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


def _read(section: _Section, cls: type[T], *, extra: tuple[str, ...] = (), **given: object) -> T:
    """`cls` (a dataclass) from the section's keys, one per field not `given` (named by the
    field or its metadata "key"; the type from its annotation); `extra` keys are the caller's."""
    fields = [f for f in dataclasses.fields(cls) if f.name not in given]
    section.only(*extra, *(f.metadata.get("key", f.name) for f in fields))
    values: dict[str, object] = {}
    for f in fields:
        key = f.metadata.get("key", f.name)
        if key not in section.data:
            if f.default is MISSING:
                raise ConfigError(f"{section.path}: missing key '{section.key(key)}'")
            continue
        kind = str(f.type)
        if kind.startswith("bool"):
            value = section.data[key]
            if not isinstance(value, bool):
                raise section.error(key, f"must be true or false, got {value!r}")
            values[f.name] = value
        else:
            values[f.name] = section.integer(key) if kind.startswith("int") else section.number(key)
    with _values_of(section):
        return cls(**values, **given)


def _names(cls: type, *without: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in without)


def _table(path: Path, doc: dict[str, object], name: str) -> _Section | None:
    return _Section(path, name, doc[name]) if name in doc else None


def _schedule(section: _Section, default_gbps: float) -> tuple[tuple[float, float], ...]:
    raw = section.data.get("schedule", [[0.0, default_gbps]])
    pairs = raw if isinstance(raw, list) else [None]
    numbers = (int, float)
    if not all(
        isinstance(p, list) and len(p) == 2 and all(type(v) in numbers for v in p) for p in pairs
    ):
        raise section.error("schedule", "must be a list of [time_s, gbps] pairs")
    return tuple((float(at), float(gbps)) for at, gbps in pairs)


def _workload(section: _Section, plan: PlanConfig, block_len: int) -> WorkloadSpec:
    section.only(
        "arrivals", "rate", "burstiness", "requests", "seed", "path", "output_len", "prefix"
    )
    arrivals = section.text("arrivals", ("poisson", "gamma", "trace"), "poisson")
    prefix = _read(section.section("prefix"), PrefixSpec) if "prefix" in section.data else None
    trace = ()
    if arrivals == "trace":
        trace = read_trace(section.path.parent / section.text("path"))
        rate = section.number("rate", trace_rate(trace))
        requests = section.integer("requests", len(trace))
    else:
        rate, requests = section.number("rate"), section.integer("requests")
    with _values_of(section):
        return WorkloadSpec(
            arrivals=arrivals,
            rate=rate,
            requests=requests,
            lengths=plan.model.lengths,
            output_len=section.integer("output_len", round(plan.model.output_len)),
            burstiness=section.number("burstiness", 1.0),
            seed=section.integer("seed", 0),
            block_len=block_len,
            prefix=prefix,
            trace=trace,
        )


def _deployment(section: _Section) -> DeploymentSpec:
    both = {"prfaas", "pd_prefill"} <= {k for k, v in section.data.items() if v}
    # With one prefill stage t is forced: everything local (+∞) or everything remote (−∞).
    threshold = section.number("threshold") if both else math.inf
    if not both and section.data.get("prfaas"):
        threshold = -math.inf
    name = section.name.split(".")[-1]
    return _read(section, DeploymentSpec, extra=("threshold",), name=name, threshold=threshold)


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
    root = _Section(path, "", doc).only(*SECTIONS)
    plan = load_plan_config(path.parent / root.text("plan"))

    def section(name: str) -> _Section:
        return _Section(path, name, doc.get(name, {}))

    link = section("link")
    schedule = _schedule(link, plan.model.deployment.egress_gbps)
    link_spec = _read(link, LinkSpec, extra=("schedule",), schedule=schedule)
    decode = section("decode").only("step_fixed_fraction")
    fixed_fraction = decode.number("step_fixed_fraction", 1.0)
    if not 0 < fixed_fraction <= 1:
        raise decode.error("step_fixed_fraction", f"must be in (0, 1], got {fixed_fraction:g}")
    cache = _table(path, doc, "cache")
    cache_spec = _read(cache, CacheSpec) if cache is not None else None
    workload = _workload(
        root.section("workload"), plan, cache_spec.block_len if cache_spec else 512
    )

    controller_spec = None
    if (controller := _table(path, doc, "controller")) is not None:
        step = controller.integer("threshold_step", 1000)
        with _values_of(controller):
            candidates = tuple(threshold_candidates(step, int(plan.model.lengths.support[1])))
        config = _read(
            controller,
            ControllerConfig,
            extra=_names(ControllerSpec, "config"),
            candidates=candidates,
        )
        controller_spec = _read(
            controller, ControllerSpec, extra=_names(ControllerConfig, "candidates"), config=config
        )
    rebalancer_spec = None
    if (rebalancer := _table(path, doc, "rebalancer")) is not None:
        config = _read(rebalancer, RebalancerConfig, extra=_names(RebalancerSpec, "config"))
        rebalancer_spec = _read(
            rebalancer, RebalancerSpec, extra=_names(RebalancerConfig), config=config
        )
    saturation = _table(path, doc, "saturation")
    report = section("report").only("bin_s")
    bin_s = report.number("bin_s", 10.0)
    if not bin_s > 0:
        raise report.error("bin_s", f"must be positive, got {bin_s:g}")
    deployments = root.section("deployments")
    if not deployments.data:
        raise ConfigError(f"{path}: [deployments] needs at least one deployment")
    return SimConfig(
        path=path,
        plan=plan,
        profiles=_profiles(plan),
        workload=workload,
        link=link_spec,
        router=_read(section("router"), RouterSpec),
        deployments=tuple(_deployment(deployments.section(n)) for n in deployments.data),
        decode_fixed_fraction=fixed_fraction,
        cache=cache_spec,
        controller=controller_spec,
        rebalancer=rebalancer_spec,
        saturation=_read(saturation, SaturationSpec) if saturation else None,
        bin_s=bin_s,
    )


def load_sim_config(path: str | Path) -> SimConfig:
    """Reads a simulation TOML (module docstring); the plan it names is read too."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"cannot read simulation config {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return _parse(path, doc)


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
