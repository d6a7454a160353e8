"""Seeded sampling through a real cluster, with and without worker kills, against one process.

Held-out prompts of both routes (half at most t = 64 tokens: PD, half longer: PrfaaS), sampled at
temperature 0.8 and top-p 0.9 with a fixed seed each, go through a cluster of real processes and
JAX engines (`cluster_config`: layers emitted in 4 groups, prefix cache on, the link striped over 2
connections) three times: undisturbed; with the PrfaaS prefill worker SIGKILLed once a state is on
the link; with the decode worker SIGKILLed once every stream has its first token. The launcher
replaces each killed worker. Every reply must equal what `prfaas generate` makes in one process
with the same seed and knobs (engine/generate.py); the exit status is 1 otherwise.

    python bench/seeded_sampling.py [--prompts 20] [--new 64] [--model recall-tiny] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from layerwise import CONFIG as LAYERWISE_CONFIG  # this directory: the script's own

from prfaas_jax.engine.generate import generate
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.model.weights import load_model
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc


def cluster_config(model: str) -> str:
    """bench/layerwise.py's cluster with layers in 4 groups, t = 64 (both routes), the link
    striped over 2 connections and retries waiting for a replacement, prefix cache on."""
    text = LAYERWISE_CONFIG.format(model=model, groups=4, bandwidth_mbps=0.8, rtt_ms=0)
    text = re.sub(r"threshold = 16 .*", "threshold = 64\nretry_wait_s = 120", text)
    text = text.replace("[link]\n", "[link]\nstreams = 2\n")
    return text + "\n[prefix_cache]\nenabled = true\n"


KNOBS = {"temperature": 0.8, "top_p": 0.9}


def ask(stub: pb_grpc.RouterStub, prompt: list[int], n: int, seed: int, got: list) -> dict:
    """One request, its tokens appended to ``got`` as they stream; its report."""
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n, seed=seed, **KNOBS)
    report = None
    for message in stub.Generate(request, timeout=600):
        got.extend(message.token_ids)
        if message.finished:
            report = message.report
    assert report is not None
    return {"route": report.route, "attempts": report.attempts, "resumed": report.resumed_from}


def egress(cluster: ClusterProcesses, name: str) -> int:
    with grpc.insecure_channel(cluster.ready["workers"][name]["address"]) as channel:
        stats = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=5)
    return stats.egress_bytes


def run(cluster, stub, prompts, seeds, n: int, kill: str | None) -> tuple[list, list]:
    got: list[list[int]] = [[] for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(ask, stub, p, n, s, g) for p, s, g in zip(prompts, seeds, got, strict=True)
        ]
        if kill == "prfaas-0":
            before, deadline = egress(cluster, kill), time.monotonic() + 120
            while egress(cluster, kill) == before and time.monotonic() < deadline:
                time.sleep(0.01)
        elif kill == "pd-1":
            deadline = time.monotonic() + 120
            while not all(got) and time.monotonic() < deadline:
                time.sleep(0.005)
        if kill is not None:
            os.kill(cluster.worker_pid(kill), signal.SIGKILL)
        reports = [f.result(timeout=900) for f in futures]
    return got, reports


def summary(kill: str | None, got: list, expected: list, reports: list[dict]) -> dict:
    return {
        "kill": kill or "none",
        "equal": sum(g == e for g, e in zip(got, expected, strict=True)),
        "requests": len(got),
        "routes": {r: sum(x["route"] == r for x in reports) for r in ("pd", "prfaas")},
        "retried": sum(x["attempts"] > 1 for x in reports),
        "resumed": sum(x["resumed"] > 0 for x in reports),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new", type=int, default=64, help="tokens per request")
    parser.add_argument("--model", default="recall-tiny")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg, params = load_model(args.model)
    rng = np.random.default_rng(2027)  # held out: none of the tests' or the demo's prompts
    lengths = [int(rng.integers(20, 65)) if i % 2 else int(rng.integers(90, 400))
               for i in range(args.prompts)]  # fmt: skip
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in lengths]
    seeds = [int(rng.integers(0, 2**63)) for _ in prompts]
    expected = [
        generate(params, cfg, p, args.new, SamplingParams(seed=s, **KNOBS))[0]
        for p, s in zip(prompts, seeds, strict=True)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(cluster_config(args.model))
        with ClusterProcesses(path, log_dir=Path(tmp) / "logs", restart_workers=True) as cluster:
            ready = cluster.start()
            with grpc.insecure_channel(ready["router"]) as channel:
                stub = pb_grpc.RouterStub(channel)
                for kill in (None, "prfaas-0", "pd-1"):
                    restarts = cluster.restarts
                    got, reports = run(cluster, stub, prompts, seeds, args.new, kill)
                    while kill and cluster.restarts == restarts:
                        time.sleep(0.1)  # replaced before the next run
                    time.sleep(2.0 if kill else 0.0)  # the router adopts the replacement
                    rows.append(summary(kill, got, expected, reports))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(
                f"kill {row['kill']:>8}: {row['equal']}/{row['requests']} equal to one process "
                f"(routes {row['routes']}, {row['retried']} retried, {row['resumed']} resumed)"
            )
    return 0 if all(r["equal"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
