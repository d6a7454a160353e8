"""The byte formula of a hybrid model's state: ``state_nbytes`` and its per-layer parts.

What the canonical representation of a state (docs/design.md §3.2; the table in
`prfaas_jax.model.state`) holds for one sequence of ``L`` tokens, computed from the config
alone; with a ``WirePrecision`` (prfaas_jax/wire_precision.py), what it takes on the wire in
narrower encodings. Kept free of JAX: the router prices every transfer with it and never
imports JAX.
"""

from __future__ import annotations

import math

from prfaas_jax.config import LayerKind, ModelConfig, dtype_nbytes
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision, encoded_nbytes


def _size(precision: WirePrecision, kind: str, dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor of ``shape`` and config dtype ``dtype`` on the wire."""
    count = math.prod(shape)
    encoding = precision.encoding(kind, dtype)
    return encoded_nbytes(count, shape[-1], dtype_nbytes(dtype), dtype, encoding)


def layer_token_nbytes(
    cfg: ModelConfig, kind: LayerKind, precision: WirePrecision = WIRE_NATIVE
) -> int:
    """Bytes one token adds to a layer's growing or windowed cache (0 for linear layers)."""
    if kind is LayerKind.MLA:
        latent = _size(precision, "latent", cfg.dtype, (cfg.mla.kv_lora_rank,))
        return latent + _size(precision, "rope", cfg.dtype, (cfg.mla.qk_rope_head_dim,))
    if kind in (LayerKind.GQA, LayerKind.SWA):
        att = cfg.attention if kind is LayerKind.GQA else cfg.swa
        keys = _size(precision, "kv", cfg.dtype, (att.num_kv_heads, att.head_dim))
        return keys + _size(precision, "kv", cfg.dtype, (att.num_kv_heads, att.value_dim))
    return 0


def layer_fixed_nbytes(
    cfg: ModelConfig, kind: LayerKind, precision: WirePrecision = WIRE_NATIVE
) -> int:
    """Bytes of a linear layer's length-independent state (0 for attention layers)."""
    if not kind.is_linear:
        return 0
    lin = cfg.linear
    heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
    shape = (heads, lin.head_dim, lin.v_head_dim)
    nbytes = _size(precision, "state", cfg.state_dtype, shape)
    if kind is not LayerKind.LIGHTNING:
        tail = (lin.conv_kernel - 1, lin.conv_channels)
        nbytes += _size(precision, "conv", cfg.dtype, tail)
    return nbytes


def layer_nbytes(
    cfg: ModelConfig, kind: LayerKind, length: int, precision: WirePrecision = WIRE_NATIVE
) -> int:
    """Bytes of one layer's state for one sequence of ``length`` tokens."""
    per_token = layer_token_nbytes(cfg, kind, precision)
    if kind is LayerKind.SWA:
        return min(length, cfg.swa.window) * per_token
    return length * per_token + layer_fixed_nbytes(cfg, kind, precision)


def state_nbytes(cfg: ModelConfig, length: int, precision: WirePrecision = WIRE_NATIVE) -> int:
    """Bytes of the whole state of one sequence of ``length`` tokens: canonical, or on the
    wire under ``precision``."""
    if length < 0:
        raise ValueError(f"length must be ≥ 0, got {length}")
    return sum(layer_nbytes(cfg, kind, length, precision) for kind in cfg.layers)
