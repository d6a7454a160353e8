"""Decode attention over a paged KV cache as a Pallas kernel: ``paged_attention_pallas`` (GQA,
SWA) and ``paged_mla_decode_pallas`` (absorbed MLA), the contracts of ``paged.py``.

One program per (sequence, kv head): the queries of the head's group (all heads for MLA) walk
the sequence's blocks in order — from the first one the window can see to the last filled one —
reading each block's page through the page table (a scalar load: SMEM on Mosaic) and folding it
into the online softmax of ``online_softmax``, sink logit first. MLA takes two dots per page
(W_UK-absorbed queries against the latents, rope queries against the rope keys) and the
latents as values; absorbing W_UK and W_UV stays in XLA around the kernel, as in
``mla_decode_pallas``.

The pages ride into each program as one block of the whole page array (the page index is a
dynamic index on its leading axis), padded to Triton's power-of-two tiles: exact, and right for
pools that fit a core's fast memory. A pool larger than that wants its pages copied in by table
(Mosaic's scalar-prefetched block indices or manual DMA), which this kernel does not do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from prfaas_jax.ops.attention.online_softmax import MASK, softmax_block
from prfaas_jax.ops.pallas_backend import (
    Backend,
    compiler_params,
    read_scalar,
    scalar_spec,
    target_backend,
)
from prfaas_jax.ops.pallas_launch import dot_f32, pad_axis, pow2_dim, resolve_interpret

_HIGHEST = jax.lax.Precision.HIGHEST


def _page(table_ref, n):
    """Entry ``n`` of this sequence's page table (a row block, or the whole table in SMEM)."""
    return table_ref[n] if table_ref.ndim == 1 else table_ref[pl.program_id(0), n]


def _paged_kernel(
    len_ref,  # []             positions held by this sequence (Mosaic: [B], SMEM)
    table_ref,  # [N]          its page table (Mosaic: [B, N], SMEM)
    sink_ref,  # [M, 1]        sink logit of each query row, MASK without sinks
    q_ref,  # [M, Dk]          scaled queries of this kv head's group
    k_ref,  # [P, T, Dk]       key pages of this kv head (MLA: the latents)
    *refs,  # MLA: q_rope [M, Dr], rope pages [P, T, Dr]; else value pages [P, T, Dv]; then out
    page_len: int,
    ring_pages: int,
    window: int,
    mla: bool,
):
    o_ref = refs[-1]
    q = q_ref[...]
    M = q.shape[0]
    T_pad = k_ref.shape[1]
    length = read_scalar(len_ref, 0)
    last = (length + page_len - 1) // page_len
    first = jnp.maximum(length - window, 0) // page_len if window else 0
    rows = jax.lax.broadcasted_iota(jnp.int32, (1, T_pad), 1)

    def body(n, carry):
        page = _page(table_ref, n % ring_pages if ring_pages else n)
        keys = k_ref[page]
        logits = dot_f32(q, keys, (1, 1))
        if mla:
            logits += dot_f32(refs[0][...], refs[1][page], (1, 1))
            values = keys
        else:
            values = refs[0][page]
        pos = n * page_len + rows
        visible = (rows < page_len) & (pos < length)
        if window:
            visible &= pos > length - 1 - window
        return softmax_block(carry, logits, visible, values)

    init = (
        sink_ref[...],
        jnp.ones((M, 1), jnp.float32),
        jnp.zeros((M, o_ref.shape[-1]), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(first, last, body, init)
    o_ref[...] = acc / l


def _call(
    queries: list[jax.Array],  # [B, G, M, D…] each
    pages: list[jax.Array],  # [G, P, T, D…] each
    sinks_GM1: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    v_dim: int,
    ring_pages: int,
    window: int,
    mla: bool,
    interpret: bool | None,
) -> jax.Array:
    """Pads every tile to a power of two and runs ``_paged_kernel`` on a (B, G) grid;
    ``[B, G, M, v_dim]`` fp32."""
    backend, interpret = target_backend(), resolve_interpret(interpret)
    B, G, M = queries[0].shape[:3]
    M_pad, T = pow2_dim(M), pages[0].shape[2]
    T_pad, P_pad = pow2_dim(T), pow2_dim(pages[0].shape[1], minimum=1)
    N_pad = pow2_dim(page_indices.shape[1], minimum=1)
    f32 = jnp.float32

    def padded_q(x):
        return pad_axis(pad_axis(x.astype(f32), 2, M_pad), 3, pow2_dim(x.shape[3]))

    def padded_pages(x):
        x = pad_axis(pad_axis(x.astype(f32), 1, P_pad), 2, T_pad)
        return pad_axis(x, 3, pow2_dim(x.shape[3]))

    qs, ps = [padded_q(q) for q in queries], [padded_pages(p) for p in pages]
    q_specs = [pl.BlockSpec((None, None, M_pad, q.shape[3]), lambda b, g: (b, g, 0, 0)) for q in qs]
    p_specs = [pl.BlockSpec((None, *p.shape[1:]), lambda b, g: (g, 0, 0, 0)) for p in ps]
    if backend is Backend.TPU:
        from jax.experimental.pallas import tpu as pltpu

        table_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
    else:
        table_spec = pl.BlockSpec((None, N_pad), lambda b, g: (b, 0))
    operands = [qs[0], ps[0]]
    specs = [q_specs[0], p_specs[0]]
    if mla:
        operands += [qs[1], ps[1]]
        specs += [q_specs[1], p_specs[1]]
    else:
        operands.append(ps[1])
        specs.append(p_specs[1])
    Dv_pad = pow2_dim(v_dim)
    kernel = functools.partial(
        _paged_kernel, page_len=T, ring_pages=ring_pages, window=window, mla=mla
    )
    out = pl.pallas_call(
        kernel,
        grid=(B, G),
        in_specs=[
            scalar_spec(backend, axis=0),
            table_spec,
            pl.BlockSpec((None, M_pad, 1), lambda b, g: (g, 0, 0)),
            *specs,
        ],
        out_specs=pl.BlockSpec((None, None, M_pad, Dv_pad), lambda b, g: (b, g, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, G, M_pad, Dv_pad), f32),
        interpret=interpret,
        compiler_params=compiler_params(
            backend, interpret=interpret, grid_rank=2, num_warps=4, num_stages=1
        ),
        name="paged_attention",
    )(
        lengths.astype(jnp.int32),
        pad_axis(page_indices.astype(jnp.int32), 1, N_pad),
        pad_axis(sinks_GM1.astype(f32), 1, M_pad, MASK),
        *operands,
    )
    return out[:, :, :M, :v_dim]


@functools.partial(jax.jit, static_argnames=("scale", "window", "ring_pages", "interpret"))
def paged_attention_pallas(
    q_BHD: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    scale: float,
    window: int = 0,
    sinks: jax.Array | None = None,
    ring_pages: int = 0,
    interpret: bool | None = None,
) -> jax.Array:
    """``paged_attention`` through the kernel; ``interpret=None`` interprets on CPU only."""
    B, H, D = q_BHD.shape
    G, Dv = k_pages.shape[0], v_pages.shape[-1]
    M = H // G
    q = (q_BHD.astype(jnp.float32) * scale).reshape(B, G, M, D)
    sink = jnp.full((H,), MASK, jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    out = _call(
        [q],
        [k_pages, v_pages],
        sink.reshape(G, M, 1),
        lengths,
        page_indices,
        v_dim=Dv,
        ring_pages=ring_pages,
        window=window,
        mla=False,
        interpret=interpret,
    )
    return out.reshape(B, H, Dv).astype(v_pages.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def paged_mla_decode_pallas(
    q_nope_BHN: jax.Array,
    q_rope_BHP: jax.Array,
    c_pages: jax.Array,
    r_pages: jax.Array,
    w_uk_RHN: jax.Array,
    w_uv_RHV: jax.Array,
    lengths: jax.Array,
    page_indices: jax.Array,
    *,
    scale: float,
    interpret: bool | None = None,
) -> jax.Array:
    """``paged_mla_decode`` through the kernel: every head in one group over the latents."""
    f32 = jnp.float32
    q_lat = jnp.einsum(
        "bhn,rhn->bhr", q_nope_BHN.astype(f32), w_uk_RHN.astype(f32), precision=_HIGHEST
    )
    H, R = q_lat.shape[1], c_pages.shape[-1]
    ctx = _call(
        [q_lat[:, None] * scale, q_rope_BHP.astype(f32)[:, None] * scale],
        [c_pages[None], r_pages[None]],
        jnp.full((1, H, 1), MASK, f32),
        lengths,
        page_indices,
        v_dim=R,
        ring_pages=0,
        window=0,
        mla=True,
        interpret=interpret,
    )[:, 0]
    out = jnp.einsum("bhr,rhv->bhv", ctx, w_uv_RHV.astype(f32), precision=_HIGHEST)
    return out.astype(c_pages.dtype)
