"""Lightning attention layer (MiniMax-01 style; sources and slopes: docs/model-configs.md).

    [q ‖ k ‖ v] = silu(W_qkv x)
    o = lightning(q, k, v, decay_l)     S_t = exp(decay_h) S_{t−1} + k_t v_tᵀ,  o_t = S_tᵀ q_t
    y = W_o · (rms_norm(o over all heads) ⊙ sigmoid(W_gate x))

The decay is not learned: head ``h`` of layer ``l`` (0-based, of ``L`` layers) uses the ALiBi
slope ``s_h`` scaled by the model's schedule (``LightningDecay``):
MINIMAX ``−s_h·(1 − l/(L−1) + 1e-5)``, RING ``−s_h·(1 − (l−1)/(L−1) + 1e-5)``, and MINIMAX_HF
(transformers' port of MiniMax-01) ``−2^(−8(h+1)/H)·(1 − l/(L−1+1e-5) + 1e-5)``, whose base slopes
skip ALiBi's interleaving when ``H`` is not a power of two. ``q`` is scaled by
``LinearAttentionConfig.qk_scale`` (MiniMax: 1, i.e. unscaled). ``LightningMixer`` is the layer as a
Flax NNX module.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx

from prfaas_jax.config import LightningDecay, ModelConfig
from prfaas_jax.model import initializers as init
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.norms import gated_rms_norm
from prfaas_jax.model.state import LightningState
from prfaas_jax.ops.dispatch import linear_op
from prfaas_jax.ops.precision import upcast
from prfaas_jax.ops.weight_dot import weight_dot


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes ``2^(−8(h+1)/n)``; non-powers of two interleave from the next power."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return np.asarray(power_of_two(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = power_of_two(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(power_of_two(closest) + extra)


def layer_decay(cfg: ModelConfig, layer_index: int) -> np.ndarray:
    """Log decay ``[H]`` (≤ 0) of the Lightning layer at block ``layer_index``."""
    heads = cfg.linear.num_heads
    if cfg.linear.lightning_decay is LightningDecay.MINIMAX_HF:
        slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
        return -slopes * (1.0 - layer_index / (cfg.num_layers - 1 + 1e-5) + 1e-5)
    depth = max(cfg.num_layers - 1, 1)
    shift = 1 if cfg.linear.lightning_decay is LightningDecay.RING else 0
    factor = 1.0 - (layer_index - shift) / depth + 1e-5
    return -alibi_slopes(heads) * factor


class LightningMixer(nnx.Module):
    """The Lightning layer at block ``layer_index`` (its decay depends on the depth)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, *, rngs: nnx.Rngs) -> None:
        self.cfg, self.layer_index = cfg, layer_index
        lin, dim, dtype = cfg.linear, cfg.hidden_dim, jnp.dtype(cfg.dtype)
        v_out = lin.num_heads * lin.v_head_dim
        qkv_out = lin.num_heads * (2 * lin.head_dim + lin.v_head_dim)
        self.qkv_proj = init.dense(rngs, (dim, qkv_out), dtype)
        self.gate_proj = init.dense(rngs, (dim, v_out), dtype)
        self.o_norm = init.ones((v_out,), dtype)
        self.o_proj = init.dense(rngs, (v_out, dim), dtype)

    def __call__(
        self, x_BTD: jax.Array, state: LightningState, ctx: StepContext
    ) -> tuple[jax.Array, LightningState]:
        lin = self.cfg.linear
        qk_out = lin.num_heads * lin.head_dim
        heads = "b t (h d) -> b t h d"
        # The projection and activation run in fp32, as MiniMax computes them.
        qkv = jax.nn.silu(upcast(weight_dot(x_BTD, self.qkv_proj[...])))
        q = rearrange(qkv[..., :qk_out], heads, d=lin.head_dim)
        k = rearrange(qkv[..., qk_out : 2 * qk_out], heads, d=lin.head_dim)
        v = rearrange(qkv[..., 2 * qk_out :], heads, d=lin.v_head_dim)
        decay = jnp.asarray(layer_decay(self.cfg, self.layer_index), jnp.float32)
        op = linear_op("lightning", ctx.linear_impl())
        o, recurrent = op(
            q,
            k,
            v,
            decay=decay,
            scale=lin.qk_scale or None,
            initial_state=state.recurrent,
            output_final_state=True,
            valid_len=ctx.valid_len,
        )
        o = rearrange(o, "b t h v -> b t (h v)")
        eps = lin.o_norm_eps or self.cfg.norm_eps
        o = gated_rms_norm(
            o, self.o_norm[...], weight_dot(x_BTD, self.gate_proj[...]), eps, jax.nn.sigmoid
        )
        y = weight_dot(o.astype(x_BTD.dtype), self.o_proj[...])
        return y, LightningState(recurrent=recurrent)
