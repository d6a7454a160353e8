"""Prompts of the paper's lengths through a real cluster: 8K, 16K and 32K tokens on both routes.

Starts the toy cluster (`configs/clusters/toy.toml`: `recall-tiny`, one PrfaaS prefill instance
behind a 16 Mbit/s = 2 MB/s shaped link, one PD prefill and one PD decode node, each a process,
as `prfaas serve` starts them) with `[engine] max_len` lifted past the preset's 4096 to hold
the longest request, twice: with t = 16 every prompt here is prefilled on PrfaaS and its state
crosses the shaped link; with t = max_len every prompt stays on PD. The controller is off (t
stays put) and the decode node has 2 slots (the requests go one at a time). On each run:

- one prompt per length (random token ids), ``--new-tokens`` greedy tokens each;
- a two-turn conversation: a ``--turns`` first-turn prompt, then the conversation so far plus
  the second number of new tokens. The second turn reuses the first prompt from the prefill
  worker's prefix cache; on PrfaaS the decode worker holds the first prompt's KV blocks from the
  first state, so only an increment crosses the link.

Per request: TTFT, the prefill on its engine, the exposed transfer (prefill end → first token,
the part of the transfer the prefill did not hide), the state's bytes and, on PrfaaS, the time
those bytes need on the link at its rate (state bytes ÷ 2 MB/s: the least the transfer takes,
most of it while the prefill computes). Checked, exit status 1 otherwise: every output equals
single-process generation with the same lifted limit (`prfaas generate --max-len`), every state
shipped whole is exactly `state_nbytes(L)` bytes, and an increment is `state_nbytes(L)` less the
held positions' KV bytes. Prints a table, then the same as JSON (``--json``: the JSON only).

    python bench/long_prompts.py [--lengths 8192,16384,32768] [--turns 16384,2048]
                                 [--new-tokens 8] [--json]

On 2 CPU cores the whole run takes 2–3 minutes: two cluster starts (the workers warm their
engines at capacity max_len), the prefills, and the reference generations in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from prfaas_jax.cli.generation import GenerateRequest, generate_from_preset
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.compile_cache import default_compile_cache_dir, enable_compile_cache
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster_config import load_cluster_config, serving_model_config
from prfaas_jax.serving.loadgen.demo import send
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.state_bytes import state_nbytes

MODEL = "recall-tiny"
LINK_MBPS = 16.0  # toy.toml's [link]
# toy.toml, but for max_len, t, the controller (off) and the decode slots.
CONFIG = """
[model]
preset = "{model}"

[engine]
max_len = {max_len}
chunk_len = 128
buckets = [32, 128]
max_slots = 2

[instances]
prfaas_prefill = 1
pd_prefill = 1
pd_decode = 1

[link]
bandwidth_mbps = {link_mbps}
latency_ms = 5
burst_kib = 16

[router]
threshold = {threshold}
prfaas_max_queue = 8
cache_rule = "scarce"    # the second turn stays where its prefix is
request_timeout_s = 600

[controller]
enabled = false

[profile]
prfaas_prefill_s = [0.002, 1.0e-4]
pd_prefill_s = [0.005, 2.5e-4]
decode_step_s = 0.01

[prefix_cache]
enabled = true
capacity_mib = 64
block_size = 16
checkpoint_every = 4
"""


def ask(
    stub: pb_grpc.RouterStub, prompt: list[int], new: int
) -> tuple[list[int], pb.RequestReport]:
    """One request, streamed to its end (as `prfaas demo` sends one): its tokens and report."""
    result = send(stub, f"long-{len(prompt)}-{time.monotonic_ns()}", prompt, new)
    return result.tokens, result.report


def row(kind: str, prompt: list[int], tokens: list[int], report: pb.RequestReport) -> dict:
    shaped = report.route == "prfaas"
    return {
        "kind": kind,
        "route": report.route,
        "prompt_len": len(prompt),
        "cached_len": report.cached_len,
        "decode_cached_len": report.decode_cached_len,
        "attempts": report.attempts,
        "ttft_s": report.ttft_s,
        "prefill_s": report.prefill_s,
        "exposed_transfer_s": report.exposed_transfer_s,
        "state_bytes": report.state_bytes,
        "saved_bytes": report.saved_bytes,
        "link_s": report.state_bytes / (LINK_MBPS * 1e6 / 8) if shaped else None,
        "tokens": tokens,
        "prompt": tuple(prompt),  # for the check; not printed
    }


def run(route: str, threshold: int, args: argparse.Namespace, work: dict, root: Path) -> dict:
    """One cluster with threshold t: every prompt of `work` (kind → prompts), one at a time."""
    path = root / f"{route}.toml"
    path.write_text(
        CONFIG.format(model=MODEL, max_len=args.max_len, link_mbps=LINK_MBPS, threshold=threshold)
    )
    started = time.perf_counter()
    with ClusterProcesses(path, log_dir=root / f"logs-{route}") as cluster:
        ready = cluster.start()
        start_s = time.perf_counter() - started
        rows = []
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            assert stub.GetStats(pb.GetStatsRequest()).max_len == args.max_len
            for prompt in work["single"]:
                rows.append(row("prompt", prompt, *ask(stub, prompt, args.new_tokens)))
                log(f"{route}: {len(prompt)} tokens, TTFT {rows[-1]['ttft_s']:.2f} s")
            prompt = work["turn 1"]
            tokens, report = ask(stub, prompt, args.new_tokens)
            rows.append(row("turn 1", prompt, tokens, report))
            prompt = prompt + tokens + work["turn 2 new"]
            rows.append(row("turn 2", prompt, *ask(stub, prompt, args.new_tokens)))
            log(f"{route}: the conversation, TTFT {rows[-1]['ttft_s']:.2f} s")
    for r in rows:
        r["run"] = route
    return {"route": route, "threshold": threshold, "cluster_start_s": start_s, "rows": rows}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def check(rows: list[dict], cfg, reference: dict[tuple[int, ...], list[int]]) -> list[str]:
    """What does not hold: outputs against single-process generation, state bytes against the
    byte formula (an increment: less the held positions' KV)."""
    problems = []
    for r in rows:
        where = f"{r['run']} run, {r['kind']} ({r['prompt_len']} tokens)"
        if r["route"] != r["run"]:
            problems.append(f"{where}: routed to {r['route']}")
        if r["tokens"] != reference[r["prompt"]]:
            problems.append(f"{where}: tokens differ from single-process generation")
        whole = state_nbytes(cfg, r["prompt_len"])
        if r["attempts"] != 1:
            problems.append(f"{where}: {r['attempts']} attempts")
        if r["decode_cached_len"] == 0 and r["state_bytes"] != whole:
            problems.append(f"{where}: {r['state_bytes']} state bytes, state_nbytes {whole}")
        if r["decode_cached_len"] and r["state_bytes"] + r["saved_bytes"] != whole:
            problems.append(f"{where}: increment {r['state_bytes']} + held {r['saved_bytes']}")
    return problems


COLUMNS = [
    ("route", "route", "{}"),
    ("request", "kind", "{}"),
    ("prompt", "prompt_len", "{:,}"),
    ("reused", "cached_len", "{:,}"),
    ("KV held", "decode_cached_len", "{:,}"),
    ("state bytes", "state_bytes", "{:,}"),
    ("on the link at 2 MB/s (s)", "link_s", "{:.2f}"),
    ("prefill (s)", "prefill_s", "{:.2f}"),
    ("exposed transfer (s)", "exposed_transfer_s", "{:.3f}"),
    ("TTFT (s)", "ttft_s", "{:.2f}"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[-2],
    )
    parser.add_argument("--lengths", default="8192,16384,32768", help="prompt lengths")
    parser.add_argument("--turns", default="16384,2048", help="first prompt, second's new tokens")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    first, more = (int(n) for n in args.turns.split(","))
    if min(*lengths, first, more, args.new_tokens) < 1:
        parser.error("every length and --new-tokens must be ≥ 1")
    longest = max(*lengths, first + args.new_tokens + more)
    # The longest request and its tokens; also what `prfaas generate` needs (L + n ≤ max_len).
    args.max_len = longest + args.new_tokens
    rng = np.random.default_rng(0)
    work = {
        "single": [rng.integers(0, 256, n).tolist() for n in lengths],
        "turn 1": rng.integers(0, 256, first).tolist(),
        "turn 2 new": rng.integers(0, 256, more).tolist(),
    }
    enable_compile_cache(default_compile_cache_dir())  # what the workers compiled, reused
    with tempfile.TemporaryDirectory(prefix="prfaas-long-") as tmp:
        runs = [
            run("prfaas", 16, args, work, Path(tmp)),
            run("pd", args.max_len, args, work, Path(tmp)),
        ]
        config = load_cluster_config(Path(tmp) / "pd.toml")
    cfg = serving_model_config(config)
    rows = [r for run_ in runs for r in run_["rows"]]
    # `prfaas generate --max-len`, the cluster's limit: once per distinct prompt.
    reference: dict[tuple[int, ...], list[int]] = {}
    started = time.perf_counter()
    for prompt in dict.fromkeys(r["prompt"] for r in rows):
        request = GenerateRequest(
            model=MODEL,
            prompt_ids=list(prompt),
            max_new_tokens=args.new_tokens,
            max_len=args.max_len,
        )
        reference[prompt] = generate_from_preset(request).tokens
    log(f"single-process generation: {time.perf_counter() - started:.0f} s")
    problems = check(rows, cfg, reference)
    for r in rows:
        del r["prompt"]
    result = {
        "command": " ".join(["python", "bench/long_prompts.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": MODEL,
        "preset_max_len": load_model_config(MODEL).max_len,
        "max_len": args.max_len,
        "link_mbps": LINK_MBPS,
        "outputs_equal_single_process": not any("tokens" in p for p in problems),
        "problems": problems,
        "runs": runs,
    }
    if not args.json:
        print("| " + " | ".join(title for title, _, _ in COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        for r in rows:
            cells = ["" if r[key] is None else fmt.format(r[key]) for _, key, fmt in COLUMNS]
            print("| " + " | ".join(cells) + " |")
        for problem in problems:
            print(f"NOT AS EXPECTED: {problem}")
    print(json.dumps(result, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
