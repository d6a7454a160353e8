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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.config import KdaGate, LayerKind, LinearAttentionConfig, ModelConfig
from prfaas_jax.model import initializers as init
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.norms import gated_rms_norm, l2_normalize
from prfaas_jax.model.state import DeltaState
from prfaas_jax.ops.conv import short_conv
from prfaas_jax.ops.dispatch import linear_op

Params = dict[str, jax.Array]


def init_params(key: jax.Array, cfg: ModelConfig, kind: LayerKind) -> Params:
    lin, dim, dtype = cfg.linear, cfg.hidden_dim, jnp.dtype(cfg.dtype)
    keys = init.KeySplitter(key)
    qk_out = lin.num_heads * lin.head_dim
    v_out = lin.num_v_heads * lin.v_head_dim
    p: Params = {
        "q_proj": init.dense(keys(), (dim, qk_out), dtype),
        "k_proj": init.dense(keys(), (dim, qk_out), dtype),
        "v_proj": init.dense(keys(), (dim, v_out), dtype),
        "conv": init.dense(
            keys(), (lin.conv_kernel, lin.conv_channels), dtype, fan_in=lin.conv_kernel
        ),
        "b_proj": init.dense(keys(), (dim, lin.num_v_heads), dtype),
        # Decay rates exp(A_log) in [1, 16] and dt in [1e-3, 1e-1], as Mamba-style layers init them.
        "A_log": jnp.log(init.uniform(keys(), (lin.num_v_heads,), 1.0, 16.0)),
        "o_norm": init.ones((lin.v_head_dim,), dtype),
        "o_proj": init.dense(keys(), (v_out, dim), dtype),
    }
    gate_width = lin.num_v_heads * lin.head_dim if kind is LayerKind.KDA else lin.num_v_heads
    p["dt_bias"] = init.inverse_softplus(
        jnp.exp(init.uniform(keys(), (gate_width,), jnp.log(1e-3), jnp.log(1e-1)))
    )
    if kind is LayerKind.KDA and lin.full_rank_gates:
        p["f_proj"] = init.dense(keys(), (dim, gate_width), dtype)
        p["g_proj"] = init.dense(keys(), (dim, v_out), dtype)
    elif kind is LayerKind.KDA:
        rank = lin.low_rank
        p["f_a"] = init.dense(keys(), (dim, rank), dtype)
        p["f_b"] = init.dense(keys(), (rank, gate_width), dtype)
        p["g_a"] = init.dense(keys(), (dim, rank), dtype)
        p["g_b"] = init.dense(keys(), (rank, v_out), dtype)
    else:
        p["a_proj"] = init.dense(keys(), (dim, lin.num_v_heads), dtype)
        p["z_proj"] = init.dense(keys(), (dim, v_out), dtype)
    return p


def _kda_gates(p: Params, lin: LinearAttentionConfig, x_BTD: jax.Array) -> tuple[jax.Array, ...]:
    """KDA's log decay ``g [B,T,Hv,K]`` (fp32) and output-gate pre-activation ``[B,T,Hv,V]``."""
    batch, seq_len, _ = x_BTD.shape
    if lin.full_rank_gates:
        f, gate = x_BTD @ p["f_proj"], x_BTD @ p["g_proj"]
    else:
        f, gate = x_BTD @ p["f_a"] @ p["f_b"], x_BTD @ p["g_a"] @ p["g_b"]
    raw = (f.astype(jnp.float32) + p["dt_bias"]).reshape(
        batch, seq_len, lin.num_v_heads, lin.head_dim
    )
    # Gates in fp32: g reaches −2000 with real weights and feeds exp() inside the op.
    rate = jnp.exp(p["A_log"].astype(jnp.float32))[:, None]
    if lin.kda_gate is KdaGate.SAFE:
        g = lin.gate_lower_bound * jax.nn.sigmoid(rate * raw)
    else:
        g = -rate * jax.nn.softplus(raw)
    return g, gate.reshape(batch, seq_len, lin.num_v_heads, lin.v_head_dim)


def apply(
    p: Params,
    cfg: ModelConfig,
    kind: LayerKind,
    x_BTD: jax.Array,
    state: DeltaState,
    ctx: StepContext,
) -> tuple[jax.Array, DeltaState]:
    lin = cfg.linear
    batch, seq_len, _ = x_BTD.shape
    heads, v_heads = lin.num_heads, lin.num_v_heads
    qk_out = heads * lin.head_dim

    mixed = jnp.concatenate([x_BTD @ p["q_proj"], x_BTD @ p["k_proj"], x_BTD @ p["v_proj"]], -1)
    mixed, conv_tail = short_conv(mixed, p["conv"], tail=state.conv, valid_len=ctx.valid_len)
    mixed = jax.nn.silu(mixed)
    q = l2_normalize(mixed[..., :qk_out].reshape(batch, seq_len, heads, lin.head_dim))
    k = l2_normalize(mixed[..., qk_out : 2 * qk_out].reshape(batch, seq_len, heads, lin.head_dim))
    v = mixed[..., 2 * qk_out :].reshape(batch, seq_len, v_heads, lin.v_head_dim)

    if kind is LayerKind.KDA:
        g, gate = _kda_gates(p, lin, x_BTD)
        act = jax.nn.sigmoid
    else:
        # Gates in fp32: g reaches −2000 with real weights and feeds exp() inside the op.
        rate = -jnp.exp(p["A_log"].astype(jnp.float32))
        raw = (x_BTD @ p["a_proj"]).astype(jnp.float32) + p["dt_bias"]
        g = rate * jax.nn.softplus(raw)
        gate = (x_BTD @ p["z_proj"]).reshape(batch, seq_len, v_heads, lin.v_head_dim)
        act = jax.nn.silu
    beta = jax.nn.sigmoid((x_BTD @ p["b_proj"]).astype(jnp.float32))

    valid = ctx.valid
    g = jnp.where(valid.reshape(valid.shape + (1,) * (g.ndim - 2)), g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)
    op = linear_op(str(kind), ctx.linear_impl())
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

    o = gated_rms_norm(o, p["o_norm"], gate, lin.o_norm_eps or cfg.norm_eps, act)
    y = o.reshape(batch, seq_len, v_heads * lin.v_head_dim).astype(x_BTD.dtype) @ p["o_proj"]
    new_state = DeltaState(recurrent=recurrent.astype(state.recurrent.dtype), conv=conv_tail)
    return y, new_state
