"""bench/tiers.py's agent-like multi-turn sessions on a real cluster of processes: prefill tokens
computed and saved, hits and TTFT by the tier each request's prefix came from, and the requests
decode-aware routing kept off the link, per configuration; the simulator's share saved beside.

    python bench/tiers.py --cluster [--sessions 20] [--turns 6] [--think-s 10] [--json]

One fake-engine toy cluster per configuration (1 PrfaaS prefill, 1 PD prefill, 1 PD decode;
the states real codec streams of the ``tiny`` layout, the compute a sleep of
``--prefill-s-per-token`` per token computed), with everything else real: each worker's prefix
pool (`[prefix_cache] capacity_mib`, ``--host-mib`` — the host budget, the same in every
configuration), the disk tier (``disk_dir``, ``disk_capacity_mib``), the router, its cache index
and its routing rule (t = ``--threshold``, the bandwidth-scarce rule, controller off), and
`[router] decode_aware`:

    host              host memory only
    host+decode       and decode-aware routing
    host+disk         host memory and the disk tier
    host+disk+decode  both

Sessions start at ``--session-rate`` per second; each sends a ``--system``-token preamble all
share and a ``--first``-token message, then ``--turns`` − 1 times waits a think time
(exponential, mean ``--think-s``: compressed, but longer than the host budget holds a context
while the other sessions run) and sends its whole context again — every earlier prompt, the
reply, and a new message of 64–255 tokens. Replies are 8–23 tokens. The sessions' plans (lengths,
messages, think times) are drawn from ``--seed`` alone, so every configuration sends the same
ones; the replies are the fake engines' and every one is checked against the exact answer.

What is read from the reports (`RequestReport.cached_len`, `cache_tier`, `ttft_s`, `route`) and
the router's `RouterStats.decode_cache_local`: prefill tokens computed and saved, hits by tier
(host memory, disk, a decode worker's pool; a prefix fetched from another prefill instance
counts as `peer`), TTFT P50 / P90 by tier (the router's: receipt → first token), the share
offloaded to PrfaaS, requests kept off the link. The simulator's column replays each run's
requests as sent (their send times, lengths and prefixes) through the discrete-event simulator
with the same pools in blocks, prefill time = ``--prefill-s-per-token`` × tokens computed.

The prefix pools checkpoint a prompt's state at its end only (the fake engine prefills in one
chunk): a turn reuses its session's previous prompt, never the preamble alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from sim_inputs import toml_text
from tiers import session_options, ttft_cell
from tiers import summary as sim_summary

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.prefix_events import block_hashes
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.sim.config import load_sim_config
from prfaas_jax.sim.simulator import Simulator
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.tables import table

CFG = load_model_config("tiny")
BLOCK = 16  # tokens per KV block, in the pools and the simulator's trace
CONFIGS = {  # name → (disk tier, decode-aware)
    "host": (False, False),
    "host+decode": (False, True),
    "host+disk": (True, False),
    "host+disk+decode": (True, True),
}
TIERS = {
    pb.CACHE_TIER_NONE: "none",
    pb.CACHE_TIER_HOST: "host",
    pb.CACHE_TIER_DISK: "disk",
    pb.CACHE_TIER_DECODE: "decode",
    pb.CACHE_TIER_PEER: "peer",
}


@dataclasses.dataclass(frozen=True)
class SessionPlan:
    start_s: float
    first: list[int]  # the preamble and the first message
    messages: list[list[int]]  # the new message of each later turn
    replies: list[int]  # each turn's reply length
    think_s: list[float]  # before each later turn


def session_plans(args: argparse.Namespace) -> list[SessionPlan]:
    """Every session's plan, from ``args.seed`` alone (module docstring)."""
    rng = np.random.default_rng(args.seed)
    vocab = CFG.vocab_size

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, n)]

    system, plans, start = tokens(args.system), [], 0.0
    for _ in range(args.sessions):
        start += float(rng.exponential(1.0 / args.session_rate))
        later = args.turns - 1
        plans.append(
            SessionPlan(
                start,
                system + tokens(args.first),
                [tokens(int(rng.integers(64, 256))) for _ in range(later)],
                [int(rng.integers(8, 24)) for _ in range(args.turns)],
                [float(rng.exponential(args.think_s)) for _ in range(later)],
            )
        )
    return plans


def cluster_config(root: Path, name: str, args: argparse.Namespace) -> Path:
    disk, decode_aware = CONFIGS[name]
    longest = args.system + args.first + (args.turns - 1) * (255 + 23) + 24
    prefix_cache = {
        "enabled": True,
        "capacity_mib": args.host_mib,
        "block_size": BLOCK,
        "checkpoint_every": 4,
    }
    if disk:
        prefix_cache |= {"disk_dir": str(root / "disk"), "disk_capacity_mib": args.disk_mib}
    sections = {
        "model": {"preset": "tiny", "engine": "fake"},
        "engine": {"max_len": longest, "max_slots": 64, "compile_cache": False},
        "fake": {"prefill_s_per_token": args.prefill_s_per_token, "decode_step_s": 0.005},
        "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1},
        "link": {"bandwidth_mbps": args.link_mbps, "latency_ms": 5.0},
        "router": {
            "threshold": float(args.threshold),
            "prfaas_max_queue": 64,
            "cache_rule": "scarce",
            "decode_aware": decode_aware,
        },
        "controller": {"enabled": False},
        "prefix_cache": prefix_cache,
    }
    path = root / "cluster.toml"
    path.write_text(toml_text(sections))
    return path


@dataclasses.dataclass
class Turn:
    session: int
    turn: int
    sent_s: float  # since the run's start
    prompt: list[int]
    reply: int  # tokens asked
    report: pb.RequestReport | None = None
    error: str = ""


def run_session(stub, index: int, plan: SessionPlan, start: float, out: list[Turn]) -> None:
    """One session's turns, each sent once the previous reply is in and its think time over."""
    context = list(plan.first)
    time.sleep(max(start + plan.start_s - time.perf_counter(), 0.0))
    for turn, reply_len in enumerate(plan.replies):
        record = Turn(index, turn, time.perf_counter() - start, list(context), reply_len)
        out.append(record)
        request = pb.GenerateRequest(prompt_token_ids=context, max_new_tokens=reply_len)
        reply: list[int] = []
        try:
            for message in stub.Generate(request, timeout=300):
                reply.extend(message.token_ids)
                if message.finished:
                    record.report = message.report
        except grpc.RpcError as err:
            record.error = f"{err.code().name}: {err.details()}"
            return
        if reply != fake_tokens(context, reply_len, CFG.vocab_size):
            record.error = "the reply is not the fake engine's exact answer"
            return
        if turn + 1 < len(plan.replies):
            time.sleep(plan.think_s[turn])
            context += reply + plan.messages[turn]


def measure(root: Path, name: str, plans: list[SessionPlan], args) -> tuple[list[Turn], dict]:
    """Every session through a fresh cluster of configuration ``name``."""
    config = cluster_config(root, name, args)
    turns: list[Turn] = []
    with ClusterProcesses(config, log_dir=root / "logs") as cluster:
        ready = cluster.start()
        channel = grpc.insecure_channel(ready["router"])
        stub = pb_grpc.RouterStub(channel)
        start = time.perf_counter()
        threads = [
            threading.Thread(target=run_session, args=(stub, i, plan, start, turns))
            for i, plan in enumerate(plans)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - start
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=30)
        channel.close()
    failed = [t.error for t in turns if t.error]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} turns failed, e.g. {failed[0]}")
    return turns, {"wall_s": wall_s, "decode_cache_local": stats.decode_cache_local}


def summary(turns: list[Turn], context: dict) -> dict:
    reports = [t.report for t in turns if t.report is not None]
    prompt = sum(r.prompt_len for r in reports)
    saved = sum(r.cached_len for r in reports)
    by_tier = {}
    for code, tier in TIERS.items():
        mine = [r for r in reports if r.cache_tier == code]
        ttft = [r.ttft_s for r in mine]
        by_tier[tier] = {
            "requests": len(mine),
            "saved_tokens": sum(r.cached_len for r in mine),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
        }
    return {
        "requests": len(reports),
        "prompt_tokens": prompt,
        "computed_tokens": prompt - saved,
        "saved_tokens": saved,
        "saved_fraction": saved / prompt if prompt else 0.0,
        "offloaded_fraction": sum(r.route == "prfaas" for r in reports) / len(reports),
        "decode_kept_local": context["decode_cache_local"],
        "wall_s": context["wall_s"],
        "by_tier": by_tier,
    }


def sim_trace(root: Path, name: str, turns: list[Turn]) -> Path:
    """The run's requests as sent, a Mooncake trace (each block hash an integer id)."""
    ids: dict[bytes, int] = {}
    lines = []
    for t in sorted(turns, key=lambda t: t.sent_s):
        hashes = [ids.setdefault(h, len(ids)) for h in block_hashes(t.prompt, BLOCK)]
        record = {"input_length": len(t.prompt), "output_length": t.reply, "hash_ids": hashes}
        lines.append(json.dumps({"timestamp": t.sent_s * 1e3, **record}) + "\n")
    path = root / f"sim-{name}.jsonl"
    path.write_text("".join(lines))
    (root / f"lengths-{name}.txt").write_text("".join(f"{len(t.prompt)}\n" for t in turns))
    return path


def simulate(root: Path, name: str, turns: list[Turn], args: argparse.Namespace) -> float:
    """The share of prompt tokens the simulator saves on this run's requests as sent: the
    fake engines' prefill time, the same budgets in blocks of KV (its pools hold blocks only)."""
    disk, decode_aware = CONFIGS[name]
    trace = sim_trace(root, name, turns)
    longest = max(len(t.prompt) for t in turns) + 24
    prefill = {"kind": "polynomial", "coeffs": [0.0, args.prefill_s_per_token]}
    plan = {
        "workload": {"output_len": 16.0},
        "workload.input_len": {"distribution": "trace", "path": str(root / f"lengths-{name}.txt")},
        "prfaas": {"instances": 1, "gpus_per_instance": 1, "egress_gbps": args.link_mbps / 1e3},
        "prfaas.prefill_time_s": prefill,
        "local": {"instances": 2, "gpus_per_instance": 1, "decode_max_batch_size": 64},
        "local.prefill_time_s": prefill,
        "kv_size_mib": {
            "kind": "table",
            "lengths": [1, longest],
            "values": [state_nbytes(CFG, n) / 2**20 for n in (1, longest)],
        },
    }
    plan["local"]["decode_step_s"] = 0.005
    (root / f"plan-{name}.toml").write_text(toml_text(plan))
    block_bytes = state_nbytes(CFG, BLOCK) - state_nbytes(CFG, 0)
    host = int(args.host_mib * 2**20 // block_bytes)
    cache = {"block_len": BLOCK, "prfaas_blocks": host, "pd_blocks": host, "decode_blocks": host}
    if disk:
        on_disk = int(args.disk_mib * 2**20 // block_bytes)
        cache |= {"prfaas_disk_blocks": on_disk, "pd_disk_blocks": on_disk}
    deployment = {"prfaas": 1, "pd_prefill": 1, "pd_decode": 1, "threshold": args.threshold}
    sim = {
        "workload": {"arrivals": "trace", "path": str(trace)},
        "cache": cache,
        "router": {"prfaas_max_queue": 64, "decode_aware": decode_aware},
        "deployments.toy": deployment | {"controller": False, "rebalancer": False},
    }
    path = root / f"sim-{name}.toml"
    path.write_text(f'plan = "plan-{name}.toml"\n' + toml_text(sim))
    config = load_sim_config(path)
    return sim_summary(Simulator(config, config.deployments[0]).run())["saved_fraction"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    session_options(parser, (20, 6, 0.5, 10.0, 128, 512))
    parser.add_argument("--threshold", type=int, default=768, help="t (tokens)")
    parser.add_argument("--host-mib", type=float, default=0.5, help="host budget per worker")
    parser.add_argument("--disk-mib", type=float, default=256.0, help="disk tier per worker")
    parser.add_argument("--prefill-s-per-token", type=float, default=4e-4)
    parser.add_argument("--link-mbps", type=float, default=64.0)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of these")
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    if not set(names) <= set(CONFIGS):
        parser.error(f"--configs: each of {', '.join(CONFIGS)}")
    plans = session_plans(args)
    runs = {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"prfaas-tiers-{name}-") as tmp:
            turns, context = measure(Path(tmp), name, plans, args)
            runs[name] = summary(turns, context)
            runs[name]["simulated_saved_fraction"] = simulate(Path(tmp), name, turns, args)
        if not args.json:
            print(f"{name}: {runs[name]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    host = runs.get("host", {}).get("saved_tokens")
    report = {
        "command": " ".join(["python bench/tiers.py --cluster", *(argv or [])]),
        "workload": {k: v for k, v in vars(args).items() if k not in ("json", "configs")},
        "runs": runs,
        "saved_over_host_only": {
            name: run["saved_tokens"] / host for name, run in runs.items() if host
        },
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(format_report(report, args))
    return 0


def format_report(report: dict, args: argparse.Namespace) -> str:
    runs = report["runs"].values()
    shown = [t for t in TIERS.values() if any(r["by_tier"][t]["requests"] for r in runs)]
    rows = [
        (
            name,
            f"{run['computed_tokens']:,}",
            f"{run['saved_tokens']:,} ({run['saved_fraction']:.0%})",
            f"{run['simulated_saved_fraction']:.0%}",
            " / ".join(f"{run['by_tier'][t]['requests']}" for t in ("host", "disk", "decode")),
            f"{run['offloaded_fraction']:.0%}",
            f"{run['decode_kept_local']:,}",
            *(ttft_cell(run["by_tier"][tier], "ttft_p50_s") for tier in shown),
        )
        for name, run in report["runs"].items()
    ]
    headers = [
        "run",
        "prefill tokens computed",
        "saved",
        "saved, simulated",
        "hits host / disk / decode",
        "offloaded",
        "kept off link",
        *(f"TTFT {tier} P50 / P90 s (n)" for tier in shown),
    ]
    lines = [
        f"{args.sessions} sessions × {args.turns} turns, think time mean {args.think_s:g} s, "
        f"host budget {args.host_mib:g} MiB per worker (a real cluster of fake engines)\n",
        table(rows, headers),
    ]
    for name, ratio in report["saved_over_host_only"].items():
        if name != "host":
            lines.append(f"prefill tokens saved, {name} over host only: {ratio:.1f}×")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
