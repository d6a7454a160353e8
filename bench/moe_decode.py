"""A decode step's routed experts at a few tokens, in four forms, timed in one process and
interleaved: the two the MoE chooses between on CPU by the number of (token, expert) pairs
(model/mlp.py's ``_cpu_experts``), a gather of the routed weights and a loop over the pairs.

Shapes are bench/engine.py's model's MoE layer (8 experts, top-2, hidden 512, expert width 256,
fp32); each of N tokens routes to 2 distinct experts drawn at random with random weights. Every
form takes the pairs sorted by expert and is combined as the MoE combines them.

    tile loop     ``_tiled_experts``: one tile of rows per expert, a ``lax.map`` over the tiles
    gather        the routed experts' weights gathered once per step (``[N·k, D, F]``), one
                  batched product per matrix
    every expert  ``_every_expert``: every expert on every token (the weights read in place,
                  ``ops/weight_dot.expert_dot``), each pair taking its own
    pair loop     a ``fori_loop`` over the pairs, each reading its expert's matrices in place

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
from prfaas_jax.model.mlp import _every_expert, _tiled_experts
from prfaas_jax.tables import table

EXPERTS, TOP_K, DIM, WIDTH = 8, 2, 512, 256


def _forms() -> dict:
    """name -> jitted ``f(x [N, D], ids [N, k], weights [N, k], experts) -> [N, D]``, the
    experts ``(gate, up, down)`` passed as arguments, as a decode step gets them (closed over as
    constants, XLA would fold a per-call copy of them into the program)."""

    def sorted_pairs(expert_rows):
        """The MoE's CPU path around ``expert_rows(experts, x, expert_of, token_of)`` (pairs
        sorted by expert), combined as the MoE combines them."""

        def run(x, ids, w, experts):
            flat = ids.reshape(-1)
            order = jnp.argsort(flat, stable=True)
            token = order // TOP_K
            ys = expert_rows(experts, x, flat[order], token)
            return jnp.zeros_like(x).at[token].add(ys * w.reshape(-1)[order][:, None])

        return run

    def gather(experts, x, expert_of, token_of):
        gate, up, down = experts
        xs = x[token_of]
        hidden = jax.nn.silu(jnp.einsum("pd,pdf->pf", xs, gate[expert_of]))
        hidden = hidden * jnp.einsum("pd,pdf->pf", xs, up[expert_of])
        return jnp.einsum("pf,pfd->pd", hidden, down[expert_of])

    def pair_loop(experts, x, expert_of, token_of):
        gate, up, down = experts

        def pair(p, out):
            e, row = expert_of[p], x[token_of[p]][None]
            hidden = jax.nn.silu(row @ gate[e]) * (row @ up[e])
            return out.at[p].set((hidden @ down[e])[0])

        zeros = jnp.zeros((len(expert_of), DIM), x.dtype)
        return jax.lax.fori_loop(0, len(expert_of), pair, zeros)

    forms = {
        "tile loop": lambda experts, x, e, t: _tiled_experts(experts, x[t], e),
        "gather": gather,
        "every expert": _every_expert,
        "pair loop": pair_loop,
    }
    return {name: jax.jit(sorted_pairs(f)) for name, f in forms.items()}


def measure(tokens: list[int], rounds: int, calls: int) -> list[dict]:
    rng = np.random.default_rng(0)

    def weights(*shape):
        return jnp.asarray((rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32))

    experts = weights(EXPERTS, DIM, WIDTH), weights(EXPERTS, DIM, WIDTH)
    experts += (weights(EXPERTS, WIDTH, DIM),)
    forms = _forms()
    results = []
    for n in tokens:
        x = jnp.asarray(rng.standard_normal((n, DIM)).astype(np.float32))
        ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(n)])
        ids = jnp.asarray(ids.astype(np.int32))
        w = jnp.asarray(rng.random((n, TOP_K)).astype(np.float32))
        args = (x, ids, w, experts)
        reference = np.asarray(forms["tile loop"](*args))
        calls_of = {name: (lambda f=f, args=args: f(*args)) for name, f in forms.items()}
        seconds = interleaved_s(calls_of, rounds, calls)
        for name, f in forms.items():
            error = np.abs(np.asarray(f(*args)) - reference).max()
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
