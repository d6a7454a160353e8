"""Striping a state over N TCP connections: transfer time against N on a shaped link with delay.

For each N in ``--streams`` it starts a fake-engine cluster (``[link] streams = N``; the states
are real codec streams of the ``tiny`` layout, the compute is a sleep) and sends ``--prompts``
prompts of ``--prompt-len`` tokens one at a time, all to PrfaaS. Each request's report gives the
exposed transfer (prefill end → first token): with a prefill this short, the state's time on the
link. With ``--netns`` (root) the link is a kernel-shaped veth (``tbf``) between two network
namespaces, else the sender's token bucket; ``--latency-ms`` is the link's one-way delay, added
in the sender (this kernel has no ``netem``). Prints a table, then the same as JSON.

    python bench/striping.py [--netns] [--streams 1,2,4] [--bandwidth-mbps 16]
                             [--latency-ms 20] [--prompts 8] [--prompt-len 2000] [--json]

Several connections pay where one TCP window cannot fill a long link (window / RTT below the
link's rate). Delay added in user space does not lengthen TCP's RTT, so on one machine striping
can show its cost (more streams to gather) but not that gain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import grpc

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CONFIG = """
[model]
preset = "tiny"
engine = "fake"

[engine]
max_len = 4096
max_slots = 4
compile_cache = false

[fake]
prefill_s_per_token = 1e-5
decode_step_s = 0.001

[instances]
prfaas_prefill = 1
pd_prefill = 1
pd_decode = 1

[link]
bandwidth_mbps = {bandwidth_mbps}
latency_ms = {latency_ms}
streams = {streams}

[router]
threshold = 16

[controller]
enabled = false

[prefix_cache]
enabled = false
"""


def run(streams: int, args: argparse.Namespace, root: Path) -> dict:
    path = root / f"streams-{streams}.toml"
    path.write_text(
        CONFIG.format(
            bandwidth_mbps=args.bandwidth_mbps, latency_ms=args.latency_ms, streams=streams
        )
    )
    cfg = load_model_config("tiny")
    exposed, ttft = [], []
    with ClusterProcesses(path, log_dir=root / f"logs-{streams}", netns=args.netns) as cluster:
        ready = cluster.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            for i in range(args.prompts + 1):  # the first warms the connections up
                prompt = [(i + 7 * j) % 250 + 1 for j in range(args.prompt_len)]
                tokens, report = [], None
                request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=2)
                for message in router.Generate(request, timeout=300):
                    tokens += message.token_ids
                    report = message.report if message.finished else report
                if report is None or tokens != fake_tokens(prompt, 2, cfg.vocab_size):
                    raise SystemExit(f"streams={streams}: request {i} went wrong: {report}")
                if i:
                    exposed.append(report.exposed_transfer_s)
                    ttft.append(report.ttft_s)
                state_bytes = report.state_bytes
    return {
        "streams": streams,
        "state_bytes": state_bytes,
        "exposed_transfer_ms_mean": statistics.fmean(exposed) * 1e3,
        "exposed_transfer_ms_min": min(exposed) * 1e3,
        "ttft_ms_mean": statistics.fmean(ttft) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", action="store_true", help="kernel-shaped veth (root)")
    parser.add_argument("--streams", default="1,2,4", help="stripe counts, comma-separated")
    parser.add_argument("--bandwidth-mbps", type=float, default=16.0, help="the link (Mbit/s)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="one-way delay (ms)")
    parser.add_argument("--prompts", type=int, default=8, help="timed requests per N")
    parser.add_argument("--prompt-len", type=int, default=2000, help="tokens per prompt")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    if not all(1 <= n <= 16 for n in counts):
        parser.error("--streams: each count must be in [1, 16]")
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root")
    with tempfile.TemporaryDirectory(prefix="prfaas-striping-") as tmp:
        rows = [run(n, args, Path(tmp)) for n in counts]
    report = {
        "link": "kernel tbf (--netns)" if args.netns else "in-process token bucket",
        "bandwidth_mbps": args.bandwidth_mbps,
        "latency_ms": args.latency_ms,
        "prompt_len": args.prompt_len,
        "prompts": args.prompts,
        "rows": rows,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
    }
    if not args.json:
        print("| streams | state bytes | exposed transfer mean / min (ms) | TTFT mean (ms) |")
        print("|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['streams']} | {r['state_bytes']:,} | {r['exposed_transfer_ms_mean']:.1f} / "
                f"{r['exposed_transfer_ms_min']:.1f} | {r['ttft_ms_mean']:.1f} |"
            )
        print()
    print(json.dumps(report, indent=None if not args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
