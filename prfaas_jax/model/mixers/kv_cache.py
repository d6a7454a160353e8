"""Writing new tokens into growing and ring-buffer KV caches, and the positions of their slots;
`write_pages`, a decode token into its page of a `PagedKvState`.

Writes are scatters with ``mode="drop"``: padding tokens (and anything past the capacity) are
sent to an out-of-range index and vanish, so they can never overwrite a real entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.state import PagedKvState


def _scatter_rows(cache: jax.Array, index_BT: jax.Array, new: jax.Array) -> jax.Array:
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, index_BT].set(new.astype(cache.dtype), mode="drop")


def write_growing(cache_BS: jax.Array, new_BT: jax.Array, ctx: StepContext) -> jax.Array:
    """Store the valid new tokens at their absolute positions."""
    capacity = cache_BS.shape[1]
    index = jnp.where(ctx.valid, ctx.positions, capacity)
    return _scatter_rows(cache_BS, index, new_BT)


def growing_positions(capacity: int, lengths: jax.Array) -> jax.Array:
    """[B, S] position held by each slot of a growing cache of ``lengths`` tokens (−1: empty)."""
    slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    return jnp.where(slots < lengths[:, None], slots, -1)


def ring_positions(ring_size: int, lengths: jax.Array) -> jax.Array:
    """[B, W'] position held by each ring slot after ``lengths`` tokens (−1: never written).

    Slot ``s`` holds the latest position ``p < length`` with ``p ≡ s (mod W')``.
    """
    slots = jnp.arange(ring_size, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    return last - jnp.mod(last - slots, ring_size)  # negative exactly when never written


def write_ring(ring_BW: jax.Array, new_BT: jax.Array, ctx: StepContext) -> jax.Array:
    """Store the last ``W'`` valid new tokens in slots ``position mod W'``.

    Only the last ``W'`` valid tokens are written so that no two writes hit the same slot.
    """
    ring_size = ring_BW.shape[1]
    step = jnp.arange(ctx.seq_len, dtype=jnp.int32)[None, :]
    keep = ctx.valid & (step >= ctx.valid_len[:, None] - ring_size)
    index = jnp.where(keep, jnp.mod(ctx.positions, ring_size), ring_size)
    return _scatter_rows(ring_BW, index, new_BT)


def write_pages(
    state: PagedKvState, first_B: jax.Array, second_B: jax.Array, ctx: StepContext, ring: bool
) -> PagedKvState:
    """Store one decode token per row (``[B, …]`` each, without the time axis) at row
    ``position mod T`` of the page its block maps to (entry ``block mod N`` of a ``ring``);
    rows without a valid token write nothing."""
    mla = state.first.ndim == 3  # [P, T, D]; GQA and SWA pages lead with the kv heads
    num_pages, page_len = state.first.shape[-3], state.first.shape[-2]
    block = ctx.lengths // page_len
    entry = jnp.mod(block, state.table.shape[1]) if ring else block
    page = jnp.take_along_axis(state.table, entry[:, None], axis=1, mode="clip")[:, 0]
    page = jnp.where(ctx.valid_len > 0, page, num_pages)
    row = jnp.mod(ctx.lengths, page_len)

    def put(pages: jax.Array, new: jax.Array) -> jax.Array:
        new = new.astype(pages.dtype)
        if mla:
            return pages.at[page, row].set(new, mode="drop")
        return pages.at[:, page, row].set(jnp.moveaxis(new, 1, 0), mode="drop")

    return PagedKvState(put(state.first, first_B), put(state.second, second_B), state.table)
