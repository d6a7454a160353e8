"""The layouts every Pallas kernel must lower for: ``KERNELS``, ``layouts`` and ``call``.

A layout is what a model hands a kernel — head counts and head dims — read from every shipped
preset (``configs/models``), plus the head dims no preset has yet (K, V in {64, 128, 256},
unequal K and V), each with batch 2 and lengths that are not a multiple of any chunk or block
(prefill T = 200 over S = 328 cache slots; decode over 300 slots). ``call(kernel, layout)``
gives a function of ``jax.ShapeDtypeStruct`` arguments and those arguments, ready for
``jax.jit(fn).trace(*args)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from prfaas_jax.config import LayerKind, available_presets, load_model_config
from prfaas_jax.ops.attention import flash_attention, mla_decode_pallas
from prfaas_jax.ops.delta_rule import gdn_pallas, kda_pallas
from prfaas_jax.ops.lightning import lightning_pallas

KERNELS = ("kda", "gdn", "lightning", "flash", "mla-decode")
B, T, S, S_DECODE = 2, 200, 328, 300
# Head dims beyond the presets': (heads, value heads or kv groups, K, V).
EXTRA_LINEAR = ((4, 8, 64, 64), (2, 4, 256, 256), (2, 2, 64, 256), (2, 2, 256, 128))
EXTRA_FLASH = ((8, 2, 64, 64, 0, False), (4, 4, 256, 256, 0, False), (8, 4, 64, 256, 32, True))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Heads and head dims of one kernel call; ``name`` says where they come from."""

    name: str
    heads: int
    groups: int  # value heads (linear), kv groups (flash); unused by MLA decode
    k_dim: int  # K (linear), q/k head dim (flash), kv_lora_rank R (MLA decode)
    v_dim: int  # V (linear, flash), v_head_dim (MLA decode)
    window: int = 0
    sinks: bool = False
    nope_dim: int = 0  # MLA decode only
    rope_dim: int = 0

    @property
    def key(self) -> tuple:
        return dataclasses.astuple(self)[1:]


def _preset_layouts() -> dict[str, list[Layout]]:
    found: dict[str, list[Layout]] = {kernel: [] for kernel in KERNELS}
    for name in available_presets():
        cfg = load_model_config(name)
        kinds = set(cfg.layers)
        if lin := cfg.linear:
            dims = (lin.num_heads, lin.num_v_heads, lin.head_dim, lin.v_head_dim)
            for kind in kinds & {LayerKind.KDA, LayerKind.GDN}:
                found[str(kind)].append(Layout(name, *dims))
            if LayerKind.LIGHTNING in kinds:  # one head count for q, k and v
                found["lightning"].append(Layout(name, lin.num_heads, lin.num_heads, *dims[2:]))
        for kind, att in ((LayerKind.GQA, cfg.attention), (LayerKind.SWA, cfg.swa)):
            if kind in kinds:
                v_dim = att.v_head_dim or att.head_dim
                dims = (att.num_heads, att.num_kv_heads, att.head_dim, v_dim)
                found["flash"].append(Layout(f"{name}-{kind}", *dims, att.window, att.use_sinks))
        if mla := cfg.mla:  # prefill: flash over the expanded heads; decode: the absorbed kernel
            qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            heads, v_dim = mla.num_heads, mla.v_head_dim
            found["flash"].append(Layout(f"{name}-mla", heads, heads, qk_dim, v_dim))
            found["mla-decode"].append(
                Layout(
                    name,
                    mla.num_heads,
                    mla.num_heads,
                    mla.kv_lora_rank,
                    mla.v_head_dim,
                    nope_dim=mla.qk_nope_head_dim,
                    rope_dim=mla.qk_rope_head_dim,
                )
            )
    return found


def layouts() -> dict[str, list[Layout]]:
    """Every kernel's distinct layouts: the presets', then the extra head dims."""
    found = _preset_layouts()
    for dims in EXTRA_LINEAR:
        for kernel in ("kda", "gdn"):
            found[kernel].append(Layout("K{2}-V{3}".format(*dims), *dims))
        heads, _, k_dim, v_dim = dims
        found["lightning"].append(Layout(f"K{k_dim}-V{v_dim}", heads, heads, k_dim, v_dim))
    for dims in EXTRA_FLASH:
        found["flash"].append(Layout("D{2}-V{3}".format(*dims), *dims))
    found["mla-decode"].append(Layout("R256-V64", 16, 16, 256, 64, nope_dim=64, rope_dim=32))
    distinct = {}
    for kernel, entries in found.items():
        seen: dict[tuple, Layout] = {}
        for layout in entries:
            seen.setdefault(layout.key, layout)
        distinct[kernel] = list(seen.values())
    return distinct


def _spec(*shape: int, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def call(kernel: str, layout: Layout) -> tuple[Callable, tuple[jax.ShapeDtypeStruct, ...]]:
    """``(fn, args)``: the kernel at its default block sizes, compiled (not interpreted)."""
    H, G, K, V = layout.heads, layout.groups, layout.k_dim, layout.v_dim
    i32 = jnp.int32
    state = {"output_final_state": True, "interpret": False}
    if kernel in ("kda", "gdn"):
        op = kda_pallas if kernel == "kda" else gdn_pallas
        gate = _spec(B, T, G, K) if kernel == "kda" else _spec(B, T, G)
        args = (_spec(B, T, H, K), _spec(B, T, H, K), _spec(B, T, G, V), gate, _spec(B, T, G))
        return (
            lambda q, k, v, g, beta, s: op(q, k, v, g, beta, initial_state=s, **state),
            (*args, _spec(B, G, K, V)),
        )
    if kernel == "lightning":
        return (
            lambda q, k, v, s, n: lightning_pallas(
                q, k, v, decay=-jnp.ones(H), initial_state=s, valid_len=n, **state
            ),
            (
                _spec(B, T, H, K),
                _spec(B, T, H, K),
                _spec(B, T, H, V),
                _spec(B, H, K, V),
                _spec(B, dtype=i32),
            ),
        )
    if kernel == "flash":
        window, use_sinks = layout.window, layout.sinks
        return (
            lambda q, k, v, qp, kp, sinks: flash_attention(
                q,
                k,
                v,
                q_pos=qp,
                kv_pos=kp,
                scale=K**-0.5,
                window=window,
                sinks=sinks if use_sinks else None,
                interpret=False,
            ),
            (
                _spec(B, T, H, K),
                _spec(B, S, G, K),
                _spec(B, S, G, V),
                _spec(B, T, dtype=i32),
                _spec(B, S, dtype=i32),
                _spec(H),
            ),
        )
    N, P = layout.nope_dim, layout.rope_dim
    return (
        lambda qn, qr, c, kr, wk, wv, qp, kp: mla_decode_pallas(
            qn, qr, c, kr, wk, wv, q_pos=qp, kv_pos=kp, scale=(N + P) ** -0.5, interpret=False
        ),
        (
            _spec(B, 1, H, N),
            _spec(B, 1, H, P),
            _spec(B, S_DECODE, K),
            _spec(B, S_DECODE, P),
            _spec(K, H, N),
            _spec(K, H, V),
            _spec(B, 1, dtype=i32),
            _spec(B, S_DECODE, dtype=i32),
        ),
    )
