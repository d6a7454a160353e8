"""Toy-cluster configs (`configs/clusters/*.toml`): `load_cluster_config(path) -> ClusterConfig`.

Also exposes `instance_roles` (the instance names and their starting roles); the section
dataclasses it reads into are serving/cluster_sections.py. Sections and keys, all optional
except `[model] preset` (docs/serving.md explains each):

    [model]       preset, seed, impl ("chunk" | "reference"), engine ("jax" | "fake")
    [engine]      max_len, chunk_len, buckets, max_slots, frame_bytes, compile_cache,
                  prefill_mesh, decode_mesh (model/sharding.py specs), max_prefill_queue
                  (per prefill worker: requests waiting for or on its engine), max_pending_states
                  (per decode worker: states held outside a slot; 0 = router.max_in_flight)
    [fake]        prefill_s_per_token, decode_step_s          (engine = "fake" only)
    [instances]   prfaas_prefill, pd_prefill, pd_decode
    [link]        bandwidth_mbps, latency_ms, burst_kib, schedule ([[at_s, factor], …]), repeat_s
    [router]      threshold, prfaas_max_queue, bandwidth_abundant, control_period_s,
                  request_timeout_s, max_attempts, retry_wait_s, stall_timeout_s,
                  metrics_port, max_in_flight (requests admitted at once), ttft_slo_s
                  (refuse a request whose predicted TTFT exceeds it, policy/admission.py; 0 = off)
    [controller]  enabled, threshold_step and every `ControllerConfig` field but candidates
    [rebalancer]  enabled, period_s, drain_timeout_s and every `RebalancerConfig` field
    [profile]     prfaas_prefill_s, pd_prefill_s (polynomial coefficients of T_prefill(l), s),
                  decode_step_s: the throughput model's view of the emulated hardware
    [prefix_cache] enabled, capacity_mib, block_size, checkpoint_every: each prefill worker's
                  hybrid prefix cache pool (engine/prefix_cache.py)
    [security]    ca_cert, cert, key (PEM paths, all three or none: mutual TLS between all
                  processes; the router's port then uses TLS too), token_file (the router's
                  bearer token); relative paths are resolved against the config's directory
                  (serving/transport/security.py)
    [chaos]       corrupt_frame_prob, drop_transfer_prob (per state transfer, in [0, 1]), seed:
                  fault injection in the prefill workers (serving/worker/faults.py); all zero = none

A typo is a `ConfigError` naming the file and the key, as is a value of the wrong type.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas_jax.config import config_dir
from prfaas_jax.errors import ConfigError
from prfaas_jax.policy.rebalancer import RebalancerConfig
from prfaas_jax.policy.routing import Role
from prfaas_jax.policy.threshold_controller import ControllerConfig
from prfaas_jax.serving.cluster_sections import (
    ChaosSection,
    ControllerSection,
    EngineSection,
    FakeSection,
    InstancesSection,
    LinkSection,
    ModelSection,
    PrefixCacheSection,
    ProfileSection,
    RebalancerSection,
    RouterSection,
    SecuritySection,
)


@dataclass(frozen=True)
class ClusterConfig:
    path: Path
    model: ModelSection
    engine: EngineSection
    fake: FakeSection
    instances: InstancesSection
    link: LinkSection
    router: RouterSection
    controller: ControllerSection
    rebalancer: RebalancerSection
    profile: ProfileSection
    prefix_cache: PrefixCacheSection = dataclasses.field(default_factory=PrefixCacheSection)
    security: SecuritySection = dataclasses.field(default_factory=SecuritySection)
    chaos: ChaosSection = dataclasses.field(default_factory=ChaosSection)

    @property
    def pending_states_limit(self) -> int:
        """`engine.max_pending_states`, or with 0 `router.max_in_flight`: then every request the
        router admits may wait on one decode node with its state, as under a decode backlog."""
        return self.engine.max_pending_states or self.router.max_in_flight

    def controller_config(self) -> ControllerConfig:
        from prfaas_jax.policy.threshold_controller import threshold_candidates

        step = self.controller.threshold_step
        candidates = tuple(threshold_candidates(step, self.engine.max_len))
        try:
            return ControllerConfig(candidates=candidates, **self.controller.options)
        except ValueError as err:
            raise ConfigError(f"{self.path}: [controller]: {err}") from None


def instance_roles(config: ClusterConfig) -> dict[str, Role]:
    """Instance names in start order with their first role: prfaas-<i>, then pd-<i> nodes."""
    roles = {f"prfaas-{i}": Role.PRFAAS_PREFILL for i in range(config.instances.prfaas_prefill)}
    local = [Role.PD_PREFILL] * config.instances.pd_prefill
    local += [Role.PD_DECODE] * config.instances.pd_decode
    roles.update({f"pd-{i}": role for i, role in enumerate(local)})
    return roles


def _typed(path: Path, where: str, value: object, default: object) -> object:
    """`value` checked against the type of `default` (tuples of numbers, or of pairs)."""

    def fail(what: str) -> ConfigError:
        return ConfigError(f"{path}: '{where}' must be {what}, got {value!r}")

    def number(x: object) -> float:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise fail("a finite number")
        return x

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise fail("true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
        return value
    if isinstance(default, float):
        return float(number(value))
    if isinstance(default, str):
        if not isinstance(value, str):
            raise fail("a string")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list):
            raise fail("a list")
        if where.endswith("schedule"):
            pairs = []
            for item in value:
                if not (isinstance(item, list) and len(item) == 2):
                    raise fail("a list of [at_s, factor] pairs")
                pairs.append((float(number(item[0])), float(number(item[1]))))
            return tuple(pairs)
        if where.endswith("buckets"):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                raise fail("a list of integers")
            return tuple(value)
        return tuple(float(number(x)) for x in value)
    raise AssertionError(f"no reader for {where}")


def _section(path: Path, doc: dict, name: str, cls: type, **extra: object) -> Any:
    raw = doc.get(name, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: '{name}' must be a table")
    # "options" and "config" hold the policy fields, which come in through `extra`.
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("options", "config")}
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key in extra:
            values[key] = _typed(path, f"{name}.{key}", value, extra[key])
        elif key in fields and fields[key].default is not dataclasses.MISSING:
            values[key] = _typed(path, f"{name}.{key}", value, fields[key].default)
        elif key in fields:
            values[key] = _typed(path, f"{name}.{key}", value, "")
        else:
            expected = ", ".join([*fields, *extra])
            raise ConfigError(f"{path}: unknown key '{name}.{key}' (expected one of: {expected})")
    return values


def _parse(path: Path, doc: dict) -> ClusterConfig:
    sections = ("model", "engine", "fake", "instances", "link", "router")
    sections += ("controller", "rebalancer", "profile", "prefix_cache", "security")
    sections += ("chaos",)
    for key in doc:
        if key not in sections:
            raise ConfigError(
                f"{path}: unknown section '[{key}]' (expected one of: {', '.join(sections)})"
            )
    model_values = _section(path, doc, "model", ModelSection)
    if "preset" not in model_values:
        raise ConfigError(f"{path}: missing key 'model.preset'")
    controller_defaults = {
        f.name: f.default for f in dataclasses.fields(ControllerConfig) if f.name != "candidates"
    }
    controller_values = _section(path, doc, "controller", ControllerSection, **controller_defaults)
    options = {
        k: controller_values.pop(k) for k in list(controller_values) if k in controller_defaults
    }
    rebalancer_defaults = {f.name: f.default for f in dataclasses.fields(RebalancerConfig)}
    rebalancer_values = _section(path, doc, "rebalancer", RebalancerSection, **rebalancer_defaults)
    policy = {
        k: rebalancer_values.pop(k) for k in list(rebalancer_values) if k in rebalancer_defaults
    }
    try:
        config = ClusterConfig(
            path=path,
            model=ModelSection(**model_values),
            engine=EngineSection(**_section(path, doc, "engine", EngineSection)),
            fake=FakeSection(**_section(path, doc, "fake", FakeSection)),
            instances=InstancesSection(**_section(path, doc, "instances", InstancesSection)),
            link=LinkSection(**_section(path, doc, "link", LinkSection)),
            router=RouterSection(**_section(path, doc, "router", RouterSection)),
            controller=ControllerSection(**controller_values, options=options),
            rebalancer=RebalancerSection(**rebalancer_values, config=RebalancerConfig(**policy)),
            profile=ProfileSection(**_section(path, doc, "profile", ProfileSection)),
            prefix_cache=PrefixCacheSection(
                **_section(path, doc, "prefix_cache", PrefixCacheSection)
            ),
            security=_security(path, doc),
            chaos=ChaosSection(**_section(path, doc, "chaos", ChaosSection)),
        )
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None
    _validate(config)
    config.controller_config()
    return config


def _security(path: Path, doc: dict) -> SecuritySection:
    """`[security]` with its paths resolved against the config file's directory."""
    values = _section(path, doc, "security", SecuritySection)
    resolved = {k: str(path.parent / v) if v else "" for k, v in values.items()}
    return SecuritySection(**resolved)


def _validate_security(config: ClusterConfig) -> None:
    section, where = config.security, config.path
    tls = {"ca_cert": section.ca_cert, "cert": section.cert, "key": section.key}
    missing = [k for k, v in tls.items() if not v]
    if missing and len(missing) < len(tls):
        raise ConfigError(
            f"{where}: 'security.{missing[0]}' is missing: ca_cert, cert and key go together "
            "(all three for mutual TLS, or none)"
        )
    for key, value in {**tls, "token_file": section.token_file}.items():
        if value and not Path(value).is_file():
            raise ConfigError(f"{where}: 'security.{key}': no such file {value}")


def _validate(config: ClusterConfig) -> None:
    def check(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{config.path}: '{key}' {message}")

    model, engine, inst = config.model, config.engine, config.instances
    check(model.impl in ("chunk", "reference"), "model.impl", "must be chunk or reference")
    check(model.engine in ("jax", "fake"), "model.engine", "must be jax or fake")
    check(engine.max_len >= 2, "engine.max_len", "must be ≥ 2")
    check(engine.chunk_len >= 1, "engine.chunk_len", "must be ≥ 1")
    ok = bool(engine.buckets) and list(engine.buckets) == sorted(set(engine.buckets))
    check(ok and engine.buckets[0] >= 1, "engine.buckets", "must be increasing positive sizes")
    check(engine.max_slots >= 1, "engine.max_slots", "must be ≥ 1")
    check(engine.max_prefill_queue >= 1, "engine.max_prefill_queue", "must be ≥ 1")
    check(engine.max_pending_states >= 0, "engine.max_pending_states", "must be ≥ 0")
    check(engine.frame_bytes >= 1024, "engine.frame_bytes", "must be ≥ 1024")
    check(min(config.fake.prefill_s_per_token, config.fake.decode_step_s) >= 0, "fake", "≥ 0")
    check(min(inst.prfaas_prefill, inst.pd_prefill) >= 0, "instances", "counts must be ≥ 0")
    check(inst.pd_decode >= 1, "instances.pd_decode", "must be ≥ 1")
    check(inst.prfaas_prefill + inst.pd_prefill >= 1, "instances", "need a prefill instance")
    link = config.link
    check(link.bandwidth_mbps > 0, "link.bandwidth_mbps", "must be positive")
    check(link.latency_ms >= 0 and link.burst_kib > 0, "link", "needs latency ≥ 0, burst > 0")
    times = [at for at, _ in link.schedule]
    ok = times == sorted(times) and all(at >= 0 and f > 0 for at, f in link.schedule)
    check(ok, "link.schedule", "must be [at_s ≥ 0, factor > 0] pairs in time order")
    check(link.repeat_s >= 0, "link.repeat_s", "must be ≥ 0")
    check(
        not link.schedule or not link.repeat_s or times[-1] < link.repeat_s,
        "link.repeat_s",
        "must exceed the last schedule time",
    )
    router = config.router
    check(router.threshold >= 0, "router.threshold", "must be ≥ 0")
    check(router.prfaas_max_queue >= 1, "router.prfaas_max_queue", "must be ≥ 1")
    check(router.control_period_s > 0, "router.control_period_s", "must be positive")
    check(router.request_timeout_s > 0, "router.request_timeout_s", "must be positive")
    check(router.max_attempts >= 1, "router.max_attempts", "must be ≥ 1")
    check(router.retry_wait_s >= 0, "router.retry_wait_s", "must be ≥ 0")
    check(router.stall_timeout_s > 0, "router.stall_timeout_s", "must be positive")
    check(0 <= router.metrics_port < 65536, "router.metrics_port", "must be a port number")
    check(router.max_in_flight >= 1, "router.max_in_flight", "must be ≥ 1")
    check(router.ttft_slo_s >= 0, "router.ttft_slo_s", "must be ≥ 0")
    check(config.controller.threshold_step >= 1, "controller.threshold_step", "must be ≥ 1")
    check(config.controller.window >= 1, "controller.window", "must be ≥ 1")
    check(config.rebalancer.period_s > 0, "rebalancer.period_s", "must be positive")
    check(config.rebalancer.drain_timeout_s > 0, "rebalancer.drain_timeout_s", "must be positive")
    profile = config.profile
    for key in ("prfaas_prefill_s", "pd_prefill_s"):
        check(bool(getattr(profile, key)), f"profile.{key}", "needs at least one coefficient")
    check(profile.decode_step_s > 0, "profile.decode_step_s", "must be positive")
    cache = config.prefix_cache
    check(cache.capacity_mib >= 0, "prefix_cache.capacity_mib", "must be ≥ 0")
    check(cache.block_size >= 1, "prefix_cache.block_size", "must be ≥ 1")
    check(cache.checkpoint_every >= 1, "prefix_cache.checkpoint_every", "must be ≥ 1")
    chaos = config.chaos
    for key in ("corrupt_frame_prob", "drop_transfer_prob"):
        check(0 <= getattr(chaos, key) <= 1, f"chaos.{key}", "must be in [0, 1]")
    _validate_security(config)


def resolve_cluster_path(name_or_path: str | Path) -> Path:
    """A config path, or a name of `configs/clusters/<name>.toml`."""
    path = Path(name_or_path)
    if path.suffix != ".toml" and not path.exists():
        path = config_dir() / "clusters" / f"{name_or_path}.toml"
    return path


def load_cluster_config(name_or_path: str | Path) -> ClusterConfig:
    path = resolve_cluster_path(name_or_path)
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except OSError as err:
        raise ConfigError(f"cannot read cluster config {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return _parse(path, doc)
