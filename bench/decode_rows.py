"""A decode step's time by busy slots: steps over the busy rows against steps over every slot.

``DecodeEngine.step`` runs over the first rows that hold every active slot (the smallest power of
two; engine/decode.py); the peer in the same run is the same engine made to step all
``--slots`` rows, as it did before. bench/engine.py's checkpoint (Kimi Linear, MoE; written with
``save_pretrained`` and loaded by ``load_hf``), ``--slots`` slots of ``--max-len`` positions, B
requests of ``--context`` tokens each; a row is the median of ``--steps`` timed steps after three
untimed ones. Both modes must produce the same tokens.

    python bench/decode_rows.py [--busy 1,4,8,16] [--slots 16] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time

import engine as engine_bench  # bench/engine.py: its checkpoint and impl
import hf_fixtures  # the tests' checkpoint builder, on the path bench/engine.py puts it
import numpy as np

from prfaas_jax.engine import decode
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.hf import load_hf


def measure(prefill: PrefillEngine, busy: int, args: argparse.Namespace) -> tuple[float, list]:
    """(median seconds a step, every row's tokens) with ``busy`` requests in the engine."""
    engine = decode.DecodeEngine(
        prefill.cfg, prefill.params, max_slots=args.slots, max_len=args.max_len, impl=prefill.impl
    )
    rng = np.random.default_rng(0)
    tokens: dict[int, list[int]] = {}
    for _ in range(busy):
        result = prefill.prefill(rng.integers(0, prefill.cfg.vocab_size, args.context))
        budget = args.steps + 4
        slot = engine.insert(result.state, result.first_token, max_new_tokens=budget)
        tokens[slot] = [result.first_token]
    times = []
    for index in range(args.steps + 3):
        start = time.perf_counter()
        out = engine.step()
        if index >= 3:
            times.append(time.perf_counter() - start)
        for slot, token in out:
            tokens[slot].append(token)
    return float(np.median(times)), [tokens[s] for s in sorted(tokens)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", default="1,4,8,16", help="busy slots per row")
    parser.add_argument("--slots", type=int, default=16, help="the engine's slots")
    parser.add_argument("--max-len", type=int, default=544, help="positions per slot")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    busy = [int(b) for b in args.busy.split(",") if b]
    if not busy or not all(1 <= b <= args.slots for b in busy):
        parser.error(f"--busy takes counts in [1, --slots={args.slots}]")
    if args.context + args.steps + 4 > args.max_len:
        parser.error("--context + --steps + 4 must fit in --max-len")
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        path = hf_fixtures.make_tiny_kimi_linear(tmp, **engine_bench.PRESET)
        cfg, params = load_hf(path, name="bench-kimi-linear")
    prefill = PrefillEngine(cfg, params, impl=engine_bench.IMPL)
    rows, busy_rows = [], decode.step_rows
    for count in busy:
        decode.step_rows = lambda active, max_slots: max_slots  # the peer: every slot
        every_s, every_tokens = measure(prefill, count, args)
        decode.step_rows = busy_rows
        busy_s, busy_tokens = measure(prefill, count, args)
        rows.append(
            {
                "busy": count,
                "rows": busy_rows(list(range(count)), args.slots),
                "all_rows_ms": every_s * 1e3,
                "busy_rows_ms": busy_s * 1e3,
                "speedup": every_s / busy_s,
                "tokens_equal": every_tokens == busy_tokens,
            }
        )
    result = {"slots": args.slots, "max_len": args.max_len, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if all(r["tokens_equal"] for r in rows) else 1
    print(f"{args.slots} slots of {args.max_len} positions, {args.context}-token prompts")
    print(
        f"{'busy':>4} {'rows':>4} {'all rows ms':>12} {'busy rows ms':>13} {'speedup':>8}  tokens"
    )
    for r in rows:
        same = "equal" if r["tokens_equal"] else "DIFFER"
        print(
            f"{r['busy']:>4} {r['rows']:>4} {r['all_rows_ms']:>12.2f} {r['busy_rows_ms']:>13.2f} "
            f"{r['speedup']:>7.2f}×  {same}"
        )
    print(json.dumps(result))
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
