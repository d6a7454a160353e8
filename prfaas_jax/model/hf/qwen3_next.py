"""Qwen3-Next (``model_type = "qwen3_next"``): ``config_from_hf`` and ``convert``.

Gated DeltaNet + gated GQA, softmax MoE with a gated shared expert. Conventions of the checkpoint
(transformers ``modeling_qwen3_next.py``):

* Every decoder norm and the attention q/k norms are zero-centred, ``x̂ · (1 + w)``: ``1 + w`` is
  folded into the weight here. The GDN output norm is a plain ``x̂ · w`` gated by ``silu(z)``.
* GDN ``in_proj_qkvz`` rows are grouped per key head ``g`` as ``[q_g | k_g | v_g | z_g]`` (the
  value/z parts holding the ``nv/nk`` value heads of that group) and ``in_proj_ba`` as
  ``[b_g | a_g]``; they are regrouped into our separate q/k/v/z/b/a projections. One conv over
  ``[q | k | v]``; ``g = −exp(A_log)·softplus(a + dt_bias)`` per value head.
* Attention: ``q_proj`` gives per head ``[q | gate]``; output ``· sigmoid(gate)`` elementwise;
  partial NeoX RoPE on the first ``int(head_dim · partial_rotary_factor)`` dims (default 0.25).
* MoE: softmax router, top-k renormalised iff ``norm_topk_prob``, plus one shared SwiGLU of width
  ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate x)``. Blocks in
  ``mlp_only_layers`` (or off the ``decoder_sparse_step``) use a dense SwiGLU.
* The hub's multi-token-prediction tensors (``mtp.*``) are not used.
"""

from __future__ import annotations

from prfaas_jax.config import (
    AttentionConfig,
    LayerKind,
    LinearAttentionConfig,
    MlpKind,
    ModelConfig,
    MoeConfig,
    MoeScoring,
    RopeKind,
)
from prfaas_jax.model.hf import layers as hl
from prfaas_jax.model.hf.reader import HfConfig, TensorReader

FAMILY = "qwen3_next"
IGNORED = (r"mtp\..*", r"model\.mtp\..*")


def _mlps(hf: HfConfig, num_layers: int) -> tuple[MlpKind, ...]:
    dense_only = set(hf.get_list("mlp_only_layers", default=[]))
    step = hf.get_int("decoder_sparse_step", default=1)
    experts = hf.get_int("num_experts", default=512)
    return tuple(
        MlpKind.MOE
        if i not in dense_only and experts > 0 and step > 0 and (i + 1) % step == 0
        else MlpKind.DENSE
        for i in range(num_layers)
    )


def config_from_hf(hf: HfConfig, name: str) -> ModelConfig:
    num_layers = hf.get_int("num_hidden_layers", default=48)
    interval = hf.get_int("full_attention_interval", default=4)
    default = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    kinds = {"linear_attention": LayerKind.GDN, "full_attention": LayerKind.GQA}
    layers = hl.layer_kinds(hf, num_layers, kinds, default)
    mlps = _mlps(hf, num_layers)
    if hf.get_bool("attention_bias", default=False):
        raise hf.unsupported("attention_bias = true")
    head_dim = hf.get_int("head_dim", default=256)
    theta, fraction = hl.rope_parameters(hf, default_fraction=0.25)
    rotary_dim = int(head_dim * fraction)
    if rotary_dim % 2:
        raise hf.unsupported(f"an odd number of rotary dims ({rotary_dim})")
    attention = AttentionConfig(
        num_heads=hf.get_int("num_attention_heads", default=16),
        num_kv_heads=hf.get_int("num_key_value_heads", default=2),
        head_dim=head_dim,
        rope=RopeKind.NEOX,
        rope_theta=theta,
        rope_fraction=rotary_dim / head_dim,
        use_qk_norm=True,
        use_output_gate=True,
    )
    linear = LinearAttentionConfig(
        num_heads=hf.get_int("linear_num_key_heads", default=16),
        num_v_heads=hf.get_int("linear_num_value_heads", default=32),
        head_dim=hf.get_int("linear_key_head_dim", default=128),
        v_head_dim=hf.get_int("linear_value_head_dim", default=128),
        conv_kernel=hf.get_int("linear_conv_kernel_dim", default=4),
    )
    shared_dim = hf.get_int("shared_expert_intermediate_size", default=512)
    moe = MoeConfig(
        num_experts=hf.get_int("num_experts", default=512),
        top_k=hf.get_int("num_experts_per_tok", default=10),
        expert_dim=hf.get_int("moe_intermediate_size", default=512),
        num_shared_experts=1,
        shared_dim=shared_dim,
        use_shared_gate=True,
        scoring=MoeScoring.SOFTMAX,
        renormalize=hf.get_bool("norm_topk_prob", default=True),
    )
    return ModelConfig(
        name=name,
        vocab_size=hf.get_int("vocab_size", default=151936),
        hidden_dim=hf.get_int("hidden_size", default=2048),
        layers=layers,
        mlps=mlps,
        mlp_dim=hf.get_int("intermediate_size", default=5632) if MlpKind.DENSE in mlps else 0,
        norm_eps=hf.get_float("rms_norm_eps", default=1e-6),
        dtype=hf.dtype(),
        tie_embeddings=hf.get_bool("tie_word_embeddings", default=False),
        max_len=hf.get_int("max_position_embeddings", default=32768),
        linear=linear if LayerKind.GDN in layers else None,
        attention=attention if LayerKind.GQA in layers else None,
        moe=moe if MlpKind.MOE in mlps else None,
    )


def _gdn(r: TensorReader, prefix: str, cfg: ModelConfig) -> hl.Arrays:
    lin, dim = cfg.linear, cfg.hidden_dim
    nk, nv, dk, dv = lin.num_heads, lin.num_v_heads, lin.head_dim, lin.v_head_dim
    ratio = nv // nk
    qkvz = r.take(f"{prefix}in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, dim))
    qkvz = qkvz.reshape(nk, 2 * dk + 2 * ratio * dv, dim)
    q, k = qkvz[:, :dk], qkvz[:, dk : 2 * dk]
    v, z = qkvz[:, 2 * dk : 2 * dk + ratio * dv], qkvz[:, 2 * dk + ratio * dv :]
    ba = r.take(f"{prefix}in_proj_ba.weight", (2 * nv, dim)).reshape(nk, 2 * ratio, dim)
    b, a = ba[:, :ratio], ba[:, ratio:]

    def rows_to_linear(rows):  # [groups, per_group, dim] rows of an [out, in] weight → [in, out]
        return rows.reshape(-1, dim).T

    return {
        "q_proj": rows_to_linear(q),
        "k_proj": rows_to_linear(k),
        "v_proj": rows_to_linear(v),
        "conv": r.take(f"{prefix}conv1d.weight", (lin.conv_channels, 1, lin.conv_kernel))[:, 0].T,
        "b_proj": rows_to_linear(b),
        "A_log": r.take(f"{prefix}A_log", (nv,)),
        "o_norm": hl.norm(r, f"{prefix}norm.weight", dv),
        "o_proj": r.linear(f"{prefix}out_proj.weight", nv * dv, dim),
        "dt_bias": r.take(f"{prefix}dt_bias", (nv,)),
        "a_proj": rows_to_linear(a),
        "z_proj": rows_to_linear(z),
    }


def _attention(r: TensorReader, prefix: str, cfg: ModelConfig) -> hl.Arrays:
    att, dim = cfg.attention, cfg.hidden_dim
    heads, head_dim = att.num_heads, att.head_dim
    # q_proj rows are per head [q_h | gate_h].
    q_gate = r.take(f"{prefix}q_proj.weight", (2 * heads * head_dim, dim))
    q_gate = q_gate.reshape(heads, 2, head_dim, dim)
    kv_out = att.num_kv_heads * head_dim
    return {
        "q_proj": q_gate[:, 0].reshape(-1, dim).T,
        "k_proj": r.linear(f"{prefix}k_proj.weight", dim, kv_out),
        "v_proj": r.linear(f"{prefix}v_proj.weight", dim, kv_out),
        "o_proj": r.linear(f"{prefix}o_proj.weight", heads * head_dim, dim),
        "q_norm": hl.norm(r, f"{prefix}q_norm.weight", head_dim, zero_centred=True),
        "k_norm": hl.norm(r, f"{prefix}k_norm.weight", head_dim, zero_centred=True),
        "gate_proj": q_gate[:, 1].reshape(-1, dim).T,
    }


def _mlp(r: TensorReader, prefix: str, cfg: ModelConfig, kind: MlpKind) -> hl.Arrays:
    dim = cfg.hidden_dim
    if kind is MlpKind.DENSE:
        return hl.swiglu(r, prefix, dim, cfg.mlp_dim)
    moe = cfg.moe
    return {
        "router": hl.router(r, f"{prefix}gate.weight", dim, moe),
        **hl.routed_experts(r, f"{prefix}experts.", dim, moe),
        "shared": hl.swiglu(r, f"{prefix}shared_expert.", dim, moe.shared_width),
        "shared_gate": r.linear(f"{prefix}shared_expert_gate.weight", dim, 1),
    }


def convert(r: TensorReader, cfg: ModelConfig, hf: HfConfig) -> dict:
    def mixer(prefix: str, index: int, kind: LayerKind) -> hl.Arrays:
        if kind is LayerKind.GDN:
            return _gdn(r, f"{prefix}linear_attn.", cfg)
        return _attention(r, f"{prefix}self_attn.", cfg)

    def mlp(prefix: str, kind: MlpKind) -> hl.Arrays:
        return _mlp(r, f"{prefix}mlp.", cfg, kind)

    layers = hl.decoder_layers(r, cfg, mixer, mlp, zero_centred=True)
    return hl.causal_lm(r, cfg, layers, zero_centred=True)
