"""Time between tokens on a node that prefills and decodes (``MixedStep``) while prompts arrive,
against the same decode batch alone.

``--batch`` requests (prompts of ``--context`` tokens, greedy) decode on one ``MixedStep``
(engine/mixed_step.py: a ``PrefillEngine`` whose ``chunk_len`` is ``--budget`` prompt tokens
per step, a ``DecodeEngine`` of ``--batch`` slots, capacity ``--max-len``), twice:

    decode alone  nothing else arrives: every step is a decode step
    mixed         prompts of lengths drawn uniformly from ``[--min-len, --max-len-prompt]``
                  arrive as a Poisson process of ``--rate`` prompts/s from the moment every
                  row decodes; each asks for its first token only, so it never takes a slot and
                  the decode batch stays ``--batch``; each step carries the decode rows and at
                  most ``--budget`` tokens of the prompt at the head of the queue

Each row asks for enough tokens to decode ``--steps`` steps after the last row's insert (the
rows' own prompts run chunk by chunk too, a decode step after each chunk, while the first rows
decode). The time between tokens (ITL) is measured per row over the steps where every row
decodes (from the last row's insert to the first row's end); the table gives its percentiles
for both runs, the ratio of their P90s, the arriving prompts prefilled and their time to first
token. The rows' tokens must be equal between the two runs (the script checks): mixing changes
no token. Every shape compiles in an untimed pass first. Prints a table, or with ``--json`` the
same numbers.

    python bench/mixed_step.py [--model tiny] [--batch 8] [--context 128] [--steps 128]
                               [--budget 32] [--rate 20] [--min-len 64] [--max-len-prompt 512]
                               [--max-len 768] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.mixed_step import MixedRequest, MixedStep
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.seeded_weights import seeded_params
from prfaas_jax.tables import table


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "n": 0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "n": len(values)}


def steady_gaps(rows: list[MixedRequest]) -> list[float]:
    """Each row's gaps between tokens while every row decodes."""
    start = max(r.times[0] for r in rows)  # the last row's first token: all rows in slots
    end = min(r.times[-1] for r in rows)  # the first row's last token
    gaps = []
    for row in rows:
        times = [t for t in row.times if start <= t <= end]
        gaps += np.diff(times).tolist()
    return gaps


def run(
    mixed: MixedStep,
    prompts: list[list[int]],
    steps: int,
    arrivals: list[tuple[float, list[int]]],
) -> tuple[list[MixedRequest], list[MixedRequest]]:
    """The rows and the arriving requests of one run; arrivals at offsets (s) after every row
    decodes."""
    # Decode steps run while the rows' own prompts prefill, one per chunk: ask for those too.
    lead = sum(-(-len(p) // mixed.budget) for p in prompts)
    rows = [mixed.submit(p, steps + 1 + lead) for p in prompts]
    while mixed.waiting:  # every row prefilled and in its slot
        mixed.step()
    origin, pending, arrived = time.perf_counter(), list(arrivals), []
    while any(not r.done for r in rows):
        now = time.perf_counter() - origin
        while pending and pending[0][0] <= now:
            arrived.append(mixed.submit(pending.pop(0)[1], 1))
        mixed.step()
    mixed.run()  # prompts still waiting when the rows ended
    return rows, arrived


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len-prompt", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cfg = load_model_config(args.model).with_max_len(args.max_len)
    params = seeded_params(cfg, 0)
    mixed = MixedStep(
        PrefillEngine(cfg, params, chunk_len=args.budget),
        DecodeEngine(cfg, params, max_slots=args.batch, max_len=args.max_len),
    )
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(args.batch)]
    offsets = np.cumsum(rng.exponential(1 / args.rate, 10_000))
    lengths = rng.integers(args.min_len, args.max_len_prompt + 1, offsets.size)
    arrivals = [
        (float(t), rng.integers(0, cfg.vocab_size, int(n)).tolist())
        for t, n in zip(offsets, lengths, strict=True)
    ]
    load = os.getloadavg()[0]
    # Untimed: the prefill block (budget-sized at capacity max_len for every prompt of at
    # least --budget tokens), the samplers and the decode step.
    run(mixed, prompts, 4, [(0.0, [1] * args.min_len)])

    alone_rows, _ = run(mixed, prompts, args.steps, [])
    mixed_rows, arrived = run(mixed, prompts, args.steps, arrivals)
    same = [r.tokens for r in alone_rows] == [r.tokens for r in mixed_rows]
    assert same, "mixing changed a decode row's tokens"
    alone_itl, mixed_itl = (
        percentiles(steady_gaps(alone_rows)),
        percentiles(steady_gaps(mixed_rows)),
    )
    ttft = percentiles([r.times[0] - r.submitted for r in arrived])
    report = {
        "model": cfg.name,
        "device": jax.devices()[0].device_kind,
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "budget": args.budget,
        "rate": args.rate,
        "prompt_lengths": [args.min_len, args.max_len_prompt],
        "max_len": args.max_len,
        "decode_alone_itl_s": alone_itl,
        "mixed_itl_s": mixed_itl,
        "p90_ratio": mixed_itl["p90"] / alone_itl["p90"],
        "arrived_prompts": len(arrived),
        "arrived_prompt_tokens": sum(len(r.prompt) for r in arrived),
        "arrived_ttft_s": ttft,
        "tokens_equal": same,
        "load_avg": [load, os.getloadavg()[0]],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{cfg.name} on {report['device']}: {args.batch} rows decoding ({args.context}-token "
        f"prompts, {args.steps} steps), budget {args.budget} prompt tokens per step, "
        f"{args.rate:g} prompts/s of {args.min_len}–{args.max_len_prompt} tokens arriving; "
        f"load average {load:.2f} → {report['load_avg'][1]:.2f}"
    )
    ms = [
        [name, *(f"{itl[k] * 1e3:.2f}" for k in ("p50", "p90", "p99")), str(itl["n"])]
        for name, itl in (("decode alone", alone_itl), ("mixed", mixed_itl))
    ]
    print(table(ms, ["ITL ms", "P50", "P90", "P99", "gaps"]))
    print(
        f"P90 ratio {report['p90_ratio']:.2f}×; {len(arrived)} prompts "
        f"({report['arrived_prompt_tokens']} tokens) prefilled, TTFT P50 "
        f"{ttft['p50'] * 1e3:.1f} ms, P90 {ttft['p90'] * 1e3:.1f} ms; rows' tokens equal: yes"
    )


if __name__ == "__main__":
    main()
