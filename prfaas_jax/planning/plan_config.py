"""Planner inputs from a TOML file: `load_plan_config(path) -> PlanConfig`.

`PlanConfig` holds the two `ThroughputModel`s the planner compares — PrfaaS-PD (a PrfaaS cluster
plus a local PD cluster) and the homogeneous PD baseline (the local hardware only) — and the
threshold grid to search. Sections and keys (docs/planning.md explains each):

    [workload]            output_len
    [workload.input_len]  distribution = "truncated_lognormal": mu, sigma, min_len, max_len
                          distribution = "trace": path (one length per line, relative to the file)
    [prfaas]              instances, gpus_per_instance, gpu_cost, egress_gbps
    [prfaas.prefill_time_s], [local.prefill_time_s], [kv_size_mib]     profiles:
                          kind = "polynomial": coeffs  |  kind = "table": lengths, values
    [local]               instances, gpus_per_instance, gpu_cost, decode_max_batch_size,
                          decode_step_s
    [baseline]            instances (optional; default: both clusters' instances)
    [search]              threshold_step, stage_time = "expected" | "at_mean" (optional)

Every user mistake (missing file, bad TOML, unknown or missing key, wrong type, invalid value)
raises `ConfigError` with a one-line message naming the file and the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prfaas_jax.errors import ConfigError
from prfaas_jax.policy.length_distribution import (
    EmpiricalLengths,
    LengthDistribution,
    TruncatedLogNormal,
)
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.search import threshold_grid
from prfaas_jax.policy.throughput_model import Cluster, Deployment, StageTime, ThroughputModel


@dataclass(frozen=True)
class PlanConfig:
    path: Path
    model: ThroughputModel  # PrfaaS-PD
    baseline: ThroughputModel  # homogeneous PD on the local hardware
    thresholds: tuple[int, ...]


class _Section:
    """One TOML table, read by typed getters whose errors name the file and the dotted key."""

    def __init__(self, path: Path, name: str, data: object) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: '{name}' must be a table")
        self.path, self.name, self.data = path, name, data

    def key(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: '{self.key(key)}' {message}")

    def only(self, *keys: str) -> _Section:
        """Rejects keys outside `keys`; called before any value is read, so a typo is named."""
        for key in self.data:
            if key not in keys:
                expected = ", ".join(keys)
                raise ConfigError(
                    f"{self.path}: unknown key '{self.key(key)}' (expected one of: {expected})"
                )
        return self

    def _get(self, key: str, default: object) -> object:
        if key in self.data:
            return self.data[key]
        if default is None:
            raise ConfigError(f"{self.path}: missing key '{self.key(key)}'")
        return default

    def section(self, key: str) -> _Section:
        return _Section(self.path, self.key(key), self._get(key, None))

    def number(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise self.error(key, f"must be finite, got {value}")
        return float(value)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}")
        return value

    def text(
        self, key: str, choices: tuple[str, ...] | None = None, default: str | None = None
    ) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    def numbers(self, key: str) -> list[float]:
        values = self._get(key, None)
        if not isinstance(values, list) or not values:
            raise self.error(key, "must be a non-empty list of numbers")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.error(key, f"must contain only numbers, got {value!r}")
            if not math.isfinite(value):
                raise self.error(key, f"must contain only finite numbers, got {value}")
        return [float(v) for v in values]


@contextlib.contextmanager
def _values_of(section: _Section) -> Iterator[None]:
    """Turns a policy object's ValueError (an invalid value) into a ConfigError naming `section`."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"{section.path}: [{section.name}]: {err}") from None


def _profile(section: _Section) -> Profile:
    kind = section.text("kind", ("polynomial", "table"))
    with _values_of(section):
        if kind == "polynomial":
            return Profile.polynomial(section.only("kind", "coeffs").numbers("coeffs"))
        section.only("kind", "lengths", "values")
        return Profile.table(section.numbers("lengths"), section.numbers("values"))


def _read_trace(section: _Section) -> EmpiricalLengths:
    trace = section.path.parent / section.text("path")
    try:
        lines = trace.read_text().splitlines()
    except OSError as err:
        raise section.error("path", f"cannot read {trace}: {err.strerror}") from None
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
    with _values_of(section):
        return EmpiricalLengths(tuple(lengths))


def _input_len(section: _Section) -> LengthDistribution:
    if section.text("distribution", ("truncated_lognormal", "trace")) == "trace":
        return _read_trace(section.only("distribution", "path"))
    section.only("distribution", "mu", "sigma", "min_len", "max_len")
    with _values_of(section):
        return TruncatedLogNormal(
            mu=section.number("mu"),
            sigma=section.number("sigma"),
            min_len=section.number("min_len"),
            max_len=section.number("max_len"),
        )


def _cluster(section: _Section) -> Cluster:
    with _values_of(section):
        return Cluster(
            num_instances=section.integer("instances"),
            prefill_s=_profile(section.section("prefill_time_s")),
            gpus_per_instance=section.integer("gpus_per_instance", 8),
            gpu_cost=section.number("gpu_cost", 1.0),
        )


def _parse(path: Path, doc: dict[str, object], egress_gbps: float | None) -> PlanConfig:
    root = _Section(path, "", doc).only(
        "workload", "prfaas", "local", "kv_size_mib", "baseline", "search"
    )
    workload = root.section("workload").only("output_len", "input_len")
    cluster_keys = ("instances", "gpus_per_instance", "gpu_cost", "prefill_time_s")
    prfaas = root.section("prfaas").only(*cluster_keys, "egress_gbps")
    local = root.section("local").only(*cluster_keys, "decode_max_batch_size", "decode_step_s")
    # [baseline] and [search] are optional: their keys all have defaults.
    baseline = _Section(path, "baseline", doc.get("baseline", {})).only("instances")
    search = _Section(path, "search", doc.get("search", {})).only("threshold_step", "stage_time")

    lengths = _input_len(workload.section("input_len"))
    # The homogeneous baseline gets every instance of both clusters unless told otherwise.
    num_baseline = baseline.integer(
        "instances", local.integer("instances") + prfaas.integer("instances")
    )
    for section, num_instances in ((local, local.integer("instances")), (baseline, num_baseline)):
        if num_instances < 2:
            raise section.error("instances", "must be at least 2 (N_p ≥ 1 and N_d ≥ 1)")
    kv_size_mib = _profile(root.section("kv_size_mib"))
    local_cluster = _cluster(local)
    with _values_of(local):
        pd_only = Deployment(
            local=local_cluster,
            decode_max_batch_size=local.integer("decode_max_batch_size"),
            decode_step_s=local.number("decode_step_s"),
            kv_size_mib=kv_size_mib,
        )
    with _values_of(prfaas):
        deployment = dataclasses.replace(
            pd_only,
            prfaas=_cluster(prfaas),
            egress_gbps=prfaas.number("egress_gbps") if egress_gbps is None else egress_gbps,
        )
    baseline_local = dataclasses.replace(local_cluster, num_instances=num_baseline)
    baseline_deployment = dataclasses.replace(pd_only, local=baseline_local)
    stage_time = StageTime(
        search.text("stage_time", tuple(s.value for s in StageTime), StageTime.EXPECTED.value)
    )
    with _values_of(workload):
        output_len = workload.number("output_len")
        model = ThroughputModel(deployment, lengths, output_len, stage_time)
        baseline_model = ThroughputModel(baseline_deployment, lengths, output_len, stage_time)
    with _values_of(search):
        thresholds = threshold_grid(lengths, search.integer("threshold_step", 100))
    if not thresholds:
        raise search.error("threshold_step", "leaves no threshold inside the length distribution")
    return PlanConfig(path, model, baseline_model, thresholds)


def load_plan_config(path: str | Path, *, egress_gbps: float | None = None) -> PlanConfig:
    """Reads a plan TOML; `egress_gbps` overrides [prfaas] egress_gbps (the --bandwidth flag)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"cannot read plan config {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return _parse(path, doc, egress_gbps)
