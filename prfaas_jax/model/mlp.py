"""Feed-forward blocks: dense SwiGLU and a routed mixture of experts.

SwiGLU: ``down(silu(x W_gate) ⊙ x W_up)``.

MoE, per token ``x``: scores ``s = softmax(x W_router)`` or ``sigmoid(x W_router)``; the top-k
experts are *selected* on ``s + b`` (``b`` a learned selection bias, DeepSeek-V3 style, or 0) but
*weighted* by ``s`` — renormalised to sum to one if configured — times ``routed_scale``. With
``num_groups > 1`` selection is group-limited (DeepSeek-V3): each group of experts is scored by the
sum of its two best ``s + b``, and experts outside the best ``topk_groups`` groups are not eligible.
Always-on shared experts are one SwiGLU (width ``MoeConfig.shared_width``) added on top, scaled per
token by ``sigmoid(x w_gate)`` when ``use_shared_gate`` (Qwen3-Next).
Routed experts run as grouped matmuls over token copies sorted by expert, so compute scales with
``top_k``, not with the number of experts: ``lax.ragged_dot`` on accelerators; on CPU, where XLA
expands ``ragged_dot`` into a dense matmul over every expert (plus a copy of each weight per
call), a loop over row tiles that each belong to one expert (``_tiled_experts``); a decode
step's few tokens, when they route to about every expert anyway, run every expert on every token
instead (``_every_expert``; ``_cpu_experts`` chooses).

``SwiGLU`` and ``MoE`` are the blocks as Flax NNX modules; the routing and expert arithmetic are
functions of arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from prfaas_jax.config import MoeConfig, MoeScoring
from prfaas_jax.model import initializers as init
from prfaas_jax.ops.precision import upcast
from prfaas_jax.ops.weight_dot import expert_dot, weight_dot


class SwiGLU(nnx.Module):
    """``down(silu(x W_gate) ⊙ x W_up)``."""

    def __init__(self, dim: int, width: int, dtype, *, rngs: nnx.Rngs) -> None:
        self.gate = init.dense(rngs, (dim, width), dtype)
        self.up = init.dense(rngs, (dim, width), dtype)
        self.down = init.dense(rngs, (width, dim), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(weight_dot(x, self.gate[...])) * weight_dot(x, self.up[...])
        return weight_dot(hidden, self.down[...])


def select_experts(
    router_DE: jax.Array, score_bias_E: jax.Array | None, moe: MoeConfig, x_ND: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Top-k expert ids ``[N, k]`` and their combine weights ``[N, k]`` (fp32)."""
    # Router logits in fp32: near-ties between experts must not depend on the model dtype.
    logits = upcast(x_ND) @ upcast(router_DE)
    if moe.scoring is MoeScoring.SOFTMAX:
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    select = scores + upcast(score_bias_E) if score_bias_E is not None else scores
    if moe.num_groups > 1:
        select = _limit_to_top_groups(select, moe)
    _, expert_ids = jax.lax.top_k(select, moe.top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if moe.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return expert_ids, weights * moe.routed_scale


def _limit_to_top_groups(select_NE: jax.Array, moe: MoeConfig) -> jax.Array:
    """``select`` with every expert outside the ``topk_groups`` best groups set to −∞."""
    tokens = select_NE.shape[0]
    grouped = select_NE.reshape(tokens, moe.num_groups, -1)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
    _, best = jax.lax.top_k(group_score, moe.topk_groups)
    keep = jnp.zeros((tokens, moe.num_groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(select_NE.shape)


_MAX_TILE_LEN = 128  # rows per expert tile on CPU: large enough for an efficient matmul


@jax.jit  # traced once per shape: a model's MoE layers of one shape share the jaxpr
def _tiled_experts(
    experts: tuple[jax.Array, jax.Array, jax.Array], xs_PD: jax.Array, experts_P: jax.Array
) -> jax.Array:
    """Expert ``experts_P[i]``'s SwiGLU of each row of ``xs_PD`` (rows sorted by expert);
    ``experts`` holds the stacked ``(gate [E,D,F], up [E,D,F], down [E,F,D])`` weights.

    Each expert's rows are padded to whole tiles of ``tile_len`` (about rows per expert, so a
    decode step's handful of rows is not padded to 128); a ``lax.map`` runs one tile per step
    with that expert's weights and skips the unused tiles of the static bound.
    """
    gate_EDF, up_EDF, down_EFD = experts
    num_experts = gate_EDF.shape[0]
    num_pairs, dim = xs_PD.shape
    per_expert = -(-num_pairs // num_experts)
    tile_len = min(_MAX_TILE_LEN, 1 << (per_expert - 1).bit_length())
    num_tiles = -(-num_pairs // tile_len) + min(num_experts, num_pairs)  # bound on tiles in use
    sizes = jnp.bincount(experts_P, length=num_experts)
    tiles = -(-sizes // tile_len)
    tile_end = jnp.cumsum(tiles)
    first_row = jnp.cumsum(sizes) - sizes
    dest_P = (tile_end - tiles)[experts_P] * tile_len + jnp.arange(num_pairs) - first_row[experts_P]
    padded = jnp.zeros((num_tiles * tile_len, dim), xs_PD.dtype).at[dest_P].set(xs_PD)
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right")

    def one_tile(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        x, e, index = args

        def run(x: jax.Array) -> jax.Array:
            e_ = jnp.minimum(e, num_experts - 1)
            hidden = jax.nn.silu(weight_dot(x, gate_EDF[e_])) * weight_dot(x, up_EDF[e_])
            return weight_dot(hidden, down_EFD[e_])

        return jax.lax.cond(index < tile_end[-1], run, jnp.zeros_like, x)

    tiles_out = jax.lax.map(
        one_tile,
        (padded.reshape(num_tiles, tile_len, dim), tile_expert, jnp.arange(num_tiles)),
    )
    return tiles_out.reshape(-1, dim)[dest_P]


@jax.jit
def _every_expert(
    experts: tuple[jax.Array, jax.Array, jax.Array],
    x_ND: jax.Array,
    experts_P: jax.Array,
    tokens_P: jax.Array,
) -> jax.Array:
    """Expert ``experts_P[i]``'s SwiGLU of token ``tokens_P[i]`` of ``x_ND``, from every expert
    run on every token (one batched product per matrix, ``expert_dot``): when a step's tokens
    route to about every expert anyway, reading each expert once in one call beats a loop over
    tiles."""
    gate_EDF, up_EDF, down_EFD = experts
    x_END = jnp.broadcast_to(x_ND, (gate_EDF.shape[0], *x_ND.shape))
    hidden = jax.nn.silu(expert_dot(x_END, gate_EDF)) * expert_dot(x_END, up_EDF)
    return expert_dot(hidden, down_EFD)[experts_P, tokens_P]


# Up to this many (token, expert) pairs, if they are at least half as many as the experts, every
# expert runs on every token: the tile loop's overhead then costs more than reading the unrouted
# experts (bench/moe_decode.py: 0.4–0.85× the tile loop's time from 2 to 32 tokens of top-2 of 8).
_MAX_EVERY_EXPERT_PAIRS = 64


def _cpu_experts(
    experts: tuple[jax.Array, jax.Array, jax.Array],
    x_ND: jax.Array,
    experts_P: jax.Array,
    tokens_P: jax.Array,
) -> jax.Array:
    """Expert ``experts_P[i]``'s SwiGLU of token ``tokens_P[i]`` of ``x_ND`` (pairs sorted by
    expert), in the form that is faster on CPU for this many pairs."""
    pairs, num_experts = experts_P.shape[0], experts[0].shape[0]
    if num_experts <= 2 * pairs <= 2 * _MAX_EVERY_EXPERT_PAIRS:
        return _every_expert(experts, x_ND, experts_P, tokens_P)
    return _tiled_experts(experts, x_ND[tokens_P], experts_P)


class MoE(nnx.Module):
    """Routed experts (top-k of ``num_experts``) plus optional shared experts (module docstring)."""

    def __init__(self, dim: int, moe: MoeConfig, dtype, *, rngs: nnx.Rngs) -> None:
        self.moe = moe
        width, experts = moe.expert_dim, moe.num_experts
        self.router = init.dense(rngs, (dim, experts), jnp.float32)
        self.experts_gate = init.dense(rngs, (experts, dim, width), dtype)
        self.experts_up = init.dense(rngs, (experts, dim, width), dtype)
        self.experts_down = init.dense(rngs, (experts, width, dim), dtype)
        if moe.use_score_bias:
            self.score_bias = init.uniform(rngs, (experts,), -0.1, 0.1)
        if moe.num_shared_experts:
            self.shared = SwiGLU(dim, moe.shared_width, dtype, rngs=rngs)
        if moe.use_shared_gate:
            self.shared_gate = init.dense(rngs, (dim, 1), dtype)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        moe = self.moe
        batch, seq_len, dim = x_BTD.shape
        x = x_BTD.reshape(-1, dim)
        score_bias = self.score_bias[...] if moe.use_score_bias else None
        expert_ids, weights = select_experts(self.router[...], score_bias, moe, x)
        flat_experts = expert_ids.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        token_of = order // moe.top_k
        gate, up, down = self.experts_gate[...], self.experts_up[...], self.experts_down[...]
        if jax.default_backend() == "cpu":
            ys = _cpu_experts((gate, up, down), x, flat_experts[order], token_of)
        else:
            xs = x[token_of]
            group_sizes = jnp.bincount(flat_experts, length=moe.num_experts).astype(jnp.int32)
            # Narrowed expert weights (model/narrow_weights.py) are read as stored.
            rows, wide = xs.astype(gate.dtype), xs.dtype
            hidden = jax.nn.silu(
                jax.lax.ragged_dot(rows, gate, group_sizes, preferred_element_type=wide)
            ) * jax.lax.ragged_dot(rows, up, group_sizes, preferred_element_type=wide)
            hidden = hidden.astype(down.dtype)
            ys = jax.lax.ragged_dot(hidden, down, group_sizes, preferred_element_type=wide)
        combine = weights.reshape(-1)[order].astype(ys.dtype)
        out = jnp.zeros_like(x).at[token_of].add(ys * combine[:, None])
        if moe.num_shared_experts:
            shared = self.shared(x)
            if moe.use_shared_gate:
                shared = shared * jax.nn.sigmoid(weight_dot(x, self.shared_gate[...]))
            out = out + shared
        return out.reshape(batch, seq_len, dim)
