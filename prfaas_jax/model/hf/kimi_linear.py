"""Kimi Linear (``model_type = "kimi_linear"``): ``config_from_hf`` and ``convert``.

KDA + MLA, pre-norm blocks, DeepSeek-V3 MoE. Conventions of the checkpoint (transformers
``modeling_kimi_linear.py``, hub tensor names):

* KDA: low-rank forget gate ``f_b(f_a x) + dt_bias`` → ``−exp(A_log)·softplus``, low-rank output
  gate ``sigmoid(g_b(g_a x))``, three depthwise convs ``{q,k,v}_conv1d``, ``A_log`` of shape
  ``[1, 1, H, 1]``; the gated output norm uses ``rms_norm_eps``.
* MLA is NoPE: no rotary at all, the ``qk_rope_head_dim`` slice is shared across heads unrotated;
  its latent norms (``kv_a_layernorm``, ``q_a_layernorm``) use eps 1e-6, not ``rms_norm_eps``.
* MoE: sigmoid scores, ``e_score_correction_bias`` for selection only, group-limited top-k,
  renormalised (``moe_renormalize``) and scaled by ``routed_scaling_factor``; shared experts are an
  ungated SwiGLU of width ``moe_intermediate_size · num_shared_experts``. Experts are stored as
  ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down); dense layers are saved
  under ``block_sparse_moe.`` too (hub files may use ``mlp.``).
* ``lm_head`` is never tied to the embeddings.
"""

from __future__ import annotations

from prfaas_jax.config import (
    LayerKind,
    LinearAttentionConfig,
    MlpKind,
    ModelConfig,
    RopeKind,
)
from prfaas_jax.model.hf import layers as hl
from prfaas_jax.model.hf.reader import HfConfig, TensorReader

FAMILY = "kimi_linear"
IGNORED: tuple[str, ...] = ()


def _layers(hf: HfConfig, num_layers: int) -> tuple[LayerKind, ...]:
    kinds = {"linear_attention": LayerKind.KDA, "full_attention": LayerKind.MLA}
    default = [
        "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)
    ]
    hub = HfConfig(hf.get_dict("linear_attn_config", default={}), f"{hf.source} linear_attn_config")
    if not hf.has("layer_types") and hub.has("full_attn_layers") and hub.has("kda_layers"):
        # The hub config lists layers 1-based.
        default = [None] * num_layers
        for key, name in (
            ("full_attn_layers", "full_attention"),
            ("kda_layers", "linear_attention"),
        ):
            for index in hub.get_list(key):
                if not (isinstance(index, int) and 1 <= index <= num_layers):
                    raise hf.unsupported(f"linear_attn_config.{key} entry {index!r}")
                default[index - 1] = name
        if None in default:
            raise hf.unsupported("linear_attn_config that leaves some layers unassigned")
    return hl.layer_kinds(hf, num_layers, kinds, default)


def config_from_hf(hf: HfConfig, name: str) -> ModelConfig:
    num_layers = hf.get_int("num_hidden_layers", default=27)
    layers = _layers(hf, num_layers)
    mlps = hl.mlp_kinds(hf, num_layers, first_dense_default=1)
    if hf.get_bool("attention_bias", default=False):
        raise hf.unsupported("attention_bias = true")
    if not hf.get_bool("mla_use_nope", default=True):
        raise hf.unsupported("mla_use_nope = false (Kimi Linear MLA is NoPE)")
    # The hub config nests the KDA sizes in linear_attn_config; HF-saved ones flatten them.
    hub = HfConfig(hf.get_dict("linear_attn_config", default={}), f"{hf.source} linear_attn_config")
    head_dim = hub.get_int("head_dim", default=hf.get_int("linear_head_dim", default=128))
    heads = hub.get_int("num_heads", default=hf.get_int("linear_num_heads", default=32))
    kernel = hf.get_int("linear_conv_kernel_dim", default=4)
    linear = LinearAttentionConfig(
        num_heads=heads,
        num_v_heads=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        conv_kernel=hub.get_int("short_conv_kernel_size", default=kernel),
        gate_rank=head_dim,
    )
    mla = hl.mla_config(
        hf, num_heads=hf.get_int("num_attention_heads", default=32), rope=RopeKind.NONE
    )
    moe = hl.deepseek_moe_config(
        hf, num_experts=256, expert_dim=1024, routed_scale=2.446, num_groups=1, topk_groups=1
    )
    kinds = set(layers)
    return ModelConfig(
        name=name,
        vocab_size=hf.get_int("vocab_size", default=163840),
        hidden_dim=hf.get_int("hidden_size", default=2304),
        layers=layers,
        mlps=mlps,
        mlp_dim=hf.get_int("intermediate_size", default=9216) if MlpKind.DENSE in mlps else 0,
        norm_eps=hf.get_float("rms_norm_eps", default=1e-5),
        dtype=hf.dtype(),
        max_len=hf.get_int("model_max_length", "max_position_embeddings", default=1048576),
        linear=linear if LayerKind.KDA in kinds else None,
        mla=mla if LayerKind.MLA in kinds else None,
        moe=moe if MlpKind.MOE in mlps else None,
    )


def _mlp(r: TensorReader, prefix: str, cfg: ModelConfig, kind: MlpKind) -> hl.Arrays:
    moe_prefix = f"{prefix}block_sparse_moe."
    if kind is MlpKind.DENSE:
        dense_prefix = moe_prefix
        if not r.has(f"{moe_prefix}gate_proj.weight") and r.has(f"{prefix}mlp.gate_proj.weight"):
            dense_prefix = f"{prefix}mlp."
        return hl.swiglu(r, dense_prefix, cfg.hidden_dim, cfg.mlp_dim)
    return hl.deepseek_moe(r, moe_prefix, cfg, expert_names=("w1", "w3", "w2"))


def convert(r: TensorReader, cfg: ModelConfig, hf: HfConfig) -> dict:
    def mixer(prefix: str, index: int, kind: LayerKind) -> hl.Arrays:
        attn = f"{prefix}self_attn."
        if kind is LayerKind.KDA:
            heads = cfg.linear.num_v_heads
            return hl.kda(r, attn, cfg, a_log_shape=(1, 1, heads, 1), o_proj="o_proj")
        return hl.mla(r, attn, cfg, o_proj="o_proj")

    def mlp(prefix: str, kind: MlpKind) -> hl.Arrays:
        return _mlp(r, prefix, cfg, kind)

    # lm_head is never tied: config_from_hf leaves tie_embeddings False.
    return hl.causal_lm(r, cfg, hl.decoder_layers(r, cfg, mixer, mlp))
