"""Dense states to and from the pages of the block pool, in jnp: `gather_state`, `write_token`,
`page_images` and `pool_rows`.

The pool is one array ``[num_pages, page_elems]`` of the model dtype (engine/page_layout.py).
Within a page, an attention layer's tokens are rows of ``row_elems(cfg, kind)`` values — MLA
``c_kv ‖ k_rope``, GQA and SWA ``k ‖ v`` (heads flattened) — position ``p`` of a block at row
``p mod tokens(kind)``; a linear layer's page is its recurrent state (reinterpreted as the
model dtype when the state dtype is wider: fp32 in a bf16 pool is two elements per value), then
its conv tail. Everything addresses the pool flattened, ``page · page_elems + offset``, so no
step copies or reshapes the pool: reads are gathers, writes scatters that drop indices past the
end (an empty table entry is ``num_pages``).

`gather_state` builds the dense `ModelState` a batch's block tables describe — the jnp path of
decode over pages: the model's own ``decode_step`` then runs on it, and `write_token` stores
what that step added (one position per attention layer, the new linear states). With
``paged=True`` it gathers only the linear states and hands each attention layer a
`PagedKvState` instead: the pool's pages of that kind viewed in the layout of the paged
attention ops (`kind_pages`: a reshape when a page is whole tokens of the kind, then slices of
each token row) and the layer's table, which the layer attends through. `page_images` is the
reverse of the gather for a whole state, for an insert.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from prfaas_jax.config import LayerKind, ModelConfig
from prfaas_jax.engine.page_layout import PageLayout
from prfaas_jax.model.state import (
    DeltaState,
    KvState,
    LayerState,
    LightningState,
    MlaState,
    ModelState,
    PagedKvState,
    WindowKvState,
)


def _token_parts(cfg: ModelConfig, kind: LayerKind) -> tuple[tuple[int, ...], ...]:
    """Per-token shapes of an attention layer's arrays, in page-row order."""
    if kind is LayerKind.MLA:
        return (cfg.mla.kv_lora_rank,), (cfg.mla.qk_rope_head_dim,)
    att = cfg.attention if kind is LayerKind.GQA else cfg.swa
    return (att.num_kv_heads, att.head_dim), (att.num_kv_heads, att.value_dim)


def row_elems(cfg: ModelConfig, kind: LayerKind) -> int:
    """Pool elements of one token of an attention layer."""
    return sum(math.prod(shape) for shape in _token_parts(cfg, kind))


def _to_pool(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` as a flat run of ``dtype`` elements (a bit-cast when ``x``'s dtype is wider)."""
    if x.dtype != dtype:
        x = jax.lax.bitcast_convert_type(x, dtype)
    return x.reshape(x.shape[0], -1)


def _from_pool(elems: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    ratio = jnp.dtype(dtype).itemsize // elems.dtype.itemsize
    if ratio == 1:
        return elems.reshape(shape).astype(dtype)
    return jax.lax.bitcast_convert_type(elems.reshape(*shape, ratio), dtype)


def _linear_parts(cfg: ModelConfig, kind: LayerKind) -> tuple[tuple[tuple[int, ...], str], ...]:
    """``(shape, dtype)`` of a linear layer's arrays without the batch axis, in page order."""
    lin = cfg.linear
    heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
    parts = (((heads, lin.head_dim, lin.v_head_dim), cfg.state_dtype),)
    if kind is LayerKind.LIGHTNING:
        return parts
    return (*parts, ((lin.conv_kernel - 1, lin.conv_channels), cfg.dtype))


def _part_elems(shape: tuple[int, ...], dtype: str, pool_dtype: jnp.dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize // pool_dtype.itemsize


def _split(values: jax.Array, sizes: list[int]) -> list[jax.Array]:
    bounds = [sum(sizes[:i]) for i in range(1, len(sizes))]
    return jnp.split(values, bounds, axis=-1)


def _token_index(
    layout: PageLayout, kind: LayerKind, page: jax.Array, pos: jax.Array, row: int
) -> jax.Array:
    """Flat pool index ``[..., row]`` of position ``pos`` of a block held in ``page``."""
    start = page * layout.page_elems + (pos % layout.tokens(kind)) * row
    return start[..., None] + jnp.arange(row, dtype=start.dtype)


def _page_of(layout: PageLayout, kind: LayerKind, table_BE: jax.Array, pos: jax.Array):
    """The page of an attention layer's table holding position ``pos`` (``[B, …]``): block
    ``pos // tokens``, at that entry of a growing table or ``block mod ring_pages`` of a ring."""
    entry = pos // layout.tokens(kind)
    if kind is LayerKind.SWA:
        entry = entry % layout.ring_pages
    flat = entry.reshape(entry.shape[0], -1)
    return jnp.take_along_axis(table_BE, flat, axis=1).reshape(pos.shape)


def _token_layer(cfg: ModelConfig, kind: LayerKind, rows: jax.Array) -> LayerState:
    """An attention layer's state from its token rows ``[B, S, row]``."""
    shapes = _token_parts(cfg, kind)
    first, second = _split(rows, [math.prod(shape) for shape in shapes])
    batch, slots = rows.shape[:2]
    arrays = (first.reshape(batch, slots, *shapes[0]), second.reshape(batch, slots, *shapes[1]))
    if kind is LayerKind.MLA:
        return MlaState(*arrays)
    return (KvState if kind is LayerKind.GQA else WindowKvState)(*arrays)


def _linear_layer(cfg: ModelConfig, kind: LayerKind, elems: jax.Array) -> LayerState:
    parts = _linear_parts(cfg, kind)
    sizes = [_part_elems(shape, dtype, elems.dtype) for shape, dtype in parts]
    arrays = [
        _from_pool(chunk, (elems.shape[0], *shape), jnp.dtype(dtype))
        for chunk, (shape, dtype) in zip(_split(elems, sizes), parts, strict=True)
    ]
    if kind is LayerKind.LIGHTNING:
        return LightningState(*arrays)
    return DeltaState(*arrays)


def _rows_of(layer: LayerState, pool_dtype: jnp.dtype) -> jax.Array:
    """An attention layer's arrays ``[B, S, …]`` as token rows ``[B, S, row]``."""
    first, second = (a.reshape(*a.shape[:2], -1) for a in jax.tree.leaves(layer))
    return jnp.concatenate([first, second], axis=-1).astype(pool_dtype)


def pool_rows(layer: LayerState, pool_dtype: jnp.dtype) -> jax.Array:
    """A linear layer's state ``[B, …]`` as its page contents ``[B, n]``."""
    return jnp.concatenate([_to_pool(a, pool_dtype) for a in jax.tree.leaves(layer)], axis=-1)


def kind_pages(
    pool: jax.Array, cfg: ModelConfig, layout: PageLayout, kind: LayerKind
) -> tuple[jax.Array, jax.Array]:
    """Every page of the pool as pages of attention kind ``kind``, in ops/attention/paged.py's
    layout: MLA ``(c_kv [P, T, R], k_rope [P, T, Dr])``, GQA / SWA ``(k [Hkv, P, T, Dk],
    v [Hkv, P, T, Dv])``."""
    per_page, row = layout.tokens(kind), row_elems(cfg, kind)
    rows = pool[:, : per_page * row].reshape(pool.shape[0], per_page, row)
    shapes = _token_parts(cfg, kind)
    parts = _split(rows, [math.prod(shape) for shape in shapes])
    if kind is LayerKind.MLA:
        return parts[0], parts[1]
    first, second = (
        jnp.moveaxis(part.reshape(*rows.shape[:2], *shape), 2, 0)
        for part, shape in zip(parts, shapes, strict=True)
    )
    return first, second


def _paged_rows(layer: PagedKvState, page: jax.Array, pos: jax.Array) -> jax.Array:
    """Token rows ``[B, row]`` at position ``pos [B]`` of ``page [B]`` of a layer's pages."""
    row = pos % layer.first.shape[-2]
    if layer.first.ndim == 3:  # MLA: [P, T, D]
        first, second = layer.first[page, row], layer.second[page, row]
    else:  # [Hkv, P, T, D] → [B, Hkv, D]
        first, second = (jnp.moveaxis(x[:, page, row], 0, 1) for x in (layer.first, layer.second))
    return jnp.concatenate([first.reshape(row.shape[0], -1), second.reshape(row.shape[0], -1)], 1)


def gather_state(
    pool: jax.Array,
    tables: jax.Array,
    lengths: jax.Array,
    *,
    cfg: ModelConfig,
    layout: PageLayout,
    capacity: int,
    paged: bool = False,
) -> ModelState:
    """The dense state of a batch: ``tables [B, layers, entries]`` (``num_pages`` where empty),
    ``lengths [B]``. Whole pages are gathered and laid end to end: an MLA or GQA layer's cache
    is its first ⌈capacity / tokens⌉ blocks, an SWA layer's ring is its ``ring_pages`` pages —
    a ring of ``ring_pages · tokens`` slots, position p in slot p mod that (entry
    (p // tokens) mod ring_pages, row p mod tokens), which holds the window and then some.
    ``paged``: attention layers as `PagedKvState`s of those tables (module docstring)."""
    batch = lengths.shape[0]
    layers = []
    for index, kind in enumerate(cfg.layers):
        table = tables[:, index]
        if kind.is_linear:
            size = sum(_part_elems(s, d, pool.dtype) for s, d in _linear_parts(cfg, kind))
            page = jnp.take(pool, table[:, 0], axis=0, mode="clip")[:, :size]
            layers.append(_linear_layer(cfg, kind, page))
            continue
        per_page, row = layout.tokens(kind), row_elems(cfg, kind)
        count = layout.ring_pages if kind is LayerKind.SWA else -(-capacity // per_page)
        if paged:
            layers.append(PagedKvState(*kind_pages(pool, cfg, layout, kind), table[:, :count]))
            continue
        pages = jnp.take(pool, table[:, :count], axis=0, mode="clip")
        rows = pages[..., : per_page * row].reshape(batch, count * per_page, row)
        layers.append(_token_layer(cfg, kind, rows))
    return ModelState(lengths=lengths, layers=tuple(layers))


def write_token(
    pool: jax.Array,
    state: ModelState,
    tables: jax.Array,
    lengths: jax.Array,
    active: jax.Array,
    *,
    cfg: ModelConfig,
    layout: PageLayout,
) -> jax.Array:
    """Store what one decode step added to ``state`` (a `gather_state` at ``lengths``, then
    stepped): position ``lengths[b]`` of each attention layer (read from its pages when it
    stepped as a `PagedKvState`) and every linear state, for the ``active`` rows only."""
    parts, where = [], []
    end = pool.size  # past the end: the scatter drops it
    pos = lengths[:, None]
    for index, (kind, layer) in enumerate(zip(cfg.layers, state.layers, strict=True)):
        table = tables[:, index]
        if kind.is_linear:
            values = pool_rows(layer, pool.dtype)
            at = table[:, :1] * layout.page_elems + jnp.arange(values.shape[1], dtype=table.dtype)
        else:
            page = _page_of(layout, kind, table, pos)
            if isinstance(layer, PagedKvState):
                values = _paged_rows(layer, page[:, 0], lengths).astype(pool.dtype)
            else:
                rows = _rows_of(layer, pool.dtype)
                slot = pos % rows.shape[1] if kind is LayerKind.SWA else pos
                values = jnp.take_along_axis(rows, slot[:, :, None], axis=1)[:, 0]
            at = _token_index(layout, kind, page, pos, values.shape[1])[:, 0]
        where.append(jnp.where(active[:, None], at, end))
        parts.append(values)
    flat = pool.reshape(-1)
    flat = flat.at[jnp.concatenate(where, 1)].set(jnp.concatenate(parts, 1), mode="drop")
    return flat.reshape(pool.shape)


def page_images(
    state: ModelState, blocks: jax.Array, *, cfg: ModelConfig, layout: PageLayout
) -> jax.Array:
    """Pages ``[layers, K, page_elems]`` of a one-sequence ``state``: for attention layers the
    blocks ``blocks[layer]`` (``[layers, K]``; positions the state does not hold are zeros),
    for linear layers its state in entry 0."""
    length = state.lengths[0]
    images = []
    for index, (kind, layer) in enumerate(zip(cfg.layers, state.layers, strict=True)):
        if kind.is_linear:
            page = pool_rows(layer, jnp.dtype(cfg.dtype))[0]
            page = jnp.broadcast_to(page, (blocks.shape[1], page.shape[0]))
        else:
            rows = _rows_of(layer, jnp.dtype(cfg.dtype))[0]
            slots, per_page = rows.shape[0], layout.tokens(kind)
            pos = blocks[index][:, None] * per_page + jnp.arange(per_page)[None, :]
            held = (pos < length) & (pos >= 0)
            if kind is LayerKind.SWA:
                held &= pos >= length - slots
            token = jnp.take(
                rows, jnp.clip(pos % slots if kind is LayerKind.SWA else pos, 0), 0, mode="clip"
            )
            page = jnp.where(held[..., None], token, 0).reshape(blocks.shape[1], -1)
        images.append(jnp.pad(page, ((0, 0), (0, layout.page_elems - page.shape[1]))))
    return jnp.stack(images)
