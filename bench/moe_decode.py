"""A decode step's routed experts at a few tokens, in four forms, timed in one process and
interleaved: what the MoE runs on CPU (the tile loop) against the forms that skip it.

Shapes are bench/engine.py's model's MoE layer (8 experts, top-2, hidden 512, expert width 256,
fp32); each of N tokens routes to 2 distinct experts drawn at random with random weights.

    tile loop     model/mlp.py's ``_tiled_experts``: the pairs sorted by expert, one tile of rows
                  per expert, a ``lax.map`` over the tiles
    gather        the routed experts' weights gathered once per step (``[N·k, D, F]``), one
                  batched product per matrix
    all experts   every token through every expert, the unrouted ones weighted 0
    pair loop     a ``fori_loop`` over the N·k pairs, each reading its expert's matrices in place

A form's time is its best round's mean call (``--rounds`` rounds of ``--calls`` calls, the
forms taking turns); ``error`` is its largest difference from the tile loop.

    python bench/moe_decode.py [--tokens 1,8,32] [--rounds 5] [--calls 20] [--json]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from timing import add_round_flags, interleaved_s  # bench/ is the script's own directory

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.model.mlp import _tiled_experts
from prfaas_jax.tables import table

EXPERTS, TOP_K, DIM, WIDTH = 8, 2, 512, 256


def _forms(gate: jax.Array, up: jax.Array, down: jax.Array) -> dict:
    """name -> jitted ``f(x [N, D], ids [N, k], weights [N, k]) -> [N, D]``."""

    def tile_loop(x, ids, w):
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // TOP_K
        ys = _tiled_experts((gate, up, down), x[token], flat[order])
        return jnp.zeros_like(x).at[token].add(ys * w.reshape(-1)[order][:, None])

    def gather(x, ids, w):
        flat, xs = ids.reshape(-1), jnp.repeat(x, TOP_K, axis=0)
        hidden = jax.nn.silu(jnp.einsum("pd,pdf->pf", xs, gate[flat]))
        hidden = hidden * jnp.einsum("pd,pdf->pf", xs, up[flat])
        ys = jnp.einsum("pf,pfd->pd", hidden, down[flat]) * w.reshape(-1)[:, None]
        return ys.reshape(x.shape[0], TOP_K, DIM).sum(axis=1)

    def all_experts(x, ids, w):
        rows = jnp.arange(x.shape[0])[:, None]
        combine = jnp.zeros((x.shape[0], EXPERTS), x.dtype).at[rows, ids].add(w)
        hidden = jax.nn.silu(jnp.einsum("nd,edf->enf", x, gate))
        hidden = hidden * jnp.einsum("nd,edf->enf", x, up)
        return jnp.einsum("enf,efd,ne->nd", hidden, down, combine)

    def pair_loop(x, ids, w):
        flat, xs, wf = ids.reshape(-1), jnp.repeat(x, TOP_K, axis=0), w.reshape(-1)

        def pair(p, out):
            e, row = flat[p], xs[p][None]
            hidden = jax.nn.silu(row @ gate[e]) * (row @ up[e])
            return out.at[p // TOP_K].add((hidden @ down[e])[0] * wf[p])

        return jax.lax.fori_loop(0, xs.shape[0], pair, jnp.zeros_like(x))

    forms = {"tile loop": tile_loop, "gather": gather, "all experts": all_experts}
    forms["pair loop"] = pair_loop
    return {name: jax.jit(f) for name, f in forms.items()}


def measure(tokens: list[int], rounds: int, calls: int) -> list[dict]:
    rng = np.random.default_rng(0)

    def weights(*shape):
        return jnp.asarray((rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32))

    matrices = weights(EXPERTS, DIM, WIDTH), weights(EXPERTS, DIM, WIDTH)
    forms = _forms(*matrices, weights(EXPERTS, WIDTH, DIM))
    results = []
    for n in tokens:
        x = jnp.asarray(rng.standard_normal((n, DIM)).astype(np.float32))
        ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(n)])
        ids = jnp.asarray(ids.astype(np.int32))
        w = jnp.asarray(rng.random((n, TOP_K)).astype(np.float32))
        reference = np.asarray(forms["tile loop"](x, ids, w))
        calls_of = {name: (lambda f=f, a=(x, ids, w): f(*a)) for name, f in forms.items()}
        seconds = interleaved_s(calls_of, rounds, calls)
        for name, f in forms.items():
            error = np.abs(np.asarray(f(x, ids, w)) - reference).max()
            results.append(
                {"tokens": n, "form": name, "us": 1e6 * seconds[name], "error": float(error)}
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tokens", type=parse_int_list, default=[1, 8, 32], help="N")
    add_round_flags(parser, calls=20)
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    if not args.tokens or min(args.tokens) < 1 or args.rounds < 1 or args.calls < 1:
        parser.error("--tokens, --rounds and --calls must be ≥ 1")
    results = measure(args.tokens, args.rounds, args.calls)
    if not args.json:
        body = [
            [str(r["tokens"]), r["form"], f"{r['us']:.0f}", f"{r['error']:.1e}"] for r in results
        ]
        print(table(body, ["N", "form", "µs", "error"]))
    print_json({"options": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
