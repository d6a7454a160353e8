"""`prfaas experiment`'s table and figure: `format_experiment` (Table 6 and Fig. 6 of the paper
in toy form: per deployment the planner's, the simulator's and the cluster's Λ_max, TTFT at the
common rate, the link's egress, the speed-ups over homogeneous PD, and the gaps) and
`draw_experiment` (Λ_max by source; measured throughput against concurrency).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from prfaas_jax.errors import UserError
from prfaas_jax.serving.loadgen.experiment import DEPLOYMENTS, Experiment
from prfaas_jax.serving.loadgen.experiment_cluster import LABELS
from prfaas_jax.tables import table

GAP = 0.15  # a source more than this far from another is a gap the docs must explain


def _num(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "—"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if math.isfinite(a) and math.isfinite(b) and b > 0 else "—"


def _gap(value: float, reference: float) -> str:
    if not (math.isfinite(value) and math.isfinite(reference) and reference > 0):
        return "—"
    gap = value / reference - 1
    return f"{100 * gap:+.0f} %" + (" !" if abs(gap) > GAP else "")


def _egress(mbps: float, bandwidth: float) -> str:
    return f"{_num(mbps, 1)} ({_num(100 * mbps / bandwidth, 0)} %)"


def _node(name: str, node) -> str:
    return f"{name} ({node.cpu_quota:g} core on cpu {node.cpus})"


def format_experiment(e: Experiment) -> str:
    plans, sims, meas = e.plans, e.simulated, e.measured
    cluster = e.config.cluster
    bandwidth = cluster.link.bandwidth_mbps
    prfaas_class, pd_class = e.config.classes
    classes = dict(cluster.node_classes)

    def row(label: str, cell) -> list[str]:
        return [label, *(cell(name) for name in DEPLOYMENTS)]

    home = "homogeneous_pd"
    rows = [
        row("threshold t (tokens)", lambda n: str(plans[n].threshold) if n == "prfaas_pd" else "—"),
        row("N_prfaas / N_p / N_d", lambda n: plans[n].split),
        row("Λ_max planner (req/s)", lambda n: _num(plans[n].lambda_max)),
        row("Λ_max simulator (req/s)", lambda n: _num(sims[n].lambda_max)),
        row("Λ_max measured (req/s)", lambda n: _num(meas[n].lambda_max)),
        row("  measured vs planner", lambda n: _gap(meas[n].lambda_max, plans[n].lambda_max)),
        row("  measured vs simulator", lambda n: _gap(meas[n].lambda_max, sims[n].lambda_max)),
        row(
            "speed-up planner / sim / measured",
            lambda n: " / ".join(
                _ratio(src[n].lambda_max, src[home].lambda_max) for src in (plans, sims, meas)
            ),
        ),
        row(
            f"TTFT mean sim / measured (s) @ {e.common_rate:.2f}",
            lambda n: f"{_num(sims[n].ttft_mean_s)} / {_num(meas[n].ttft_mean_s)}",
        ),
        row(
            "TTFT P90 sim / measured (s)",
            lambda n: f"{_num(sims[n].ttft_p90_s)} / {_num(meas[n].ttft_p90_s)}",
        ),
        row(
            "offloaded planner / measured",
            lambda n: (
                f"{100 * plans[n].offload_fraction:.0f} % / "
                + (
                    f"{100 * meas[n].routed_prfaas:.0f} %"
                    if math.isfinite(meas[n].routed_prfaas)
                    else "—"
                )
            ),
        ),
        row(
            f"egress measured (Mbit/s of {bandwidth:g})",
            lambda n: _egress(meas[n].egress_mbps, bandwidth) if plans[n].prfaas else "—",
        ),
        row(
            "outputs checked / wrong / lost",
            lambda n: f"{meas[n].checked} / {meas[n].mismatched} / {meas[n].lost}",
        ),
    ]
    rows.append(
        row(
            f"TPOT at saturation (ms; profile {1e3 * e.decode_step_s:.0f})",
            lambda n: ", ".join(f"{1e3 * r.tpot_s:.0f}" for r in meas[n].levels),
        )
    )
    rows.append(
        row(
            "prefill on engine / profile (top level)",
            lambda n: (
                ", ".join(
                    f"{route} {ratio:.2f}×"
                    for route, ratio in (
                        meas[n].levels[-1].prefill_vs_profile if meas[n].levels else {}
                    ).items()
                )
                or "—"
            ),
        )
    )
    levels = row(
        "throughput by concurrency",
        lambda n: ", ".join(f"{r.concurrency}: {_num(r.throughput)}" for r in meas[n].levels),
    )
    rows.append(levels)
    head = (
        f"prfaas experiment: {e.config.path}{' (--quick)' if e.config.quick else ''}\n"
        f"{len(e.prompt_lengths)} prompts (mean {statistics.fmean(e.prompt_lengths):.0f} tokens), "
        f"{e.config.workload.output_len} new tokens each; node classes: PrfaaS "
        f"{_node(prfaas_class, classes[prfaas_class])}, PD {_node(pd_class, classes[pd_class])}; "
        f"link {bandwidth:g} Mbit/s\n"
    )
    body = table(rows, headers=["", *(LABELS[n] for n in DEPLOYMENTS)])
    verdict = (
        f"\noutputs equal single-process greedy generation: "
        f"{'yes' if e.outputs_ok else 'NO'}; gaps over {100 * GAP:.0f} % are marked !; "
        f"{e.wall_s / 60:.1f} min"
    )
    return head + "\n" + body + verdict


def draw_experiment(e: Experiment, path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install -e '.[plot]'") from None

    fig, (ax_bar, ax_level) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.26
    sources = (
        ("planner", e.plans, "#9aa7b8"),
        ("simulator", e.simulated, "#5b8bd0"),
        ("cluster", e.measured, "#d0703c"),
    )
    for k, (label, source, color) in enumerate(sources):
        values = [source[n].lambda_max for n in DEPLOYMENTS]
        xs = [i + (k - 1) * width for i in range(len(DEPLOYMENTS))]
        ax_bar.bar(
            xs, [v if math.isfinite(v) else 0 for v in values], width, label=label, color=color
        )
    ax_bar.set_xticks(range(len(DEPLOYMENTS)), [LABELS[n] for n in DEPLOYMENTS])
    ax_bar.set_ylabel("Λ_max (requests/s)")
    ax_bar.set_title("(a) saturation throughput: predicted, simulated, measured")
    ax_bar.grid(axis="y", alpha=0.3)
    ax_bar.legend()
    for name in DEPLOYMENTS:
        levels = e.measured[name].levels
        ax_level.plot(
            [r.concurrency for r in levels],
            [r.throughput for r in levels],
            marker="o",
            label=LABELS[name],
        )
        ax_level.axhline(
            e.plans[name].lambda_max, ls="--", lw=0.8, color=ax_level.lines[-1].get_color()
        )
    levels = sorted({r.concurrency for m in e.measured.values() for r in m.levels})
    ax_level.set_xscale("log", base=2)
    ax_level.set_xticks(levels, [str(level) for level in levels])
    ax_level.minorticks_off()
    ax_level.set_xlabel("requests in flight (closed loop)")
    ax_level.set_ylabel("completions/s")
    ax_level.set_title("(b) measured throughput by concurrency (dashed: planner)")
    ax_level.grid(alpha=0.3)
    ax_level.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
