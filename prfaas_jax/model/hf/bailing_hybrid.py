"""Bailing hybrid / Ling (``model_type = "bailing_hybrid"``): ``config_from_hf`` and ``convert``.

KDA + gated MLA, DeepSeek-V3 MoE with group-limited routing. Conventions of the checkpoint
(transformers ``modeling_bailing_hybrid.py``, hub tensor names):

* Names: ``model.word_embeddings``, ``layers.{i}.attention.*``, output projection
  ``attention.dense``, MoE selection bias ``mlp.gate.expert_bias``.
* KDA and MLA share ``num_attention_heads``. KDA uses full-rank gates (``f_proj``, ``g_proj``) and
  by default the bounded "safe" gate ``g = kda_lower_bound · sigmoid(exp(A_log)·(f + dt_bias))``
  (``kda_safe_gate``); its head dim is ``linear_head_dim`` in HF-saved configs and ``head_dim``
  in hub configs (transformers overwrites ``head_dim`` with ``qk_rope_head_dim`` on load).
* MLA applies interleaved RoPE (pairs ``2i, 2i+1``) to the ``qk_rope_head_dim`` slice with
  ``rope_theta``, latent norms with eps 1e-6, and gates each head's output by
  ``sigmoid(g_proj x)`` (one scalar per head) before ``dense``.
* MoE: sigmoid scores + selection bias, group-limited (``num_expert_group``/``topk_group``),
  renormalised, times ``routed_scaling_factor``, plus ungated shared experts.
* Multi-token-prediction layers (indices ≥ ``num_hidden_layers``, or ``model.mtp.*``) are unused.
"""

from __future__ import annotations

import re

from prfaas_jax.config import (
    KdaGate,
    LayerKind,
    LinearAttentionConfig,
    MlpKind,
    ModelConfig,
    RopeKind,
)
from prfaas_jax.model.hf import layers as hl
from prfaas_jax.model.hf.reader import HfConfig, TensorReader

FAMILY = "bailing_hybrid"
IGNORED = (r"model\.mtp\..*",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def config_from_hf(hf: HfConfig, name: str) -> ModelConfig:
    num_layers = hf.get_int("num_hidden_layers", default=42)
    group = hf.get_int("layer_group_size", default=6)
    default = [
        "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(num_layers)
    ]
    kinds = {"linear_attention": LayerKind.KDA, "full_attention": LayerKind.MLA}
    layers = hl.layer_kinds(hf, num_layers, kinds, default)
    mlps = hl.mlp_kinds(hf, num_layers, first_dense_default=2)
    if hf.get_bool("attention_bias", default=False):
        raise hf.unsupported("attention_bias = true")
    heads = hf.get_int("num_attention_heads", default=32)
    head_dim = hf.get_int("linear_head_dim", default=hf.get_int("head_dim", default=128))
    kernel = hf.get_int("linear_conv_kernel_dim", default=4)
    linear = LinearAttentionConfig(
        num_heads=heads,
        num_v_heads=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        conv_kernel=hf.get_int("short_conv_kernel_size", default=kernel),
        full_rank_gates=True,
        kda_gate=KdaGate.SAFE if hf.get_bool("kda_safe_gate", default=True) else KdaGate.SOFTPLUS,
        gate_lower_bound=hf.get_float("kda_lower_bound", default=-5.0),
    )
    theta, _ = hl.rope_parameters(hf, default_theta=6e6)
    mla = hl.mla_config(
        hf, num_heads=heads, rope=RopeKind.INTERLEAVED, rope_theta=theta, use_output_gate=True
    )
    moe = hl.deepseek_moe_config(
        hf, num_experts=512, expert_dim=768, routed_scale=2.5, num_groups=8, topk_groups=4
    )
    return ModelConfig(
        name=name,
        vocab_size=hf.get_int("vocab_size", default=157184),
        hidden_dim=hf.get_int("hidden_size", default=2560),
        layers=layers,
        mlps=mlps,
        mlp_dim=hf.get_int("intermediate_size", default=6144) if MlpKind.DENSE in mlps else 0,
        norm_eps=hf.get_float("rms_norm_eps", default=1e-6),
        dtype=hf.dtype(),
        tie_embeddings=hf.get_bool("tie_word_embeddings", default=False),
        max_len=hf.get_int("model_max_length", "max_position_embeddings", default=262144),
        linear=linear if LayerKind.KDA in layers else None,
        mla=mla if LayerKind.MLA in layers else None,
        moe=moe if MlpKind.MOE in mlps else None,
    )


def _mlp(r: TensorReader, prefix: str, cfg: ModelConfig, kind: MlpKind) -> hl.Arrays:
    if kind is MlpKind.DENSE:
        return hl.swiglu(r, prefix, cfg.hidden_dim, cfg.mlp_dim)
    return hl.deepseek_moe(r, prefix, cfg, bias="expert_bias")


def convert(r: TensorReader, cfg: ModelConfig, hf: HfConfig) -> dict:
    def mixer(prefix: str, index: int, kind: LayerKind) -> hl.Arrays:
        attn = f"{prefix}attention."
        if kind is LayerKind.KDA:
            return hl.kda(r, attn, cfg, a_log_shape=(cfg.linear.num_v_heads,), o_proj="dense")
        return hl.mla(r, attn, cfg, o_proj="dense")

    def mlp(prefix: str, kind: MlpKind) -> hl.Arrays:
        return _mlp(r, f"{prefix}mlp.", cfg, kind)

    layers = hl.decoder_layers(r, cfg, mixer, mlp)
    mtp = [n for n in r.names() if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.num_layers]
    r.skip(mtp)
    return hl.causal_lm(r, cfg, layers, embed="model.word_embeddings.weight")
