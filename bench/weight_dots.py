"""How XLA:CPU runs a decode step's weight matmuls at a few rows: one weight in several layouts
and widths, timed in the same process, interleaved.

Shapes are bench/engine.py's model's: the LM head (512 × 32,000, 65 MB in fp32) and a projection
(512 × 1,024). For each row count M in ``--rows`` and each form:

    fp32             ``x @ w``, ``w [D, O]`` as the model stores it
    fp32 [O, D]      ``w`` stored transposed, contracted on its last axis: how a decode
                     engine reads its LM head from 2 rows (model/decode_weights.py)
    [O, D] @ x.T     ``w`` stored transposed, on the left of the product (``[O, M]``,
                     transposed back)
    fp32, 4 blocks   ``w`` stored as 4 column blocks ``[4, D, O/4]``, one batched dot
    bf16             ``x`` rounded to bfloat16, ``w [D, O]`` bfloat16, fp32 accumulation
    bf16, rows to 8  the same with the rows padded to 8 (ops/weight_dot.py)
    int8             ``w`` int8 with per-output-channel scales, widened to bfloat16 for the dot
                     (rows padded to 8), the scales applied to the output

Each form runs ``--calls`` calls per round, ``--rounds`` rounds taking turns; a form's time is
its best round's mean call (wall clock), beside the time its weight's bytes take at the read
bandwidth measured in the same run (bench/roofline.py). ``error`` is the largest difference
from the fp32 product, over the largest fp32 output. With ``--cold`` every timed call follows
a read of an array as large as the read-bandwidth measurement's (400 MB): a decode step reads
more bytes than the caches keep between calls, so its weights come from DRAM, and a weight
timed call after call stays in the last-level cache (this machine's is large) instead.

    python bench/weight_dots.py [--rows 1,2,4,8,16] [--rounds 5] [--calls 10] [--cold] [--json]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from roofline import ceilings  # bench/ is the script's own directory
from timing import add_round_flags, dram_flush, interleaved_s

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.ops.weight_dot import weight_dot
from prfaas_jax.tables import table

SHAPES = {"LM head": (512, 32_000), "projection": (512, 1_024)}


def _forms(w: np.ndarray) -> dict:
    """name -> (jitted ``f(x, weight)``, weight, bytes read)."""
    scale = np.abs(w).max(axis=0) / 127
    w_int8 = jnp.asarray(np.round(w / scale).astype(np.int8))
    scale = jnp.asarray(scale)
    w_bf16 = jnp.asarray(w, jnp.bfloat16)

    def bf16(x, w):
        return jnp.matmul(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)

    def int8(x, w):
        return weight_dot(x, w.astype(jnp.bfloat16)) * scale

    return {
        "fp32": (jax.jit(jnp.matmul), jnp.asarray(w), w.nbytes),
        "fp32 [O, D]": (
            jax.jit(lambda x, w: jnp.einsum("md,od->mo", x, w)),
            jnp.asarray(np.ascontiguousarray(w.T)),
            w.nbytes,
        ),
        "[O, D] @ x.T": (
            jax.jit(lambda x, w: jax.lax.optimization_barrier(w @ x.T).T),
            jnp.asarray(np.ascontiguousarray(w.T)),
            w.nbytes,
        ),
        "fp32, 4 blocks": (
            jax.jit(lambda x, w: jnp.einsum("md,kdo->mko", x, w).reshape(x.shape[0], -1)),
            jnp.asarray(np.ascontiguousarray(w.reshape(w.shape[0], 4, -1).transpose(1, 0, 2))),
            w.nbytes,
        ),
        "bf16": (jax.jit(bf16), w_bf16, w.nbytes // 2),
        "bf16, rows to 8": (jax.jit(weight_dot), w_bf16, w.nbytes // 2),
        "int8": (jax.jit(int8), w_int8, w.nbytes // 4 + scale.nbytes),
    }


def measure(
    rows: list[int], rounds: int, per_round: int, bandwidth: float, cold: bool = False
) -> list[dict]:
    rng = np.random.default_rng(0)
    before = dram_flush() if cold else None
    results = []
    for shape_name, (dim, out) in SHAPES.items():
        w = (rng.standard_normal((dim, out)) / np.sqrt(dim)).astype(np.float32)
        forms = _forms(w)
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, dim)).astype(np.float32))
            exact = np.asarray(x) @ w
            calls = {name: (lambda f=f, v=v, x=x: f(x, v)) for name, (f, v, _) in forms.items()}
            seconds = interleaved_s(calls, rounds, per_round, before)
            for name, (f, v, nbytes) in forms.items():
                error = np.abs(np.asarray(f(x, v)) - exact).max() / np.abs(exact).max()
                results.append(
                    {
                        "weight": shape_name,
                        "rows": m,
                        "form": name,
                        "us": 1e6 * seconds[name],
                        "bytes": nbytes,
                        "bound_us": 1e6 * nbytes / bandwidth,
                        "error": float(error),
                    }
                )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=parse_int_list, default=[1, 2, 4, 8, 16], help="M")
    add_round_flags(parser, calls=10)
    parser.add_argument(
        "--cold", action="store_true", help="each call after a 400 MB read (weights from DRAM)"
    )
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    if not args.rows or min(args.rows) < 1 or args.rounds < 1 or args.calls < 1:
        parser.error("--rows, --rounds and --calls must be ≥ 1")
    machine = ceilings()
    results = measure(args.rows, args.rounds, args.calls, machine["read_bytes_s"], args.cold)
    if not args.json:
        print(f"read bandwidth {machine['read_bytes_s'] / 1e9:.1f} GB/s")
        body = [
            [
                r["weight"],
                str(r["rows"]),
                r["form"],
                f"{r['us']:.0f}",
                f"{r['bytes'] / 1e6:.1f}",
                f"{r['bound_us'] / r['us']:.0%}",
                f"{r['error']:.1e}",
            ]
            for r in results
        ]
        print(table(body, ["weight", "M", "form", "µs", "MB", "of bound", "error"]))
    print_json({"ceilings": machine, "options": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
