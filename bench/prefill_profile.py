"""Where a prefill's time goes: each part of one prompt's prefill compiled and timed alone,
against the time its counted FLOPs take at this machine's matmul peak.

The model is bench/engine.py's (``PRESET``: the random Kimi-Linear checkpoint, KDA, KDA, KDA,
MLA, a dense first MLP then MoE, vocab 32,000, fp32, loaded by ``load_hf``). For each T in
``--lengths``, one prompt of T tokens (batch 1, one chunk) goes through:

    engine.prefill()   what bench/engine.py times: token upload, the compiled block, the first
                       token's sample, the result state (``impl`` = bench/engine.py's ``IMPL``)
    compiled block     the engine's jitted block alone, on a fresh state
    parts              each compiled on its own, on real inputs (the embedded prompt, a fresh
                       state of T tokens):
                         embed        the T rows of the embedding table
                         L<i> mixer   RMSNorm + the layer's prefill (for a linear layer once per
                                      ``--impls``: ``reference`` is the token scan, ``chunk`` the
                                      chunked form), and a delta-rule layer's op alone (q, k,
                                      v, g, β in, output and final state out) below it
                         L<i> mlp     RMSNorm + SwiGLU or MoE
                         head         final RMSNorm + LM head at the last position

Each time is the best of ``--repeats`` calls after a warm-up. A part's FLOPs are its share of
``prefill_flops`` (planning/prefill_cost.py ``prefill_flops_by_part``: projections, attention or
the chunked linear-attention state, the MoE's active experts); its bound is those FLOPs at the
matmul peak measured in the same run (bench/roofline.py). The sum of the parts beside the block
shows what XLA gains by compiling them together; each part's time beside its bound shows which
of them keeps the prefill from the matmul peak. A linear layer's FLOPs are counted for the
chunked form whichever form runs, so the token scan's fraction is of the same work.

    python bench/prefill_profile.py [--lengths 2048] [--impls reference,chunk] [--repeats 5]
                                    [--json]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.config import LayerKind, MlpKind
from prfaas_jax.engine.prefill import PrefillEngine, _prefill_block
from prfaas_jax.model import init_state
from prfaas_jax.model.hybrid import bind
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.ops.dispatch import Impl, linear_op
from prfaas_jax.planning.prefill_cost import prefill_flops_by_part

# tests/model/hf holds the checkpoint builder bench_model uses (hf_fixtures; not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model" / "hf"))
from engine import IMPL  # bench/ is the script's own directory
from layer_parts import bench_model, mixer_part, mlp_part, parts_table
from roofline import ceilings
from timing import best_s


def _context(length: int, impl: Impl) -> StepContext:
    return StepContext(
        lengths=jnp.zeros((1,), jnp.int32),
        valid_len=jnp.full((1,), length, jnp.int32),
        seq_len=length,
        impl=impl,
        decode=False,
    )


def _delta_rule_call(cfg, kind: LayerKind, impl: Impl, length: int) -> Callable[[], object]:
    """The layer's delta-rule op alone (``linear_op``), on inputs shaped and ranged as the
    mixer feeds it: unit-norm q and k, gates g < 0 (per channel for KDA), β in (0, 1)."""
    lin = cfg.linear
    keys = jax.random.split(jax.random.PRNGKey(length), 5)
    shape_k = (1, length, lin.num_v_heads, lin.head_dim)
    q, k = (
        x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        for x in (jax.random.normal(keys[0], shape_k), jax.random.normal(keys[1], shape_k))
    )
    v = jax.random.normal(keys[2], (1, length, lin.num_v_heads, lin.v_head_dim))
    gate_shape = shape_k if kind is LayerKind.KDA else shape_k[:3]
    g = -jax.nn.softplus(jax.random.normal(keys[3], gate_shape))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], shape_k[:3]))
    op = jax.jit(lambda *a: linear_op(str(kind), impl)(*a, output_final_state=True))
    return lambda: op(q, k, v, g, beta)


def profile(engine: PrefillEngine, length: int, impls: list[Impl], repeats: int, peak: float):
    cfg, params = engine.cfg, engine.params
    flops = prefill_flops_by_part(cfg, length)
    rng = np.random.default_rng(length)
    ids = rng.integers(0, cfg.vocab_size, length)
    rows: list[dict] = []

    def add(name: str, seconds: float, part_flops: float | None) -> None:
        bound_us = None if part_flops is None else 1e6 * part_flops / peak
        rows.append({"part": name, "us": 1e6 * seconds, "flops": part_flops, "bound_us": bound_us})

    add("engine.prefill()", best_s(lambda: engine.prefill(ids).state, repeats), flops.total)

    tokens = jnp.asarray(ids, jnp.int32)[None]
    valid = jnp.full((1,), length, jnp.int32)
    fresh = init_state(cfg, 1, length)
    block = jax.jit(_prefill_block, static_argnames=("cfg", "impl"))

    def run_block():  # not donated, so one fresh state serves every call
        return block(params, tokens, valid, fresh, cfg=cfg, impl=engine.impl)

    add("compiled block", best_s(run_block, repeats), flops.total)
    parts_from = len(rows)

    embed = jax.jit(lambda p, t: p["embed"][t])
    h = embed(params, tokens)
    add("embed", best_s(lambda: embed(params, tokens), repeats), None)

    def run_mixer_part(p, h, layer_state, index, impl):
        return mixer_part(cfg, p, h, layer_state, _context(length, impl), index)

    mixer = jax.jit(run_mixer_part, static_argnames=("index", "impl"))
    mlp = jax.jit(functools.partial(mlp_part, cfg), static_argnames="index")
    for index, kind in enumerate(cfg.layers):
        layer_state = fresh.layers[index]
        forms = impls if kind.is_linear else [engine.impl]
        for impl in forms:
            name = f"L{index} {kind.value} mixer" + (f" ({impl.value})" if kind.is_linear else "")

            def run_mixer(index=index, layer_state=layer_state, impl=impl):
                return mixer(params, h, layer_state, index=index, impl=impl)

            seconds = best_s(run_mixer, repeats)
            # The engine's own form counts toward the sum of the parts; others are shown beside.
            add(name, seconds, flops.mixers[index])
            rows[-1]["in_sum"] = impl is engine.impl
            if kind in (LayerKind.KDA, LayerKind.GDN):
                op_s = best_s(_delta_rule_call(cfg, kind, impl, length), repeats)
                add(f"  of which the delta rule ({impl.value})", op_s, flops.cores[index])
                rows[-1]["in_sum"] = False
        kind_name = "MoE" if cfg.mlps[index] is MlpKind.MOE else "dense"
        run_mlp = lambda index=index: mlp(params, h, index=index)  # noqa: E731
        add(f"L{index} {kind_name} mlp", best_s(run_mlp, repeats), flops.mlps[index])

    last = jnp.full((1,), length - 1, jnp.int32)
    head = jax.jit(lambda p, h: bind(cfg, p).head(h, last_B=last))
    add("head", best_s(lambda: head(params, h), repeats), flops.head)
    parts_s = sum(r["us"] for r in rows[parts_from:] if r.get("in_sum", True)) / 1e6
    add("sum of the parts", parts_s, flops.total)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lengths", type=parse_int_list, default=[2048], help="tokens (2048)")
    parser.add_argument(
        "--impls",
        default="reference,chunk",
        help="linear-layer forms to time (reference,chunk; pallas runs interpreted on a CPU)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per part (5)")
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    if not args.lengths or min(args.lengths) < 1 or args.repeats < 1:
        parser.error("--lengths and --repeats must be ≥ 1")
    try:
        impls = [Impl(name) for name in args.impls.split(",") if name]
    except ValueError as err:
        parser.error(f"--impls: {err}")
    if not impls:
        parser.error("--impls names no form")
    cfg, params = bench_model()
    machine = ceilings()
    result = {"ceilings": machine, "options": vars(args), "lengths": {}}
    for length in args.lengths:
        engine = PrefillEngine(cfg, params, impl=IMPL, chunk_len=length)
        rows = profile(engine, length, impls, args.repeats, machine["matmul_flops"])
        result["lengths"][length] = rows
        if args.json:
            continue
        print(
            f"prefill T = {length}, batch 1, impl {IMPL}; matmul peak "
            f"{machine['matmul_flops'] / 1e9:.0f} GFLOP/s"
        )
        scale = {"time": 1e3, "digits": 2, "work": 1e9}
        headers = ["part", "ms", "GFLOP", "bound ms", "of peak"]
        print(parts_table(rows, work="flops", scale=scale, headers=headers))
        print("· not in the sum of the parts (another form, or a piece of the row above)")
        print()
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
