"""The simulator against the real toy cluster: one workload, measured and then simulated.

1. Starts the toy cluster (configs/clusters/toy.toml: its model, engine, link and t; the
   controller off, so t stays put and both sides route alike; no prefix cache: random prompts
   share nothing) — with ``--netns`` (root) across a kernel-shaped veth, else through the
   sender's token bucket — once per mode: chunk-wise (``[engine] layer_groups = 1``) and
   layer-wise (``= --groups``).
2. Runs ``prfaas bench``'s workload against it: Poisson arrivals at ``--rate``, ``--prompts``
   prompts of uniform length around ``--input-len``, ``--output-len`` tokens each; every
   request's report is kept.
3. Takes the simulator's inputs from that run and the config only: T_prefill(l) = c0 + c1·l
   fitted (least squares) to each route's (prompt length, prefill time on the engine); the
   decode step = the mean TPOT; the handoff (what handing any state to decode costs besides its
   bytes: the push's setup, the codec's checks, the insert) = the median exposed transfer of the
   local route, whose bytes take no time; S_kv(l) = the model's ``state_nbytes`` (exact); the
   link's bandwidth and latency as configured.
4. Replays the same requests (send times, lengths, output lengths) through the simulator, with
   ``layerwise = false`` for the chunk-wise run and ``layerwise = true, chunks = --groups`` for
   the layer-wise one.
5. Prints per mode and route the requests, mean / P50 / P90 TTFT and mean exposed transfer
   (prefill end → first token), measured and simulated, and the simulator's error; ``--json``
   prints the same as JSON.

    python bench/sim_vs_measured.py [--netns] [--rate 4] [--prompts 60] [--input-len 120]
                                    [--output-len 8] [--groups 4] [--json]

What the simulator still leaves out is what the errors show: TCP and gRPC flow control, the
chunk-wise stream's early KV rows (it ships a chunk-wise state whole after the prefill), the
router's hops, and Python threads sharing two cores with the engines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import tomllib
from pathlib import Path

import numpy as np
from sim_inputs import ROUTES, plan_and_trace, toml_text

from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.loadgen.bench import BenchOptions, BenchResult, InputDist, run_bench
from prfaas_jax.sim.config import load_sim_config
from prfaas_jax.sim.simulator import Simulator

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "configs" / "clusters" / "toy.toml"


def cluster_config(root: Path, groups: int) -> Path:
    toy = tomllib.loads(TOY.read_text())
    toy["engine"]["layer_groups"] = groups
    toy["controller"] = {"enabled": False}  # t stays put: the simulator routes alike
    toy["prefix_cache"] = {"enabled": False}
    path = root / f"toy-groups-{groups}.toml"
    path.write_text(toml_text(toy))
    return path


def measure(root: Path, groups: int, args: argparse.Namespace) -> tuple[list[BenchResult], dict]:
    config = cluster_config(root, groups)
    with ClusterProcesses(config, log_dir=root / f"logs-{groups}", netns=args.netns) as cluster:
        ready = cluster.start()
        options = BenchOptions(
            router=ready["router"],
            num_prompts=args.prompts,
            request_rate=args.rate,
            input_dist=InputDist.UNIFORM,
            input_len=args.input_len,
            range_ratio=args.range_ratio,
            output_len=args.output_len,
            seed=args.seed,
        )
        records, _ = run_bench(options)
    failed = [r.error for r in records if r.error]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return records, tomllib.loads(config.read_text())


def simulate(root: Path, records: list[BenchResult], toy: dict, groups: int, tag: str) -> dict:
    """Replay ``records`` through the simulator with profiles fitted to them (module doc)."""
    fitted = plan_and_trace(root, records, toy, tag)
    link = toy["link"]
    sim = {
        "workload": {"arrivals": "trace", "path": str(fitted["trace"])},
        "link": {
            "schedule": [[0, link["bandwidth_mbps"] / 1e3]],
            "latency_s": link.get("latency_ms", 0.0) / 1e3,
            "handoff_s": fitted["handoff_s"],
            "layerwise": groups > 1,
            "chunks": groups,
        },
        "router": {"prfaas_max_queue": toy["router"]["prfaas_max_queue"]},
        "report": {"bin_s": 1.0},
        "deployments.toy": {
            "prfaas": 1,
            "pd_prefill": 1,
            "pd_decode": 1,
            "threshold": toy["router"]["threshold"],
            "controller": False,
        },
    }
    path = root / f"sim-{tag}.toml"
    path.write_text(f'plan = "plan-{tag}.toml"\n' + toml_text(sim))
    config = load_sim_config(path)
    result = Simulator(config, config.deployments[0]).run()
    return {
        "result": result,
        "profile": fitted["profile"],
        "decode_step_s": fitted["decode_step_s"],
        "handoff_s": fitted["handoff_s"],
    }


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {
        "n": len(ms),
        "mean_ms": float(ms.mean()) if len(ms) else math.nan,
        "p50_ms": float(np.percentile(ms, 50)) if len(ms) else math.nan,
        "p90_ms": float(np.percentile(ms, 90)) if len(ms) else math.nan,
    }


def compare(records: list[BenchResult], simulated: dict) -> dict:
    result = simulated["result"]
    order = sorted(range(len(records)), key=lambda i: records[i].sent)
    rows = {}
    for route in ROUTES:
        measured = [records[i] for i in order if records[i].route == route]
        sim_ids = [k for k in range(len(order)) if bool(result.offloaded[k]) == (route == "prfaas")]
        sim_ttft = [float(result.first_token[k] - result.arrival[k]) for k in sim_ids]
        sim_exposed = [float(result.first_token[k] - result.prefill_end[k]) for k in sim_ids]
        exposed = [r.exposed_transfer for r in measured if r.exposed_transfer is not None]
        row = {
            "measured_ttft": _stats([r.ttft for r in measured]),
            "simulated_ttft": _stats(sim_ttft),
            "measured_exposed": _stats(exposed),
            "simulated_exposed": _stats(sim_exposed),
        }
        for what in ("ttft", "exposed"):
            m, s = row[f"measured_{what}"]["mean_ms"], row[f"simulated_{what}"]["mean_ms"]
            row[f"{what}_error"] = (s - m) / m if m else math.nan
        rows[route] = row
    return rows


def table(modes: dict[str, dict]) -> str:
    head = (
        "| mode | route | n (measured / sim) | TTFT mean ms: measured / sim (error) | "
        "TTFT P50 / P90 ms: measured · sim | exposed transfer mean ms: measured / sim (error) |"
    )
    lines = [head, "|" + "---|" * 6]
    for mode, data in modes.items():
        for route, row in data["routes"].items():
            mt, st = row["measured_ttft"], row["simulated_ttft"]
            me, se = row["measured_exposed"], row["simulated_exposed"]
            lines.append(
                f"| {mode} | {route} | {mt['n']} / {st['n']} | {mt['mean_ms']:.1f} / "
                f"{st['mean_ms']:.1f} ({row['ttft_error']:+.0%}) | {mt['p50_ms']:.1f} / "
                f"{mt['p90_ms']:.1f} · {st['p50_ms']:.1f} / {st['p90_ms']:.1f} | "
                f"{me['mean_ms']:.1f} / {se['mean_ms']:.1f} ({row['exposed_error']:+.0%}) |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", action="store_true", help="kernel-shaped veth (root)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    parser.add_argument("--prompts", type=int, default=60, help="requests per mode")
    parser.add_argument("--input-len", type=int, default=120, help="mean prompt length")
    parser.add_argument("--range-ratio", type=float, default=0.9, help="uniform ± this fraction")
    parser.add_argument("--output-len", type=int, default=8, help="tokens per request")
    parser.add_argument("--groups", type=int, default=4, help="layer groups of the layer-wise run")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    if args.groups < 2:
        parser.error("--groups must be ≥ 2 (1 is the chunk-wise run)")
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root")
    modes = {}
    with tempfile.TemporaryDirectory(prefix="prfaas-sim-vs-measured-") as tmp:
        root = Path(tmp)
        for tag, groups in (("chunk-wise", 1), ("layer-wise", args.groups)):
            records, toy = measure(root, groups, args)
            simulated = simulate(root, records, toy, groups, tag)
            modes[tag] = {
                "layer_groups": groups,
                "prefill_fit_s": simulated["profile"],
                "decode_step_s": simulated["decode_step_s"],
                "handoff_s": simulated["handoff_s"],
                "routes": compare(records, simulated),
            }
    report = {
        "config": str(TOY.relative_to(ROOT)),
        "link": "kernel tbf (--netns)" if args.netns else "in-process token bucket",
        "rate": args.rate,
        "prompts": args.prompts,
        "input_len": args.input_len,
        "range_ratio": args.range_ratio,
        "output_len": args.output_len,
        "modes": modes,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
    }
    if not args.json:
        print(table(modes))
        for tag, data in modes.items():
            fit = ", ".join(
                f"{route} {c0 * 1e3:.2f} ms + {c1 * 1e6:.1f} µs/token"
                for route, (c0, c1) in data["prefill_fit_s"].items()
            )
            print(
                f"{tag}: prefill fit {fit}; decode step {data['decode_step_s'] * 1e3:.2f} ms; "
                f"handoff {data['handoff_s'] * 1e3:.2f} ms"
            )
        print()
    print(json.dumps(report, indent=None if not args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
