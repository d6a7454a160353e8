"""Delta-rule linear-attention layers: KDA (Kimi Delta Attention) and GDN (Gated DeltaNet).

Both (sources: docs/model-configs.md, "Layer math and its sources"):

    [q ‖ k ‖ v] = silu(short_conv([W_q x ‖ W_k x ‖ W_v x]))    (depthwise, kernel 4, carried tail)
    q, k ← l2_normalize per head;   β = sigmoid(W_b x)
    o    = delta-rule recurrence(q, k, v, g, β)                   (ops/delta_rule)
    y    = W_o · (rms_norm_per_head(o) ⊙ act(gate))

and differ in the decay and the output gate:

    KDA: g = −exp(A_log[h])·softplus(W_fb W_fa x + dt_bias) per channel; gate = sigmoid(W_gb W_ga x)
    GDN: g = −exp(A_log[h])·softplus(W_a x + dt_bias)       per head;    gate = silu(W_z x)

KDA variants (Bailing): full-rank ``W_f``, ``W_g`` instead of the low-rank pairs
(``full_rank_gates``), and the bounded "safe" gate ``g = lb·sigmoid(exp(A_log[h])·f)``
(``KdaGate.SAFE``), which keeps every step's log decay in ``(lb, 0)``.

Padding tokens get g = 0 and β = 0, which leaves the recurrent state untouched.

``DeltaMixer`` is the layer as a Flax NNX module; its parameter names are the keys of the layer's
entry in the model's parameter tree (model/hybrid.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from prfaas_jax.config import KdaGate, LayerKind, ModelConfig
from prfaas_jax.model import initializers as init
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.norms import gated_rms_norm, l2_normalize
from prfaas_jax.model.state import DeltaState
from prfaas_jax.ops.conv import short_conv
from prfaas_jax.ops.dispatch import linear_op
from prfaas_jax.ops.precision import upcast
from prfaas_jax.ops.weight_dot import weight_dot


class DeltaMixer(nnx.Module):
    """A KDA or GDN layer (``kind``), with the projections and gates of the module docstring."""

    def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs) -> None:
        self.cfg, self.kind = cfg, kind
        lin, dim, dtype = cfg.linear, cfg.hidden_dim, jnp.dtype(cfg.dtype)
        qk_out = lin.num_heads * lin.head_dim
        v_out = lin.num_v_heads * lin.v_head_dim
        self.q_proj = init.dense(rngs, (dim, qk_out), dtype)
        self.k_proj = init.dense(rngs, (dim, qk_out), dtype)
        self.v_proj = init.dense(rngs, (dim, v_out), dtype)
        self.conv = init.dense(
            rngs, (lin.conv_kernel, lin.conv_channels), dtype, fan_in=lin.conv_kernel
        )
        self.b_proj = init.dense(rngs, (dim, lin.num_v_heads), dtype)
        # Decay rates exp(A_log) in [1, 16] and dt in [1e-3, 1e-1], as Mamba-style layers init them.
        self.A_log = init.log_uniform(rngs, (lin.num_v_heads,), 1.0, 16.0)
        self.o_norm = init.ones((lin.v_head_dim,), dtype)
        self.o_proj = init.dense(rngs, (v_out, dim), dtype)
        gate_width = lin.num_v_heads * lin.head_dim if kind is LayerKind.KDA else lin.num_v_heads
        self.dt_bias = init.softplus_inverse_of_log_uniform(rngs, (gate_width,), 1e-3, 1e-1)
        if kind is LayerKind.KDA and lin.full_rank_gates:
            self.f_proj = init.dense(rngs, (dim, gate_width), dtype)
            self.g_proj = init.dense(rngs, (dim, v_out), dtype)
        elif kind is LayerKind.KDA:
            self.f_a = init.dense(rngs, (dim, lin.low_rank), dtype)
            self.f_b = init.dense(rngs, (lin.low_rank, gate_width), dtype)
            self.g_a = init.dense(rngs, (dim, lin.low_rank), dtype)
            self.g_b = init.dense(rngs, (lin.low_rank, v_out), dtype)
        else:
            self.a_proj = init.dense(rngs, (dim, lin.num_v_heads), dtype)
            self.z_proj = init.dense(rngs, (dim, v_out), dtype)

    def _kda_gates(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """KDA's log decay ``g [B,T,Hv,K]`` (fp32) and output-gate pre-activation ``[B,T,Hv,V]``."""
        lin = self.cfg.linear
        if lin.full_rank_gates:
            f, gate = weight_dot(x_BTD, self.f_proj[...]), weight_dot(x_BTD, self.g_proj[...])
        else:
            f = weight_dot(weight_dot(x_BTD, self.f_a[...]), self.f_b[...])
            gate = weight_dot(weight_dot(x_BTD, self.g_a[...]), self.g_b[...])
        raw = rearrange(upcast(f) + self.dt_bias[...], "b t (h k) -> b t h k", k=lin.head_dim)
        # Gates in fp32: g reaches −2000 with real weights and feeds exp() inside the op.
        rate = jnp.exp(upcast(self.A_log[...]))[:, None]
        if lin.kda_gate is KdaGate.SAFE:
            g = lin.gate_lower_bound * jax.nn.sigmoid(rate * raw)
        else:
            g = -rate * jax.nn.softplus(raw)
        return g, rearrange(gate, "b t (h v) -> b t h v", v=lin.v_head_dim)

    def __call__(
        self, x_BTD: jax.Array, state: DeltaState, ctx: StepContext
    ) -> tuple[jax.Array, DeltaState]:
        lin = self.cfg.linear
        qk_out = lin.num_heads * lin.head_dim
        mixed = jnp.concatenate(
            [
                weight_dot(x_BTD, self.q_proj[...]),
                weight_dot(x_BTD, self.k_proj[...]),
                weight_dot(x_BTD, self.v_proj[...]),
            ],
            -1,
        )
        mixed, conv_tail = short_conv(
            mixed, self.conv[...], tail=state.conv, valid_len=ctx.valid_len
        )
        mixed = jax.nn.silu(mixed)
        heads = "b t (h d) -> b t h d"
        q = l2_normalize(rearrange(mixed[..., :qk_out], heads, d=lin.head_dim))
        k = l2_normalize(rearrange(mixed[..., qk_out : 2 * qk_out], heads, d=lin.head_dim))
        v = rearrange(mixed[..., 2 * qk_out :], heads, d=lin.v_head_dim)

        if self.kind is LayerKind.KDA:
            g, gate = self._kda_gates(x_BTD)
            act = jax.nn.sigmoid
        else:
            # Gates in fp32: g reaches −2000 with real weights and feeds exp() inside the op.
            rate = -jnp.exp(upcast(self.A_log[...]))
            raw = upcast(weight_dot(x_BTD, self.a_proj[...])) + self.dt_bias[...]
            g = rate * jax.nn.softplus(raw)
            gate = rearrange(weight_dot(x_BTD, self.z_proj[...]), heads, d=lin.v_head_dim)
            act = jax.nn.silu
        beta = jax.nn.sigmoid(upcast(weight_dot(x_BTD, self.b_proj[...])))

        valid = ctx.valid
        g = jnp.where(valid.reshape(valid.shape + (1,) * (g.ndim - 2)), g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
        op = linear_op(str(self.kind), ctx.linear_impl())
        o, recurrent = op(
            q,
            k,
            v,
            g,
            beta,
            scale=lin.qk_scale or None,
            initial_state=state.recurrent,
            output_final_state=True,
        )

        o = gated_rms_norm(o, self.o_norm[...], gate, lin.o_norm_eps or self.cfg.norm_eps, act)
        y = weight_dot(rearrange(o, "b t h v -> b t (h v)").astype(x_BTD.dtype), self.o_proj[...])
        return y, DeltaState(recurrent=recurrent.astype(state.recurrent.dtype), conv=conv_tail)
