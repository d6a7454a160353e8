"""Slots against pages at one memory budget: concurrent requests and decode tokens/s.

The paper's length mix (configs/plans/case-study-1t.toml: input ln L ~ N(9.90, 1.00) on
[128, 128K], 1,024 output tokens) scaled to a toy model by ``--scale`` (lengths ÷ 128: inputs
on [1, 1,024], mean ≈ 215, 8 output tokens): ``--requests`` prompts of those lengths are
prefilled once, then decoded by two engines holding the same bytes of state:

    slots  ``DecodeEngine`` with ``--budget-slots`` slots of ``max_len`` positions (every
           slot holds a whole ``max_len`` state whatever its request's length)
    pages  ``PagedDecodeEngine`` with as many pages as fit the same bytes
           (engine/page_layout.py), each request holding the pages its length needs

A slot holds ``max_len`` = 128K ÷ scale + the output positions, as a real slot holds the
model's whole context. Both drain one queue holding every request from the start: whenever a
slot or enough pages are free the next request is inserted, and every engine step is one token
for each live request.
Reported per engine: the peak and mean live requests over the steps, the steps, and decode
tokens/s (tokens over the time of the steps; compiles excluded: the schedule is run once
untimed, then timed). Every request's tokens must be equal between the engines (greedy).

    python bench/paged_engine.py [--model tiny] [--requests 64] [--budget-slots 4]
                                 [--block-size 16] [--scale 128] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.block_pool import NoFreePageError
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.decode_slots import NoFreeSlotError
from prfaas_jax.engine.page_layout import page_layout
from prfaas_jax.engine.paged_decode import PagedDecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.seeded_weights import seeded_params
from prfaas_jax.policy.length_distribution import TruncatedLogNormal
from prfaas_jax.sim.workload import sample_lengths
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.tables import table

PAPER = {"mu": 9.90, "sigma": 1.00, "min_len": 128, "max_len": 131072, "output_len": 1024}


def scaled_mix(scale: float, n: int, seed: int) -> tuple[np.ndarray, int]:
    """``n`` input lengths and the output length of the paper's mix divided by ``scale``:
    L / s is log-normal with μ − ln s and the same σ."""
    dist = TruncatedLogNormal(
        PAPER["mu"] - math.log(scale),
        PAPER["sigma"],
        max(1.0, PAPER["min_len"] / scale),
        PAPER["max_len"] / scale,
    )
    lengths = sample_lengths(dist, np.random.default_rng(seed), n)
    return lengths, max(1, round(PAPER["output_len"] / scale))


def drain(engine, requests: list, new: int) -> dict:
    """Decode every request, inserting as soon as the engine takes one; tokens and counts."""
    queue, live, tokens = list(range(len(requests))), {}, {}
    concurrency, seconds = [], 0.0
    while queue or live:
        while queue:
            state, first = requests[queue[0]]
            try:
                slot = engine.insert(state, first, max_new_tokens=new)
            except (NoFreeSlotError, NoFreePageError):
                break
            live[slot] = queue.pop(0)
            tokens[live[slot]] = [first]
        if not live:
            raise RuntimeError("a request fits no empty engine: raise the budget")
        concurrency.append(len(live))
        start = time.perf_counter()
        out = engine.step()
        seconds += time.perf_counter() - start
        for slot, token in out:
            tokens[live[slot]].append(token)
        for slot in [s for s in live if engine.is_finished(s)]:
            engine.free(slot)
            del live[slot]
    return {
        "tokens": tokens,
        "peak": max(concurrency),
        "mean": float(np.mean(concurrency)),
        "steps": len(concurrency),
        "decode_tokens": sum(len(t) - 1 for t in tokens.values()),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--budget-slots", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scale", type=float, default=128.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cfg = load_model_config(args.model)
    params = seeded_params(cfg, 0)
    lengths, new = scaled_mix(args.scale, args.requests, args.seed)
    # A slot is sized for the longest request the mix allows (the paper's 128K, scaled), not
    # for the longest one drawn: an engine does not know its requests in advance.
    max_len = round(PAPER["max_len"] / args.scale) + new
    rng = np.random.default_rng(args.seed + 1)
    prefill = PrefillEngine(cfg, params, chunk_len=64)
    requests = []
    for length in lengths:
        result = prefill.prefill(rng.integers(0, cfg.vocab_size, int(length)).tolist())
        requests.append((result.state, result.first_token))

    budget = args.budget_slots * state_nbytes(cfg, max_len)
    layout = page_layout(cfg, args.block_size)
    num_pages = budget // layout.page_bytes
    fewest = min(layout.request_pages(int(n) + new) for n in lengths)
    rows = min(args.requests, num_pages // fewest)

    def engines():
        return {
            "slots": DecodeEngine(cfg, params, max_slots=args.budget_slots, max_len=max_len),
            "pages": PagedDecodeEngine(
                cfg,
                params,
                num_pages=num_pages,
                block_size=args.block_size,
                max_slots=rows,
                max_len=max_len,
            ),
        }

    for engine in engines().values():  # the same schedule untimed: every compile happens here
        drain(engine, requests, new)
    runs = {name: drain(engine, requests, new) for name, engine in engines().items()}
    assert runs["slots"]["tokens"] == runs["pages"]["tokens"], "the engines' tokens differ"

    report = {
        "model": cfg.name,
        "requests": args.requests,
        "input_len_mean": float(lengths.mean()),
        "input_len_max": int(lengths.max()),
        "output_len": new,
        "max_len": max_len,
        "budget_bytes": budget,
        "block_size": args.block_size,
        "tokens_per_page": layout.tokens_per_page,
        "page_bytes": layout.page_bytes,
        "num_pages": num_pages,
        "page_rows": rows,
        "engines": {
            name: {k: v for k, v in run.items() if k != "tokens"}
            | {"tokens_per_s": run["decode_tokens"] / run["seconds"]}
            for name, run in runs.items()
        },
        "tokens_equal": True,
    }
    report["concurrency_ratio"] = runs["pages"]["peak"] / runs["slots"]["peak"]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{cfg.name}: {args.requests} requests, inputs mean {lengths.mean():.0f} max "
        f"{lengths.max()} tokens, {new} out (the paper's mix ÷ {args.scale:g}); budget "
        f"{budget:,} B = {args.budget_slots} slots of {max_len} positions = {num_pages} pages "
        f"of {layout.page_bytes:,} B ({layout.tokens_per_page} tokens)"
    )
    rows_out = [
        [
            name,
            str(run["peak"]),
            f"{run['mean']:.1f}",
            str(run["steps"]),
            f"{run['decode_tokens'] / run['seconds']:.0f}",
        ]
        for name, run in runs.items()
    ]
    headers = ["engine", "peak live", "mean live", "steps", "decode tok/s"]
    print(table(rows_out, headers=headers))
    print(f"tokens equal; concurrent requests pages / slots = {report['concurrency_ratio']:.2f}×")


if __name__ == "__main__":
    main()
