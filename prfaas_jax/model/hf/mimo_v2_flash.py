"""MiMo-V2-Flash (``model_type = "mimo_v2_flash"``): ``config_from_hf`` and ``convert``.

Sliding-window + full GQA, DeepSeek-V3-style sigmoid MoE. Conventions of the checkpoint
(transformers ``modeling_mimo_v2_flash.py``):

* SWA layers have twice ``num_key_value_heads`` and a learned per-head sink logit
  (``attention_sink_bias``) in the softmax denominator; full layers have neither.
  ``sliding_window`` counts the query itself (keys ``i−W+1 … i``), as our window does.
* q/k head dim ``head_dim``, value head dim ``v_head_dim``; values are multiplied by
  ``attention_value_scale`` — folded into ``v_proj`` here.
* RoPE per layer type (``rope_parameters.{full,sliding}_attention``): NeoX over the first
  ``int(head_dim · partial_rotary_factor)`` dims with its own theta.
* MoE: sigmoid scores, ``e_score_correction_bias`` for selection, group-limited top-k,
  renormalised iff ``norm_topk_prob``, times ``routed_scaling_factor``; no shared expert.
* The hub's multi-token-prediction tensors (``model.mtp.*``) are not used.
"""

from __future__ import annotations

from prfaas_jax.config import (
    AttentionConfig,
    LayerKind,
    MlpKind,
    ModelConfig,
    MoeConfig,
    MoeScoring,
    RopeKind,
)
from prfaas_jax.model.hf import layers as hl
from prfaas_jax.model.hf.reader import HfConfig, TensorReader

FAMILY = "mimo_v2_flash"
IGNORED = (r"model\.mtp\..*", r"mtp\..*")
_DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def _attention(hf: HfConfig, layer_type: str, *, kv_heads: int, window: int) -> AttentionConfig:
    head_dim = hf.get_int("head_dim", default=192)
    per_type = hf.get_dict("rope_parameters", default=_DEFAULT_ROPE)
    section = per_type.get(layer_type)
    if not isinstance(section, dict):
        raise hf.unsupported(f"rope_parameters without a {layer_type!r} entry")
    theta, fraction = hl.rope_parameters(hf, section, default_fraction=0.334)
    rotary_dim = int(head_dim * fraction)
    if rotary_dim % 2:
        raise hf.unsupported(f"an odd number of rotary dims ({rotary_dim})")
    return AttentionConfig(
        num_heads=hf.get_int("num_attention_heads", default=64),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=hf.get_int("v_head_dim", default=128),
        window=window,
        rope=RopeKind.NEOX,
        rope_theta=theta,
        rope_fraction=rotary_dim / head_dim,
        use_sinks=bool(window),
    )


def config_from_hf(hf: HfConfig, name: str) -> ModelConfig:
    num_layers = hf.get_int("num_hidden_layers", default=48)
    default = [
        "full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    kinds = {"full_attention": LayerKind.GQA, "sliding_attention": LayerKind.SWA}
    layers = hl.layer_kinds(hf, num_layers, kinds, default)
    mlps = hl.mlp_kinds(hf, num_layers, first_dense_default=1)
    if hf.get_bool("attention_bias", default=False):
        raise hf.unsupported("attention_bias = true")
    if hf.has("sliding_window_size"):
        window = hf.get_int("sliding_window_size") + 1  # the hub counts keys before the query
    else:
        window = hf.get_int("sliding_window", default=129)
    kv_heads = hf.get_int("num_key_value_heads", default=4)
    moe = MoeConfig(
        num_experts=hf.get_int("n_routed_experts", "num_local_experts", default=256),
        top_k=hf.get_int("num_experts_per_tok", default=8),
        expert_dim=hf.get_int("moe_intermediate_size", default=2048),
        scoring=MoeScoring.SIGMOID,
        use_score_bias=True,
        renormalize=hf.get_bool("norm_topk_prob", default=True),
        routed_scale=hf.get_float("routed_scaling_factor", default=1.0),
        num_groups=hf.get_int("n_group", default=1),
        topk_groups=hf.get_int("topk_group", default=1),
    )
    return ModelConfig(
        name=name,
        vocab_size=hf.get_int("vocab_size", default=152576),
        hidden_dim=hf.get_int("hidden_size", default=4096),
        layers=layers,
        mlps=mlps,
        mlp_dim=hf.get_int("intermediate_size", default=16384) if MlpKind.DENSE in mlps else 0,
        norm_eps=hf.get_float("rms_norm_eps", default=1e-5),
        dtype=hf.dtype(),
        tie_embeddings=hf.get_bool("tie_word_embeddings", default=False),
        max_len=hf.get_int("max_position_embeddings", default=131072),
        attention=_attention(hf, "full_attention", kv_heads=kv_heads, window=0)
        if LayerKind.GQA in layers
        else None,
        swa=_attention(hf, "sliding_attention", kv_heads=2 * kv_heads, window=window)
        if LayerKind.SWA in layers
        else None,
        moe=moe if MlpKind.MOE in mlps else None,
    )


def _attention_params(
    r: TensorReader, prefix: str, cfg: ModelConfig, kind: LayerKind, value_scale: float
) -> hl.Arrays:
    att, dim = cfg.layer_config(kind), cfg.hidden_dim
    p = {
        "q_proj": r.linear(f"{prefix}q_proj.weight", dim, att.num_heads * att.head_dim),
        "k_proj": r.linear(f"{prefix}k_proj.weight", dim, att.num_kv_heads * att.head_dim),
        # The cache holds the scaled values, so scaling the projection is exact in meaning.
        "v_proj": r.linear(f"{prefix}v_proj.weight", dim, att.num_kv_heads * att.value_dim)
        * value_scale,
        "o_proj": r.linear(f"{prefix}o_proj.weight", att.num_heads * att.value_dim, dim),
    }
    if att.use_sinks:
        p["sinks"] = r.take(f"{prefix}attention_sink_bias", (att.num_heads,))
    return p


def convert(r: TensorReader, cfg: ModelConfig, hf: HfConfig) -> dict:
    value_scale = hf.get_float("attention_value_scale", default=0.707)

    def mixer(prefix: str, index: int, kind: LayerKind) -> hl.Arrays:
        return _attention_params(r, f"{prefix}self_attn.", cfg, kind, value_scale)

    def mlp(prefix: str, kind: MlpKind) -> hl.Arrays:
        if kind is MlpKind.DENSE:
            return hl.swiglu(r, f"{prefix}mlp.", cfg.hidden_dim, cfg.mlp_dim)
        return hl.deepseek_moe(r, f"{prefix}mlp.", cfg)  # no shared experts

    return hl.causal_lm(r, cfg, hl.decoder_layers(r, cfg, mixer, mlp))
