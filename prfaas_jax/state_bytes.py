"""The byte formula of a hybrid model's state: ``state_nbytes`` and its per-layer parts.

What the canonical representation of a state (docs/design.md §3.2; the table in
`prfaas_jax.model.state`) holds for one sequence of ``L`` tokens, computed from the config
alone. Kept free of JAX: the router prices every transfer with it and never imports JAX.
"""

from __future__ import annotations

from prfaas_jax.config import LayerKind, ModelConfig, dtype_nbytes


def layer_token_nbytes(cfg: ModelConfig, kind: LayerKind) -> int:
    """Bytes one token adds to a layer's growing or windowed cache (0 for linear layers)."""
    item = dtype_nbytes(cfg.dtype)
    if kind is LayerKind.MLA:
        return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * item
    if kind in (LayerKind.GQA, LayerKind.SWA):
        att = cfg.attention if kind is LayerKind.GQA else cfg.swa
        return att.num_kv_heads * (att.head_dim + att.value_dim) * item
    return 0


def layer_fixed_nbytes(cfg: ModelConfig, kind: LayerKind) -> int:
    """Bytes of a linear layer's length-independent state (0 for attention layers)."""
    if not kind.is_linear:
        return 0
    lin = cfg.linear
    heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
    nbytes = heads * lin.head_dim * lin.v_head_dim * dtype_nbytes(cfg.state_dtype)
    if kind is not LayerKind.LIGHTNING:
        nbytes += (lin.conv_kernel - 1) * lin.conv_channels * dtype_nbytes(cfg.dtype)
    return nbytes


def layer_nbytes(cfg: ModelConfig, kind: LayerKind, length: int) -> int:
    """Canonical bytes of one layer's state for one sequence of ``length`` tokens."""
    if kind is LayerKind.SWA:
        return min(length, cfg.swa.window) * layer_token_nbytes(cfg, kind)
    return length * layer_token_nbytes(cfg, kind) + layer_fixed_nbytes(cfg, kind)


def state_nbytes(cfg: ModelConfig, length: int) -> int:
    """Canonical bytes of the whole state of one sequence of ``length`` tokens."""
    if length < 0:
        raise ValueError(f"length must be ≥ 0, got {length}")
    return sum(layer_nbytes(cfg, kind, length) for kind in cfg.layers)
