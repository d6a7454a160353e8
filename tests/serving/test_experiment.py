"""`prfaas experiment`'s parts (serving/loadgen/experiment*.py) against hand-computed values:
the steady closed-loop throughput, the output check, the config and its `[quick]` table, the
planner's three deployments from profiles whose Λ_max is known by hand, the simulation and
cluster configs it writes, the single-process reference, and the report."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.plan_config import load_plan_config
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.loadgen.bench import BenchResult
from prfaas_jax.serving.loadgen.experiment import (
    DEPLOYMENTS,
    Experiment,
    experiment_json,
    workload_prompts,
)
from prfaas_jax.serving.loadgen.experiment_cluster import (
    LevelRun,
    Measured,
    check_outputs,
    deployment_cluster,
    reference_outputs,
    steady_throughput,
)
from prfaas_jax.serving.loadgen.experiment_config import load_experiment_config
from prfaas_jax.serving.loadgen.experiment_predict import (
    DeploymentPlan,
    Simulated,
    plan_deployments,
    planner_inputs,
    simulator_inputs,
)
from prfaas_jax.serving.loadgen.experiment_report import format_experiment
from prfaas_jax.sim.config import load_sim_config
from prfaas_jax.toml_config import dumps

ROOT = Path(__file__).resolve().parents[2]


def _experiment(root: Path, **sections: dict) -> Path:
    cluster = root / "cluster.toml"
    cluster.write_text(
        dumps(
            {
                "model": {"preset": "tiny"},
                "engine": {"max_len": 4096, "max_slots": 16},
                "instances": {"prfaas_class": "fast", "pd_class": "slow"},
                "link": {"bandwidth_mbps": 100.0},
                "controller": {"threshold_step": 64},
                "node_classes": {
                    "fast": {"cpus": "0", "cpu_quota": 0.8},
                    "slow": {"cpus": "0", "cpu_quota": 0.3},
                },
            }
        )
    )
    path = root / "experiment.toml"
    doc = {"cluster": "cluster.toml", "workload": {"requests": 96}, **sections}
    path.write_text(dumps(doc))
    return path


def _record(sent: float, end: float, tokens: list[int] | None = None) -> BenchResult:
    rec = BenchResult(prompt_len=8, sent=sent, ttft=0.1, e2el=end - sent)
    rec.token_ids = tokens or [1, 2]
    return rec


def test_steady_throughput_counts_completions_while_the_level_holds():
    # 20 requests, 4 in flight, one completion every 0.5 s from t = 1: the window runs from the
    # 4th completion (t = 2.5) to the 16th (t = 8.5), 12 completions in 6 s.
    records = [_record(0.0, 1.0 + 0.5 * i) for i in range(20)]
    assert steady_throughput(records, 4) == pytest.approx(12 / 6.0)
    # Too short to hold 8 in flight steadily: no estimate.
    assert math.isnan(steady_throughput(records[:16], 8))
    # A failed request ends nothing.
    records[5].error = "UNAVAILABLE: gone"
    assert steady_throughput(records, 4) == pytest.approx(12 / 6.5)


def test_check_outputs_counts_wrong_and_lost_requests():
    records = [_record(0, 1, [1, 2]), _record(0, 1, [1, 3]), _record(0, 1, [1, 2])]
    records[2].error = "DEADLINE_EXCEEDED: late"
    assert check_outputs(records, [[1, 2]] * 3) == (3, 1, 1)


def test_config_quick_table_and_mistakes(tmp_path):
    path = _experiment(
        tmp_path,
        measure={"concurrency": [8, 16]},
        quick={"workload.requests": 48, "measure.concurrency": [16]},
    )
    full = load_experiment_config(path)
    quick = load_experiment_config(path, quick=True)
    assert (full.workload.requests, full.measure.concurrency) == (96, (8, 16))
    assert (quick.workload.requests, quick.measure.concurrency) == (48, (16,))
    assert full.classes == ("fast", "slow")
    shipped = load_experiment_config("toy-case-study", quick=True)
    assert shipped.cluster.path.name == "hetero.toml"

    bad = _experiment(tmp_path, measure={"concurrency": [64]})
    with pytest.raises(ConfigError, match=r"workload\.requests: 96 requests cannot hold"):
        load_experiment_config(bad)
    bad = _experiment(tmp_path, quick={"nowhere.key": 1})
    with pytest.raises(ConfigError, match=r"quick\.nowhere\.key: expected SECTION\.KEY"):
        load_experiment_config(bad, quick=True)


def _profile(path: Path, seconds: float, decode_step_s: float) -> str:
    """A profile whose prefill takes ``seconds`` at any length."""
    path.write_text(
        dumps(
            {
                "model": "tiny",
                "source": "by hand",
                "lengths": [1, 4096],
                "prefill_s": [seconds, seconds],
                "decode_batch_sizes": [1, 16],
                "decode_step_s": [decode_step_s, decode_step_s],
            }
        )
    )
    return str(path)


def test_the_planners_three_deployments_match_hand_computed_capacities(tmp_path):
    """Prefill 0.1 s on the fast node and 0.25 s on a slow one whatever the length, decode
    nearly free: homogeneous PD (3 slow nodes) is best at 2 prefill + 1 decode, Λ = 2/0.25 = 8;
    naive heterogeneous is the fast node alone, Λ = 1/0.1 = 10; PrfaaS-PD (fast + slow prefill,
    one decode) at best 1/0.1 + 1/0.25 = 14, when t sends 10/14 of the requests to PrfaaS,
    which the workload's lengths allow only approximately."""
    config = load_experiment_config(_experiment(tmp_path))
    profiles = {
        "fast": _profile(tmp_path / "fast.toml", 0.1, 1e-4),
        "slow": _profile(tmp_path / "slow.toml", 0.25, 1e-4),
    }
    prompts = workload_prompts(config, 256)
    assert len(prompts) == 96 and max(map(len, prompts)) <= 4096 - 64 + 1
    plan_path = planner_inputs(config, profiles, [len(p) for p in prompts], tmp_path)
    assert load_plan_config(plan_path).model.deployment.local.num_instances == 2
    plans = plan_deployments(plan_path, 4096)
    home, naive, best = plans["homogeneous_pd"], plans["naive_heterogeneous"], plans["prfaas_pd"]
    assert (home.prfaas, home.pd_prefill, home.pd_decode, home.threshold) == (0, 2, 1, 4096)
    assert home.lambda_max == pytest.approx(8.0)
    assert (naive.prfaas, naive.pd_prefill, naive.pd_decode, naive.threshold) == (1, 0, 2, 0)
    assert naive.lambda_max == pytest.approx(10.0)
    assert (best.prfaas, best.pd_prefill, best.pd_decode) == (1, 1, 1)
    assert 12.5 < best.lambda_max <= 14.0 + 1e-9
    assert best.offload_fraction == pytest.approx(10 / 14, abs=0.1)

    sim = load_sim_config(simulator_inputs(config, plans, 4.0, tmp_path))
    specs = {d.name: d for d in sim.deployments}
    assert specs["prfaas_pd"].threshold == best.threshold
    assert specs["homogeneous_pd"].threshold == math.inf
    assert specs["naive_heterogeneous"].threshold == -math.inf
    assert not any(d.use_controller or d.use_rebalancer for d in sim.deployments)
    assert sim.link.schedule == ((0.0, 0.1),) and sim.workload.rate == 4.0

    cluster = load_cluster_config(deployment_cluster(config, best, tmp_path))
    assert (cluster.instances.prfaas_prefill, cluster.instances.pd_prefill) == (1, 1)
    assert cluster.router.threshold == best.threshold
    assert not (cluster.controller.enabled or cluster.rebalancer.enabled)
    assert not cluster.prefix_cache.enabled
    assert dict(cluster.node_classes) == dict(config.cluster.node_classes)


def _plan(name: str, split: tuple[int, int, int], lam: float) -> DeploymentPlan:
    return DeploymentPlan(name, *split, threshold=100, lambda_max=lam, offload_fraction=0.3,
                          egress_mbps=5.0)  # fmt: skip


def test_the_report_shows_each_source_and_marks_the_gaps(tmp_path):
    config = load_experiment_config(_experiment(tmp_path))
    lams = {"prfaas_pd": 4.0, "homogeneous_pd": 2.0, "naive_heterogeneous": 3.0}
    splits = {"prfaas_pd": (1, 1, 1), "homogeneous_pd": (0, 2, 1), "naive_heterogeneous": (1, 0, 2)}
    measured = {
        n: Measured(lambda_max=0.7 * lams[n], ttft_mean_s=1.0, ttft_p90_s=2.0) for n in DEPLOYMENTS
    }
    for m in measured.values():
        m.levels = [LevelRun(16, m.lambda_max, 3.0, 0.05, 4.0, {"pd": 1.1})]
        m.checked = 10
    e = Experiment(
        config=config,
        common_rate=1.2,
        profiles={},
        decode_step_s=0.05,
        plans={n: _plan(n, splits[n], lams[n]) for n in DEPLOYMENTS},
        simulated={n: Simulated(lams[n], 0.5, 1.0, 4.0) for n in DEPLOYMENTS},
        measured=measured,
        prompt_lengths=[10, 30],
        wall_s=60.0,
    )
    text = format_experiment(e)
    measured_row = next(line for line in text.splitlines() if line.startswith("Λ_max measured"))
    assert measured_row.split()[-3:] == ["2.80", "1.40", "2.10"]
    assert "-30 % !" in text  # 0.7 × the planner: a gap the docs must explain
    assert "2.00× / 2.00× / 2.00×" in text
    assert "outputs equal single-process greedy generation: yes" in text
    payload = experiment_json(e)
    assert payload["deployments"]["prfaas_pd"]["measured"]["lambda_max"] == pytest.approx(2.8)
    assert payload["mean_prompt_len"] == statistics.fmean([10, 30])
    measured["prfaas_pd"].mismatched = 1
    assert not e.outputs_ok


def test_the_reference_is_single_request_generation(tmp_path):
    """The batched reference equals `generate` run on each prompt alone."""
    from prfaas_jax.engine.generate import generate
    from prfaas_jax.engine.sampling import GREEDY
    from prfaas_jax.model.weights import load_model

    config = load_experiment_config(_experiment(tmp_path))
    cluster = config.cluster
    prompts = [[3, 1, 4, 1, 5], list(range(40)), [7] * 130]
    got = reference_outputs(cluster, prompts, 5, say=lambda _: None)
    cfg, params = load_model("tiny")
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == generate(params, cfg, prompt, 5, GREEDY)[0]


def test_without_root_or_cgroups_node_classes_are_refused_in_one_line(monkeypatch, tmp_path):
    from prfaas_jax.errors import UserError
    from prfaas_jax.serving.cluster import cgroups

    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match=r"^node classes \(\[node_classes\]\) need root"):
        cgroups.require_cgroups()
    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    with pytest.raises(UserError, match="need the cgroup v1 'cpu' controller mounted at"):
        cgroups.require_cgroups()
