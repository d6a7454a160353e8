"""Multi-head latent attention layer (DeepSeek-V3 / Kimi Linear / Ring-2.5; docs/model-configs.md).

    q        = W_q x                 or  W_qb rms_norm(W_qa x)              (per head [nope ‖ rope])
    c ‖ k_r  = W_kva x;   c ← rms_norm(c);   k_r ← RoPE(k_r)   (k_r shared by every head)
    cache   ← c ‖ k_r                       (the canonical MLA state: R + Dr values per token)

With ``use_output_gate`` (Bailing) each head's output is scaled by ``sigmoid(w_h · x)`` before
``W_o``. The latent norms use ``MlaConfig.latent_norm_eps`` (HF checkpoints: 1e-6).

Prefill expands the latent cache per head (``k = [W_UK c ‖ k_r]``, ``v = W_UV c``) and runs
ordinary attention; decode uses the absorbed form over the latent cache (or over its pages, given
a `PagedKvState`: ops/attention/paged.py). Both forms live in ops/attention/reference.py and give
the same numbers up to rounding — a test holds them to it.
``MlaMixer`` is the layer as a Flax NNX module; ``AbsorbedKvB`` is ``kv_b`` split once into
its absorbing halves, laid out head-major — a decode engine's view of the weights
(model/decode_weights.py), which the absorbed decode reads without per-step copies.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from prfaas_jax.config import Impl, ModelConfig
from prfaas_jax.model import initializers as init
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.mixers.kv_cache import growing_positions, write_growing, write_pages
from prfaas_jax.model.norms import rms_norm
from prfaas_jax.model.rope import apply_rope
from prfaas_jax.model.state import MlaState, PagedKvState
from prfaas_jax.ops.attention import mla_decode_absorbed_heads
from prfaas_jax.ops.dispatch import attention_op, mla_decode_op, paged_mla_op
from prfaas_jax.ops.precision import upcast
from prfaas_jax.ops.weight_dot import weight_dot


class AbsorbedKvB(NamedTuple):
    """``kv_b`` ``[R, H·(N + V)]`` as its absorbing halves, per head and contracted on the last
    axis as stored: what the absorbed decode multiplies (ops/attention/reference.py)."""

    w_uk: jax.Array  # [H, R, N] latent → the heads' k_nope, applied to the queries
    w_uv: jax.Array  # [H, V, R] latent → the heads' values, applied to the attended latents

    @classmethod
    def of(cls, kv_b: jax.Array, heads: int, nope: int) -> AbsorbedKvB:
        w_kv = rearrange(kv_b, "r (h d) -> h r d", h=heads)
        return cls(w_kv[..., :nope], jnp.swapaxes(w_kv[..., nope:], 1, 2))

    def per_latent(self) -> tuple[jax.Array, jax.Array]:
        """``(W_UK [R, H, N], W_UV [R, H, V])``, the halves as ``kv_b`` holds them."""
        return jnp.transpose(self.w_uk, (1, 0, 2)), jnp.transpose(self.w_uv, (2, 0, 1))


class MlaMixer(nnx.Module):
    """An MLA layer: low-rank (or full) queries, one shared latent ``c ‖ k_r`` per token."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        mla, dim, dtype = cfg.mla, cfg.hidden_dim, jnp.dtype(cfg.dtype)
        q_out = mla.num_heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a = init.dense(rngs, (dim, mla.q_lora_rank), dtype)
            self.q_a_norm = init.ones((mla.q_lora_rank,), dtype)
            self.q_b = init.dense(rngs, (mla.q_lora_rank, q_out), dtype)
        else:
            self.q_proj = init.dense(rngs, (dim, q_out), dtype)
        self.kv_a = init.dense(rngs, (dim, mla.kv_lora_rank + mla.qk_rope_head_dim), dtype)
        self.kv_a_norm = init.ones((mla.kv_lora_rank,), dtype)
        kv_b_out = mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b = init.dense(rngs, (mla.kv_lora_rank, kv_b_out), dtype)
        self.o_proj = init.dense(rngs, (mla.num_heads * mla.v_head_dim, dim), dtype)
        if mla.use_output_gate:
            self.gate_proj = init.dense(rngs, (dim, mla.num_heads), dtype)

    def __call__(
        self, x_BTD: jax.Array, state: MlaState | PagedKvState, ctx: StepContext
    ) -> tuple[jax.Array, MlaState | PagedKvState]:
        mla = self.cfg.mla
        heads, nope, rope_dim = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        positions = ctx.positions
        latent_eps = mla.latent_norm_eps or self.cfg.norm_eps
        rope = {"kind": mla.rope, "rotary_dim": rope_dim, "theta": mla.rope_theta}

        if mla.q_lora_rank:
            q_low = rms_norm(weight_dot(x_BTD, self.q_a[...]), self.q_a_norm[...], latent_eps)
            q = weight_dot(q_low, self.q_b[...])
        else:
            q = weight_dot(x_BTD, self.q_proj[...])
        q = rearrange(q, "b t (h d) -> b t h d", h=heads)
        q_nope = q[..., :nope]
        q_rope = apply_rope(q[..., nope:], positions, **rope)

        kv = weight_dot(x_BTD, self.kv_a[...])
        c_kv = rms_norm(kv[..., : mla.kv_lora_rank], self.kv_a_norm[...], latent_eps)
        k_rope = apply_rope(kv[..., None, mla.kv_lora_rank :], positions, **rope)[:, :, 0]
        kv_b = self.kv_b.get_value()  # an array, or `AbsorbedKvB` in a decode engine's weights
        if isinstance(kv_b, AbsorbedKvB):
            w_uk, w_uv = kv_b.per_latent()
        else:
            w_kv = rearrange(kv_b, "r (h d) -> r h d", h=heads)
            w_uk, w_uv = w_kv[..., :nope], w_kv[..., nope:]
        scale = mla.qk_head_dim**-0.5
        if isinstance(state, PagedKvState):  # one decode token, the latents in pages
            state = write_pages(state, c_kv[:, 0], k_rope[:, 0], ctx, ring=False)
            out = paged_mla_op(ctx.impl)(
                q_nope[:, 0],
                q_rope[:, 0],
                state.first,
                state.second,
                w_uk,
                w_uv,
                ctx.new_lengths,
                state.table,
                scale=scale,
            )[:, None]
            return self._output(x_BTD, out), state

        state = MlaState(
            c_kv=write_growing(state.c_kv, c_kv, ctx),
            k_rope=write_growing(state.k_rope, k_rope, ctx),
        )
        kv_pos = growing_positions(state.c_kv.shape[1], ctx.new_lengths)
        if ctx.decode and isinstance(kv_b, AbsorbedKvB) and Impl(ctx.impl) is not Impl.PALLAS:
            out = mla_decode_absorbed_heads(
                q_nope,
                q_rope,
                state.c_kv,
                state.k_rope,
                *kv_b,
                q_pos=positions,
                kv_pos=kv_pos,
                scale=scale,
            )
        elif ctx.decode:
            out = mla_decode_op(ctx.impl)(
                q_nope,
                q_rope,
                state.c_kv,
                state.k_rope,
                w_uk,
                w_uv,
                q_pos=positions,
                kv_pos=kv_pos,
                scale=scale,
            )
        else:
            k_nope = jnp.einsum("bsr,rhn->bshn", state.c_kv, w_uk)
            values = jnp.einsum("bsr,rhv->bshv", state.c_kv, w_uv)
            k_shared = jnp.broadcast_to(
                state.k_rope[:, :, None], (*state.k_rope.shape[:2], heads, rope_dim)
            )
            keys = jnp.concatenate([k_nope, k_shared], axis=-1)
            queries = jnp.concatenate([q_nope, q_rope], axis=-1)
            out = attention_op(ctx.impl)(
                queries, keys, values, q_pos=positions, kv_pos=kv_pos, scale=scale
            )
        return self._output(x_BTD, out), state

    def _output(self, x_BTD: jax.Array, out: jax.Array) -> jax.Array:
        """The heads' outputs ``[B, T, H, V]`` gated (Bailing) and projected back."""
        if self.cfg.mla.use_output_gate:
            gate = jax.nn.sigmoid(upcast(weight_dot(x_BTD, self.gate_proj[...])))
            out = (upcast(out) * gate[..., None]).astype(out.dtype)
        heads_out = rearrange(out, "b t h v -> b t (h v)").astype(x_BTD.dtype)
        return weight_dot(heads_out, self.o_proj[...])
