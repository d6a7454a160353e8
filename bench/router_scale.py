"""The router's cost per request in a running cluster of worker processes, with the cache index
and with a ``Lookup`` fan-out, as the cluster grows: `prfaas bench` against fake-engine clusters.

For each ``N`` in ``--instances``: a cluster of ``N`` prefill instances (half PrfaaS, half PD
prefill) and ``--decode`` decode instances, every one a worker process of its own
(serving/cluster/launcher.py, ``engine = "fake"``: hand-computable engines, so the router's work
is what is left to see), with prefix caches on. It runs twice, once with ``[router] cache_index
= true`` (the router follows every worker's cache events) and once with ``false`` (a
``PrefixCache.Lookup`` RPC to every prefill instance per request); the router reads its config at
start, so each run gets a cluster of its own. Both runs send the same workload through
`run_bench`: ``--prompts`` prompts at ``--rate`` per second, each opening with one of
``--prefixes`` shared ``--prefix-len``-token prefixes.

Per run, from the router's own counters (``GetStats``, differences over the run): its process's
CPU time per request (all its threads: routing, the token relay, the control loop's polls), the
mean wall time of a request's cached-prefix lookup, the share of prompt tokens reused from a
cache, and with the index how many per-instance lengths it answered and asked, and its (key,
instance) entries; and the requests' P50 / P90 TTFT. Prints a table, then JSON.

    python bench/router_scale.py [--instances 4,16,32] [--prompts 300] [--rate 30] [--json]

Each worker process imports JAX: about 150 MB and a CPU-second or two to start.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.loadgen.bench import BenchOptions, InputDist, run_bench
from prfaas_jax.serving.loadgen.bench_report import summarize
from prfaas_jax.tables import table


def _config(path: Path, instances: int, decode: int, cache_index: bool) -> Path:
    prfaas = instances // 2
    path.write_text(
        '[model]\npreset = "tiny"\nengine = "fake"\n'
        "[engine]\nmax_len = 1024\nmax_slots = 64\ncompile_cache = false\n"
        "[fake]\ndecode_step_s = 0.002\nprefill_s_per_token = 2.0e-5\nchunk_len = 64\n"
        f"[instances]\nprfaas_prefill = {prfaas}\npd_prefill = {instances - prfaas}\n"
        f"pd_decode = {decode}\n"
        "[router]\nthreshold = 64\nprfaas_max_queue = 64\nmax_in_flight = 1024\n"
        f"cache_index = {str(cache_index).lower()}\n"
        "[controller]\nenabled = false\n"
        "[prefix_cache]\nenabled = true\ncapacity_mib = 16\nblock_size = 16\n"
        "checkpoint_every = 4\n"
    )
    return path


def run(instances: int, cache_index: bool, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        config = _config(Path(directory) / "cluster.toml", instances, args.decode, cache_index)
        with ClusterProcesses(config, log_dir=Path(directory) / "logs") as cluster:
            ready = cluster.start()
            opts = BenchOptions(
                ready["router"],
                num_prompts=args.prompts,
                request_rate=args.rate,
                input_dist=InputDist.FIXED,
                input_len=args.suffix_len,
                output_len=args.output_len,
                prefix_len=args.prefix_len,
                num_prefixes=args.prefixes,
                percentiles=(50.0, 90.0),
                seed=0,
            )
            records, context = run_bench(opts)
    summary = summarize(records, context, opts)
    if summary["failed"]:
        raise SystemExit(f"{instances} instances: {summary['failed']} requests failed")
    return {
        "instances": instances,
        "cache_index": cache_index,
        **summary["router"],
        "ttft_p50_ms": summary["ttft"]["p50_ms"],
        "ttft_p90_ms": summary["ttft"]["p90_ms"],
        "request_throughput": summary["request_throughput"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--instances",
        type=parse_int_list,
        default=[4, 16, 32],
        help="prefill instances of each cluster, comma-separated (default 4,16,32)",
    )
    parser.add_argument("--decode", type=int, default=2, help="decode instances (default 2)")
    parser.add_argument("--prompts", type=int, default=300, help="requests per run (default 300)")
    parser.add_argument("--rate", type=float, default=30.0, help="arrivals/s (default 30)")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared prefix (default 256)")
    parser.add_argument("--prefixes", type=int, default=8, help="shared prefixes (default 8)")
    parser.add_argument("--suffix-len", type=int, default=32, help="tokens after the prefix")
    parser.add_argument("--output-len", type=int, default=4, help="new tokens (default 4)")
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    counts = args.instances
    if not counts or min(counts) < 2 or args.decode < 1 or args.prompts < 1:
        parser.error("--instances must be ≥ 2, --decode and --prompts ≥ 1")
    rows = [run(n, index, args) for n in counts for index in (True, False)]
    if not args.json:
        header = ["prefill instances", "lookup", "router CPU ms/req", "lookup ms"]
        header += ["tokens reused", "index answered / asked", "(key, instance)", "P50 TTFT ms"]
        header += ["P90 TTFT ms"]
        body = [
            [
                r["instances"],
                "index" if r["cache_index"] else "fan-out",
                f"{r['cpu_ms_per_request']:.2f}",
                f"{r['lookup_mean_ms']:.3f}",
                f"{r['token_hit_rate']:.1%}",
                f"{r['index_answered']} / {r['index_asked']}" if r["cache_index"] else "",
                f"{r['index_entries']:,}" if r["cache_index"] else "",
                f"{r['ttft_p50_ms']:.1f}",
                f"{r['ttft_p90_ms']:.1f}",
            ]
            for r in rows
        ]
        print(table(body, header))
        print()
    print_json({"rows": rows, "options": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
