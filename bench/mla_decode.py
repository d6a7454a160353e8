"""How the absorbed MLA decode runs on XLA:CPU with its absorbing weights in three forms, timed
in the same process, interleaved.

Shapes are bench/engine.py's model's MLA (4 heads, kv_lora_rank 256, qk 128 + 64, v 128) over a
latent cache of ``--slots`` slots, ``--context`` of them filled, at B rows in ``--rows`` (one
query each). The forms:

    kv_b as loaded   ``kv_b [R, H·(N + V)]``, sliced and regrouped per head in the step
                     (``mla_decode_absorbed``)
    split once       ``W_UK [H, R, N]`` and ``W_UV [H, V, R]`` as a decode engine holds them
                     (``AbsorbedKvB``, ``mla_decode_absorbed_heads``)
    packed, sliced   the same two halves flattened into one array, sliced apart in the step

Each form runs ``--calls`` calls per round, ``--rounds`` rounds taking turns; a form's time is
its best round's mean call. ``error`` is the largest difference from the first form's output.

    python bench/mla_decode.py [--rows 1,8] [--slots 640] [--context 512] [--rounds 5]
                               [--calls 50] [--json]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from timing import add_round_flags, interleaved_s  # bench/ is the script's own directory

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.model.mixers.mla import AbsorbedKvB
from prfaas_jax.ops.attention import mla_decode_absorbed, mla_decode_absorbed_heads
from prfaas_jax.tables import table

HEADS, RANK, NOPE, ROPE, VALUE = 4, 256, 128, 64, 128


def _forms() -> dict:
    """name -> ``f(kv_b_form, q_nope, q_rope, c_kv, k_rope, q_pos, kv_pos)``, jitted."""

    def loaded(kv_b, *args):
        w_kv = kv_b.reshape(RANK, HEADS, NOPE + VALUE)
        return mla_decode_absorbed(*args[:4], w_kv[..., :NOPE], w_kv[..., NOPE:], **_masks(args))

    def split(halves, *args):
        return mla_decode_absorbed_heads(*args[:4], *halves, **_masks(args))

    def packed(flat, *args):
        w_uk = flat[: HEADS * RANK * NOPE].reshape(HEADS, RANK, NOPE)
        w_uv = flat[HEADS * RANK * NOPE :].reshape(HEADS, VALUE, RANK)
        return mla_decode_absorbed_heads(*args[:4], w_uk, w_uv, **_masks(args))

    return {"kv_b as loaded": loaded, "split once": split, "packed, sliced": packed}


def _masks(args) -> dict:
    return {"q_pos": args[4], "kv_pos": args[5], "scale": (NOPE + ROPE) ** -0.5}


def measure(rows: list[int], slots: int, context: int, rounds: int, per_round: int) -> list[dict]:
    rng = np.random.default_rng(0)
    kv_b = jnp.asarray(rng.standard_normal((RANK, HEADS * (NOPE + VALUE)), np.float32) / 16)
    halves = AbsorbedKvB.of(kv_b, HEADS, NOPE)
    weights = {
        "kv_b as loaded": kv_b,
        "split once": halves,
        "packed, sliced": jnp.concatenate([halves.w_uk.ravel(), halves.w_uv.ravel()]),
    }
    forms = {name: jax.jit(f) for name, f in _forms().items()}
    results = []

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    for batch in rows:
        slot = np.arange(slots, dtype=np.int32)
        kv_pos = jnp.asarray(np.tile(np.where(slot < context, slot, -1), (batch, 1)))
        q_pos = jnp.full((batch, 1), context - 1, jnp.int32)
        args = (draw(batch, 1, HEADS, NOPE), draw(batch, 1, HEADS, ROPE))
        args += (draw(batch, slots, RANK), draw(batch, slots, ROPE), q_pos, kv_pos)
        calls = {name: (lambda f=f, w=weights[name], a=args: f(w, *a)) for name, f in forms.items()}
        seconds = interleaved_s(calls, rounds, per_round)
        first = np.asarray(next(iter(calls.values()))())
        for name, call in calls.items():
            error = float(np.abs(np.asarray(call()) - first).max())
            results.append({"rows": batch, "form": name, "us": 1e6 * seconds[name], "error": error})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=parse_int_list, default=[1, 8], help="B (1,8)")
    parser.add_argument("--slots", type=int, default=640, help="latent cache slots (640)")
    parser.add_argument("--context", type=int, default=512, help="filled slots (512)")
    add_round_flags(parser, calls=50)
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    if not args.rows or min(args.rows) < 1 or min(args.rounds, args.calls) < 1:
        parser.error("--rows, --rounds and --calls must be ≥ 1")
    if not 1 <= args.context <= args.slots:
        parser.error("--context must be in 1 … --slots")
    results = measure(args.rows, args.slots, args.context, args.rounds, args.calls)
    if args.json:
        print_json({"options": vars(args), "results": results})
        return 0
    base = {r["rows"]: r["us"] for r in results if r["form"] == "kv_b as loaded"}
    body = [
        [
            str(r["rows"]),
            r["form"],
            f"{r['us']:.0f}",
            f"{r['us'] / base[r['rows']]:.2f}×",
            f"{r['error']:.1e}",
        ]
        for r in results
    ]
    print(table(body, ["B", "form", "µs", "vs as loaded", "error"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
