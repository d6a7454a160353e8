"""Typed state pytrees of the hybrid model, and the byte formula that counts them.

``ModelState`` is what prefill returns, what decode consumes and what the codec ships. It holds
the per-row sequence length and one state per layer, by layer kind:

=============  =====================================  =================================
kind           arrays (batch first)                   canonical bytes for length ``L``
=============  =====================================  =================================
MLA            ``c_kv[B,S,R]``, ``k_rope[B,S,Dr]``      ``L·(R+Dr)·dtype``
GQA            ``k[B,S,Hkv,Dk]``, ``v[B,S,Hkv,Dv]``     ``L·Hkv·(Dk+Dv)·dtype``
SWA            ring of ``W' = min(W, S)`` positions    ``min(L,W)·Hkv·(Dk+Dv)·dtype``
KDA, GDN       ``recurrent[B,Hv,K,V]``, ``conv[B,k−1,C]``  ``Hv·K·V·state_dtype + (k−1)·C·dtype``
Lightning      ``recurrent[B,H,K,V]``                  ``H·K·V·state_dtype``
=============  =====================================  =================================

``S`` is the capacity (``max_len``) of the growing caches. Position ``p`` of an SWA layer lives
in ring slot ``p mod W'``. The canonical representation (what the codec transfers and what
``state_nbytes`` counts) keeps only the first ``L`` positions of growing caches and the last
``min(L, W)`` positions of a window. ``PagedKvState`` stands in for an attention layer's cache
during one decode step over a block pool (engine/paged_decode.py): pages and a block table,
never a canonical state.
"""

from __future__ import annotations

import dataclasses
from typing import TypeAlias

import jax
import jax.numpy as jnp

from prfaas_jax.config import LayerKind, ModelConfig
from prfaas_jax.state_bytes import layer_fixed_nbytes as layer_fixed_nbytes  # re-exported
from prfaas_jax.state_bytes import layer_nbytes as layer_nbytes  # re-exported
from prfaas_jax.state_bytes import layer_token_nbytes as layer_token_nbytes  # re-exported
from prfaas_jax.state_bytes import state_nbytes as state_nbytes  # re-exported


def _pytree(cls: type) -> type:
    """Register a frozen dataclass whose fields are all array leaves."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_pytree
class MlaState:
    c_kv: jax.Array  # [B, S, kv_lora_rank], model dtype, after kv_a_layernorm
    k_rope: jax.Array  # [B, S, qk_rope_head_dim], model dtype, after RoPE (if any)


@_pytree
class KvState:
    k: jax.Array  # [B, S, num_kv_heads, head_dim], after q/k norm and RoPE
    v: jax.Array  # [B, S, num_kv_heads, v_head_dim]


@_pytree
class WindowKvState:
    k: jax.Array  # [B, W', num_kv_heads, head_dim]; position p in slot p mod W'
    v: jax.Array  # [B, W', num_kv_heads, v_head_dim]


@_pytree
class DeltaState:
    recurrent: jax.Array  # [B, Hv, K, V], state dtype (fp32)
    conv: jax.Array  # [B, conv_kernel − 1, conv_channels]: last pre-conv inputs, model dtype


@_pytree
class LightningState:
    recurrent: jax.Array  # [B, H, K, V], state dtype (fp32)


@_pytree
class PagedKvState:
    """An attention layer's cache as pages, for one decode step over a block pool
    (engine/paged_decode.py): pages in the layout of ops/attention/paged.py — MLA
    ``first = c_kv[P,T,R]``, ``second = k_rope[P,T,Dr]``; GQA, SWA ``first = k[Hkv,P,T,Dk]``,
    ``second = v[Hkv,P,T,Dv]`` — and ``table[B,N]``, the page of each row's block ``n`` (SWA:
    of block ``b`` at entry ``b mod N``, a ring). The layer writes its token into its page,
    then attends through the table."""

    first: jax.Array
    second: jax.Array
    table: jax.Array  # [B, N] int32


LayerState: TypeAlias = (
    MlaState | KvState | WindowKvState | DeltaState | LightningState | PagedKvState
)


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Lengths per row plus one state per layer (``layers[i]`` belongs to block ``i``)."""

    lengths: jax.Array  # [B] int32: tokens already absorbed by each row
    layers: tuple[LayerState, ...]

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        """Positions a growing cache can hold (0 when the model has no growing cache)."""
        for layer in self.layers:
            if isinstance(layer, MlaState):
                return int(layer.c_kv.shape[1])
            if isinstance(layer, KvState):
                return int(layer.k.shape[1])
        return 0


jax.tree_util.register_dataclass(ModelState, data_fields=["lengths", "layers"], meta_fields=[])


def window_capacity(window: int, max_len: int) -> int:
    """Ring size of an SWA cache: never more slots than positions the state can reach."""
    return min(window, max_len)


def init_layer_state(cfg: ModelConfig, kind: LayerKind, batch: int, max_len: int) -> LayerState:
    dtype = jnp.dtype(cfg.dtype)
    state_dtype = jnp.dtype(cfg.state_dtype)
    if kind is LayerKind.MLA:
        mla = cfg.mla
        return MlaState(
            c_kv=jnp.zeros((batch, max_len, mla.kv_lora_rank), dtype),
            k_rope=jnp.zeros((batch, max_len, mla.qk_rope_head_dim), dtype),
        )
    if kind in (LayerKind.GQA, LayerKind.SWA):
        att = cfg.attention if kind is LayerKind.GQA else cfg.swa
        slots = max_len if kind is LayerKind.GQA else window_capacity(att.window, max_len)
        cls = KvState if kind is LayerKind.GQA else WindowKvState
        return cls(
            k=jnp.zeros((batch, slots, att.num_kv_heads, att.head_dim), dtype),
            v=jnp.zeros((batch, slots, att.num_kv_heads, att.value_dim), dtype),
        )
    lin = cfg.linear
    heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
    recurrent = jnp.zeros((batch, heads, lin.head_dim, lin.v_head_dim), state_dtype)
    if kind is LayerKind.LIGHTNING:
        return LightningState(recurrent=recurrent)
    conv = jnp.zeros((batch, lin.conv_kernel - 1, lin.conv_channels), dtype)
    return DeltaState(recurrent=recurrent, conv=conv)


def init_state(cfg: ModelConfig, batch: int, max_len: int) -> ModelState:
    """An empty state (length 0) whose growing caches hold up to ``max_len`` positions."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be ≥ 1, got {batch} and {max_len}")
    return ModelState(
        lengths=jnp.zeros((batch,), jnp.int32),
        layers=tuple(init_layer_state(cfg, kind, batch, max_len) for kind in cfg.layers),
    )
