"""Toy-cluster configs (`configs/clusters/*.toml`): `load_cluster_config(path) -> ClusterConfig`.

Also exposes `serving_model_config` (the model every process of the cluster serves, holding
`[engine] max_len` tokens), `instance_roles` (the instance names and their starting roles),
`instance_part`, `served_hosts`, `check_binds` (the security rule over every server a config
binds) and `load_security_file` (a `[security]` table on its own); the section dataclasses it
reads into are serving/cluster_sections.py. Sections and keys, all
optional except `[model] preset` (docs/serving.md explains each):

    [model]       preset, seed, impl ("chunk" | "reference" | "pallas"), engine ("jax" | "fake")
    [engine]      max_len, chunk_len, buckets, max_slots, frame_bytes, compile_cache,
                  prefill_mesh, decode_mesh, prfaas_mesh (model/sharding.py specs; PrfaaS
                  instances use prfaas_mesh, else prefill_mesh), layer_groups (> 1: a
                  prefill's last chunk streams by groups of layers), max_prefill_queue
                  (per prefill worker: requests waiting for or on its engine), max_pending_states
                  (per decode worker: states held outside a slot; 0 = router.max_in_flight),
                  allocator ("slots" | "paged": the decode engine's), block_size, num_pages
                  (paged; 0: the bytes of max_slots slots)
    [fake]        prefill_s_per_token, decode_step_s, chunk_len  (engine = "fake" only)
    [instances]   prfaas_prefill, pd_prefill, pd_decode, prfaas_processes (JAX processes per
                  PrfaaS instance, sharing its mesh: engine/spmd.py), prfaas_class, pd_class
                  (the node class of each cluster's instances), pd_mode ("disaggregated" |
                  "mixed": each pd_decode instance prefills local prompts in its decode
                  steps, serving/worker/mixed.py; no pd_prefill then)
    [node_classes.NAME]  cpus, cpu_quota, period_ms: a node's speed, set per instance by
                  cgroups (serving/cluster/cgroups.py)
    [link]        bandwidth_mbps, latency_ms, rtt_ms, jitter_ms, loss_percent, loss_burst, reorder
                  (the link in packets: serving/cluster/wan.py), burst_kib, schedule ([[at_s,
                  factor], …]), repeat_s, streams, precision (how a state crossing the link is
                  encoded: "native", "bf16", "int8", "fp8_e4m3" or per kind,
                  "state=bf16,kv=int8")
    [router]      threshold, prfaas_max_queue, cache_rule, cache_index (the cached lengths
                  from an index of the instances' cache events; serving/router/cache_feed.py),
                  replicate_prefixes (a hot prefix is copied to the instance load picks),
                  control_period_s,
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
                  processes; the router's port and metrics endpoint then use TLS too),
                  token_file (the router's bearer token); relative paths are resolved against
                  the config's directory (serving/transport/security.py). allow_plaintext: let
                  servers listen beyond loopback without them (otherwise refused: `check_binds`)
    [faults]      corrupt_frame_prob, drop_transfer_prob (per state transfer, in [0, 1]), seed:
                  fault injection in state transfers (serving/transfer/faults.py); all zero = none
    [hosts]       router, prfaas, pd, or an instance's name ("pd-1"): "HOST" or "HOST:PORT",
                  where each server listens (instance i of a cluster at PORT + i; the metrics
                  endpoint on the router's host); loopback and free ports by default
    [wire]        options ([{precision, byte_ratio, recall_loss}, …]), recall_budget,
                  high_utilization, low_utilization, window_s: the simulator's section, read
                  into the same `AdaptiveWireConfig` (policy/wire_choice.py); present, the
                  router picks per offloaded request whether its state crosses narrowed

A typo is a `ConfigError` naming the file and the key, as is a value of the wrong type or out
of range (`toml_config`); a section under its former name gets one naming the new one
(`[chaos] is now [faults]`).

One limit. `[engine] max_len` is the number of tokens (prompt + new) a request may hold in this
cluster, decided once, here: it replaces the preset's `max_len`, lifting it as `prfaas generate
--max-len` does for one run, and the router, the front door, every worker's engines and `prfaas
bench` (through the router's stats) read it. A preset whose limit is the positional range its
weights were trained for (`max_len_fixed`: an imported Hugging Face checkpoint) cannot be lifted:
a larger `[engine] max_len` is a `ConfigError` when the config is loaded, so `prfaas serve` and
every process refuse it at start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.errors import ConfigError
from prfaas_jax.mesh_spec import parse_mesh_spec
from prfaas_jax.policy.rebalancer import RebalancerConfig
from prfaas_jax.policy.routing import Role
from prfaas_jax.policy.threshold_controller import ControllerConfig, threshold_candidates
from prfaas_jax.policy.wire_choice import AdaptiveWireConfig
from prfaas_jax.serving.cluster_sections import (
    Allocator,
    ControllerSection,
    Endpoint,
    EngineKind,
    EngineSection,
    FakeSection,
    FaultsSection,
    HostsSection,
    InstancesSection,
    LinkSection,
    ModelSection,
    NodeClassSection,
    PrefixCacheSection,
    ProfileSection,
    RebalancerSection,
    RouterSection,
    SecuritySection,
)
from prfaas_jax.toml_config import Where, build, keys_of, located, read, resolve, split, value

T = TypeVar("T")
# Sections renamed since configs were written with them: former name → current name.
RENAMED_SECTIONS = {"chaos": "faults"}


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
    faults: FaultsSection = dataclasses.field(default_factory=FaultsSection)
    hosts: HostsSection = dataclasses.field(default_factory=HostsSection)
    node_classes: tuple[tuple[str, NodeClassSection], ...] = ()
    wire: AdaptiveWireConfig | None = None  # [wire]: the router narrows states (wire_choice.py)

    def node_class(self, role: Role) -> tuple[str, NodeClassSection] | None:
        """The node class (name, limits) of an instance starting in ``role``; None: none."""
        name = (
            self.instances.prfaas_class if role is Role.PRFAAS_PREFILL else self.instances.pd_class
        )
        return (name, dict(self.node_classes)[name]) if name else None

    @property
    def lossy_wire(self) -> str | None:
        """What lets a state cross the link other than exact (`[link] precision` not native,
        or `[wire]`), in words; None: every state crosses exact."""
        if self.wire is not None:
            return "[wire] (narrowed states)"
        if not self.link.wire_precision.is_native:
            return f'[link] precision = "{self.link.precision}"'
        return None

    @property
    def pending_states_limit(self) -> int:
        """`engine.max_pending_states`, or with 0 `router.max_in_flight`: then every request the
        router admits may wait on one decode node with its state, as under a decode backlog."""
        return self.engine.max_pending_states or self.router.max_in_flight

    def controller_config(self) -> ControllerConfig:
        """The threshold controller's policy: `[controller]`'s keys, candidates every
        `threshold_step` tokens up to `engine.max_len`."""
        return self.controller.config


def serving_model_config(config: ClusterConfig) -> ModelConfig:
    """The model the cluster serves: `[model] preset` holding `[engine] max_len` tokens (module
    docstring, "One limit"). Every process builds its model from this, never from the preset
    alone. A `ConfigError` when `max_len` is past a fixed limit."""
    return load_model_config(config.model.preset).with_max_len(config.engine.max_len)


def instance_roles(config: ClusterConfig) -> dict[str, Role]:
    """Instance names in start order with their first role: prfaas-<i>, then pd-<i> nodes."""
    roles = {f"prfaas-{i}": Role.PRFAAS_PREFILL for i in range(config.instances.prfaas_prefill)}
    local = [Role.PD_PREFILL] * config.instances.pd_prefill
    local += [Role.PD_DECODE] * config.instances.pd_decode
    roles.update({f"pd-{i}": role for i, role in enumerate(local)})
    return roles


def instance_part(name: str) -> str:
    """The part of the cluster (`prfaas serve --only`: "prfaas" or "pd") instance ``name``
    belongs to."""
    return "prfaas" if name.startswith("prfaas-") else "pd"


def served_hosts(config: ClusterConfig) -> list[str]:
    """Every host the config's servers listen on (`[hosts]`: the router's, each instance's),
    once each, in the order of the cluster's start: the machines `prfaas certs --config`
    makes a certificate for."""
    names = ["router", *instance_roles(config)]
    return list(dict.fromkeys(config.hosts.endpoint(name).host for name in names))


def check_binds(
    config: ClusterConfig, parts: Collection[str] = ("router", "prfaas", "pd")
) -> list[str]:
    """The security rule (`SecuritySection.check_bind`) over every server of ``parts`` at its
    `[hosts]` address: the router's client port and metrics endpoint, each instance's worker
    port (a decode worker's data port shares its host). A `ConfigError` naming the file for the
    first server refused; else the warnings `allow_plaintext` asks for, one per server."""
    servers = []
    if "router" in parts:
        host = config.hosts.router.host
        servers += [(host, "the router's client port"), (host, "the router's metrics endpoint")]
    for name in instance_roles(config):
        if instance_part(name) in parts:
            servers.append((config.hosts.endpoint(name).host, f"worker {name}"))
    warnings = []
    for host, what in servers:
        try:
            warning = config.security.check_bind(host, what)
        except ConfigError as err:
            raise ConfigError(f"{config.path}: {err}") from None
        if warning is not None:
            warnings.append(warning)
    return warnings


def _controller(table: object, where: Where, max_len: int) -> ControllerSection:
    own, policy = split(
        table, where, keys_of(ControllerSection, "config"), keys_of(ControllerConfig, "candidates")
    )
    step = value(own, "threshold_step", int, where, default=ControllerSection.threshold_step)
    with located(where):
        candidates = tuple(threshold_candidates(step, max_len))
    config = build(ControllerConfig, policy, where, candidates=candidates)
    return build(ControllerSection, own, where, config=config)


def _rebalancer(table: object, where: Where) -> RebalancerSection:
    own, policy = split(
        table, where, keys_of(RebalancerSection, "config"), keys_of(RebalancerConfig)
    )
    return build(RebalancerSection, own, where, config=build(RebalancerConfig, policy, where))


def _security(
    table: object, where: Where, directory: Path, *, check_files: bool = True
) -> SecuritySection:
    """`[security]` with its paths resolved against the config file's directory, and checked
    (that the files exist, too, with `check_files`)."""
    section = build(SecuritySection, table, where)
    resolved = {k: str(directory / v) if v else "" for k, v in section.paths.items()}
    section = dataclasses.replace(section, **resolved)
    tls = {"ca_cert": section.ca_cert, "cert": section.cert, "key": section.key}
    missing = [k for k, v in tls.items() if not v]
    if missing and len(missing) < len(tls):
        raise where.at(missing[0]).error(
            "missing: ca_cert, cert and key go together (all three for mutual TLS, or none)"
        )
    for key, path in {**tls, "token_file": section.token_file}.items():
        if check_files and path and not Path(path).is_file():
            raise where.at(key).error(f"no such file {path}")
    return section


def _parse(path: Path, doc: dict[str, object], *, security_files: bool = True) -> ClusterConfig:
    where = Where(str(path))
    for former, current in RENAMED_SECTIONS.items():
        if former in doc:
            raise where.error(f"[{former}] is now [{current}]")
    split(doc, where, keys_of(ClusterConfig, "path"))

    def section(name: str, cls: type[T]) -> T:
        return build(cls, doc.get(name, {}), where.at(name))

    engine = section("engine", EngineSection)
    config = ClusterConfig(
        path=path,
        model=section("model", ModelSection),
        engine=engine,
        fake=section("fake", FakeSection),
        instances=section("instances", InstancesSection),
        link=section("link", LinkSection),
        router=section("router", RouterSection),
        controller=_controller(doc.get("controller", {}), where.at("controller"), engine.max_len),
        rebalancer=_rebalancer(doc.get("rebalancer", {}), where.at("rebalancer")),
        profile=section("profile", ProfileSection),
        prefix_cache=section("prefix_cache", PrefixCacheSection),
        security=_security(
            doc.get("security", {}), where.at("security"), path.parent, check_files=security_files
        ),
        faults=section("faults", FaultsSection),
        node_classes=_node_classes(doc.get("node_classes", {}), where.at("node_classes")),
        wire=build(AdaptiveWireConfig, doc["wire"], where.at("wire")) if "wire" in doc else None,
    )
    config = dataclasses.replace(
        config, hosts=_hosts(doc.get("hosts", {}), where.at("hosts"), config)
    )
    classes = dict(config.node_classes)
    for key in ("prfaas_class", "pd_class"):
        name = getattr(config.instances, key)
        if name and name not in classes:
            known = ", ".join(classes) or "none defined"
            raise (
                where.at("instances").at(key).error(f"no [node_classes.{name}] (classes: {known})")
            )
    _check_processes(config, where)
    paged = config.engine.allocator is Allocator.PAGED
    if config.instances.mixed and (paged or config.engine.decode_mesh):
        raise (
            where.at("instances")
            .at("pd_mode")
            .error(
                '"mixed" steps the slot decode engine on one device: no allocator = "paged", '
                "no decode_mesh"
            )
        )
    model = load_model_config(config.model.preset)
    try:
        model.with_max_len(engine.max_len)
    except ConfigError as err:  # past a trained positional range: refused before any process
        raise where.at("engine").at("max_len").error(str(err)) from None
    return config


def _node_classes(table: object, where: Where) -> tuple[tuple[str, NodeClassSection], ...]:
    """`[node_classes.NAME]` tables, in the file's order."""
    if not isinstance(table, dict):
        raise where.error("expected tables [node_classes.NAME]")
    return tuple(
        (name, build(NodeClassSection, keys, where.at(name))) for name, keys in table.items()
    )


def _hosts(table: object, where: Where, config: ClusterConfig) -> HostsSection:
    """`[hosts]`: role keys and instance names, each ``HOST`` or ``HOST:PORT``; no two servers
    may be given the same fixed port on one host."""
    if not isinstance(table, dict):
        raise where.error("expected a table")
    names = list(instance_roles(config))
    roles: dict[str, Endpoint] = {}
    instances: list[tuple[str, Endpoint]] = []
    for key, raw in table.items():
        if key not in ("router", "prfaas", "pd", *names):
            raise where.at(key).error(
                f"unknown key (expected router, prfaas, pd or an instance name: {', '.join(names)})"
            )
        if not isinstance(raw, str):
            raise where.at(key).error(f"expected a string HOST or HOST:PORT, got {raw!r}")
        with located(where.at(key)):
            endpoint = Endpoint.parse(raw, f"hosts.{key}")
        if key in ("router", "prfaas", "pd"):
            roles[key] = endpoint
        else:
            instances.append((key, endpoint))
    hosts = HostsSection(**roles, instances=tuple(instances))
    taken: dict[tuple[str, int], str] = {}
    for name in ("router", *names):
        endpoint = hosts.endpoint(name)
        if endpoint.port:
            other = taken.setdefault((endpoint.host, endpoint.port), name)
            if other != name:
                raise where.error(f"{other} and {name} would both listen on {endpoint}")
    return hosts


def _check_processes(config: ClusterConfig, root: Where) -> None:
    """A multi-process PrfaaS instance needs a prefill mesh it can split evenly, the JAX
    engines, and no prefix cache (engine/spmd.py)."""
    for key in ("prefill_mesh", "decode_mesh", "prfaas_mesh"):
        if mesh := getattr(config.engine, key):
            with located(root.at("engine").at(key)):
                parse_mesh_spec(mesh)
    processes = config.instances.prfaas_processes
    if processes == 1:
        return
    where = root.at("instances").at("prfaas_processes")
    mesh = config.engine.prfaas_prefill_mesh
    devices = parse_mesh_spec(mesh).num_devices if mesh else 1
    if devices % processes:
        raise where.error(
            f"{processes} processes need [engine] prfaas_mesh (or prefill_mesh) to span them with "
            f"the same number of devices each (e.g. tensor={2 * processes}); "
            f"{mesh or 'one device'} does not"
        )
    if config.model.engine != EngineKind.JAX:
        raise where.error('needs [model] engine = "jax" (a fake engine has no devices)')
    if config.prefix_cache.enabled:
        raise where.error(
            "needs [prefix_cache] enabled = false: a cached state would have to reach every "
            "process of the instance"
        )


def local_devices(config: ClusterConfig, role: Role) -> int:
    """CPU devices a worker process of ``role`` holds: its share of a multi-process PrfaaS
    instance's mesh, else enough for the largest mesh the node may run (a PD node may switch
    between prefill and decode)."""
    if role is Role.PRFAAS_PREFILL:
        meshes, processes = [config.engine.prfaas_prefill_mesh], config.instances.prfaas_processes
    else:
        meshes, processes = [config.engine.prefill_mesh, config.engine.decode_mesh], 1
    sizes = [parse_mesh_spec(mesh).num_devices for mesh in meshes if mesh]
    return max(sizes, default=1) // processes


def resolve_cluster_path(name_or_path: str | Path) -> Path:
    """A config path, or a name of `configs/clusters/<name>.toml`."""
    return resolve("clusters", name_or_path)


def load_cluster_config(name_or_path: str | Path, *, security_files: bool = True) -> ClusterConfig:
    """The config; ``security_files=False`` leaves out the check that `[security]`'s files
    exist (`prfaas certs --config` reads a config whose certificates it is about to make)."""
    path = resolve_cluster_path(name_or_path)
    return _parse(path, read(path, "cluster config"), security_files=security_files)


def load_security_file(path: str | Path) -> SecuritySection:
    """A file holding one `[security]` table (nothing else), read and checked as the cluster
    config's: what a `--netns` launcher gives its processes for the certificates it made."""
    path = Path(path)
    where = Where(str(path))
    doc = read(path, "security file")
    split(doc, where, ("security",))
    return _security(doc.get("security", {}), where.at("security"), path.parent)
