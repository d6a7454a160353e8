"""Every deployment of a simulation config, simulated: `simulate(config) -> SimulationRun`.

For each deployment: one run at the configured workload (`SimResult`: TTFT, TPOT, offload,
egress, queues, t, role changes), the analytic operating point of Eqs. 3–6 for the same
deployment, and — when the config has a `[saturation]` section — the saturation search
(`sim/saturation.py`). Progress lines go to the `progress` callback (the command prints them on
stderr).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prfaas_jax.policy.throughput_model import OperatingPoint
from prfaas_jax.sim.config import DeploymentSpec, SimConfig
from prfaas_jax.sim.result import SimResult
from prfaas_jax.sim.saturation import (
    Probe,
    Saturation,
    analytic_point,
    saturation_search,
)
from prfaas_jax.sim.simulator import Simulator


@dataclass(frozen=True)
class DeploymentRun:
    spec: DeploymentSpec
    result: SimResult
    analytic: OperatingPoint
    saturation: Saturation | None
    wall_s: float


@dataclass(frozen=True)
class SimulationRun:
    config: SimConfig
    deployments: tuple[DeploymentRun, ...]
    wall_s: float

    @property
    def simulated_requests(self) -> int:
        return sum(
            d.result.num_arrived + (d.saturation.simulated_requests if d.saturation else 0)
            for d in self.deployments
        )


def simulate(
    config: SimConfig,
    *,
    saturation: bool = True,
    progress: Callable[[str], None] | None = None,
) -> SimulationRun:
    """Runs every deployment of `config`; `saturation=False` skips the capacity searches."""

    def say(message: str) -> None:
        if progress is not None:
            progress(message)

    started = time.perf_counter()
    runs = []
    workload = config.workload
    for spec in config.deployments:
        t0 = time.perf_counter()
        say(f"{spec.name}: {workload.requests:,} requests at {workload.rate:g} req/s")

        def arrived(count: int, name: str = spec.name, total: int = workload.requests) -> None:
            say(f"{name}:   {count:,} / {total:,} arrived")

        result = Simulator(config, spec, progress=arrived).run()
        analytic = analytic_point(config, spec)
        found = None
        if saturation and config.saturation is not None:
            say(f"{spec.name}: saturation search around Λ_max = {analytic.lambda_max:.3f} req/s")

            def probed(probe: Probe, name: str = spec.name) -> None:
                verdict = "keeps up" if probe.keeps_up else "falls behind"
                say(f"{name}:   {probe.rate:.3f} req/s → backlog {probe.backlog:,}, {verdict}")

            found = saturation_search(
                config, spec, config.saturation, guess=analytic.lambda_max, on_probe=probed
            )
        runs.append(DeploymentRun(spec, result, analytic, found, time.perf_counter() - t0))
    return SimulationRun(config, tuple(runs), time.perf_counter() - started)
