"""Times the discrete-event simulator: simulated requests per second of wall time.

Runs one deployment of a simulation config (default: PrfaaS-PD of
configs/sim/case-study-1t.toml, 4 / 3 / 5 at t = 19.4K, Poisson arrivals, the router's `route`
and `pick_decode` for every request) for --requests requests, --runs times, and reports the best
and median rates. The target is ≥ 20,000 simulated requests/s (a million-request run in
under a minute).

    python bench/simulate.py [--json] [--runs N] [--requests N] [--deployment NAME] [--config FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prfaas_jax.sim.config import load_sim_config, with_overrides
from prfaas_jax.sim.simulator import Simulator

CASE_STUDY = Path(__file__).resolve().parents[1] / "configs" / "sim" / "case-study-1t.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CASE_STUDY), help="simulation TOML")
    parser.add_argument("--deployment", default="prfaas_pd", help="deployment to run")
    parser.add_argument("--requests", type=int, default=1_000_000, help="requests per run")
    parser.add_argument("--runs", type=int, default=1, help="timed runs")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)

    config = with_overrides(load_sim_config(args.config), requests=args.requests)
    specs = {d.name: d for d in config.deployments}
    if args.deployment not in specs:
        parser.error(f"no deployment {args.deployment!r}; the config has {', '.join(specs)}")
    seconds, cpu_seconds = [], []
    for _ in range(max(args.runs, 1)):
        start, cpu_start = time.perf_counter(), time.process_time()
        result = Simulator(config, specs[args.deployment]).run()
        seconds.append(time.perf_counter() - start)
        # CPU time as well: on a shared machine wall time also counts other jobs' turns.
        cpu_seconds.append(time.process_time() - cpu_start)
    best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
    report = {
        "config": str(args.config),
        "deployment": args.deployment,
        "requests": result.num_finished,
        "simulated_seconds": result.end_s,
        "runs": len(seconds),
        "best_seconds": best,
        "median_seconds": median,
        "requests_per_second_best": result.num_finished / best,
        "requests_per_second_median": result.num_finished / median,
        "cpu_seconds_best": min(cpu_seconds),
        "requests_per_cpu_second": result.num_finished / min(cpu_seconds),
        "python": sys.version.split()[0],
    }
    if not args.json:
        print(f"{'config':<28}{report['config']} [{args.deployment}]")
        print(f"{'requests':<28}{report['requests']:,} ({result.end_s:,.0f} s simulated)")
        print(f"{'best / median wall':<28}{best:.2f} s / {median:.2f} s")
        rates = (report["requests_per_second_best"], report["requests_per_second_median"])
        print(f"{'requests/s (best, median)':<28}{rates[0]:,.0f}, {rates[1]:,.0f}")
        print(f"{'requests per CPU second':<28}{report['requests_per_cpu_second']:,.0f}")
        print()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
