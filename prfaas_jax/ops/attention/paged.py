"""Decode attention over a paged KV cache, in jnp: ``paged_attention`` (GQA, SWA) and
``paged_mla_decode`` (absorbed MLA), and ``paged_positions``.

Pages are laid out as JAX's TPU paged-attention kernel lays them: keys ``[H_kv, P, T, D]``,
values ``[H_kv, P, T, Dv]`` (MLA: latents ``[P, T, R]`` and rope keys ``[P, T, Dr]``, shared by
every head), ``T`` positions a page. Row ``b`` holds ``lengths[b]`` positions; block ``n`` of it
(positions ``n·T … n·T + T − 1``) is in page ``page_indices[b, n]`` — or, with
``ring_pages = R`` (a sliding window), in ``page_indices[b, n mod R]``, the ring reusing its
pages. The query is the row's last position (``lengths − 1``): one decode token, written to
its page before the call. These forms gather the pages into a dense cache and call
``attention`` / ``mla_decode_absorbed``; the Pallas kernels of ``paged_pallas.py`` read the pages
in place and must equal them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.ops.attention.reference import attention, mla_decode_absorbed


def paged_positions(lengths: jax.Array, blocks: int, page_len: int, ring_pages: int) -> jax.Array:
    """``[B, blocks · page_len]`` position held by each row of the gathered pages (−1: none)."""
    slots = jnp.arange(blocks * page_len, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    if ring_pages:  # slot s of a ring of R·T slots holds the latest p ≡ s (mod R·T)
        return last - jnp.mod(last - slots, ring_pages * page_len)  # negative: never written
    return jnp.where(slots <= last, slots, -1)


def _gather(pages: jax.Array, page_indices: jax.Array, blocks: int) -> jax.Array:
    """Pages ``[..., P, T, D]`` of each row's first ``blocks`` entries, end to end:
    ``[B, blocks·T, ..., D]``."""
    taken = jnp.take(pages, page_indices[:, :blocks], axis=-3, mode="clip")  # [..., B, n, T, D]
    taken = jnp.moveaxis(taken, -4, 0)  # [B, ..., n, T, D]
    shape = taken.shape
    merged = taken.reshape(*shape[:-3], shape[-3] * shape[-2], shape[-1])
    return jnp.moveaxis(merged, -2, 1) if merged.ndim == 4 else merged


def _blocks(page_indices: jax.Array, ring_pages: int) -> int:
    return ring_pages or page_indices.shape[1]


def paged_attention(
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
) -> jax.Array:
    """``[B, H, Dv]``: each row's query against its pages (module docstring)."""
    blocks, page_len = _blocks(page_indices, ring_pages), k_pages.shape[2]
    keys, values = (_gather(p, page_indices, blocks) for p in (k_pages, v_pages))
    out = attention(
        q_BHD[:, None],
        keys,
        values,
        q_pos=(lengths - 1)[:, None],
        kv_pos=paged_positions(lengths, blocks, page_len, ring_pages),
        scale=scale,
        window=window,
        sinks=sinks,
    )
    return out[:, 0]


def paged_mla_decode(
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
) -> jax.Array:
    """``[B, H, Dv]``: absorbed MLA of each row's query over its latent pages."""
    blocks, page_len = page_indices.shape[1], c_pages.shape[1]
    out = mla_decode_absorbed(
        q_nope_BHN[:, None],
        q_rope_BHP[:, None],
        _gather(c_pages, page_indices, blocks),
        _gather(r_pages, page_indices, blocks),
        w_uk_RHN,
        w_uv_RHV,
        q_pos=(lengths - 1)[:, None],
        kv_pos=paged_positions(lengths, blocks, page_len, 0),
        scale=scale,
    )
    return out[:, 0]
