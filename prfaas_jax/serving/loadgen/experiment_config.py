"""Case-study experiment configs (`configs/experiments/*.toml`): `load_experiment_config(path,
quick=False) -> ExperimentConfig`, and the sections it is read into (`BudgetSection`,
`WorkloadSection`, `MeasureSection`, `ProfilingSection`, `SimulationSection`).

An experiment names a cluster config — its model, engine, link and node classes
(`[node_classes.NAME]`, the PrfaaS cluster's `[instances] prfaas_class` and the PD cluster's
`pd_class`) — and says how to compare the three deployments on it (docs/serving.md, "The case
study on real processes"):

    cluster = "../clusters/x.toml"   relative to this file
    [budget]       prfaas, local, homogeneous: instances of the PrfaaS class and of the PD class
                   for PrfaaS-PD and naive heterogeneous; of the PD class for homogeneous PD
    [workload]     length_scale (the paper's truncated log-normal, scaled), output_len,
                   requests (one prompt set, sent in every run), seed
    [measure]      concurrency (closed-loop levels of the saturation runs), common_rate (req/s
                   of the TTFT run; 0: a share of homogeneous PD's predicted Λ_max),
                   common_share, ttft_slo_s (a level counts only when its P90 TTFT meets it)
    [profiling]    lengths, batch_sizes, repeats (`prfaas profile` per node class)
    [simulation]   requests, probes, backlog_scale (the simulator's saturation search)
    [quick]        any of the keys above, as "section.key" = value: what `--quick` changes

Errors are one-line `ConfigError`s naming the file and the key (`toml_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prfaas_jax.serving.cluster_config import ClusterConfig, load_cluster_config
from prfaas_jax.toml_config import Where, build, read, resolve, split

SECTIONS = ("budget", "workload", "measure", "profiling", "simulation")


@dataclass(frozen=True)
class BudgetSection:
    prfaas: int = 1
    local: int = 2
    homogeneous: int = 3

    def __post_init__(self) -> None:
        if self.prfaas < 1 or self.local < 1:
            raise ValueError("prfaas and local must be ≥ 1")
        if self.homogeneous < 2:
            raise ValueError("homogeneous must be ≥ 2 (a prefill and a decode instance)")


@dataclass(frozen=True)
class WorkloadSection:
    # The paper's input lengths (truncated log-normal μ = 9.90, σ = 1.00 on [128, 128K]) scaled
    # by this factor (0: to the cluster's max_len), so the shape survives on a toy context.
    length_scale: float = 0.0
    output_len: int = 64
    requests: int = 96
    seed: int = 0

    def __post_init__(self) -> None:
        if self.length_scale < 0 or self.length_scale > 1:
            raise ValueError("length_scale must be in [0, 1]")
        if self.output_len < 1 or self.requests < 8:
            raise ValueError("need output_len ≥ 1 and requests ≥ 8")


@dataclass(frozen=True)
class MeasureSection:
    concurrency: tuple[int, ...] = (8, 16, 32)
    common_rate: float = 0.0
    common_share: float = 0.6
    ttft_slo_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency needs levels ≥ 1")
        if self.common_rate < 0 or not 0 < self.common_share <= 1:
            raise ValueError("need common_rate ≥ 0 and common_share in (0, 1]")
        if not self.ttft_slo_s > 0:
            raise ValueError("ttft_slo_s must be > 0")


@dataclass(frozen=True)
class ProfilingSection:
    lengths: tuple[int, ...] = (128, 1024, 4096)
    batch_sizes: tuple[int, ...] = (1, 8)
    repeats: int = 2

    def __post_init__(self) -> None:
        if not self.lengths or not self.batch_sizes or self.repeats < 1:
            raise ValueError("need lengths, batch_sizes and repeats ≥ 1")


@dataclass(frozen=True)
class SimulationSection:
    requests: int = 4000
    probes: int = 6
    backlog_scale: float = 2.0

    def __post_init__(self) -> None:
        if self.requests < 100 or self.probes < 1 or not self.backlog_scale > 0:
            raise ValueError("need requests ≥ 100, probes ≥ 1 and backlog_scale > 0")


@dataclass(frozen=True)
class ExperimentConfig:
    path: Path
    cluster: ClusterConfig
    budget: BudgetSection
    workload: WorkloadSection
    measure: MeasureSection
    profiling: ProfilingSection
    simulation: SimulationSection
    quick: bool = False

    @property
    def classes(self) -> tuple[str, str]:
        """The node classes of the PrfaaS cluster and of the PD cluster."""
        return self.cluster.instances.prfaas_class, self.cluster.instances.pd_class


_CLASSES = {
    "budget": BudgetSection,
    "workload": WorkloadSection,
    "measure": MeasureSection,
    "profiling": ProfilingSection,
    "simulation": SimulationSection,
}


def _quick_overrides(table: object, where: Where) -> dict[str, dict[str, object]]:
    """`[quick]`'s "section.key" = value pairs, by section."""
    if not isinstance(table, dict):
        raise where.error('expected a table of "section.key" = value')
    out: dict[str, dict[str, object]] = {}
    for dotted, raw in table.items():
        section, _, key = dotted.partition(".")
        if section not in _CLASSES or not key:
            raise where.at(dotted).error(f"expected SECTION.KEY with SECTION one of {SECTIONS}")
        out.setdefault(section, {})[key] = raw
    return out


def load_experiment_config(name_or_path: str | Path, *, quick: bool = False) -> ExperimentConfig:
    """An experiment config (a path, or a name under configs/experiments/); ``quick`` applies
    its `[quick]` table."""
    path = resolve("experiments", name_or_path)
    doc = read(path, "experiment config")
    where = Where(str(path))
    split(doc, where, ("cluster", "quick", *SECTIONS))
    if not isinstance(doc.get("cluster"), str):
        raise where.at("cluster").error("expected the path of a cluster config")
    cluster = load_cluster_config(path.parent / doc["cluster"])
    prfaas_class, pd_class = cluster.instances.prfaas_class, cluster.instances.pd_class
    if not prfaas_class or not pd_class:
        raise where.at("cluster").error(
            f"{cluster.path} must give both clusters a node class ([instances] prfaas_class "
            "and pd_class): the comparison is between kinds of node"
        )
    overrides = _quick_overrides(doc.get("quick", {}), where.at("quick")) if quick else {}
    sections = {}
    for name, cls in _CLASSES.items():
        table = doc.get(name, {})
        if not isinstance(table, dict):
            raise where.at(name).error("expected a table")
        sections[name] = build(cls, {**table, **overrides.get(name, {})}, where.at(name))
    config = ExperimentConfig(path=path, cluster=cluster, quick=quick, **sections)
    needed = config.workload.output_len + 2
    if needed > cluster.engine.max_len:
        raise (
            where.at("workload")
            .at("output_len")
            .error(f"leaves no room for a prompt in [engine] max_len {cluster.engine.max_len}")
        )
    largest = max(config.measure.concurrency)
    if config.workload.requests < 3 * largest:
        raise (
            where.at("workload")
            .at("requests")
            .error(
                f"{config.workload.requests} requests cannot hold concurrency {largest} steady: "
                f"need at least {3 * largest}"
            )
        )
    return config
