"""`prfaas experiment`: the paper's case study in toy form — three deployments of the same node
budget, predicted by the planner, simulated, and measured on real processes. Exposes
`run_experiment`, the `Experiment` it returns, `workload_prompts` and `experiment_json`; the
predicted side is serving/loadgen/experiment_predict.py, the measured side
serving/loadgen/experiment_cluster.py, the table and figure serving/loadgen/experiment_report.py.

1. **Profiles.** `prfaas profile --config CLUSTER --node-class C` for the PrfaaS class and the
   PD class: the engines as the cluster's workers run them, on one node of the class (a
   cgroup with its CPU quota and cores; serving/cluster/cgroups.py).
2. **Planner.** A plan config from those profiles (prefill time per length, the decode step at
   `max_slots` rows), the workload's own prompt lengths, the model's exact state size
   (`state_nbytes`) and the link's rate: `policy.search` gives PrfaaS-PD's threshold t and
   split, the homogeneous PD split, and Λ_max of each with naive heterogeneous.
3. **Simulator.** The same plan in `prfaas simulate`: each deployment's saturation search and a
   run at the common rate (TTFT), t fixed, no controller, rebalancer or queue spill.
4. **Cluster.** Each deployment started as real processes (in network namespaces across the
   kernel-shaped link; each instance in its node class's cgroup), with t fixed at the
   planner's value. Saturation is measured closed-loop: at each concurrency level the same
   prompts are sent with that many in flight, and the completion rate while the level holds
   steady (`steady_throughput`) is its throughput; measured Λ_max is the highest such rate
   whose P90 TTFT meets the SLO (a closed loop bounds every queue). Then the prompts go again
   as Poisson arrivals at the common rate: mean and P90 TTFT, the link's egress. Every output
   of every run is checked against single-process greedy generation (`check_outputs`).

The same prompts are sent in every run (common random numbers), so the reference is computed
once, before any cluster starts.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prfaas_jax.serving.cluster.cgroups import NodeCgroups
from prfaas_jax.serving.cluster_config import serving_model_config
from prfaas_jax.serving.loadgen.bench import (
    BenchOptions,
    InputDist,
    input_lengths,
    make_prompts,
)
from prfaas_jax.serving.loadgen.experiment_cluster import (
    LABELS,
    Measured,
    measure_deployment,
    reference_outputs,
)
from prfaas_jax.serving.loadgen.experiment_config import ExperimentConfig
from prfaas_jax.serving.loadgen.experiment_predict import (
    DeploymentPlan,
    Say,
    Simulated,
    decode_step,
    plan_deployments,
    planner_inputs,
    profile_classes,
    simulate_deployments,
    simulator_inputs,
)

DEPLOYMENTS = ("prfaas_pd", "homogeneous_pd", "naive_heterogeneous")


@dataclass
class Experiment:
    config: ExperimentConfig
    common_rate: float
    profiles: dict[str, str]  # node class → profile file
    decode_step_s: float  # the PD class's profiled step at max_slots rows: the planner's
    plans: dict[str, DeploymentPlan]
    simulated: dict[str, Simulated]
    measured: dict[str, Measured]
    prompt_lengths: list[int]
    wall_s: float = 0.0

    @property
    def outputs_ok(self) -> bool:
        return all(m.mismatched == 0 and m.lost == 0 for m in self.measured.values())


def workload_prompts(config: ExperimentConfig, vocab_size: int) -> list[list[int]]:
    """The prompts every run sends: lengths from the paper's truncated log-normal scaled to the
    cluster (bench.py's `paper` distribution), random token ids."""
    w = config.workload
    opts = BenchOptions(
        router="-",
        num_prompts=w.requests,
        input_dist=InputDist.PAPER,
        length_scale=w.length_scale or None,
        output_len=w.output_len,
        seed=w.seed,
    )
    rng = np.random.default_rng(w.seed)
    lengths = input_lengths(opts, config.cluster.engine.max_len - w.output_len + 1, rng)
    return make_prompts(opts, lengths, vocab_size, rng)


def run_experiment(
    config: ExperimentConfig, root: Path, *, netns: bool = True, say: Say = print
) -> Experiment:
    """The whole comparison (module docstring); files (profiles, plan, simulation and cluster
    configs, worker logs) under ``root``."""
    # This process computes the reference and then sends the load and times it: it gets the
    # nodes' weight, so a busy machine slows neither its clock readings nor its sends.
    client = NodeCgroups()
    try:
        client.adopt_self("client")
        return _run(config, root, netns=netns, say=say)
    finally:
        client.close()


def _run(config: ExperimentConfig, root: Path, *, netns: bool, say: Say) -> Experiment:
    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    cluster = config.cluster
    cfg = serving_model_config(cluster)
    prompts = workload_prompts(config, cfg.vocab_size)
    lengths = [len(p) for p in prompts]
    say(
        f"workload: {len(prompts)} prompts of {min(lengths)}–{max(lengths)} tokens "
        f"(mean {statistics.fmean(lengths):.0f}), {config.workload.output_len} new tokens each"
    )
    profiles = profile_classes(config, root, say)
    plans = plan_deployments(planner_inputs(config, profiles, lengths, root), cfg.max_len)
    for plan in plans.values():
        say(f"planner: {LABELS[plan.name]} {plan.split}, Λ_max {plan.lambda_max:.2f} req/s")
    common_rate = config.measure.common_rate or (
        config.measure.common_share * plans["homogeneous_pd"].lambda_max
    )
    simulated = simulate_deployments(simulator_inputs(config, plans, common_rate, root), say)
    say("single-process reference for every prompt")
    reference = reference_outputs(cluster, prompts, config.workload.output_len, say)
    from prfaas_jax.planning.hardware import load_measured

    routes = dict(zip(("prfaas", "pd"), config.classes, strict=True))
    route_profiles = {route: load_measured(profiles[c]).profile for route, c in routes.items()}
    measured = {
        name: measure_deployment(
            config,
            plans[name],
            prompts,
            reference,
            common_rate,
            root,
            profiles=route_profiles,
            netns=netns,
            say=say,
        )
        for name in DEPLOYMENTS
    }
    experiment = Experiment(
        config=config,
        common_rate=common_rate,
        profiles=profiles,
        decode_step_s=decode_step(profiles[config.classes[1]], cluster.engine.max_slots),
        plans=plans,
        simulated=simulated,
        measured=measured,
        prompt_lengths=lengths,
        wall_s=time.perf_counter() - started,
    )
    (root / "experiment.json").write_text(json.dumps(experiment_json(experiment), indent=1))
    return experiment


def experiment_json(experiment: Experiment) -> dict:
    """Everything the table shows, and the levels behind it."""
    from dataclasses import asdict

    def clean(value: object) -> object:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(
        {
            "config": str(experiment.config.path),
            "quick": experiment.config.quick,
            "common_rate": experiment.common_rate,
            "prompts": len(experiment.prompt_lengths),
            "mean_prompt_len": statistics.fmean(experiment.prompt_lengths),
            "output_len": experiment.config.workload.output_len,
            "profiles": experiment.profiles,
            "decode_step_s": experiment.decode_step_s,
            "deployments": {
                name: {
                    "planner": asdict(experiment.plans[name]),
                    "simulator": asdict(experiment.simulated[name]),
                    "measured": asdict(experiment.measured[name]),
                }
                for name in DEPLOYMENTS
            },
            "outputs_ok": experiment.outputs_ok,
            "wall_s": experiment.wall_s,
        }
    )
