"""Converters shared by the Hugging Face families (``hf_<family>.py``).

Config readers: ``layer_kinds``, ``mlp_kinds``, ``rope_parameters``, ``mla_config`` and
``deepseek_moe_config``. Tensor converters, one per layer: ``causal_lm`` (embeddings, final norm,
head) around ``decoder_layers`` (the pre-norm blocks ``model.layers.{i}.``), ``norm``, ``swiglu``,
``router``, ``routed_experts``, ``deepseek_moe``, ``kda`` and ``mla``.

Each tensor converter takes tensors from a ``TensorReader`` under a prefix and returns them in
this package's parameter layout as float32 numpy arrays (``hf.py`` casts them to the model dtype):
an ``nn.Linear`` weight ``[out, in]`` becomes ``[in, out]`` (``TensorReader.linear``), a depthwise
conv ``[channels, 1, kernel]`` becomes ``[kernel, channels]``, per-expert matrices are stacked
``[E, in, out]``; everything else keeps its shape unless the docstring says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from prfaas_jax.config import (
    LayerKind,
    MlaConfig,
    MlpKind,
    ModelConfig,
    MoeConfig,
    MoeScoring,
    RopeKind,
)
from prfaas_jax.model.hf.reader import HfConfig, TensorReader

Arrays = dict
# transformers builds the MLA latent norms (``kv_a_layernorm``, ``q_a_layernorm``) of Kimi Linear
# and Bailing without the config's eps, so they keep their RMSNorm class default.
MLA_LATENT_NORM_EPS = 1e-6


def layer_kinds(
    hf: HfConfig, num_layers: int, kinds: Mapping[str, LayerKind], default: Sequence[str]
) -> tuple[LayerKind, ...]:
    """``config.json``'s ``layer_types`` (or ``default``) mapped through ``kinds``."""
    names = hf.get_list("layer_types", default=list(default))
    if len(names) != num_layers:
        raise hf.unsupported(
            f"layer_types with {len(names)} entries for num_hidden_layers={num_layers}"
        )
    unknown = sorted({str(n) for n in names} - set(kinds))
    if unknown:
        raise hf.unsupported(f"layer type(s) {unknown} (known: {sorted(kinds)})")
    return tuple(kinds[n] for n in names)


def mlp_kinds(hf: HfConfig, num_layers: int, first_dense_default: int) -> tuple[MlpKind, ...]:
    """``mlp_layer_types`` ("dense" / "sparse"), else dense for the first ``first_k_dense``."""
    first_dense = hf.get_int("first_k_dense_replace", default=first_dense_default)
    default = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    names = hf.get_list("mlp_layer_types", default=default)
    table = {"dense": MlpKind.DENSE, "sparse": MlpKind.MOE}
    if len(names) != num_layers or not set(names) <= set(table):
        raise hf.unsupported(f"mlp_layer_types {names}")
    return tuple(table[n] for n in names)


def rope_parameters(
    hf: HfConfig,
    section: Mapping | None = None,
    *,
    default_theta: float = 10000.0,
    default_fraction: float = 1.0,
) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` of default (unscaled) RoPE.

    ``section`` is one entry of a per-layer-type ``rope_parameters`` (MiMo); otherwise the model's
    ``rope_parameters``, falling back to the legacy top-level keys and then the family defaults.
    """
    params = section if section is not None else hf.get_dict("rope_parameters", default={})
    legacy = hf.get_dict("rope_scaling", default={})  # pre-v5 configs name scaled RoPE here
    for table in (params, legacy):
        rope_type = table.get("rope_type", table.get("type", "default"))
        if rope_type != "default":
            raise hf.unsupported(f"rope_type {rope_type!r} (only default RoPE)")
    theta = params.get("rope_theta")
    if theta is None:
        theta = hf.get_float("rope_theta", default=default_theta)
    fraction = params.get("partial_rotary_factor")
    if fraction is None:
        fraction = hf.get_float("partial_rotary_factor", default=default_fraction)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (theta, fraction)):
        raise hf.unsupported(f"rope_parameters {dict(params)}")
    return float(theta), float(fraction)


def mla_config(
    hf: HfConfig,
    *,
    num_heads: int,
    rope: RopeKind,
    rope_theta: float = MlaConfig.rope_theta,
    use_output_gate: bool = False,
) -> MlaConfig:
    """DeepSeek-V3 MLA sizes (``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim``, ``q_lora_rank``; DeepSeek's defaults) with latent norm eps 1e-6."""
    return MlaConfig(
        num_heads=num_heads,
        kv_lora_rank=hf.get_int("kv_lora_rank", default=512),
        qk_nope_head_dim=hf.get_int("qk_nope_head_dim", default=128),
        qk_rope_head_dim=hf.get_int("qk_rope_head_dim", default=64),
        v_head_dim=hf.get_int("v_head_dim", default=128),
        q_lora_rank=hf.get_int("q_lora_rank", default=0),
        rope=rope,
        rope_theta=rope_theta,
        latent_norm_eps=MLA_LATENT_NORM_EPS,
        use_output_gate=use_output_gate,
    )


def deepseek_moe_config(
    hf: HfConfig,
    *,
    num_experts: int,
    expert_dim: int,
    routed_scale: float,
    num_groups: int,
    topk_groups: int,
) -> MoeConfig:
    """DeepSeek-V3 routing as Kimi Linear and Bailing configure it: sigmoid scores, a
    selection-only bias, group-limited top-k (8 by default), renormalised unless
    ``moe_renormalize`` / ``norm_topk_prob`` is false, times ``routed_scaling_factor``, plus
    shared experts (1 by default). The keywords are the family's defaults for absent keys.
    """
    return MoeConfig(
        num_experts=hf.get_int("num_experts", "num_local_experts", default=num_experts),
        top_k=hf.get_int("num_experts_per_token", "num_experts_per_tok", default=8),
        expert_dim=hf.get_int("moe_intermediate_size", default=expert_dim),
        num_shared_experts=hf.get_int("num_shared_experts", "n_shared_experts", default=1),
        scoring=MoeScoring.SIGMOID,
        use_score_bias=True,
        renormalize=hf.get_bool("moe_renormalize", "norm_topk_prob", default=True),
        routed_scale=hf.get_float("routed_scaling_factor", default=routed_scale),
        num_groups=hf.get_int("num_expert_group", "n_group", default=num_groups),
        topk_groups=hf.get_int("topk_group", default=topk_groups),
    )


def causal_lm(
    r: TensorReader,
    cfg: ModelConfig,
    layers: tuple[Arrays, ...],
    *,
    embed: str = "model.embed_tokens.weight",
    zero_centred: bool = False,
) -> Arrays:
    """The whole parameter tree around converted ``layers``.

    ``{embed}`` ``[vocab, dim]`` → ``embed`` (as stored), ``model.norm.weight`` → ``final_norm``
    and, unless ``cfg.tie_embeddings``, ``lm_head.weight`` ``[vocab, dim]`` → ``lm_head``
    ``[dim, vocab]``.
    """
    dim = cfg.hidden_dim
    params = {
        "embed": r.take(embed, (cfg.vocab_size, dim)),
        "layers": layers,
        "final_norm": norm(r, "model.norm.weight", dim, zero_centred=zero_centred),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = r.linear("lm_head.weight", dim, cfg.vocab_size)
    return params


def decoder_layers(
    r: TensorReader,
    cfg: ModelConfig,
    mixer: Callable[[str, int, LayerKind], Arrays],
    mlp: Callable[[str, MlpKind], Arrays],
    *,
    zero_centred: bool = False,
) -> tuple[Arrays, ...]:
    """Every pre-norm decoder block, in ``init_params``' layout.

    Under ``prefix = model.layers.{i}.``, in this order: ``input_layernorm.weight`` →
    ``mixer_norm``, ``mixer(prefix, i, kind)`` → ``mixer``, ``post_attention_layernorm.weight`` →
    ``mlp_norm``, ``mlp(prefix, mlp_kind)`` → ``mlp``.
    """

    def block_norm(name: str) -> np.ndarray:
        return norm(r, name, cfg.hidden_dim, zero_centred=zero_centred)

    layers = []
    for index, (kind, mlp_kind) in enumerate(zip(cfg.layers, cfg.mlps, strict=True)):
        prefix = f"model.layers.{index}."
        mixer_norm = block_norm(f"{prefix}input_layernorm.weight")
        mixer_params = mixer(prefix, index, kind)
        mlp_norm = block_norm(f"{prefix}post_attention_layernorm.weight")
        layers.append(
            {
                "mixer_norm": mixer_norm,
                "mixer": mixer_params,
                "mlp_norm": mlp_norm,
                "mlp": mlp(prefix, mlp_kind),
            }
        )
    return tuple(layers)


def norm(r: TensorReader, name: str, dim: int, *, zero_centred: bool = False) -> np.ndarray:
    """An RMSNorm weight ``[dim]``; a zero-centred norm (``x̂ · (1 + w)``) is folded to ``1 + w``."""
    weight = r.take(name, (dim,))
    return 1.0 + weight if zero_centred else weight


def swiglu(
    r: TensorReader,
    prefix: str,
    dim: int,
    width: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> Arrays:
    """A SwiGLU MLP: ``{prefix}{names}.weight`` → ``gate``, ``up`` ``[dim, width]`` and ``down``
    ``[width, dim]``, each transposed."""
    gate, up, down = names
    return {
        "gate": r.linear(f"{prefix}{gate}.weight", dim, width),
        "up": r.linear(f"{prefix}{up}.weight", dim, width),
        "down": r.linear(f"{prefix}{down}.weight", width, dim),
    }


def routed_experts(
    r: TensorReader,
    prefix: str,
    dim: int,
    moe: MoeConfig,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> Arrays:
    """Per-expert SwiGLU weights ``{prefix}{e}.{gate,up,down}.weight``, stacked ``[E, in, out]``."""
    per_expert = [
        swiglu(r, f"{prefix}{e}.", dim, moe.expert_dim, names) for e in range(moe.num_experts)
    ]
    return {
        f"experts_{part}": np.stack([expert[part] for expert in per_expert])
        for part in ("gate", "up", "down")
    }


def router(r: TensorReader, name: str, dim: int, moe: MoeConfig) -> np.ndarray:
    """The router ``{name}`` ``[E, dim]``, transposed to ``[dim, E]``."""
    return r.linear(name, dim, moe.num_experts)


def kda(
    r: TensorReader,
    prefix: str,
    cfg: ModelConfig,
    *,
    a_log_shape: tuple[int, ...],
    o_proj: str,
) -> Arrays:
    """A KDA layer under ``prefix`` (Kimi Linear, Bailing); linear weights are transposed.

    ``{q,k,v}_proj`` → ``q_proj``, ``k_proj``, ``v_proj``; the three depthwise convs
    ``{q,k,v}_conv1d.weight`` ``[channels, 1, kernel]`` → one ``conv`` ``[kernel, q|k|v]``;
    ``b_proj`` (beta) → ``b_proj``; ``A_log`` (stored as ``a_log_shape``) → ``A_log`` ``[HV]``;
    ``dt_bias`` ``[HV·K]``; ``o_norm.weight`` → ``o_norm``; ``{o_proj}`` → ``o_proj``. Gates: full
    rank ``f_proj``, ``g_proj``, or low rank ``f_a_proj``, ``f_b_proj``, ``g_a_proj``,
    ``g_b_proj`` → ``f_a``, ``f_b``, ``g_a``, ``g_b``.
    """
    lin, dim = cfg.linear, cfg.hidden_dim
    heads, key_dim, value_dim = lin.num_v_heads, lin.head_dim, lin.v_head_dim
    qk_out, v_out = lin.num_heads * key_dim, heads * value_dim
    # HF keeps one depthwise conv per projection, [channels, 1, kernel]; ours is one [kernel, C].
    conv = np.concatenate(
        [
            r.take(f"{prefix}{part}_conv1d.weight", (width, 1, lin.conv_kernel))[:, 0, :]
            for part, width in (("q", qk_out), ("k", qk_out), ("v", v_out))
        ]
    ).T
    p: Arrays = {
        "q_proj": r.linear(f"{prefix}q_proj.weight", dim, qk_out),
        "k_proj": r.linear(f"{prefix}k_proj.weight", dim, qk_out),
        "v_proj": r.linear(f"{prefix}v_proj.weight", dim, v_out),
        "conv": conv,
        "b_proj": r.linear(f"{prefix}b_proj.weight", dim, heads),
        "A_log": r.take(f"{prefix}A_log", a_log_shape).reshape(heads),
        "o_norm": norm(r, f"{prefix}o_norm.weight", value_dim),
        "o_proj": r.linear(f"{prefix}{o_proj}.weight", v_out, dim),
        "dt_bias": r.take(f"{prefix}dt_bias", (heads * key_dim,)),
    }
    if lin.full_rank_gates:
        p["f_proj"] = r.linear(f"{prefix}f_proj.weight", dim, heads * key_dim)
        p["g_proj"] = r.linear(f"{prefix}g_proj.weight", dim, v_out)
    else:
        rank = lin.low_rank
        p["f_a"] = r.linear(f"{prefix}f_a_proj.weight", dim, rank)
        p["f_b"] = r.linear(f"{prefix}f_b_proj.weight", rank, heads * key_dim)
        p["g_a"] = r.linear(f"{prefix}g_a_proj.weight", dim, rank)
        p["g_b"] = r.linear(f"{prefix}g_b_proj.weight", rank, v_out)
    return p


def mla(r: TensorReader, prefix: str, cfg: ModelConfig, *, o_proj: str) -> Arrays:
    """An MLA layer under ``prefix`` (DeepSeek-V3 names); linear weights are transposed.

    ``q_proj`` → ``q_proj``, or with a ``q_lora_rank`` ``q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj`` → ``q_a``, ``q_a_norm``, ``q_b``; ``kv_a_proj_with_mqa`` → ``kv_a`` (columns
    ``[c_kv | k_rope]``), ``kv_a_layernorm`` → ``kv_a_norm``, ``kv_b_proj`` → ``kv_b``,
    ``{o_proj}`` → ``o_proj``; with ``use_output_gate`` the per-head gate ``g_proj`` →
    ``gate_proj`` ``[dim, H]``.
    """
    m, dim = cfg.mla, cfg.hidden_dim
    q_out = m.num_heads * m.qk_head_dim
    p: Arrays = {}
    if m.q_lora_rank:
        p["q_a"] = r.linear(f"{prefix}q_a_proj.weight", dim, m.q_lora_rank)
        p["q_a_norm"] = norm(r, f"{prefix}q_a_layernorm.weight", m.q_lora_rank)
        p["q_b"] = r.linear(f"{prefix}q_b_proj.weight", m.q_lora_rank, q_out)
    else:
        p["q_proj"] = r.linear(f"{prefix}q_proj.weight", dim, q_out)
    p["kv_a"] = r.linear(
        f"{prefix}kv_a_proj_with_mqa.weight", dim, m.kv_lora_rank + m.qk_rope_head_dim
    )
    p["kv_a_norm"] = norm(r, f"{prefix}kv_a_layernorm.weight", m.kv_lora_rank)
    p["kv_b"] = r.linear(
        f"{prefix}kv_b_proj.weight",
        m.kv_lora_rank,
        m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
    )
    p["o_proj"] = r.linear(f"{prefix}{o_proj}.weight", m.num_heads * m.v_head_dim, dim)
    if m.use_output_gate:
        p["gate_proj"] = r.linear(f"{prefix}g_proj.weight", dim, m.num_heads)
    return p


def deepseek_moe(
    r: TensorReader,
    prefix: str,
    cfg: ModelConfig,
    *,
    bias: str = "e_score_correction_bias",
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    shared: str = "shared_experts",
) -> Arrays:
    """Sigmoid-routed experts with a selection bias and optional always-on shared experts.

    ``gate.weight`` → ``router`` ``[dim, E]``, ``gate.{bias}`` → ``score_bias`` ``[E]``,
    ``experts.{e}.{expert_names}`` → ``experts_{gate,up,down}`` (``routed_experts``) and, if the
    config has shared experts, the SwiGLU ``{shared}.{gate,up,down}_proj`` → ``shared``. The
    defaults are DeepSeek-V3's names.
    """
    moe, dim = cfg.moe, cfg.hidden_dim
    p: Arrays = {
        "router": router(r, f"{prefix}gate.weight", dim, moe),
        **routed_experts(r, f"{prefix}experts.", dim, moe, expert_names),
        "score_bias": r.take(f"{prefix}gate.{bias}", (moe.num_experts,)),
    }
    if moe.num_shared_experts:
        p["shared"] = swiglu(r, f"{prefix}{shared}.", dim, moe.shared_width)
    return p
