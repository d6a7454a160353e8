"""What `prfaas plan` prints and draws: `plan_to_json`, `format_plan`, `draw_plan`, and with
``--wire`` one plan per wire precision (`wire_plans_to_json`, `format_wire_plans`).

`plan_to_json` gives the stable machine-readable keys; `format_plan` lays the plan out like the
paper's Table 6 (PrfaaS-PD beside the homogeneous and naive heterogeneous baselines); `draw_plan`
saves a PNG with the paper's Fig. 5 — Λ_max and the Eq. 6 stage bounds against the split N_p/N_d at
the chosen t (a) and against t at the chosen split (b) — plus a heatmap of Λ_max over (t, N_p) (c).
The plot needs matplotlib (the `plot` extra), imported only when a plot is asked for.
"""

from __future__ import annotations

import math
from pathlib import Path

from prfaas_jax.errors import UserError
from prfaas_jax.planning.plan_config import PlanConfig
from prfaas_jax.policy.search import Plan
from prfaas_jax.policy.throughput_model import (
    OperatingPoint,
    StageTime,
    mib_per_s_to_gbps,
    prefill_imbalance,
    producer_consumer_gap,
)
from prfaas_jax.tables import table

_STAGE_TIME_TEXT = {
    StageTime.EXPECTED: "E[T(L) | class] (mean service time)",
    StageTime.AT_MEAN: "T(E[L | class]) (time at the mean length)",
}


def plan_to_json(plan: Plan, config: PlanConfig) -> dict[str, object]:
    best, homogeneous, naive = plan.best, plan.homogeneous_pd, plan.naive_heterogeneous
    return {
        "threshold_tokens": int(best.routing.threshold),
        "n_prfaas": best.num_prfaas,
        "n_pd_prefill": best.num_pd_prefill,
        "n_pd_decode": best.num_pd_decode,
        "lambda_max": best.lambda_max,
        "stage_throughput": {
            "prfaas": best.stages.prfaas,
            "pd_prefill": best.stages.pd_prefill,
            "pd_decode": best.stages.pd_decode,
        },
        "offload_fraction": best.routing.offload_fraction,
        "mean_long_len": best.routing.mean_long_len,
        "mean_short_len": best.routing.mean_short_len,
        "egress_gbps": best.egress_gbps,
        "egress_limit_gbps": config.model.deployment.egress_gbps,
        "baselines": {
            "homogeneous_pd": {
                "n_pd_prefill": homogeneous.num_pd_prefill,
                "n_pd_decode": homogeneous.num_pd_decode,
                "lambda_max": homogeneous.lambda_max,
                "stage_throughput": {
                    "pd_prefill": homogeneous.stages.pd_prefill,
                    "pd_decode": homogeneous.stages.pd_decode,
                },
            },
            "naive_heterogeneous": {
                "n_prfaas": naive.num_prfaas,
                "n_pd_decode": naive.num_pd_decode,
                "lambda_max": naive.lambda_max,
                "stage_throughput": {
                    "prfaas": naive.stages.prfaas,
                    "pd_decode": naive.stages.pd_decode,
                },
                "egress_gbps": naive.egress_gbps,
            },
        },
        "speedup_vs_homogeneous": plan.speedup_vs_homogeneous,
        "speedup_vs_naive": plan.speedup_vs_naive,
        "cost": {"prfaas_pd": plan.cost, "homogeneous_pd": plan.homogeneous_cost},
        "equal_cost_speedup_vs_homogeneous": plan.equal_cost_speedup_vs_homogeneous,
        "stage_time": config.model.stage_time.value,
        "search": {"thresholds": len(plan.grid), "splits": len(plan.grid[0])},
    }


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _count(value: int) -> str:
    return "—" if value == 0 else str(value)


def _tokens(value: float | None) -> str:
    return "—" if value is None else f"{value / 1000:.1f}K"


def _column(point: OperatingPoint, plan: Plan, cost: float, egress_limit: float) -> list[str]:
    routing, stages = point.routing, point.stages
    threshold = routing.threshold
    speedup = point.lambda_max / plan.homogeneous_pd.lambda_max
    per_cost = speedup * plan.homogeneous_cost / cost
    return [
        f"{threshold:,.0f}" if math.isfinite(threshold) else "—",
        " / ".join(
            _count(n) for n in (point.num_prfaas, point.num_pd_prefill, point.num_pd_decode)
        ),
        " / ".join(_num(s) for s in (stages.prfaas, stages.pd_prefill, stages.pd_decode)),
        f"{point.lambda_max:.3f}",
        f"{speedup:.2f}×",
        f"{routing.offload_fraction:.1%}",
        f"{_tokens(routing.mean_long_len)} / {_tokens(routing.mean_short_len)}",
        f"{point.egress_gbps:.1f} of {egress_limit:g}" if point.num_prfaas else "—",
        f"{cost:g}",
        f"{per_cost:.2f}×",
    ]


_ROW_LABELS = [
    "threshold t (tokens)",
    "N_prfaas / N_p / N_d",
    "Θ_prfaas / Θ_pd-p / Θ_pd-d (req/s)",
    "Λ_max (req/s)",
    "ratio",
    "offloaded p = P(L > t)",
    "E[L | L > t] / E[L | L ≤ t]",
    "PrfaaS egress (Gbps)",
    "GPU cost",
    "Λ_max per cost (ratio)",
]


def format_plan(plan: Plan, config: PlanConfig) -> str:
    """The plan as a table for humans, with the headline numbers underneath."""
    link = config.model.deployment.egress_gbps
    columns = [
        _ROW_LABELS,
        _column(plan.best, plan, plan.cost, link),
        _column(plan.homogeneous_pd, plan, plan.homogeneous_cost, 0.0),
        _column(plan.naive_heterogeneous, plan, plan.cost, link),
    ]
    headers = ["", "PrfaaS-PD", "homogeneous PD", "naive heterogeneous"]
    best, p = plan.best, plan.best.routing.offload_fraction
    rows = list(zip(*columns, strict=True))
    lines = [f"prfaas plan: {config.path}", "", table(rows, headers), ""]
    lines += [
        f"speedup: {plan.speedup_vs_homogeneous:.2f}× vs homogeneous PD, "
        f"{plan.speedup_vs_naive:.2f}× vs naive heterogeneous",
        f"         {plan.equal_cost_speedup_vs_homogeneous:.2f}× vs homogeneous PD at equal cost",
        f"Eq. 7 at the optimum: Θ_prfaas/p − Θ_pd-p/(1−p) = "
        f"{prefill_imbalance(p, best.stages):+.3f} req/s",
        f"Eq. 8 at the optimum: Θ_prfaas + Θ_pd-p − Θ_pd-d = "
        f"{producer_consumer_gap(best.stages):+.3f} req/s",
        f"searched {len(plan.grid):,} thresholds × {len(plan.grid[0])} splits; "
        f"stage time {_STAGE_TIME_TEXT[config.model.stage_time]}",
    ]
    return "\n".join(lines)


def draw_plan(plan: Plan, path: str | Path) -> None:
    """Saves Fig. 5 (a: Λ vs split, b: Λ vs t) and a Λ_max heatmap over (t, N_p) as a PNG."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'prfaas_jax[plot]'") from None
    best = plan.best
    thresholds = [row[0].routing.threshold for row in plan.grid]
    row = plan.grid[thresholds.index(best.routing.threshold)]
    column = [r[[p.num_pd_prefill for p in r].index(best.num_pd_prefill)] for r in plan.grid]
    ceiling = 2.0 * best.lambda_max  # Eq. 6 bounds of an idle stage grow without limit

    fig = Figure(figsize=(16, 4.8), layout="constrained")
    split_ax, t_ax, heat_ax = fig.subplots(1, 3, width_ratios=[1, 1.4, 1.4])

    splits = [p.num_pd_prefill for p in row]
    split_ax.plot(splits, [min(p.bounds[:2]) for p in row], "o-", color="tab:red", label="prefill")
    split_ax.plot(splits, [p.bounds[2] for p in row], "o-", color="tab:green", label="decode")
    split_ax.plot(splits, [p.lambda_max for p in row], "k--", label="Λ_max")
    split_ax.plot([best.num_pd_prefill], [best.lambda_max], "k*", markersize=14)
    split_ax.set(
        title=f"(a) split at t = {best.routing.threshold:,.0f}",
        xlabel="N_p (N_d = local − N_p)",
        ylabel="requests/s",
        ylim=(0, ceiling),
    )
    split_ax.legend()

    t_k = [t / 1000 for t in thresholds]
    t_ax.plot(t_k, [p.bounds[0] for p in column], color="tab:red", label="PrfaaS Θ_prfaas/p")
    t_ax.plot(t_k, [p.bounds[1] for p in column], color="tab:blue", label="PD-prefill Θ_pd-p/(1−p)")
    t_ax.plot(t_k, [p.bounds[2] for p in column], color="tab:green", label="PD-decode Θ_pd-d")
    t_ax.plot(t_k, [p.lambda_max for p in column], "k--", label="Λ_max")
    t_ax.plot([best.routing.threshold / 1000], [best.lambda_max], "k*", markersize=14)
    t_ax.set(
        title=f"(b) threshold at N_p/N_d = {best.num_pd_prefill}/{best.num_pd_decode}",
        xlabel="threshold t (K tokens)",
        ylabel="requests/s",
        ylim=(0, ceiling),
    )
    t_ax.legend()

    image = heat_ax.imshow(
        [[p.lambda_max for p in r] for r in plan.grid],
        aspect="auto",
        origin="lower",
        extent=(splits[0] - 0.5, splits[-1] + 0.5, t_k[0], t_k[-1]),
        cmap="viridis",
        interpolation="nearest",
    )
    heat_ax.plot([best.num_pd_prefill], [best.routing.threshold / 1000], "w*", markersize=14)
    heat_ax.set(title="(c) Λ_max (requests/s)", xlabel="N_p", ylabel="threshold t (K tokens)")
    fig.colorbar(image, ax=heat_ax)
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise UserError(f"cannot write plot {path}: {err.strerror}") from None


# --- one plan per wire precision (`prfaas plan --wire`) ---------------------------------------


def _wire_row(plan: Plan) -> dict[str, object]:
    best = plan.best
    routing = best.routing
    per_instance = (
        mib_per_s_to_gbps(routing.kv_mib / routing.prfaas_prefill_s)
        if routing.kv_mib and routing.prfaas_prefill_s
        else 0.0
    )
    return {
        "threshold_tokens": int(routing.threshold),
        "n_prfaas": best.num_prfaas,
        "n_pd_prefill": best.num_pd_prefill,
        "n_pd_decode": best.num_pd_decode,
        "offload_fraction": routing.offload_fraction,
        "kv_mib_offloaded": routing.kv_mib,
        "phi_kv_gbps": per_instance,
        "lambda_max": best.lambda_max,
        "egress_gbps": best.egress_gbps,
        "speedup_vs_homogeneous": plan.speedup_vs_homogeneous,
    }


def wire_plans_to_json(plans: list[tuple[object, PlanConfig, Plan]]) -> dict[str, object]:
    """Each precision's plan: t, the split, Φ_kv of the offloaded traffic, Λ_max and egress."""
    first = plans[0][1]
    return {
        "config": str(first.path),
        "egress_limit_gbps": first.model.deployment.egress_gbps,
        "rows": [{"wire": str(setting), **_wire_row(plan)} for setting, _, plan in plans],
    }


def format_wire_plans(plans: list[tuple[object, PlanConfig, Plan]], model: str) -> str:
    payload = wire_plans_to_json(plans)
    headers = ["wire", "t", "N_p/N_d", "offload", "E[S_kv|L>t] MiB", "Φ_kv Gbps"]
    headers += ["Λ_max req/s", "egress Gbps", "× homogeneous"]
    rows = []
    for row in payload["rows"]:
        kv = row["kv_mib_offloaded"]
        rows.append(
            [
                row["wire"],
                f"{row['threshold_tokens']:,}",
                f"{row['n_pd_prefill']}/{row['n_pd_decode']}",
                f"{row['offload_fraction']:.1%}",
                "-" if kv is None else f"{kv:,.1f}",
                f"{row['phi_kv_gbps']:.2f}",
                f"{row['lambda_max']:.3f}",
                f"{row['egress_gbps']:.1f}",
                f"{row['speedup_vs_homogeneous']:.2f}",
            ]
        )
    return "\n".join(
        [
            f"prfaas plan: {payload['config']}, S_kv of {model} on the wire in each precision, "
            f"link {payload['egress_limit_gbps']:g} Gbps",
            "",
            table(rows, headers),
            "",
            "Φ_kv: E[S_kv | L > t] / E[T_prefill | L > t] per PrfaaS instance (Eq. 2); what each "
            "precision costs the model: `prfaas wirecheck`.",
        ]
    )
