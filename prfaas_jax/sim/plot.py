"""`draw_run(run, path)`: the simulator's figure, one PNG with three panels.

(a) TTFT CDF per deployment; (b) link egress over time per deployment (Gbps sent in each bin,
solid) against the link's capacity (dashed); (c) the routing threshold t over time for the
deployments that route by length. Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from prfaas_jax.errors import UserError
from prfaas_jax.sim.report import egress_series, ttft_s
from prfaas_jax.sim.run import SimulationRun


def draw_run(run: SimulationRun, path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install -e '.[plot]'") from None

    fig, (ax_cdf, ax_egress, ax_t) = plt.subplots(1, 3, figsize=(17, 4.8))
    for dep in run.deployments:
        ttft = np.sort(ttft_s(dep.result))
        if ttft.size:
            ax_cdf.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=dep.spec.name)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("(a) TTFT CDF")
    ax_cdf.grid(alpha=0.3)
    ax_cdf.legend()

    capacity_drawn = False
    for dep in run.deployments:
        if dep.spec.num_prfaas == 0:
            continue
        times, sent, _ = egress_series(dep.result)
        ax_egress.plot(times, sent, label=f"{dep.spec.name} egress", lw=1)
        if not capacity_drawn:
            series = dep.result.series
            ax_egress.step(
                series["time_s"],
                series["capacity_gbps"],
                where="post",
                ls="--",
                color="black",
                label="link capacity",
            )
            capacity_drawn = True
    ax_egress.set_yscale("symlog", linthresh=1.0)
    ax_egress.set_xlabel("simulated time (s)")
    ax_egress.set_ylabel("Gbps")
    ax_egress.set_title("(b) PrfaaS → PD egress per bin")
    ax_egress.grid(alpha=0.3)
    if capacity_drawn:
        ax_egress.legend(fontsize="small")

    routed = False
    for dep in run.deployments:
        series = dep.result.series
        if not any(math.isfinite(t) for t in series["threshold"]):
            continue
        ax_t.step(
            series["time_s"],
            [t / 1000 for t in series["threshold"]],
            where="post",
            label=dep.spec.name,
        )
        routed = True
    ax_t.set_xlabel("simulated time (s)")
    ax_t.set_ylabel("threshold t (K tokens)")
    ax_t.set_title("(c) routing threshold t")
    ax_t.grid(alpha=0.3)
    if routed:
        ax_t.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
