"""Agent-like multi-turn sessions through the simulator: prefill tokens saved and TTFT by cache
tier, host memory alone vs host memory + disk at the same host budget, and the requests
decode-aware routing kept off the link.

Sessions (the case study's deployment, configs/plans/case-study-1t.toml: 4 PrfaaS / 3 PD
prefill / 5 decode, t = 19.4K) start at `--session-rate` per second. Each shares a
`--system`-token preamble, opens with `--first` tokens of its own, and then, `--turns` times,
waits a think time (exponential, mean `--think-s`: a tool call, a person reading) and sends its
whole context again — every earlier prompt and reply — plus a new message of 1–4K tokens. The
sessions' contexts together far exceed the host pools (`--host-blocks` blocks of 512 tokens per
pool), so by the time a session comes back its context has been evicted from host memory.

Four runs on the same trace (one Mooncake trace written to a temporary directory):

    host             host pools only; decode workers keep what they receive in their own pool
    host+decode      and decode-aware routing (the decode pool's prefixes count as local)
    host+disk        host pools and a disk tier of `--disk-blocks` per cluster (read at
                     `--disk-gbps`)
    host+disk+decode both

Per run: prefill tokens saved (reused / prompt tokens), the share read back from disk, the
offloaded fraction, the requests a decode prefix kept off the link, TTFT mean / P90 by the tier
the request's prefix came from. Numbers are simulated (the discrete-event simulator with the
router's own policy objects), not measured on hardware.

    python bench/tiers.py [--json] [--sessions N] [--turns N] [--think-s S] [--seed N]

With ``--cluster`` the same kind of sessions, scaled down, run on a real cluster of processes
instead (bench/tiers_cluster.py, whose options follow it): measured, with the simulator's share
saved beside.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from prfaas_jax.sim.config import CacheSpec, load_sim_config
from prfaas_jax.sim.report import ttft_s
from prfaas_jax.sim.result import SimResult
from prfaas_jax.sim.simulator import Simulator
from prfaas_jax.tables import table

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "configs" / "plans" / "case-study-1t.toml"
BLOCK = 512
TIERS = ("none", "host", "disk")


def sessions_trace(args: argparse.Namespace) -> list[dict]:
    """The Mooncake records of every session's turns, in time order (module docstring)."""
    rng = np.random.default_rng(args.seed)
    system_blocks = args.system // BLOCK  # shared by every session
    records, next_id, start = [], system_blocks, 0.0
    for _ in range(args.sessions):
        start += rng.exponential(1.0 / args.session_rate)
        context, at = args.system + args.first, start
        ids = list(range(system_blocks))  # the session's block ids, grown as its context grows
        for turn in range(args.turns):
            while len(ids) * BLOCK < context:
                ids.append(next_id)
                next_id += 1
            output = int(rng.integers(256, 1024))
            records.append(
                {
                    "timestamp": at * 1000.0,
                    "input_length": context,
                    "output_length": output,
                    "hash_ids": ids[: -(-context // BLOCK)],
                }
            )
            if turn + 1 < args.turns:
                # The next prompt: everything so far, the reply, a new message of 1–4K tokens.
                context += output + int(rng.integers(1024, 4096))
                at += rng.exponential(args.think_s)
    records.sort(key=lambda r: r["timestamp"])
    return records


def sim_config(directory: Path, records: list[dict], args: argparse.Namespace):
    trace = directory / "sessions.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "tiers.toml").write_text(
        f"""plan = "{PLAN}"
[workload]
arrivals = "trace"
path = "{trace}"
[cache]
block_len = {BLOCK}
prfaas_blocks = {args.host_blocks}
pd_blocks = {args.host_blocks}
decode_blocks = {args.host_blocks}
[report]
bin_s = 60.0
[deployments.prfaas_pd]
prfaas = 4
pd_prefill = 3
pd_decode = 5
threshold = 19400
controller = false
rebalancer = false
"""
    )
    return load_sim_config(directory / "tiers.toml")


def summary(result: SimResult) -> dict[str, object]:
    n = result.num_arrived
    prompts = int((result.uncached_len[:n] + result.cached_len[:n]).sum())
    cached, disk = result.cached_len[:n], result.disk_cached_len[:n]
    tier = np.where(disk > 0, 2, np.where(cached > 0, 1, 0))
    ttft = ttft_s(result)[:n]
    by_tier = {}
    for index, name in enumerate(TIERS):
        values = ttft[(tier == index) & ~np.isnan(ttft)]
        by_tier[name] = {
            "requests": int(values.size),
            "ttft_mean_s": float(values.mean()) if values.size else None,
            "ttft_p90_s": float(np.percentile(values, 90)) if values.size else None,
        }
    return {
        "requests": n,
        "completed": result.num_finished,
        "prompt_tokens": prompts,
        "saved_tokens": int(cached.sum()),
        "saved_fraction": float(cached.sum() / prompts) if prompts else 0.0,
        "disk_tokens": int(disk.sum()),
        "offloaded_fraction": float(result.offloaded[:n].mean()) if n else 0.0,
        "decode_kept_local": int(result.decode_local[:n].sum()),
        "by_tier": by_tier,
    }


def ttft_cell(cell: dict, centre: str) -> str:
    """A table's TTFT cell: the ``centre`` statistic / P90 (requests), or — for none."""
    if not cell["requests"]:
        return "—"
    return f"{cell[centre]:.2f} / {cell['ttft_p90_s']:.2f} ({cell['requests']})"


def session_options(parser: argparse.ArgumentParser, defaults: tuple) -> None:
    """The sessions' options (module docstring), ``defaults`` in order: sessions, turns,
    session rate, think time, preamble and first message; and ``--seed``, ``--json``."""
    sessions, turns, rate, think_s, system, first = defaults
    parser.add_argument("--sessions", type=int, default=sessions)
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--session-rate", type=float, default=rate, help="sessions started / s")
    parser.add_argument("--think-s", type=float, default=think_s, help="mean think time (s)")
    parser.add_argument("--system", type=int, default=system, help="shared preamble tokens")
    parser.add_argument("--first", type=int, default=first, help="a session's first message")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON only")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--cluster" in argv:  # on real processes: bench/tiers_cluster.py takes the options
        from tiers_cluster import main as cluster_main

        return cluster_main([a for a in argv if a != "--cluster"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cluster", action="store_true", help="on a real cluster (bench/tiers_cluster.py --help)"
    )
    session_options(parser, (300, 8, 0.15, 300.0, 2048, 12288))
    parser.add_argument("--host-blocks", type=int, default=1000, help="per host pool")
    parser.add_argument("--disk-blocks", type=int, default=200_000, help="per cluster")
    parser.add_argument("--disk-gbps", type=float, default=2.0, help="disk read, GB/s")
    args = parser.parse_args(argv)

    records = sessions_trace(args)
    runs = {}
    with tempfile.TemporaryDirectory() as directory:
        base = sim_config(Path(directory), records, args)
    assert base.cache is not None
    disk = dataclasses.replace(
        base.cache,
        prfaas_disk_blocks=args.disk_blocks,
        pd_disk_blocks=args.disk_blocks,
        disk_gb_per_s=args.disk_gbps,
    )
    aware = dataclasses.replace(base.router, decode_aware=True)
    variants: dict[str, tuple[CacheSpec, object]] = {
        "host": (base.cache, base.router),
        "host+decode": (base.cache, aware),
        "host+disk": (disk, base.router),
        "host+disk+decode": (disk, aware),
    }
    for name, (cache, router) in variants.items():
        config = dataclasses.replace(base, cache=cache, router=router)
        runs[name] = summary(Simulator(config, config.deployments[0]).run())
    host_saved = runs["host"]["saved_tokens"]
    report = {
        "workload": {
            "sessions": args.sessions,
            "turns": args.turns,
            "requests": len(records),
            "think_s_mean": args.think_s,
            "host_blocks_per_pool": args.host_blocks,
            "disk_blocks_per_cluster": args.disk_blocks,
        },
        "runs": runs,
        "saved_with_disk_over_host_only": runs["host+disk"]["saved_tokens"] / host_saved
        if host_saved
        else None,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0

    rows = [
        (
            name,
            f"{run['saved_tokens']:,} ({run['saved_fraction']:.0%})",
            f"{run['disk_tokens']:,}",
            f"{run['offloaded_fraction']:.0%}",
            f"{run['decode_kept_local']:,}",
            *(ttft_cell(run["by_tier"][tier], "ttft_mean_s") for tier in TIERS),
        )
        for name, run in runs.items()
    ]
    headers = [
        "run",
        "prefill tokens saved",
        "from disk",
        "offloaded",
        "kept off link",
        *(f"TTFT {tier} mean / P90 s (n)" for tier in TIERS),
    ]
    print(
        f"{args.sessions} sessions × {args.turns} turns ({len(records)} requests), think time "
        f"mean {args.think_s:g} s, host pools {args.host_blocks} blocks of {BLOCK} tokens "
        "(simulated)\n"
    )
    print(table(rows, headers))
    ratio = report["saved_with_disk_over_host_only"]
    if ratio is not None:
        print(f"\nprefill tokens saved, host+disk over host only: {ratio:.1f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
