"""Time between tokens on a node that prefills and decodes (``MixedStep``) while prompts arrive,
against the same decode batch alone.

``--batch`` requests (prompts of ``--context`` tokens, greedy, prefilled beforehand and untimed)
decode on one ``MixedStep`` (engine/mixed_step.py: a ``DecodeEngine`` of ``--batch`` slots,
capacity ``--max-len``; each step one compiled call of the decode rows and a block of at most
``--budget`` prompt tokens), three times:

    decode alone   nothing else arrives: every step is a decode step
    mixed, tokens  prompts of lengths drawn uniformly from ``[--min-len, --max-len-prompt]``
                   arrive as a Poisson process of ``--rate`` prompts/s; each asks for its first
                   token only, so it never takes a slot and the decode batch stays ``--batch``;
                   every step carries ``--budget`` tokens of the prompt at the head of the queue
    mixed, time    the same arrivals; a step carries the largest block whose measured cost stays
                   within ``1 + --share`` decode steps alone (engine/chunk_budget.py)

Each row decodes ``--steps`` tokens; the three runs take turns ``--rounds`` times (so a load
that drifts weighs on each alike), and each run's numbers pool its rounds. The time between
tokens (ITL) is measured per row over the steps where every row decodes; the table gives its
percentiles for each run, the ratio of each mixed P90 to decode alone's, the arriving prompts
prefilled and their time to first token. The rows' tokens must be equal between the runs (the
script checks): mixing changes no token. Every shape compiles in an untimed pass first. Prints
a table, or with ``--json`` the same numbers.

    python bench/mixed_step.py [--model tiny] [--batch 8] [--context 128] [--steps 256]
                               [--budget 32] [--share 0.5] [--rate 20] [--min-len 64]
                               [--max-len-prompt 512] [--max-len 768] [--rounds 3]
                               [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.chunk_budget import ChunkBudget
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.mixed_step import MixedRequest, MixedStep
from prfaas_jax.engine.prefill import PrefillEngine, PrefillResult
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
    rows: list[tuple[list[int], PrefillResult]],
    steps: int,
    arrivals: list[tuple[float, list[int]]],
) -> tuple[list[MixedRequest], list[MixedRequest]]:
    """The rows and the arriving requests of one run; arrivals at offsets (s) after every row
    decodes."""
    decoding = [mixed.insert(p, r.state, r.first_token, steps + 1) for p, r in rows]
    origin, pending, arrived = time.perf_counter(), list(arrivals), []
    while any(not r.done for r in decoding):
        now = time.perf_counter() - origin
        while pending and pending[0][0] <= now:
            arrived.append(mixed.submit(pending.pop(0)[1], 1))
        mixed.step()
    mixed.run()  # prompts still waiting when the rows ended
    return decoding, arrived


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--share", type=float, default=0.5)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len-prompt", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cfg = load_model_config(args.model).with_max_len(args.max_len)
    params = seeded_params(cfg, 0)
    prefill = PrefillEngine(cfg, params, chunk_len=args.budget)
    decode = DecodeEngine(cfg, params, max_slots=args.batch, max_len=args.max_len)
    by_tokens = MixedStep(prefill, decode, share=None)
    by_time = MixedStep(prefill, decode, share=args.share)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(args.batch)]
    rows = [(p, prefill.prefill(p, max_len=args.max_len)) for p in prompts]
    offsets = np.cumsum(rng.exponential(1 / args.rate, 10_000))
    lengths = rng.integers(args.min_len, args.max_len_prompt + 1, offsets.size)
    arrivals = [
        (float(t), rng.integers(0, cfg.vocab_size, int(n)).tolist())
        for t, n in zip(offsets, lengths, strict=True)
    ]
    load = os.getloadavg()[0]
    # Untimed: every block size beside the full batch, and alone; the samplers; the decode step.
    warm = [(0.0, [1] * (args.budget * 2 - 1))]
    for mixed in (by_tokens, by_time):
        run(mixed, rows, 4, warm)
    for size in by_time.budget.sizes:
        run(MixedStep(prefill, decode, share=None), rows, 2, [(0.0, [1] * size)])
    # The time budget starts from nothing measured: costs from the untimed pass (first calls,
    # compiles) would stay in its windows for hundreds of steps.
    by_time.budget = ChunkBudget(args.budget, share=args.share)

    # The runs take turns, --rounds times, so a machine whose load drifts weighs on each alike.
    names = ("decode alone", "mixed, tokens", "mixed, time")
    gaps: dict[str, list[float]] = {name: [] for name in names}
    arrived: dict[str, list[MixedRequest]] = {name: [] for name in names}
    alone_tokens, same = None, True
    for _ in range(args.rounds):
        for name, mixed, load_in in zip(
            names, (by_tokens, by_tokens, by_time), ([], arrivals, arrivals), strict=True
        ):
            decoding, came = run(mixed, rows, args.steps, load_in)
            tokens = [r.tokens for r in decoding]
            alone_tokens = tokens if alone_tokens is None else alone_tokens
            same = same and tokens == alone_tokens
            gaps[name] += steady_gaps(decoding)
            arrived[name] += came
    assert same, "mixing changed a decode row's tokens"
    itl = {name: percentiles(gaps[name]) for name in names}
    alone_p90 = itl["decode alone"]["p90"]
    report = {
        "model": cfg.name,
        "device": jax.devices()[0].device_kind,
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "budget": args.budget,
        "share": args.share,
        "rate": args.rate,
        "prompt_lengths": [args.min_len, args.max_len_prompt],
        "max_len": args.max_len,
        "runs": {
            name: {
                "itl_s": itl[name],
                "p90_ratio": itl[name]["p90"] / alone_p90,
                "arrived_prompts": len(arrived[name]),
                "arrived_prompt_tokens": sum(len(r.prompt) for r in arrived[name]),
                "arrived_ttft_s": percentiles([r.times[0] - r.submitted for r in arrived[name]]),
            }
            for name in names
        },
        "tokens_equal": same,
        "load_avg": [load, os.getloadavg()[0]],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{cfg.name} on {report['device']}: {args.batch} rows decoding ({args.context}-token "
        f"prompts, {args.steps} steps, {args.rounds} rounds), at most {args.budget} prompt "
        f"tokens per step "
        f"(time budget: {1 + args.share:g}× a decode step), {args.rate:g} prompts/s of "
        f"{args.min_len}–{args.max_len_prompt} tokens arriving; load average {load:.2f} → "
        f"{report['load_avg'][1]:.2f}"
    )
    lines = []
    for name, run_report in report["runs"].items():
        ttft, gaps = run_report["arrived_ttft_s"], run_report["itl_s"]
        lines.append(
            [
                name,
                *(f"{gaps[k] * 1e3:.2f}" for k in ("p50", "p90", "p99")),
                f"{run_report['p90_ratio']:.2f}×",
                str(run_report["arrived_prompts"]),
                "" if not run_report["arrived_prompts"] else f"{ttft['p50'] * 1e3:.1f}",
                "" if not run_report["arrived_prompts"] else f"{ttft['p90'] * 1e3:.1f}",
            ]
        )
    header = ["ITL ms", "P50", "P90", "P99", "P90 / alone", "prompts", "TTFT P50", "TTFT P90"]
    print(table(lines, header))
    print("rows' tokens equal in every run: yes")


if __name__ == "__main__":
    main()
