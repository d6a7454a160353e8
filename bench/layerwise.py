"""Layer-wise vs chunk-wise state emission on a real cluster: the transfer compute does not hide.

Runs the toy cluster twice from one config — ``[engine] layer_groups = 1`` (a prompt's last
chunk runs whole, and every state it finishes leaves after it) and ``= G`` (the last chunk runs
as G groups of layers, each group's states leaving while the next computes) — over a scarce
inter-cluster link: with ``--netns`` (root) a kernel-shaped veth between two network namespaces,
else the sender's token bucket. The same long prompts go one at a time (no queueing, so each
request's numbers are its own), all to PrfaaS; each report gives the prefill time on the engine
and the exposed transfer (prefill end → first token at the router). Printed per mode: their
means, TTFT, and the ratio of exposed transfers; the tokens must be equal in both runs and to
single-process greedy generation (exit status 1 otherwise).

    python bench/layerwise.py [--model recall-tiny] [--groups 4] [--bandwidth-mbps 2]
                              [--prompts 8] [--lengths 100,200,400] [--rtts 0]
                              [--netns] [--json]

``--rtts`` repeats both runs per round trip (``[link] rtt_ms``; under ``--netns`` in the packet
path, serving/cluster/wan.py, else a delay the sender adds to each frame).

What layer-wise emission can hide is bounded twice: by the last chunk's compute time, and by
the bytes of the layers before the last group. The toy ``recall-tiny`` (KDA, KDA, KDA, MLA)
puts its MLA layer, most of the state, last: its KV rows always leave after compute. ``tiny-swa``
(GQA, SWA, SWA, SWA) puts its big layer first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from prfaas_jax.model.weights import load_model
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.loadgen.demo import reference_tokens
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CONFIG = """
[model]
preset = "{model}"

[engine]
max_len = 512
chunk_len = 128
buckets = [32, 128]
max_slots = 8
layer_groups = {groups}

[instances]
prfaas_prefill = 1
pd_prefill = 1
pd_decode = 1

[link]
bandwidth_mbps = {bandwidth_mbps}
latency_ms = 0
rtt_ms = {rtt_ms}

[router]
threshold = 16           # every prompt here goes to PrfaaS
prfaas_max_queue = 64

[controller]
enabled = false          # t stays put
"""
NEW_TOKENS = 4


def run_mode(
    groups: int, rtt_ms: float, args: argparse.Namespace, prompts: list[list[int]], root: Path
) -> dict:
    name = f"layer-groups-{groups}-rtt{rtt_ms:g}"
    path = root / f"{name}.toml"
    path.write_text(
        CONFIG.format(
            model=args.model, groups=groups, bandwidth_mbps=args.bandwidth_mbps, rtt_ms=rtt_ms
        )
    )
    started = time.perf_counter()
    with ClusterProcesses(path, log_dir=root / f"logs-{name}", netns=args.netns) as cluster:
        ready = cluster.start()
        start_s = time.perf_counter() - started
        rows = []
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            for prompt in prompts:
                tokens, report = [], None
                request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=NEW_TOKENS)
                for message in stub.Generate(request, timeout=300):
                    tokens += message.token_ids
                    if message.finished:
                        report = message.report
                assert report is not None and report.route == "prfaas", report
                rows.append(
                    {
                        "prompt_len": len(prompt),
                        "tokens": tokens,
                        "prefill_ms": report.prefill_s * 1e3,
                        "exposed_transfer_ms": report.exposed_transfer_s * 1e3,
                        "ttft_ms": report.ttft_s * 1e3,
                        "state_bytes": report.state_bytes,
                    }
                )
    return {"layer_groups": groups, "rtt_ms": rtt_ms, "cluster_start_s": start_s, "requests": rows}


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="recall-tiny", help="preset (default recall-tiny)")
    parser.add_argument("--groups", type=int, default=4, help="layer groups of the layer-wise run")
    parser.add_argument("--bandwidth-mbps", type=float, default=2.0, help="the link (Mbit/s)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per length")
    parser.add_argument("--lengths", default="100,200,400", help="prompt lengths, comma-separated")
    parser.add_argument("--rtts", default="0", help="round trips (ms), comma-separated")
    parser.add_argument("--netns", action="store_true", help="the link in the kernel (root)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    if args.groups < 2:
        parser.error("--groups must be ≥ 2 (1 is the chunk-wise baseline)")
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
        rtts = [float(x) for x in args.rtts.split(",")]
    except ValueError as err:
        parser.error(f"a comma-separated list of numbers: {err}")
    cfg, params = load_model(args.model)
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths for _ in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory(prefix="prfaas-layerwise-") as tmp:
        modes = [
            run_mode(g, rtt, args, prompts, Path(tmp)) for rtt in rtts for g in (1, args.groups)
        ]
    expected = reference_tokens(cfg, params, prompts, NEW_TOKENS, 512)
    same = all([r["tokens"] for r in mode["requests"]] == expected for mode in modes)
    by_length = []
    for rtt, length in [(rtt, length) for rtt in rtts for length in lengths]:
        row = {"rtt_ms": rtt, "prompt_len": length}
        for mode in (m for m in modes if m["rtt_ms"] == rtt):
            rows = [r for r in mode["requests"] if r["prompt_len"] == length]
            tag = "layerwise" if mode["layer_groups"] > 1 else "chunkwise"
            for key in ("prefill_ms", "exposed_transfer_ms", "ttft_ms"):
                row[f"{tag}_{key}"] = mean(rows, key)
            row["state_bytes"] = rows[0]["state_bytes"]
        row["exposed_ratio"] = row["chunkwise_exposed_transfer_ms"] / max(
            row["layerwise_exposed_transfer_ms"], 1e-9
        )
        by_length.append(row)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "link": "kernel tbf and delay line (netns)" if args.netns else "in-process token bucket",
        "model": args.model,
        "bandwidth_mbps": args.bandwidth_mbps,
        "layer_groups": args.groups,
        "outputs_equal_greedy": same,
        "by_length": by_length,
        "modes": modes,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if same else 1
    print(
        f"link {args.bandwidth_mbps:g} Mbit/s ({result['link']}), {args.model} "
        f"({', '.join(k.value for k in cfg.layers)}), "
        f"{args.prompts} prompts per length, one at a time; means in ms"
    )
    head = ("RTT", "prompt", "state B", "prefill", "exposed", "TTFT", "prefill", "exposed", "TTFT")
    print(f"{'':>24}{'chunk-wise':^24}{'layer-wise (' + str(args.groups) + ' groups)':^24}")
    print("".join(f"{h:>8}" for h in (*head, "÷")))
    for row in by_length:
        cells = [row["prompt_len"], row["state_bytes"]]
        for tag in ("chunkwise", "layerwise"):
            cells += [row[f"{tag}_{k}"] for k in ("prefill_ms", "exposed_transfer_ms", "ttft_ms")]
        text = [f"{row['rtt_ms']:>8g}", f"{cells[0]:>8}", f"{cells[1]:>8}"]
        text += [f"{c:>8.1f}" for c in cells[2:]]
        print("".join(text) + f"{row['exposed_ratio']:>8.2f}")
    print(f"outputs equal single-process greedy generation in both runs: {'yes' if same else 'NO'}")
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
