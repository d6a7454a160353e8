"""MiniMax-01 (``model_type = "minimax"``): ``config_from_hf`` and ``convert``.

Lightning attention + GQA softmax attention, Mixtral MoE in every block. Conventions of the
checkpoint (transformers ``modeling_minimax.py``):

* Residuals are scaled and start from the *normed* input: ``h ← α·n(h) + β·f(n(h))`` with
  ``(α, β)`` = ``{linear,full}_attn_{alpha,beta}_factor`` around the mixer and
  ``mlp_{alpha,beta}_factor`` around the MoE (``ResidualConfig``).
* Lightning: ``silu(qkv_proj x)`` viewed per head as ``[q | k | v]`` (reordered here into our
  ``[q all heads | k | v]``), no q/k normalisation and no ``1/sqrt(d)`` scale (``qk_scale = 1``);
  decay ``exp(−s_h)`` with transformers' slope schedule (``LightningDecay.MINIMAX_HF``), checked
  against the saved ``slope_rate`` buffers; output ``RMSNorm`` over all heads with eps 1e-6 (not
  ``rms_norm_eps``), times ``sigmoid(output_gate x)``.
* Softmax attention rotates the whole head (``partial_rotary_factor`` is ignored by transformers'
  default RoPE); a ``sliding_window`` applies to every softmax layer (→ SWA layers).
* MoE: softmax router, top-k always renormalised, no shared expert; experts ``w1`` (gate),
  ``w3`` (up), ``w2`` (down); the per-expert width is ``intermediate_size``.
"""

from __future__ import annotations

import numpy as np

from prfaas_jax.config import (
    AttentionConfig,
    LayerKind,
    LightningDecay,
    LinearAttentionConfig,
    MlpKind,
    ModelConfig,
    MoeConfig,
    MoeScoring,
    ResidualConfig,
    RopeKind,
)
from prfaas_jax.errors import CheckpointError
from prfaas_jax.model.hf import layers as hl
from prfaas_jax.model.hf.reader import HfConfig, TensorReader
from prfaas_jax.model.mixers.lightning import layer_decay

FAMILY = "minimax"
# Lightning's decay tables are buffers derived from slope_rate (which is checked, below).
IGNORED = (r"model\.layers\.\d+\.self_attn\.(query_decay|key_decay|diagonal_decay)",)
_LIGHTNING_NORM_EPS = 1e-6  # MiniMaxRMSNorm's default: the Lightning output norm gets no config eps


def config_from_hf(hf: HfConfig, name: str) -> ModelConfig:
    num_layers = hf.get_int("num_hidden_layers", default=32)
    hidden = hf.get_int("hidden_size", default=4096)
    heads = hf.get_int("num_attention_heads", default=32)
    head_dim = hf.get_int("head_dim", default=hidden // heads)
    window = hf.get_int("sliding_window", default=0)
    softmax_kind = LayerKind.SWA if window else LayerKind.GQA
    kinds = {"full_attention": softmax_kind, "linear_attention": LayerKind.LIGHTNING}
    default = ["full_attention" if i % 2 == 0 else "linear_attention" for i in range(num_layers)]
    layers = hl.layer_kinds(hf, num_layers, kinds, default)
    theta, _ = hl.rope_parameters(hf, default_theta=1e6)
    attention = AttentionConfig(
        num_heads=heads,
        num_kv_heads=hf.get_int("num_key_value_heads", default=8),
        head_dim=head_dim,
        window=window,
        rope=RopeKind.NEOX,
        rope_theta=theta,
    )
    linear = LinearAttentionConfig(
        num_heads=heads,
        num_v_heads=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        conv_kernel=1,
        lightning_decay=LightningDecay.MINIMAX_HF,
        qk_scale=1.0,
        o_norm_eps=_LIGHTNING_NORM_EPS,
    )
    factor = {
        ours: hf.get_float(theirs, default=1.0)
        for ours, theirs in (
            ("linear_alpha", "linear_attn_alpha_factor"),
            ("linear_beta", "linear_attn_beta_factor"),
            ("attention_alpha", "full_attn_alpha_factor"),
            ("attention_beta", "full_attn_beta_factor"),
            ("mlp_alpha", "mlp_alpha_factor"),
            ("mlp_beta", "mlp_beta_factor"),
        )
    }
    return ModelConfig(
        name=name,
        vocab_size=hf.get_int("vocab_size", default=32000),
        hidden_dim=hidden,
        layers=layers,
        mlps=(MlpKind.MOE,) * num_layers,
        norm_eps=hf.get_float("rms_norm_eps", default=1e-5),
        dtype=hf.dtype(),
        tie_embeddings=hf.get_bool("tie_word_embeddings", default=False),
        max_len=hf.get_int("max_position_embeddings", default=4096 * 32),
        linear=linear if LayerKind.LIGHTNING in layers else None,
        attention=attention if softmax_kind is LayerKind.GQA and softmax_kind in layers else None,
        swa=attention if softmax_kind is LayerKind.SWA and softmax_kind in layers else None,
        moe=MoeConfig(
            num_experts=hf.get_int("num_local_experts", "num_experts", default=8),
            top_k=hf.get_int("num_experts_per_tok", default=2),
            expert_dim=hf.get_int("intermediate_size", default=14336),
            scoring=MoeScoring.SOFTMAX,
            renormalize=True,
        ),
        residual=ResidualConfig(**factor),
    )


def _lightning(r: TensorReader, prefix: str, cfg: ModelConfig, index: int) -> hl.Arrays:
    lin, dim = cfg.linear, cfg.hidden_dim
    heads, head_dim = lin.num_heads, lin.head_dim
    width = heads * head_dim
    slope_name = f"{prefix}slope_rate"
    if r.has(slope_name):
        saved = r.take(slope_name, (heads, 1, 1)).reshape(heads)
        expected = -layer_decay(cfg, index)
        if not np.allclose(saved, expected, rtol=1e-5, atol=0.0):
            raise CheckpointError(
                f"{slope_name} = {saved.tolist()} does not follow MiniMax's slope schedule "
                f"{expected.tolist()}"
            )
    qkv = r.take(f"{prefix}qkv_proj.weight", (3 * width, dim))
    # Rows are per head [q_h | k_h | v_h]; ours are [q of all heads | k | v].
    qkv = qkv.reshape(heads, 3, head_dim, dim).transpose(1, 0, 2, 3).reshape(3 * width, dim)
    return {
        "qkv_proj": qkv.T,
        "gate_proj": r.linear(f"{prefix}output_gate.weight", dim, width),
        "o_norm": hl.norm(r, f"{prefix}norm.weight", width),
        "o_proj": r.linear(f"{prefix}out_proj.weight", width, dim),
    }


def _attention(r: TensorReader, prefix: str, cfg: ModelConfig, kind: LayerKind) -> hl.Arrays:
    att, dim = cfg.layer_config(kind), cfg.hidden_dim
    q_out, kv_out = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    return {
        "q_proj": r.linear(f"{prefix}q_proj.weight", dim, q_out),
        "k_proj": r.linear(f"{prefix}k_proj.weight", dim, kv_out),
        "v_proj": r.linear(f"{prefix}v_proj.weight", dim, kv_out),
        "o_proj": r.linear(f"{prefix}o_proj.weight", q_out, dim),
    }


def convert(r: TensorReader, cfg: ModelConfig, hf: HfConfig) -> dict:
    dim = cfg.hidden_dim

    def mixer(prefix: str, index: int, kind: LayerKind) -> hl.Arrays:
        attn = f"{prefix}self_attn."
        if kind is LayerKind.LIGHTNING:
            return _lightning(r, attn, cfg, index)
        return _attention(r, attn, cfg, kind)

    def mlp(prefix: str, kind: MlpKind) -> hl.Arrays:  # every block is MoE
        moe = f"{prefix}block_sparse_moe."
        return {
            "router": hl.router(r, f"{moe}gate.weight", dim, cfg.moe),
            **hl.routed_experts(r, f"{moe}experts.", dim, cfg.moe, ("w1", "w3", "w2")),
        }

    return hl.causal_lm(r, cfg, hl.decoder_layers(r, cfg, mixer, mlp))
