"""Converters shared by several Hugging Face families: layer patterns, norms, SwiGLU, routed
experts, KDA (Kimi Linear, Bailing) and MLA (Kimi Linear, Bailing) blocks.

Each converter takes tensors from a ``TensorReader`` under a layer prefix and returns them in this
package's parameter layout (``[in, out]`` matrices, ``[kernel, channels]`` convolutions, stacked
``[E, in, out]`` experts), as float32 numpy arrays; ``hf.py`` casts them to the model dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from prfaas_jax.config import LayerKind, MlpKind, ModelConfig, MoeConfig
from prfaas_jax.model.hf_checkpoint import HfConfig, TensorReader

Arrays = dict


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


def block(mixer_norm: np.ndarray, mixer: Arrays, mlp_norm: np.ndarray, mlp: Arrays) -> Arrays:
    return {"mixer_norm": mixer_norm, "mixer": mixer, "mlp_norm": mlp_norm, "mlp": mlp}


def norm(r: TensorReader, name: str, dim: int, *, zero_centred: bool = False) -> np.ndarray:
    """An RMSNorm weight; zero-centred norms (``x̂ · (1 + w)``) are folded into ``1 + w``."""
    weight = r.take(name, (dim,))
    return 1.0 + weight if zero_centred else weight


def swiglu(
    r: TensorReader,
    prefix: str,
    dim: int,
    width: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> Arrays:
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
    return r.linear(name, dim, moe.num_experts)


def kda(
    r: TensorReader,
    prefix: str,
    cfg: ModelConfig,
    *,
    a_log_shape: tuple[int, ...],
    o_proj: str,
) -> Arrays:
    """A KDA layer: separate q/k/v projections and convs, gates low-rank or full-rank."""
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
    """An MLA layer (DeepSeek-V3 names), with the optional per-head output gate ``g_proj``."""
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
    bias: str,
    expert_names: tuple[str, str, str],
    shared: str | None,
) -> Arrays:
    """Sigmoid-routed experts with a selection bias and optional always-on shared experts."""
    moe, dim = cfg.moe, cfg.hidden_dim
    p: Arrays = {
        "router": router(r, f"{prefix}gate.weight", dim, moe),
        **routed_experts(r, f"{prefix}experts.", dim, moe, expert_names),
        "score_bias": r.take(f"{prefix}gate.{bias}", (moe.num_experts,)),
    }
    if moe.num_shared_experts:
        p["shared"] = swiglu(r, f"{prefix}{shared}.", dim, moe.shared_width)
    return p
