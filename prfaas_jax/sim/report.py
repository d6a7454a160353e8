"""What `prfaas simulate` prints: `deployment_summary`, `run_to_json`, `format_run`.

Per deployment, at the configured workload: TTFT mean/P50/P90/P99 (arrival → first token at
the decode instance), TPOT ((finish − first token) / output length: decode-slot wait and steps),
the exposed transfer per route (prefill end → first token),
the offloaded fraction, mean link egress (bytes sent over the run's length) and its largest
`bin_s` average, queue depths, the threshold over time and its changes, role changes, prefix-cache
hit rates; plus the analytic Λ_max and, when searched, the simulated saturation throughput.

The JSON's stable keys, which scripts may rely on: per deployment `max_throughput`,
`analytic_lambda_max`, `ttft_mean`, `ttft_p50`, `ttft_p90`, `ttft_p99`, `offload_fraction`,
`egress_gbps_mean`, and at the top `simulated_requests` and `wall_seconds`. The rest are extras
(among them `narrowed_fraction` and `recall_loss_mean`, adaptive wire precision's share of the
offloaded states sent narrowed and the recall it cost them on average).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from prfaas_jax.sim.result import SimResult
from prfaas_jax.sim.run import DeploymentRun, SimulationRun
from prfaas_jax.tables import table

MAX_SERIES_POINTS = 200  # longer series are thinned to every k-th sample in the JSON


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _stats(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def ttft_s(result: SimResult) -> np.ndarray:
    ttft = result.first_token - result.arrival
    return ttft[~np.isnan(ttft)]


def exposed_transfer_s(result: SimResult, *, offloaded: bool) -> np.ndarray:
    """Prefill end → first token of the finished requests of one route: the state transfer
    (and, locally, the RDMA hop) compute did not hide — what the serving plane reports as
    `exposed_transfer_s`."""
    exposed = result.first_token - result.prefill_end
    keep = ~np.isnan(exposed) & (result.offloaded == offloaded)
    return exposed[keep]


def egress_series(result: SimResult) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin end times, Gbps sent in each bin, Gbps offered in each bin)."""
    series = result.series
    time_s = np.asarray(series["time_s"])
    if time_s.size < 2:
        return time_s[:0], time_s[:0], time_s[:0]
    dt = np.diff(time_s)
    dt[dt <= 0] = math.nan
    sent = np.diff(np.asarray(series["sent_bytes"])) * 8 / 1e9 / dt
    offered = np.diff(np.asarray(series["offered_bytes"])) * 8 / 1e9 / dt
    return time_s[1:], sent, offered


def _queue(result: SimResult, key: str) -> dict[str, float]:
    values = np.asarray(result.series[key])
    return {"mean": float(values.mean()), "max": float(values.max())} if values.size else {}


def _thin(values: list[float]) -> list[float | None]:
    step = max(1, math.ceil(len(values) / MAX_SERIES_POINTS))
    return [_finite(v) for v in values[::step]]


def _wire_summary(result: SimResult) -> dict[str, float]:
    """Adaptive wire precision over the completed offloaded requests: the share whose state
    crossed narrowed, and the recall lost on average (each narrowed request loses its option's
    recall_loss; native ones none)."""
    done = ~np.isnan(result.finish) & result.offloaded
    losses = result.recall_loss[done]
    return {
        "narrowed_fraction": float((losses > 0).mean()) if losses.size else 0.0,
        "recall_loss_mean": float(losses.mean()) if losses.size else 0.0,
    }


def deployment_summary(run: DeploymentRun, *, series: bool = True) -> dict[str, object]:
    """The per-deployment JSON object (module docstring)."""
    result, analytic, spec = run.result, run.analytic, run.spec
    ttft = ttft_s(result)
    ttft_stats = _stats(ttft)
    done = ~np.isnan(result.finish)
    tpot = (result.finish[done] - result.first_token[done]) / result.output_len[done]
    duration = result.end_s - (np.nanmin(result.arrival) if result.num_arrived else 0.0)
    egress_mean = result.sent_bytes * 8 / 1e9 / duration if duration > 0 else 0.0
    times, sent, offered = egress_series(result)
    thresholds = [t for t in result.series["threshold"] if math.isfinite(t)]
    summary: dict[str, object] = {
        "max_throughput": run.saturation.max_throughput if run.saturation else None,
        "analytic_lambda_max": analytic.lambda_max,
        "ttft_mean": ttft_stats["mean"],
        "ttft_p50": ttft_stats["p50"],
        "ttft_p90": ttft_stats["p90"],
        "ttft_p99": ttft_stats["p99"],
        "offload_fraction": float(result.offloaded[: result.num_arrived].mean()),
        **_wire_summary(result),
        "egress_gbps_mean": egress_mean,
        "instances": {
            "prfaas": spec.num_prfaas,
            "pd_prefill": spec.num_pd_prefill,
            "pd_decode": spec.num_pd_decode,
        },
        "requests": result.num_arrived,
        "completed": result.num_finished,
        "duration_s": duration,
        "tpot_s": _stats(tpot),
        "exposed_transfer_s": {
            route: _stats(exposed_transfer_s(result, offloaded=route == "prfaas"))
            for route in ("prfaas", "pd")
        },
        "egress_gbps_max_bin": float(np.nanmax(sent)) if sent.size else 0.0,
        "egress_offered_gbps_max_bin": float(np.nanmax(offered)) if offered.size else 0.0,
        "analytic": {
            "stage_throughput": {
                "prfaas": analytic.stages.prfaas,
                "pd_prefill": analytic.stages.pd_prefill,
                "pd_decode": analytic.stages.pd_decode,
            },
            "offload_fraction": analytic.routing.offload_fraction,
            "egress_gbps_at_lambda_max": analytic.egress_gbps,
        },
        "queue_depth": {
            "prfaas": _queue(result, "prfaas_queue"),
            "pd_prefill": _queue(result, "pd_prefill_queue"),
            "decode_waiting": _queue(result, "decode_waiting"),
        },
        "threshold": {
            "initial": _finite(spec.threshold),
            "final": _finite(result.series["threshold"][-1]) if thresholds else None,
            "min": min(thresholds) if thresholds else None,
            "max": max(thresholds) if thresholds else None,
            "changes": [
                {
                    "at_s": u.at,
                    "threshold": u.threshold,
                    "previous": u.previous,
                    "reason": u.reason,
                    "utilization": u.utilization,
                }
                for u in result.threshold_updates
            ],
        },
        "role_changes": [
            {
                "at_s": r.at,
                "from": r.change.from_role.value,
                "to": r.change.to_role.value,
                "applied": r.applied,
                "stage_ratio": r.change.ratio,
            }
            for r in result.role_changes
        ],
        "cache_hit_rate": dict(result.cache_hit_rate),
        "cached_tokens": int(result.cached_len[: result.num_arrived].sum()),
        "disk_cached_tokens": int(result.disk_cached_len[: result.num_arrived].sum()),
        "decode_kept_local": int(result.decode_local[: result.num_arrived].sum()),
    }
    if run.saturation is not None:
        summary["saturation"] = {
            "simulated_requests": run.saturation.simulated_requests,
            "probes": [
                {"rate": p.rate, "backlog": p.backlog, "keeps_up": p.keeps_up}
                for p in run.saturation.probes
            ],
        }
    if series:
        summary["series"] = {
            "time_s": _thin(list(times)),
            "egress_gbps": _thin(list(sent)),
            "egress_offered_gbps": _thin(list(offered)),
            **{
                key: _thin(result.series[key][1:])
                for key in (
                    "capacity_gbps",
                    "threshold",
                    "prfaas_queue",
                    "pd_prefill_queue",
                    "decode_waiting",
                    "num_pd_prefill",
                    "num_pd_decode",
                )
            },
        }
    return summary


def run_to_json(run: SimulationRun, *, series: bool = True) -> dict[str, object]:
    workload = run.config.workload
    return {
        "config": str(run.config.path),
        "workload": {
            "arrivals": workload.arrivals,
            "rate": workload.rate,
            "requests": workload.requests,
            "seed": workload.seed,
        },
        "deployments": {d.spec.name: deployment_summary(d, series=series) for d in run.deployments},
        "simulated_requests": run.simulated_requests,
        "wall_seconds": run.wall_s,
        "requests_per_second": run.simulated_requests / run.wall_s if run.wall_s > 0 else None,
    }


def _num(value: object, fmt: str = ".2f") -> str:
    return "—" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.1f}"


def format_run(run: SimulationRun) -> str:
    """The human table: one column per deployment."""
    summaries = [deployment_summary(d, series=False) for d in run.deployments]
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell: Callable[[dict], str]) -> None:
        rows.append((label, [cell(s) for s in summaries]))

    def inst(s: dict) -> str:
        i = s["instances"]
        return f"{i['prfaas'] or '—'} / {i['pd_prefill'] or '—'} / {i['pd_decode']}"

    def threshold(s: dict) -> str:
        t = s["threshold"]
        if t["initial"] is None:
            return "—"
        moved = f" → {t['final']:,.0f} ({len(t['changes'])} changes)" if t["changes"] else ""
        return f"{t['initial']:,.0f}{moved}"

    def saturation(s: dict) -> str:
        if s["max_throughput"] is None:
            return "—"
        return f"{s['max_throughput']:.3f} ({s['max_throughput'] / s['analytic_lambda_max']:.1%})"

    def queues(s: dict) -> str:
        q = s["queue_depth"]
        return " / ".join(_num(q[k].get("mean"), ".1f") for k in q)

    row("N_prfaas / N_p / N_d", inst)
    row("threshold t (tokens)", threshold)
    row("analytic Λ_max (req/s)", lambda s: f"{s['analytic_lambda_max']:.3f}")
    row("saturation (req/s, of Λ_max)", saturation)
    row("TTFT mean / P50 (s)", lambda s: f"{_num(s['ttft_mean'])} / {_num(s['ttft_p50'])}")
    row("TTFT P90 / P99 (s)", lambda s: f"{_num(s['ttft_p90'])} / {_num(s['ttft_p99'])}")
    row(
        "TPOT mean / P90 (ms)",
        lambda s: f"{_ms(s['tpot_s']['mean'])} / {_ms(s['tpot_s']['p90'])}",
    )
    row("offloaded", lambda s: f"{s['offload_fraction']:.1%}")
    row(
        "exposed transfer PrfaaS mean / P90 (ms)",
        lambda s: (
            f"{_ms(s['exposed_transfer_s']['prfaas']['mean'])} / "
            f"{_ms(s['exposed_transfer_s']['prfaas']['p90'])}"
        ),
    )
    row(
        "egress mean / max bin (Gbps)",
        lambda s: f"{s['egress_gbps_mean']:.1f} / {s['egress_gbps_max_bin']:.1f}",
    )
    row("queue PrfaaS / PD-P / decode", queues)
    if any(d.spec.adaptive_wire for d in run.deployments):
        row(
            "narrowed / recall loss (offloaded)",
            lambda s: f"{s['narrowed_fraction']:.1%} / {100 * s['recall_loss_mean']:.2f} pt",
        )
    row("role changes", lambda s: str(sum(r["applied"] for r in s["role_changes"])))
    if any(s["cache_hit_rate"] for s in summaries):
        row(
            "cache hits PrfaaS / PD",
            lambda s: " / ".join(f"{v:.0%}" for v in s["cache_hit_rate"].values()) or "—",
        )
    if any(s["disk_cached_tokens"] for s in summaries):
        row(
            "cached tokens (from disk)",
            lambda s: f"{s['cached_tokens']:,} ({s['disk_cached_tokens']:,})",
        )
    if any(s["decode_kept_local"] for s in summaries):
        row("kept off the link by a decode prefix", lambda s: f"{s['decode_kept_local']:,}")

    headers = ["", *(d.spec.name for d in run.deployments)]
    workload = run.config.workload
    rate = run.simulated_requests / run.wall_s if run.wall_s > 0 else 0.0
    lines = [
        f"prfaas simulate: {run.config.path} ({workload.arrivals}, {workload.rate:g} req/s, "
        f"{workload.requests:,} requests, seed {workload.seed})",
        "",
        table([(label, *cells) for label, cells in rows], headers),
        "",
        f"simulated {run.simulated_requests:,} requests in {run.wall_s:.1f} s "
        f"({rate:,.0f} requests/s of wall time)",
    ]
    return "\n".join(lines)
