"""Decode with narrower weights against fp32 on the same checkpoint: step time, interleaved in
one process, and how many greedy tokens agree.

The model is bench/engine.py's (``PRESET``, loaded by ``load_hf``; ``impl = reference``). For
each B in ``--batches``, B prompts of ``--context`` tokens are prefilled once and inserted into
three ``DecodeEngine``s of B slots:

    fp32   the weights as loaded
    bf16   ``weight_dtype="bfloat16"`` (model/narrow_weights.py: the projections in bfloat16,
           each dot reading them as stored, ops/weight_dot.py)
    int8   the same projections rounded to int8 with one scale per output channel (the largest
           magnitude over the input axis / 127) and held as fp32: what weight-only int8 gives
           the tokens, not a faster engine (bench/weight_dots.py times int8 dots)

Then ``--steps`` greedy steps run with the engines taking turns each step (after ``--warmup``
untimed ones), so load from other jobs falls on all of them alike; a step's time is the median
(and the best) of its timed steps. Agreement: per row, how many of the greedy tokens (the first
included) equal fp32's before the first difference, and how many rows agree in all of them.

    python bench/decode_weights.py [--batches 1,8,32] [--context 512] [--steps 64] [--json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.narrow_weights import NARROWED
from prfaas_jax.tables import table

# tests/model/hf holds the checkpoint builder bench_model uses (hf_fixtures; not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model" / "hf"))
from engine import IMPL  # bench/ is the script's own directory
from layer_parts import bench_model


def int8_rounded(params: dict) -> dict:
    """``params`` with the ``NARROWED`` matrices rounded to int8 per output channel, in fp32."""

    def rounded(path, leaf: jax.Array) -> jax.Array:
        if getattr(path[-1], "key", None) not in NARROWED:
            return leaf
        scale = jnp.max(jnp.abs(leaf), axis=-2, keepdims=True) / 127
        scale = jnp.where(scale > 0, scale, 1.0)
        return (jnp.round(leaf / scale) * scale).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(rounded, params)


def _agreement(tokens: np.ndarray, reference: np.ndarray) -> dict:
    """Leading tokens equal per row, and rows equal throughout."""
    differs = tokens != reference
    first = np.where(differs.any(axis=1), differs.argmax(axis=1), tokens.shape[1])
    return {
        "rows_equal": int(np.sum(first == tokens.shape[1])),
        "mean_leading_equal": float(np.mean(first)),
        "min_leading_equal": int(np.min(first)),
    }


def run_batch(prefill: PrefillEngine, params: dict, batch: int, args) -> dict:
    cfg, total = prefill.cfg, args.warmup + args.steps
    variants = {
        "fp32": {"params": params},
        "bf16": {"params": params, "weight_dtype": "bfloat16"},
        "int8": {"params": int8_rounded(params)},
    }
    rng = np.random.default_rng(batch)
    results = [prefill.prefill(rng.integers(0, cfg.vocab_size, args.context)) for _ in range(batch)]
    engines, tokens = {}, {}
    for name, kwargs in variants.items():
        engine = DecodeEngine(
            cfg, max_slots=batch, max_len=args.context + total + 1, impl=IMPL, **kwargs
        )
        tokens[name] = np.zeros((batch, 1 + total), np.int64)
        for result in results:
            slot = engine.insert(result.state, result.first_token, max_new_tokens=total)
            tokens[name][slot, 0] = result.first_token
        engines[name] = engine
    times = {name: [] for name in engines}
    for index in range(1, 1 + total):
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.step()
            times[name].append(time.perf_counter() - start)
            for slot, token in out:
                tokens[name][slot, index] = token
    row = {"batch": batch}
    for name in engines:
        timed = np.asarray(times[name][args.warmup :])
        row[name] = {
            "median_ms": 1e3 * float(np.median(timed)),
            "best_ms": 1e3 * float(np.min(timed)),
            **_agreement(tokens[name], tokens["fp32"]),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batches", type=parse_int_list, default=[1, 8, 32], help="rows")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (512)")
    parser.add_argument("--steps", type=int, default=64, help="timed greedy steps (64)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    if not args.batches or min(args.batches) < 1 or args.context < 1 or args.steps < 1:
        parser.error("--batches, --context and --steps must be ≥ 1")
    cfg, params = bench_model()
    prefill = PrefillEngine(cfg, params, impl=IMPL, chunk_len=args.context)
    rows = [run_batch(prefill, params, batch, args) for batch in args.batches]
    if not args.json:
        body = []
        for row in rows:
            base = row["fp32"]["median_ms"]
            for name in ("fp32", "bf16", "int8"):
                r = row[name]
                body.append(
                    [
                        str(row["batch"]),
                        name,
                        f"{r['median_ms']:.2f}",
                        f"{r['best_ms']:.2f}",
                        f"{base / r['median_ms']:.2f}×",
                        f"{r['rows_equal']}/{row['batch']}",
                        f"{r['mean_leading_equal']:.1f}",
                    ]
                )
        headers = ["B", "weights", "ms/step", "best ms", "vs fp32", "rows equal", "mean equal"]
        print(f"{args.steps} timed steps, {args.steps + args.warmup + 1} tokens a row")
        print(table(body, headers))
    print_json({"options": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
