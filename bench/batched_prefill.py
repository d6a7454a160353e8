"""Batched prefill against batch-1 prefill on one engine: prompt tokens/s for many short prompts.

``--prompts`` prompts of lengths drawn uniformly from ``[--min-len, --max-len]`` (``--seed``)
are prefilled three times by one ``PrefillEngine`` (default buckets, ``--chunk-len``) in this
process:

    batch-1          ``prefill`` on each prompt in turn (a prefill worker's single request)
    batched, 1 share ``prefill_batch(threads=1)``: every call one after another,
                     ``--max-batch-tokens`` padded tokens per call (rows grouped by shape:
                     engine/batched_prefill.py)
    batched          ``prefill_batch`` as a worker runs it: the prompts in ``--threads`` shares
                     (default: the cores this process may use), each share's calls in a thread

Each side runs once untimed (every compile happens there), then ``--repeats`` timed runs; the
best is reported, with the CPU seconds that run took in all threads. A run's time is the wall
time until every result state is ready: uploads, the compiled calls, the first-token samples and
each row's batch-1 state. Every side must give every prompt the same first token (greedy).
Prints a table, or with ``--json`` the same numbers.

    python bench/batched_prefill.py [--model tiny] [--prompts 32] [--min-len 64]
                                    [--max-len 512] [--chunk-len 512]
                                    [--max-batch-tokens 4096] [--threads N] [--repeats 3]
                                    [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import jax
import numpy as np

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.batched_prefill import batch_threads
from prfaas_jax.engine.prefill import PrefillEngine, PrefillResult
from prfaas_jax.model.seeded_weights import seeded_params
from prfaas_jax.tables import table


def best_of(run: Callable[[], list[PrefillResult]], repeats: int) -> tuple[float, float, list[int]]:
    """The fastest of ``repeats`` timed runs (after one untimed): its wall and CPU seconds, and
    the first tokens."""
    results = run()
    times = []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        results = run()
        jax.block_until_ready([r.state for r in results])
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    wall, cpu = min(times)
    return wall, cpu, [r.first_token for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--chunk-len", type=int, default=512)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=batch_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cfg = load_model_config(args.model)
    engine = PrefillEngine(cfg, seeded_params(cfg, 0), chunk_len=args.chunk_len)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.prompts)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)) for n in lengths]
    load = os.getloadavg()[0]

    def alone() -> list[PrefillResult]:
        return [engine.prefill(p) for p in prompts]

    def batched(threads: int) -> Callable[[], list[PrefillResult]]:
        return lambda: engine.prefill_batch(
            prompts, max_batch_tokens=args.max_batch_tokens, threads=threads
        )

    sides = {
        "batch-1": best_of(alone, args.repeats),
        "batched, 1 share": best_of(batched(1), args.repeats),
        f"batched, {args.threads} shares": best_of(batched(args.threads), args.repeats),
    }
    single_s = sides["batch-1"][0]
    for name, (_, _, tokens) in sides.items():
        assert tokens == sides["batch-1"][2], f"{name}: first tokens differ from batch-1"
    total = int(lengths.sum())
    report = {
        "model": cfg.name,
        "device": jax.devices()[0].device_kind,
        "prompts": args.prompts,
        "prompt_tokens": total,
        "lengths": [args.min_len, args.max_len],
        "chunk_len": args.chunk_len,
        "max_batch_tokens": args.max_batch_tokens,
        "threads": args.threads,
        "sides": {
            name: {
                "s": wall,
                "cpu_s": cpu,
                "tokens_per_s": total / wall,
                "speedup": single_s / wall,
            }
            for name, (wall, cpu, _) in sides.items()
        },
        "first_tokens_equal": True,
        "compiles": engine.compile_count,
        "load_avg": [load, os.getloadavg()[0]],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{cfg.name} on {report['device']}: {args.prompts} prompts of {args.min_len}–"
        f"{args.max_len} tokens ({total} in all), chunk_len {args.chunk_len}, "
        f"{args.max_batch_tokens} padded tokens per batched call; load average "
        f"{load:.2f} → {report['load_avg'][1]:.2f}"
    )
    rows = [
        [
            name,
            f"{side['s']:.3f}",
            f"{side['cpu_s']:.3f}",
            f"{side['tokens_per_s']:,.0f}",
            f"{side['speedup']:.2f}×",
        ]
        for name, side in report["sides"].items()
    ]
    print(table(rows, ["prefill", "s", "CPU s", "tokens/s", "speedup"]))
    print("first tokens equal: yes")


if __name__ == "__main__":
    main()
