"""Striping a state over N TCP connections: transfer time against N on a link with a round trip
and losses.

For each round trip in ``--rtts``, loss rate in ``--losses`` and N in ``--streams`` it starts a
fake-engine cluster (``[link] streams = N``; the states are real codec streams of the ``tiny``
layout, the compute is a sleep) and sends ``--prompts`` prompts of ``--prompt-len`` tokens one
at a time, all to PrfaaS. Each request's report gives the exposed transfer (prefill end → first
token): with a prefill this short, the state's time on the link. With ``--netns`` (root) the
link is real TCP between two network namespaces, its rate in the kernel's ``tbf`` and, where a
round trip or loss is asked for, every packet through the delay line of a third namespace
(serving/cluster/wan.py: ``[link] rtt_ms``, ``loss_percent``); without it the sender's token
bucket, whose delay TCP never sees. Prints a table with each link's bandwidth-delay product, then
the same as JSON.

    python bench/striping.py [--netns] [--streams 1,2,4,8] [--rtts 0,20,60]
                             [--losses 0,0.1] [--bandwidth-mbps 100] [--prompts 6]
                             [--prompt-len 16000] [--json]

One TCP connection fills a link only when its window covers the bandwidth-delay product and
loss lets the window grow: each push opens fresh connections, which start in slow start (ten
segments), and a loss halves the window, after which it regains one segment per round trip —
so a lossy long link caps one stream near MSS / (RTT · √p) (Mathis et al.) whatever the link's
rate, and N streams recover N times as fast.
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
max_len = {max_len}
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
latency_ms = 0
rtt_ms = {rtt_ms}
loss_percent = {loss_percent}
streams = {streams}

[router]
threshold = 16

[controller]
enabled = false

[prefix_cache]
enabled = false
"""


def run(rtt_ms: float, loss: float, streams: int, args: argparse.Namespace, root: Path) -> dict:
    name = f"rtt{rtt_ms:g}-loss{loss:g}-streams{streams}"
    path = root / f"{name}.toml"
    path.write_text(
        CONFIG.format(
            bandwidth_mbps=args.bandwidth_mbps,
            rtt_ms=rtt_ms,
            loss_percent=loss,
            streams=streams,
            max_len=args.prompt_len + 64,
        )
    )
    cfg = load_model_config("tiny")
    exposed, ttft = [], []
    with ClusterProcesses(path, log_dir=root / f"logs-{name}", netns=args.netns) as cluster:
        ready = cluster.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            for i in range(args.prompts + 1):  # the first warms the processes up
                prompt = [(i + 7 * j) % 250 + 1 for j in range(args.prompt_len)]
                tokens, report = [], None
                request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=2)
                for message in router.Generate(request, timeout=300):
                    tokens += message.token_ids
                    report = message.report if message.finished else report
                if report is None or tokens != fake_tokens(prompt, 2, cfg.vocab_size):
                    raise SystemExit(f"{name}: request {i} went wrong: {report}")
                if i:
                    exposed.append(report.exposed_transfer_s)
                    ttft.append(report.ttft_s)
                state_bytes = report.state_bytes
            stats = router.GetStats(pb.GetStatsRequest(), timeout=10)
    return {
        "rtt_ms": rtt_ms,
        "loss_percent": loss,
        "streams": streams,
        "state_bytes": state_bytes,
        "exposed_transfer_ms_mean": statistics.fmean(exposed) * 1e3,
        "exposed_transfer_ms_min": min(exposed) * 1e3,
        "ttft_ms_mean": statistics.fmean(ttft) * 1e3,
        "measured_rtt_ms": stats.link_rtt_s * 1e3,
        "retransmitted_segments": stats.link_data_retransmitted_segments,
    }


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", action="store_true", help="the link in the kernel (root)")
    parser.add_argument("--streams", default="1,2,4,8", help="stripe counts, comma-separated")
    parser.add_argument("--rtts", default="0,20,60", help="round trips (ms), comma-separated")
    parser.add_argument("--losses", default="0,0.1", help="loss rates (%%), comma-separated")
    parser.add_argument("--bandwidth-mbps", type=float, default=100.0, help="the link (Mbit/s)")
    parser.add_argument("--prompts", type=int, default=6, help="timed requests per point")
    parser.add_argument("--prompt-len", type=int, default=16000, help="tokens per prompt")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    try:
        counts = [int(n) for n in args.streams.split(",")]
        rtts, losses = _floats(args.rtts), _floats(args.losses)
    except ValueError as err:
        parser.error(f"a comma-separated list of numbers: {err}")
    if not all(1 <= n <= 16 for n in counts):
        parser.error("--streams: each count must be in [1, 16]")
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root")
    rows = []
    with tempfile.TemporaryDirectory(prefix="prfaas-striping-") as tmp:
        for rtt in rtts:
            for loss in losses:
                for n in counts:
                    rows.append(run(rtt, loss, n, args, Path(tmp)))
                    if not args.json:
                        print(
                            f"  rtt {rtt:g} ms, loss {loss:g} %, {n} streams: done", file=sys.stderr
                        )
    rate = args.bandwidth_mbps * 1e6 / 8
    report = {
        "link": "kernel tbf + delay line (--netns)" if args.netns else "in-process token bucket",
        "bandwidth_mbps": args.bandwidth_mbps,
        "bdp_bytes": {f"{rtt:g}": rate * rtt / 1e3 for rtt in rtts},
        "prompt_len": args.prompt_len,
        "prompts": args.prompts,
        "rows": rows,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
    }
    if not args.json:
        print(
            "| RTT (ms) | BDP (KiB) | loss (%) | streams | state (MiB) | exposed transfer "
            "mean / min (ms) | vs 1 stream | TCP RTT (ms) | retransmitted |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            one = next(
                x for x in rows
                if (x["rtt_ms"], x["loss_percent"]) == (r["rtt_ms"], r["loss_percent"])
            )  # fmt: skip
            print(
                f"| {r['rtt_ms']:g} | {rate * r['rtt_ms'] / 1e3 / 1024:.0f} | "
                f"{r['loss_percent']:g} | {r['streams']} | {r['state_bytes'] / 2**20:.2f} | "
                f"{r['exposed_transfer_ms_mean']:.0f} / {r['exposed_transfer_ms_min']:.0f} | "
                f"{one['exposed_transfer_ms_mean'] / r['exposed_transfer_ms_mean']:.2f}× | "
                f"{r['measured_rtt_ms']:.1f} | {r['retransmitted_segments']} |"
            )
        print()
    print(json.dumps(report, indent=None if not args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
