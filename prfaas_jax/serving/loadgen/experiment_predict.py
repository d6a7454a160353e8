"""The predicted side of `prfaas experiment` (serving/loadgen/experiment.py): each node class
profiled (`profile_classes`), the planner's three deployments from those profiles
(`planner_inputs`, `plan_deployments` → `DeploymentPlan`) and the simulator's view of them
(`simulator_inputs`, `simulate_deployments` → `Simulated`).

The planner gets only what a user of `prfaas plan` would give it: T_prefill(l) of each class as
profiled (`prfaas profile --config … --node-class …`), the PD class's decode step at
`max_slots` rows, the model's exact state size per length (`state_nbytes`), the workload's own
prompt lengths (a trace, so the planner and the cluster see the same requests) and output
length, the link's rate. The simulator replays the same plan with t fixed: no controller,
rebalancer or queue spill (`NO_SPILL`), as the cluster runs it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster_config import serving_model_config
from prfaas_jax.serving.loadgen.experiment_config import ExperimentConfig
from prfaas_jax.toml_config import dumps

Say = Callable[[str], None]
NO_SPILL = 256  # the PrfaaS queue never spills to PD: routing by t alone, as the planner has it


@dataclass(frozen=True)
class DeploymentPlan:
    """One deployment as the planner has it."""

    name: str
    prfaas: int
    pd_prefill: int
    pd_decode: int
    threshold: int  # requests longer than this go to PrfaaS (max_len: none; 0: all)
    lambda_max: float  # predicted, req/s
    offload_fraction: float
    egress_mbps: float  # at Λ_max

    @property
    def split(self) -> str:
        return f"{self.prfaas or '—'} / {self.pd_prefill or '—'} / {self.pd_decode}"


@dataclass(frozen=True)
class Simulated:
    lambda_max: float
    ttft_mean_s: float
    ttft_p90_s: float
    egress_mbps: float


def profile_classes(config: ExperimentConfig, root: Path, say: Say) -> dict[str, str]:
    """`prfaas profile` on one node of each class; the profile file per class."""
    out = {}
    p = config.profiling
    lengths = sorted({*p.lengths, config.cluster.engine.max_len - 1})
    batches = sorted({*p.batch_sizes, config.cluster.engine.max_slots})
    for name in dict.fromkeys(config.classes):
        path = root / f"profile-{name}.toml"
        say(f"profiling node class {name} (prefill at {lengths}, decode at {batches} rows)")
        argv = [sys.executable, "-m", "prfaas_jax.cli", "profile", "--config"]
        argv += [str(config.cluster.path), "--node-class", name, "--json", "--out", str(path)]
        argv += ["--lengths", ",".join(map(str, lengths))]
        argv += ["--batch-sizes", ",".join(map(str, batches)), "--repeats", str(p.repeats)]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise UserError(f"profiling node class {name} failed: {done.stderr.strip()[-400:]}")
        out[name] = str(path)
    return out


def decode_step(profile_path: str, rows: int) -> float:
    from prfaas_jax.planning.hardware import load_measured

    measured = load_measured(profile_path)
    batches, steps = measured.decode_batch_sizes, measured.decode_step_s
    return float(np.interp(rows, batches, steps))


def planner_inputs(
    config: ExperimentConfig, profiles: dict[str, str], lengths: Sequence[int], root: Path
) -> Path:
    """The plan config of the three deployments: written under ``root``; its path."""
    from prfaas_jax.model.state import state_nbytes

    cluster = config.cluster
    prfaas_class, pd_class = config.classes
    classes = dict(cluster.node_classes)
    cfg = serving_model_config(cluster)
    (root / "lengths.txt").write_text("".join(f"{n}\n" for n in lengths))
    points = sorted({1, cluster.engine.max_len // 2, cluster.engine.max_len})
    plan = {
        "workload": {
            "output_len": config.workload.output_len,
            "input_len": {"distribution": "trace", "path": "lengths.txt"},
        },
        "prfaas": {
            "instances": config.budget.prfaas,
            "gpus_per_instance": 1,
            "gpu_cost": classes[prfaas_class].cpu_quota,  # the toy's cost: cores
            "egress_gbps": cluster.link.bandwidth_mbps / 1e3,
            "prefill_time_s": {"kind": "measured", "path": profiles[prfaas_class]},
        },
        "local": {
            "instances": config.budget.local,
            "gpus_per_instance": 1,
            "gpu_cost": classes[pd_class].cpu_quota,
            "decode_max_batch_size": cluster.engine.max_slots,
            "decode_step_s": decode_step(profiles[pd_class], cluster.engine.max_slots),
            "prefill_time_s": {"kind": "measured", "path": profiles[pd_class]},
        },
        "kv_size_mib": {
            "kind": "table",
            "lengths": points,
            "values": [state_nbytes(cfg, n) / 2**20 for n in points],
        },
        "baseline": {"instances": config.budget.homogeneous},
        "search": {"threshold_step": cluster.controller.threshold_step},
    }
    path = root / "plan.toml"
    path.write_text(dumps(plan))
    return path


def plan_deployments(plan_path: Path, max_len: int) -> dict[str, DeploymentPlan]:
    """The planner's three deployments (`prfaas plan` on the written plan config)."""
    from prfaas_jax.planning.plan_config import load_plan_config
    from prfaas_jax.policy.search import search

    config = load_plan_config(plan_path)
    plan = search(config.model, config.baseline, thresholds=config.thresholds)
    points = {
        "prfaas_pd": plan.best,
        "homogeneous_pd": plan.homogeneous_pd,
        "naive_heterogeneous": plan.naive_heterogeneous,
    }
    out = {}
    for name, point in points.items():
        t = point.routing.threshold
        threshold = max_len if t == math.inf else 0 if t == -math.inf else int(t)
        out[name] = DeploymentPlan(
            name=name,
            prfaas=point.num_prfaas,
            pd_prefill=point.num_pd_prefill,
            pd_decode=point.num_pd_decode,
            threshold=threshold,
            lambda_max=point.lambda_max,
            offload_fraction=point.routing.offload_fraction,
            egress_mbps=point.egress_gbps * 1e3,
        )
    return out


def simulator_inputs(
    config: ExperimentConfig, plans: dict[str, DeploymentPlan], rate: float, root: Path
) -> Path:
    """The simulation config of the three deployments, beside the plan config; its path."""
    cluster, sim = config.cluster, config.simulation
    link = cluster.link
    deployments = {}
    for name, plan in plans.items():
        deployments[name] = {
            "prfaas": plan.prfaas,
            "pd_prefill": plan.pd_prefill,
            "pd_decode": plan.pd_decode,
            "controller": False,
            "rebalancer": False,
        }
        if plan.prfaas and plan.pd_prefill:
            deployments[name]["threshold"] = plan.threshold
    doc = {
        "plan": "plan.toml",
        "workload": {
            "arrivals": "poisson",
            "rate": rate,
            "requests": sim.requests,
            "seed": config.workload.seed,
        },
        "link": {
            "schedule": [[0.0, link.bandwidth_mbps / 1e3]],
            "latency_s": link.latency_ms / 1e3,
            "rtt_ms": link.rtt_ms,
            "layerwise": cluster.engine.layer_groups > 1,
            "chunks": cluster.engine.layer_groups,
        },
        "router": {"prfaas_max_queue": NO_SPILL},
        "saturation": {
            "requests": sim.requests,
            "probes": sim.probes,
            "backlog_scale": sim.backlog_scale,
        },
        "deployments": deployments,
    }
    path = root / "sim.toml"
    path.write_text(dumps(doc))
    return path


def simulate_deployments(sim_path: Path, say: Say) -> dict[str, Simulated]:
    from prfaas_jax.sim.config import load_sim_config
    from prfaas_jax.sim.report import ttft_s
    from prfaas_jax.sim.run import simulate

    run = simulate(load_sim_config(sim_path), progress=say)
    out = {}
    for dep in run.deployments:
        ttft = ttft_s(dep.result)
        egress = dep.result.sent_bytes * 8 / 1e6 / max(dep.result.end_s, 1e-9)
        out[dep.spec.name] = Simulated(
            lambda_max=dep.saturation.max_throughput if dep.saturation else math.nan,
            ttft_mean_s=float(np.mean(ttft)) if ttft.size else math.nan,
            ttft_p90_s=float(np.percentile(ttft, 90)) if ttft.size else math.nan,
            egress_mbps=egress,
        )
    return out
