"""Planner inputs from a TOML file: `load_plan_config(path) -> PlanConfig`.

`PlanConfig` holds the two `ThroughputModel`s the planner compares — PrfaaS-PD (a PrfaaS cluster
plus a local PD cluster) and the homogeneous PD baseline (the local hardware only) — and the
threshold grid to search. Also exposes the tables the file is read into (`ProfileSpec`,
`PrfaasSpec`, `LocalSpec`, `BaselineSpec`, `SearchSpec`, `TraceSpec`) and their modes
(`ProfileKind`, `LengthSource`). Sections and keys (docs/planning.md explains each):

    [workload]            output_len
    [workload.input_len]  distribution = "truncated_lognormal": mu, sigma, min_len, max_len
                          distribution = "trace": path (one length per line, relative to the file)
    [prfaas]              instances, gpus_per_instance, gpu_cost, egress_gbps
    [prfaas.prefill_time_s], [local.prefill_time_s], [kv_size_mib]     profiles:
                          kind = "polynomial": coeffs  |  kind = "table": lengths, values
                          kind = "measured": path (a profile file, `prfaas profile --out`)
    [local]               instances, gpus_per_instance, gpu_cost, decode_max_batch_size,
                          decode_step_s
    [baseline]            instances (optional; default: both clusters' instances)
    [search]              threshold_step, stage_time = "expected" | "at_mean" (optional)

Every user mistake (missing file, bad TOML, unknown or missing key, wrong type, invalid value)
raises `ConfigError` with a one-line message naming the file and the key (`toml_config`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.hardware import load_measured
from prfaas_jax.policy.length_distribution import (
    EmpiricalLengths,
    LengthDistribution,
    TruncatedLogNormal,
)
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.search import threshold_grid
from prfaas_jax.policy.throughput_model import Cluster, Deployment, StageTime, ThroughputModel
from prfaas_jax.toml_config import Where, build, keys_of, located, read, split, value

SECTIONS = ("workload", "prfaas", "local", "kv_size_mib", "baseline", "search")


class ProfileKind(enum.StrEnum):
    POLYNOMIAL = "polynomial"  # coeffs: f(l) = Σ coeffs[k]·l^k
    TABLE = "table"  # lengths, values: linear through the points
    MEASURED = "measured"  # path: a prefill profile file (`prfaas profile`, configs/hardware/)


class LengthSource(enum.StrEnum):
    TRUNCATED_LOGNORMAL = "truncated_lognormal"
    TRACE = "trace"


_PROFILE_KEYS = {
    ProfileKind.POLYNOMIAL: ("coeffs",),
    ProfileKind.TABLE: ("lengths", "values"),
    ProfileKind.MEASURED: ("path",),
}


@dataclass(frozen=True)
class ProfileSpec:
    """A profile table: `kind = "polynomial"` with `coeffs`, `"table"` with `lengths` and
    `values` (`policy.profiles.Profile`), or `"measured"` with the `path` of a prefill profile
    file (relative to the plan file; planning/hardware.py `MeasuredPrefill`)."""

    kind: ProfileKind
    coeffs: tuple[float, ...] = ()
    lengths: tuple[float, ...] = ()
    values: tuple[float, ...] = ()
    path: str = ""

    def __post_init__(self) -> None:
        for kind, keys in _PROFILE_KEYS.items():
            for key in keys:
                if kind is not self.kind and getattr(self, key):
                    raise ValueError(f"{key} goes with kind = {kind.value}, not {self.kind.value}")
        if self.kind is not ProfileKind.MEASURED:
            self.profile()  # a spec that makes no profile is refused here, where its key is known
        elif not self.path:
            raise ValueError("kind = measured needs the path of a profile file")

    def profile(self, directory: Path = Path()) -> Profile:
        if self.kind is ProfileKind.POLYNOMIAL:
            return Profile.polynomial(self.coeffs)
        if self.kind is ProfileKind.MEASURED:
            return load_measured(directory / self.path).profile
        return Profile.table(self.lengths, self.values)


@dataclass(frozen=True)
class PrfaasSpec:
    instances: int
    prefill_time_s: ProfileSpec
    egress_gbps: float
    gpus_per_instance: int = 8
    gpu_cost: float = 1.0


@dataclass(frozen=True)
class LocalSpec:
    instances: int
    prefill_time_s: ProfileSpec
    decode_max_batch_size: int
    decode_step_s: float
    gpus_per_instance: int = 8
    gpu_cost: float = 1.0

    def __post_init__(self) -> None:
        if self.instances < 2:
            raise ConfigError("local.instances: must be at least 2 (N_p ≥ 1 and N_d ≥ 1)")


@dataclass(frozen=True)
class BaselineSpec:
    instances: int | None = None  # None: every instance of both clusters

    def __post_init__(self) -> None:
        if self.instances is not None and self.instances < 2:
            raise ConfigError("baseline.instances: must be at least 2 (N_p ≥ 1 and N_d ≥ 1)")


@dataclass(frozen=True)
class SearchSpec:
    threshold_step: int = 100
    stage_time: StageTime = StageTime.EXPECTED


@dataclass(frozen=True)
class TraceSpec:
    path: str  # one length per line, relative to the plan file


@dataclass(frozen=True)
class PlanConfig:
    path: Path
    model: ThroughputModel  # PrfaaS-PD
    baseline: ThroughputModel  # homogeneous PD on the local hardware
    thresholds: tuple[int, ...]

    def with_profiles(
        self,
        *,
        kv_size_mib: Profile | None = None,
        prfaas_prefill_s: Profile | None = None,
        local_prefill_s: Profile | None = None,
    ) -> PlanConfig:
        """The same deployments and workload with other profiles (None: keep the file's): a
        model's own S_kv (`prfaas plan --model`), or another layout's (`prfaas codesign`)."""

        def changed(deployment: Deployment, *, with_prfaas: bool) -> Deployment:
            local = deployment.local
            if local_prefill_s is not None:
                local = dataclasses.replace(local, prefill_s=local_prefill_s)
            prfaas = deployment.prfaas
            if with_prfaas and prfaas_prefill_s is not None:
                prfaas = dataclasses.replace(prfaas, prefill_s=prfaas_prefill_s)
            kv = deployment.kv_size_mib if kv_size_mib is None else kv_size_mib
            return dataclasses.replace(deployment, local=local, prfaas=prfaas, kv_size_mib=kv)

        model = dataclasses.replace(
            self.model, deployment=changed(self.model.deployment, with_prfaas=True)
        )
        baseline = dataclasses.replace(
            self.baseline, deployment=changed(self.baseline.deployment, with_prfaas=False)
        )
        return dataclasses.replace(self, model=model, baseline=baseline)


def _read_trace(trace: Path, where: Where) -> EmpiricalLengths:
    try:
        lines = trace.read_text().splitlines()
    except OSError as err:
        raise where.at("path").error(f"cannot read {trace}: {err.strerror}") from None
    lengths = []
    for line_number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            lengths.append(int(text))
        except ValueError:
            raise ConfigError(
                f"{trace}:{line_number}: expected a token count, got {text!r}"
            ) from None
    with located(where):
        return EmpiricalLengths(tuple(lengths))


def _input_len(table: dict[str, object], where: Where, directory: Path) -> LengthDistribution:
    source = value(table, "distribution", LengthSource, where)
    spec_type = TraceSpec if source is LengthSource.TRACE else TruncatedLogNormal
    _, rest = split(table, where, ("distribution",), keys_of(spec_type))
    spec = build(spec_type, rest, where)
    if isinstance(spec, TraceSpec):
        return _read_trace(directory / spec.path, where)
    return spec


def _cluster(
    spec: PrfaasSpec | LocalSpec, directory: Path, num_instances: int | None = None
) -> Cluster:
    return Cluster(
        num_instances=spec.instances if num_instances is None else num_instances,
        prefill_s=spec.prefill_time_s.profile(directory),
        gpus_per_instance=spec.gpus_per_instance,
        gpu_cost=spec.gpu_cost,
    )


def _parse(path: Path, doc: dict[str, object], egress_gbps: float | None) -> PlanConfig:
    where = Where(str(path))
    (doc,) = split(doc, where, SECTIONS)
    workload_where = where.at("workload")
    workload = value(doc, "workload", dict, where)
    split(workload, workload_where, ("output_len", "input_len"))
    input_len = value(workload, "input_len", dict, workload_where)
    lengths = _input_len(input_len, workload_where.at("input_len"), path.parent)
    output_len = value(workload, "output_len", float, workload_where)
    prfaas = value(doc, "prfaas", PrfaasSpec, where)
    local = value(doc, "local", LocalSpec, where)
    kv_size_mib = value(doc, "kv_size_mib", ProfileSpec, where).profile(path.parent)
    baseline = value(doc, "baseline", BaselineSpec, where, default=BaselineSpec())
    search = value(doc, "search", SearchSpec, where, default=SearchSpec())

    with located(where.at("local")):
        pd_only = Deployment(
            local=_cluster(local, path.parent),
            decode_max_batch_size=local.decode_max_batch_size,
            decode_step_s=local.decode_step_s,
            kv_size_mib=kv_size_mib,
        )
    with located(where.at("prfaas")):
        deployment = dataclasses.replace(
            pd_only,
            prfaas=_cluster(prfaas, path.parent),
            egress_gbps=prfaas.egress_gbps if egress_gbps is None else egress_gbps,
        )
    # The homogeneous baseline gets every instance of both clusters unless told otherwise.
    num_baseline = baseline.instances
    if num_baseline is None:
        num_baseline = local.instances + prfaas.instances
    baseline_deployment = dataclasses.replace(
        pd_only, local=_cluster(local, path.parent, num_baseline)
    )
    with located(workload_where):
        model = ThroughputModel(deployment, lengths, output_len, search.stage_time)
        baseline_model = ThroughputModel(
            baseline_deployment, lengths, output_len, search.stage_time
        )
    with located(where.at("search")):
        thresholds = threshold_grid(lengths, search.threshold_step)
    if not thresholds:
        raise where.at("search.threshold_step").error(
            "leaves no threshold inside the length distribution"
        )
    return PlanConfig(path, model, baseline_model, thresholds)


def load_plan_config(path: str | Path, *, egress_gbps: float | None = None) -> PlanConfig:
    """Reads a plan TOML; `egress_gbps` overrides [prfaas] egress_gbps (the --bandwidth flag)."""
    path = Path(path)
    return _parse(path, read(path, "plan config"), egress_gbps)
