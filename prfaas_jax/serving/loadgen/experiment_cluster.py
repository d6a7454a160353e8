"""The measured side of `prfaas experiment` (serving/loadgen/experiment.py): each deployment on
real processes (`measure_deployment` → `Measured`, one `LevelRun` per closed-loop level), the
cluster config it runs (`deployment_cluster`), the single-process reference its outputs are
checked against (`reference_outputs`, `check_outputs`) and the steady closed-loop throughput
(`steady_throughput`).

Saturation is measured closed-loop: at each concurrency level the same prompts are sent with
that many in flight, so no queue grows without bound, and the completion rate while the level
holds is its throughput; Λ_max is the highest one whose P90 TTFT meets the SLO. Then the prompts
go again as Poisson arrivals at the common rate (mean and P90 TTFT, the link's egress). Beside
each level the run records what explains a gap to the prediction: the mean time per output
token (the decode node's step as the requests saw it) and, per route, the prefill's time on
its engine over the node class's profile at the same length.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prfaas_jax.serving.cluster_config import ClusterConfig, serving_model_config
from prfaas_jax.serving.loadgen.bench import BenchOptions, BenchResult, run_bench
from prfaas_jax.serving.loadgen.experiment_config import ExperimentConfig
from prfaas_jax.serving.loadgen.experiment_predict import NO_SPILL, DeploymentPlan, Say
from prfaas_jax.toml_config import dumps

LABELS = {
    "prfaas_pd": "PrfaaS-PD",
    "homogeneous_pd": "homogeneous PD",
    "naive_heterogeneous": "naive heterogeneous",
}


@dataclass(frozen=True)
class LevelRun:
    """One closed-loop saturation run."""

    concurrency: int
    throughput: float  # completions/s while the level held (`steady_throughput`)
    ttft_p90_s: float
    tpot_s: float  # mean time per output token after the first: the decode node's step, seen
    egress_mbps: float
    # Per route, the mean of (the prefill's time on its engine, as the worker reports it) over
    # (the node class's profile at the prompt's length): > 1 when a node in the cluster runs
    # its engine slower than the profile did alone.
    prefill_vs_profile: dict[str, float] = field(default_factory=dict)


@dataclass
class Measured:
    """One deployment on real processes."""

    levels: list[LevelRun] = field(default_factory=list)
    lambda_max: float = math.nan
    ttft_mean_s: float = math.nan
    ttft_p90_s: float = math.nan
    egress_mbps: float = math.nan  # at the common rate
    routed_prfaas: float = math.nan  # share of the common-rate run's requests sent to PrfaaS
    checked: int = 0
    mismatched: int = 0
    lost: int = 0
    throttling: dict[str, dict[str, float]] = field(default_factory=dict)


def steady_throughput(records: Sequence[BenchResult], concurrency: int) -> float:
    """Completions per second of a closed-loop run while ``concurrency`` requests were in
    flight: between the ``concurrency``-th completion (every slot has turned over once) and the
    one after which fewer prompts than ``concurrency`` were left to send (the drain). NaN when
    the run is too short to have such a window."""
    ends = sorted(r.sent + r.e2el for r in records if r.e2el is not None and r.error is None)
    first, last = concurrency - 1, len(records) - concurrency - 1
    if last - first < 2 or last >= len(ends):
        return math.nan
    return (last - first) / (ends[last] - ends[first])


def check_outputs(
    records: Sequence[BenchResult], reference: Sequence[Sequence[int]]
) -> tuple[int, int, int]:
    """(checked, mismatched, lost): a lost request ended in an error or without its tokens."""
    lost = sum(1 for r in records if r.error is not None or r.e2el is None)
    mismatched = sum(
        1
        for r, want in zip(records, reference, strict=True)
        if r.error is None and r.e2el is not None and r.token_ids != list(want)
    )
    return len(records), mismatched, lost


def deployment_cluster(config: ExperimentConfig, plan: DeploymentPlan, root: Path) -> Path:
    """The cluster config of one deployment: the experiment's cluster with the plan's
    instances and threshold, t held fixed (no controller, rebalancer, spill or prefix cache:
    random prompts share nothing); written under ``root``, its path."""
    import tomllib

    doc = tomllib.loads(config.cluster.path.read_text())
    doc.pop("security", None)  # the namespaced workers have other addresses than 127.0.0.1
    doc.setdefault("instances", {}).update(
        prfaas_prefill=plan.prfaas, pd_prefill=plan.pd_prefill, pd_decode=plan.pd_decode
    )
    levels = max(config.measure.concurrency)
    router = doc.setdefault("router", {})
    router.update(threshold=plan.threshold, prfaas_max_queue=NO_SPILL, ttft_slo_s=0.0)
    router["max_in_flight"] = max(int(router.get("max_in_flight", 0)), 4 * levels)
    doc["controller"] = {**doc.get("controller", {}), "enabled": False}
    doc["rebalancer"] = {**doc.get("rebalancer", {}), "enabled": False}
    doc["prefix_cache"] = {**doc.get("prefix_cache", {}), "enabled": False}
    path = root / f"cluster-{plan.name}.toml"
    path.write_text(dumps(doc))
    return path


def reference_outputs(
    cluster: ClusterConfig, prompts: Sequence[Sequence[int]], output_len: int, say: Say
) -> list[list[int]]:
    """Greedy generation on this process with the cluster's engines (its buckets, chunk
    length and decode capacity), many requests per decode step."""
    from prfaas_jax.engine.compile_cache import enable_compile_cache, enable_weights_cache
    from prfaas_jax.engine.decode import DecodeEngine
    from prfaas_jax.engine.prefill import PrefillEngine
    from prfaas_jax.engine.sampling import GREEDY
    from prfaas_jax.model.weights import load_model

    if cluster.engine.compile_cache:
        enable_compile_cache()
        enable_weights_cache()
    cfg = serving_model_config(cluster)
    params = load_model(cluster.model.preset, seed=cluster.model.seed)[1]
    engine = cluster.engine
    prefill = PrefillEngine(
        cfg, params, impl=cluster.model.impl, buckets=engine.buckets, chunk_len=engine.chunk_len
    )
    decode = DecodeEngine(
        cfg, params, max_slots=engine.max_slots, max_len=engine.max_len, impl=cluster.model.impl
    )
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = list(range(len(prompts)))
    slots: dict[int, int] = {}
    reported = 0
    while pending or slots:
        while pending and len(slots) < engine.max_slots:
            i = pending.pop(0)
            result = prefill.prefill(list(prompts[i]), max_len=engine.max_len)
            outputs[i].append(int(result.first_token))
            if output_len > 1:
                slot = decode.insert(
                    result.state, result.first_token, GREEDY, max_new_tokens=output_len - 1
                )
                slots[slot] = i
        if not slots:
            continue
        for slot, token in decode.step():
            outputs[slots[slot]].append(int(token))
        for slot in [s for s in slots if decode.is_finished(s)]:
            decode.free(slot)
            del slots[slot]
        done = len(prompts) - len(pending) - len(slots)
        if done // 16 > reported // 16:
            say(f"reference: {done} / {len(prompts)}")
        reported = done
    return outputs


def _prefill_vs_profile(
    records: Sequence[BenchResult], profiles: dict[str, Callable[[float], float]]
) -> dict[str, float]:
    out = {}
    for route, profile in profiles.items():
        ratios = [
            r.prefill_s / profile(r.prompt_len)
            for r in records
            if r.route == route and r.prefill_s is not None and r.error is None
        ]
        if ratios:
            out[route] = statistics.fmean(ratios)
    return out


def _ratios(ratios: dict[str, float]) -> str:
    return ", ".join(f"{route} {value:.2f}×" for route, value in ratios.items()) or "—"


def _mean_tpot(records: Sequence[BenchResult]) -> float:
    tpot = [
        (r.e2el - r.ttft) / (r.output_tokens - 1)
        for r in records
        if r.e2el is not None and r.ttft is not None and r.output_tokens > 1
    ]
    return statistics.fmean(tpot) if tpot else math.nan


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def measure_deployment(
    config: ExperimentConfig,
    plan: DeploymentPlan,
    prompts: list[list[int]],
    reference: list[list[int]],
    common_rate: float,
    root: Path,
    *,
    profiles: dict[str, Callable[[float], float]],
    netns: bool,
    say: Say,
) -> Measured:
    """Start the deployment, run the saturation levels and the common-rate run (module
    docstring), stop it; every output checked. ``profiles``: T_prefill(l) of each route's node
    class ("prfaas", "pd"), to compare the engines' times in the cluster with."""
    from prfaas_jax.serving.cluster.launcher import ClusterProcesses

    path = deployment_cluster(config, plan, root)
    cluster_cfg = config.cluster
    measured = Measured()
    bandwidth_mbps = cluster_cfg.link.bandwidth_mbps
    n, output_len = len(prompts), config.workload.output_len
    log_dir = root / f"logs-{plan.name}"
    with ClusterProcesses(path, log_dir=log_dir, netns=netns) as cluster:
        ready = cluster.start()
        say(f"{LABELS[plan.name]}: cluster up ({plan.split}, t = {plan.threshold})")
        warm = BenchOptions(
            router=ready["router"],
            num_prompts=4,
            max_concurrency=4,
            output_len=4,
            seed=99,
            wait_warm=True,
        )
        run_bench(warm)  # first-use costs (connections, allocator growth) stay out of the table

        def account(records: list[BenchResult]) -> None:
            checked, mismatched, lost = check_outputs(records, reference)
            measured.checked += checked
            measured.mismatched += mismatched
            measured.lost += lost

        for level in config.measure.concurrency:
            opts = BenchOptions(
                router=ready["router"],
                num_prompts=n,
                max_concurrency=level,
                output_len=output_len,
                timeout_s=600.0,
            )
            records, context = run_bench(opts, prompts=prompts)
            account(records)
            ttft = [r.ttft for r in records if r.ttft is not None]
            run = LevelRun(
                concurrency=level,
                throughput=steady_throughput(records, level),
                ttft_p90_s=_percentile(ttft, 90),
                tpot_s=_mean_tpot(records),
                egress_mbps=context["egress_bytes"] * 8 / 1e6 / context["duration_s"],
                prefill_vs_profile=_prefill_vs_profile(records, profiles),
            )
            measured.levels.append(run)
            say(
                f"{LABELS[plan.name]}: {level} in flight → {run.throughput:.2f} req/s, "
                f"P90 TTFT {run.ttft_p90_s:.2f} s, TPOT {1e3 * run.tpot_s:.0f} ms, prefill on "
                f"the engine / profile {_ratios(run.prefill_vs_profile)}"
            )
        meeting = [
            r.throughput
            for r in measured.levels
            if r.ttft_p90_s <= config.measure.ttft_slo_s and math.isfinite(r.throughput)
        ]
        measured.lambda_max = max(meeting, default=math.nan)
        opts = BenchOptions(
            router=ready["router"],
            num_prompts=n,
            request_rate=common_rate,
            output_len=output_len,
            seed=config.workload.seed,
            timeout_s=600.0,
        )
        records, context = run_bench(opts, prompts=prompts)
        account(records)
        ttft = [r.ttft for r in records if r.ttft is not None]
        measured.ttft_mean_s = statistics.fmean(ttft) if ttft else math.nan
        measured.ttft_p90_s = _percentile(ttft, 90)
        measured.egress_mbps = context["egress_bytes"] * 8 / 1e6 / context["duration_s"]
        routed = context["routed"]
        measured.routed_prfaas = routed[0] / max(sum(routed), 1)
        if cluster.cgroups is not None:
            measured.throttling = cluster.cgroups.throttling()
        say(
            f"{LABELS[plan.name]}: at {common_rate:.2f} req/s TTFT mean "
            f"{measured.ttft_mean_s:.2f} s, P90 {measured.ttft_p90_s:.2f} s; egress "
            f"{measured.egress_mbps:.1f} of {bandwidth_mbps:g} Mbit/s"
        )
    return measured
