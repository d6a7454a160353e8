"""Where a training step's time goes: each piece of the ``tiny`` layout jitted alone, forward
and forward + backward, at one batch shape.

The model is the ``tiny`` preset (KDA, KDA, KDA, MLA; a dense first MLP, then MoE; the layout
bench/train.py trains), seeded weights, on ``--batch-size`` × ``--seq-len`` tokens of random
hidden states, prefilled from an empty state with the ops training runs (``--impl``: by default
``train.loop.default_train_impl``, the token scans on a CPU):

    L<i> mixer      the layer's mixer (KDA: projections, short conv, the chunked delta rule,
                    output norm and gate; MLA: projections, rope, cache write, attention)
    L<i> mlp        SwiGLU or MoE
    delta rule      the KDA and GDN ops of ``--impl`` alone at the KDA mixers' shapes
    lightning       the Lightning op of ``--impl`` alone at the same shapes
    attention       ``ops.attention.reference.attention`` alone at the MLA mixer's shapes
    loss            the LM head and the cross-entropy of bench/train.py's step

Each time is the median of ``--calls`` calls after a warm-up; forward + backward is
``jax.value_and_grad`` of the piece's summed squares (the loss: of itself) with respect to its
parameters and inputs. A backward several times its forward marks the piece that holds the step
back from ~3× its forward pass.

    python bench/train_profile.py [--batch-size 16] [--seq-len 256] [--calls 8] [--impl IMPL]
                                  [--json]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from timing import median_s  # bench/ is the script's own directory

from prfaas_jax.cli.flags import print_json
from prfaas_jax.config import LayerKind, load_model_config
from prfaas_jax.model.hybrid import bind, init_params
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.state import init_state
from prfaas_jax.ops.attention.reference import attention
from prfaas_jax.ops.dispatch import Impl, linear_op
from prfaas_jax.tables import table
from prfaas_jax.train.loop import TRAINABLE_IMPLS, default_train_impl


def _time(name: str, f: Callable, args: tuple, calls: int) -> dict:
    """``f(*args)`` → an array; forward, and value_and_grad of its summed squares."""
    forward = jax.jit(f)
    both = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), tuple(range(len(args)))))
    fwd = 1e3 * median_s(lambda: forward(*args), calls)
    total = 1e3 * median_s(lambda: both(*args), calls)
    return {"piece": name, "forward_ms": fwd, "forward_backward_ms": total}


def profile(batch: int, seq_len: int, calls: int, impl: Impl) -> list[dict]:
    cfg = load_model_config("tiny")
    params = init_params(jax.random.PRNGKey(0), cfg)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 16))
    h = jax.random.normal(next(keys), (batch, seq_len, cfg.hidden_dim))
    state = init_state(cfg, batch, seq_len)
    ctx = StepContext(
        lengths=jnp.zeros(batch, jnp.int32),
        valid_len=jnp.full(batch, seq_len, jnp.int32),
        seq_len=seq_len,
        impl=impl,
        decode=False,
    )
    rows = []
    for index, kind in enumerate(cfg.layers):
        layer = params["layers"][index]

        def mixer(p, h, index=index):
            return (
                bind(cfg, {**params, "layers": _with(params, index, p)})
                .layers[index]
                .mixer(h, state.layers[index], ctx)[0]
            )

        def mlp(p, h, index=index):
            return bind(cfg, {**params, "layers": _with(params, index, p)}).layers[index].mlp(h)

        rows.append(_time(f"L{index} {kind.value} mixer", mixer, (layer, h), calls))
        rows.append(_time(f"L{index} {cfg.mlps[index].value} mlp", mlp, (layer, h), calls))

    lin = cfg.linear
    heads, k_dim, v_dim = lin.num_v_heads, lin.head_dim, lin.v_head_dim
    q, k = (jax.random.normal(next(keys), (batch, seq_len, heads, k_dim)) for _ in range(2))
    v = jax.random.normal(next(keys), (batch, seq_len, heads, v_dim))
    g = -jax.nn.softplus(jax.random.normal(next(keys), (batch, seq_len, heads, k_dim)))
    beta = jax.nn.sigmoid(jax.random.normal(next(keys), (batch, seq_len, heads)))
    # Each linear op alone at these shapes: what --impl changes (the mixers above run KDA only).
    kda, gdn = linear_op("kda", impl), linear_op("gdn", impl)
    rule = lambda q, k, v, g, beta: kda(q, k, v, g, beta)[0]  # noqa: E731
    rows.append(_time(f"delta rule (kda, {impl.value})", rule, (q, k, v, g, beta), calls))
    rule = lambda q, k, v, g, beta: gdn(q, k, v, g, beta)[0]  # noqa: E731
    rows.append(_time(f"delta rule (gdn, {impl.value})", rule, (q, k, v, g[..., 0], beta), calls))
    lightning = functools.partial(linear_op("lightning", impl), decay=-jnp.linspace(0.1, 1, heads))
    rows.append(_time(f"lightning ({impl.value})", lambda *a: lightning(*a)[0], (q, k, v), calls))

    if LayerKind.MLA in cfg.layers:
        mla = cfg.mla
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        shape = (batch, seq_len, mla.num_heads)
        q, k = (jax.random.normal(next(keys), (*shape, qk)) for _ in range(2))
        v = jax.random.normal(next(keys), (*shape, mla.v_head_dim))
        positions = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))

        def attend(q, k, v):
            return attention(q, k, v, q_pos=positions, kv_pos=positions, scale=qk**-0.5)

        rows.append(_time("attention (MLA shapes)", attend, (q, k, v), calls))

    targets = jax.random.randint(next(keys), (batch, seq_len), 0, cfg.vocab_size)

    def loss(p, h):
        logits = bind(cfg, p).head(h)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))

    forward = jax.jit(loss)
    both = jax.jit(jax.value_and_grad(loss, (0, 1)))
    rows.append(
        {
            "piece": "loss (LM head + cross-entropy)",
            "forward_ms": 1e3 * median_s(lambda: forward(params, h), calls),
            "forward_backward_ms": 1e3 * median_s(lambda: both(params, h), calls),
        }
    )
    return rows


def _with(params: dict, index: int, layer: dict) -> tuple:
    layers = list(params["layers"])
    layers[index] = layer
    return tuple(layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch-size", type=int, default=16, help="sequences (16)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens each (256)")
    parser.add_argument("--calls", type=int, default=8, help="timed calls per piece (8)")
    parser.add_argument(
        "--impl",
        choices=[impl.value for impl in TRAINABLE_IMPLS],
        default=default_train_impl().value,
        help="the ops the pieces run (default: what training runs on this backend)",
    )
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.seq_len, args.calls) < 1:
        parser.error("--batch-size, --seq-len and --calls must be ≥ 1")
    rows = profile(args.batch_size, args.seq_len, args.calls, Impl(args.impl))
    if not args.json:
        print(f"tiny, {args.batch_size} × {args.seq_len} tokens, median of {args.calls} calls")
        body = [
            [
                r["piece"],
                f"{r['forward_ms']:.1f}",
                f"{r['forward_backward_ms']:.1f}",
                f"{r['forward_backward_ms'] / r['forward_ms']:.1f}×",
            ]
            for r in rows
        ]
        print(table(body, ["piece", "forward ms", "forward + backward ms", "ratio"]))
        print()
    print_json({"rows": rows, "options": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
