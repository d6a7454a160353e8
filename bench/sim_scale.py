"""The routing step of the discrete-event simulator as the deployment grows to hundreds of
instances: its cost per request, its cache pools' size and hit rate.

Starts from ``configs/sim/skewed-caches.toml`` (the 1T case study's profiles; requests share long
prefixes: 32 Zipf-popular groups of 16K tokens) and its ``abundant`` deployment (4 PrfaaS, 3 PD
prefill, 5 decode instances at 2.2 req/s), and multiplies the instances, the arrival rate and
both clusters' prefix-cache pools by each ``k`` in ``--scales``: the same load per instance.
Each simulated request's arrival — the prefix match in both pools (the simulator's global cache
index: one pool of block hashes per cluster), the routing rule over every instance's load and
the bookkeeping of the pick (`Simulator._arrive`) — is timed with ``perf_counter``, and the
pools' ``match`` calls within it on their own.

Per scale: instances, the arrival step's mean and p99 µs and the match's share of it, the run's
wall time per request, the share of prompt tokens reused from a cache, and the pools' block
entries at the end. Prints a table, then JSON.

    python bench/sim_scale.py [--scales 1,8,42] [--requests 4000]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.sim.config import load_sim_config, with_overrides
from prfaas_jax.sim.simulator import Simulator
from prfaas_jax.tables import table

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sim" / "skewed-caches.toml"


def run(scale: int, requests: int) -> dict:
    base = load_sim_config(CONFIG)
    config = with_overrides(base, requests=requests, rate=base.workload.rate * scale)
    cache = dataclasses.replace(
        config.cache,
        prfaas_blocks=config.cache.prfaas_blocks * scale,
        pd_blocks=config.cache.pd_blocks * scale,
    )
    config = dataclasses.replace(config, cache=cache)
    spec = next(d for d in config.deployments if d.name == "abundant")
    spec = dataclasses.replace(
        spec,
        num_prfaas=spec.num_prfaas * scale,
        num_pd_prefill=spec.num_pd_prefill * scale,
        num_pd_decode=spec.num_pd_decode * scale,
    )
    sim = Simulator(config, spec)
    arrive, times = sim._arrive, []
    prompt = reused = 0

    def timed(req) -> None:
        nonlocal prompt, reused
        start = time.perf_counter()
        arrive(req)
        times.append(time.perf_counter() - start)
        prompt += req.prompt_len
        reused += req.prompt_len - req.uncached_len

    sim._arrive = timed  # the arrivals are scheduled through the instance's attribute
    match_s = 0.0
    for cache in sim.caches.values():

        def timed_match(hash_ids, prompt_len, match=cache.match) -> int:
            nonlocal match_s
            start = time.perf_counter()
            cached = match(hash_ids, prompt_len)
            match_s += time.perf_counter() - start
            return cached

        cache.match = timed_match
    started = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - started
    instances = spec.num_prfaas + spec.num_pd_prefill + spec.num_pd_decode
    return {
        "scale": scale,
        "instances": instances,
        "rate": config.workload.rate,
        "requests": len(times),
        "arrive_us": 1e6 * statistics.fmean(times),
        "arrive_p99_us": 1e6 * float(np.quantile(times, 0.99)),
        "match_us": 1e6 * match_s / len(times),
        "wall_us_per_request": 1e6 * wall / len(times),
        "token_hit_rate": reused / prompt,
        "pool_blocks": sum(len(c) for c in sim.caches.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--scales",
        type=parse_int_list,
        default=[1, 8, 42],
        help="instance multipliers, comma-separated (default 1,8,42)",
    )
    parser.add_argument("--requests", type=int, default=4000, help="requests per run")
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    scales = args.scales
    if not scales or min(scales) < 1 or args.requests < 100:
        parser.error("--scales must be ≥ 1 and --requests ≥ 100")
    rows = [run(k, args.requests) for k in scales]
    if not args.json:
        header = ["instances", "req/s", "arrival µs", "p99 µs", "of which match µs"]
        header += ["sim µs/request"]
        header += ["tokens reused", "pool blocks"]
        body = [
            [
                r["instances"],
                f"{r['rate']:g}",
                f"{r['arrive_us']:.0f}",
                f"{r['arrive_p99_us']:.0f}",
                f"{r['match_us']:.0f}",
                f"{r['wall_us_per_request']:,.0f}",
                f"{r['token_hit_rate']:.1%}",
                f"{r['pool_blocks']:,}",
            ]
            for r in rows
        ]
        print(table(body, header))
        print()
    print_json({"rows": rows, "options": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
