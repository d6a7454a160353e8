"""Grouped-query attention layers: full (GQA, cache grows) and sliding-window (SWA, ring cache).

    q, k, v = W_q x, W_k x, W_v x;  q, k ← rms_norm per head (optional);  q, k ← RoPE (partial)
    o = attention(q, cache_k, cache_v)   (· sigmoid(W_gate x) per head when output-gated)

The attention sees the whole growing cache (GQA) or the previous ring contents plus the new tokens
(SWA), masked by position (ops/attention/reference.py); given a `PagedKvState`, a decode token
attends over the pages its table maps instead (ops/attention/paged.py). Sink logits, when
configured, are per head. ``GqaMixer`` is the layer as a Flax NNX module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from prfaas_jax.config import AttentionConfig, LayerKind, ModelConfig
from prfaas_jax.model import initializers as init
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.mixers.kv_cache import (
    growing_positions,
    ring_positions,
    write_growing,
    write_pages,
    write_ring,
)
from prfaas_jax.model.norms import rms_norm
from prfaas_jax.model.rope import apply_rope
from prfaas_jax.model.state import KvState, PagedKvState, WindowKvState
from prfaas_jax.ops.dispatch import attention_op, paged_attention_op
from prfaas_jax.ops.precision import upcast
from prfaas_jax.ops.weight_dot import weight_dot


def attention_section(cfg: ModelConfig, kind: LayerKind) -> AttentionConfig:
    """The config section of a GQA (``[attention]``) or SWA (``[swa]``) layer."""
    return cfg.attention if kind is LayerKind.GQA else cfg.swa


class GqaMixer(nnx.Module):
    """A GQA (``kind`` GQA, growing cache) or sliding-window (SWA, ring cache) attention layer."""

    def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs) -> None:
        self.cfg, self.kind = cfg, kind
        att, dim, dtype = attention_section(cfg, kind), cfg.hidden_dim, jnp.dtype(cfg.dtype)
        self.q_proj = init.dense(rngs, (dim, att.num_heads * att.head_dim), dtype)
        self.k_proj = init.dense(rngs, (dim, att.num_kv_heads * att.head_dim), dtype)
        self.v_proj = init.dense(rngs, (dim, att.num_kv_heads * att.value_dim), dtype)
        self.o_proj = init.dense(rngs, (att.num_heads * att.value_dim, dim), dtype)
        if att.use_qk_norm:
            self.q_norm = init.ones((att.head_dim,), dtype)
            self.k_norm = init.ones((att.head_dim,), dtype)
        if att.use_output_gate:
            self.gate_proj = init.dense(rngs, (dim, att.num_heads * att.value_dim), dtype)
        if att.use_sinks:
            self.sinks = init.uniform(rngs, (att.num_heads,), -1.0, 1.0, dtype)

    def __call__(
        self, x_BTD: jax.Array, state: KvState | WindowKvState | PagedKvState, ctx: StepContext
    ) -> tuple[jax.Array, KvState | WindowKvState | PagedKvState]:
        att = attention_section(self.cfg, self.kind)
        heads = "b t (h d) -> b t h d"
        q = rearrange(weight_dot(x_BTD, self.q_proj[...]), heads, d=att.head_dim)
        k = rearrange(weight_dot(x_BTD, self.k_proj[...]), heads, d=att.head_dim)
        v = rearrange(weight_dot(x_BTD, self.v_proj[...]), heads, d=att.value_dim)
        if att.use_qk_norm:
            q = rms_norm(q, self.q_norm[...], self.cfg.norm_eps)
            k = rms_norm(k, self.k_norm[...], self.cfg.norm_eps)
        rope = {"kind": att.rope, "rotary_dim": att.rotary_dim, "theta": att.rope_theta}
        q = apply_rope(q, ctx.positions, **rope)
        k = apply_rope(k, ctx.positions, **rope)

        window = att.window if self.kind is LayerKind.SWA else 0
        sinks = self.sinks[...] if att.use_sinks else None
        if isinstance(state, PagedKvState):  # one decode token, the cache in pages
            state = write_pages(state, k[:, 0], v[:, 0], ctx, ring=bool(window))
            out = paged_attention_op(ctx.impl)(
                q[:, 0],
                state.first,
                state.second,
                ctx.new_lengths,
                state.table,
                scale=att.head_dim**-0.5,
                window=window,
                sinks=sinks,
                ring_pages=state.table.shape[1] if window else 0,
            )
            return self._output(x_BTD, out[:, None]), state

        if self.kind is LayerKind.GQA:
            state = KvState(k=write_growing(state.k, k, ctx), v=write_growing(state.v, v, ctx))
            keys, values = state.k, state.v
            kv_pos = growing_positions(state.k.shape[1], ctx.new_lengths)
        else:
            # Attend over the ring *before* this call's writes plus the new tokens themselves: a
            # write could otherwise evict a position that an earlier query of this call still sees.
            old_pos = ring_positions(state.k.shape[1], ctx.lengths)
            new_pos = jnp.where(ctx.valid, ctx.positions, -1)
            keys = jnp.concatenate([state.k, k.astype(state.k.dtype)], axis=1)
            values = jnp.concatenate([state.v, v.astype(state.v.dtype)], axis=1)
            kv_pos = jnp.concatenate([old_pos, new_pos], axis=1)
            state = WindowKvState(k=write_ring(state.k, k, ctx), v=write_ring(state.v, v, ctx))

        out = attention_op(ctx.impl)(
            q,
            keys,
            values,
            q_pos=ctx.positions,
            kv_pos=kv_pos,
            scale=att.head_dim**-0.5,
            window=window,
            sinks=sinks,
        )
        return self._output(x_BTD, out), state

    def _output(self, x_BTD: jax.Array, out: jax.Array) -> jax.Array:
        """The heads' outputs ``[B, T, H, V]`` gated (when configured) and projected back."""
        att = attention_section(self.cfg, self.kind)
        if att.use_output_gate:
            gate = weight_dot(x_BTD, self.gate_proj[...])
            gate = rearrange(gate, "b t (h d) -> b t h d", d=att.value_dim)
            out = (upcast(out) * jax.nn.sigmoid(upcast(gate))).astype(out.dtype)
        y = rearrange(out, "b t h v -> b t (h v)").astype(x_BTD.dtype)
        return weight_dot(y, self.o_proj[...])
