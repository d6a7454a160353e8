"""``PagedDecodeEngine``: continuous batching over a block pool instead of fixed slots; and
``PagedPrefix``, a request's pages held for others to map.

The same interface as ``DecodeEngine`` (engine/decode.py; `DecodeEngineLike`), the same tokens
and log-probabilities: a request's state lives in pages of one pool (engine/page_layout.py,
engine/block_pool.py), as many as its length needs, so the requests that fit are bounded by
pages, not by ``max_slots × max_len``. ``max_slots`` is only the row count of the compiled step.

``insert`` reserves every page the request can need up to its last token (new blocks, and one
copy for each page it shares and will write), so a step never finds the pool empty; it writes the
state's blocks into fresh pages, or — given a ``PagedPrefix`` — maps the prefix's pages into the
request's table instead (a reference each, no copy): every full block of the prefix, and when
the state is exactly the prefix, its last partial block and linear states too. Before each step
the engine makes the page each row writes its own (copy-on-write: a page another table still
references is copied first), then one compiled function gathers the batch's dense state from the
pages (engine/page_views.py), runs the model's ``decode_step`` on it, stores the new position and
linear states, and samples. With ``paged_attention`` only the linear states are gathered: each
attention layer attends through its block table (ops/attention/paged.py's ops, the Pallas
kernels of paged_pallas.py under ``impl="pallas"``, interpreted on a CPU). ``share(slot)`` pins
a request's pages at its current length, with the copies its own next writes will need reserved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from prfaas_jax.config import LayerKind, ModelConfig
from prfaas_jax.engine.block_pool import EMPTY, BlockTable, PagePool
from prfaas_jax.engine.decode_slots import SlotControls
from prfaas_jax.engine.logprobs import log_softmax_top
from prfaas_jax.engine.page_layout import PageLayout, page_layout
from prfaas_jax.engine.page_views import gather_state, page_images, write_token
from prfaas_jax.engine.prefill import default_buckets, pick_bucket
from prfaas_jax.engine.sampling import GREEDY, SamplingParams, draw_tokens
from prfaas_jax.errors import EngineError, LengthLimitError
from prfaas_jax.model import ModelState, decode_step
from prfaas_jax.ops.dispatch import Impl


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _step(
    params: dict,
    pool: jax.Array,
    tables: jax.Array,
    lengths: jax.Array,
    tokens: jax.Array,
    active: jax.Array,
    keys: jax.Array,
    index: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    cfg: ModelConfig,
    impl: Impl,
    layout: PageLayout,
    capacity: int,
    paged: bool,
    top: int = 0,
) -> tuple[jax.Array, ...]:
    """The new pool and every row's token; with ``top`` > 0 also their log-probabilities
    (`log_softmax_top`, ``top`` wide), as the slot engine's step."""
    state = gather_state(
        pool, tables, lengths, cfg=cfg, layout=layout, capacity=capacity, paged=paged
    )
    logits, state = decode_step(params, cfg, tokens, state, impl=impl, active=active)
    pool = write_token(pool, state, tables, lengths, active, cfg=cfg, layout=layout)
    drawn = draw_tokens(logits, keys, index, temperature, top_k, top_p)
    if not top:
        return pool, drawn
    return pool, drawn, log_softmax_top(logits, drawn, top)


def _write_pages(
    pool: jax.Array, state: ModelState, blocks: jax.Array, dst: jax.Array, *, cfg, layout
) -> jax.Array:
    images = page_images(state, blocks, cfg=cfg, layout=layout)
    return pool.at[dst.reshape(-1)].set(images.reshape(-1, pool.shape[1]), mode="drop")


def _copy_pages(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    return pool.at[dst].set(pool[src], mode="drop")


_STEP = jax.jit(
    _step,
    static_argnames=("cfg", "impl", "layout", "capacity", "paged", "top"),
    donate_argnums=(1,),
)
_WRITE = jax.jit(_write_pages, static_argnames=("cfg", "layout"), donate_argnums=(0,))
_COPY = jax.jit(_copy_pages, donate_argnums=(0,))
_GATHER = jax.jit(gather_state, static_argnames=("cfg", "layout", "capacity"))


@dataclasses.dataclass
class PagedPrefix:
    """A request's pages at ``length`` positions, each holding one reference until released."""

    length: int
    table: BlockTable
    released: bool = False


@dataclasses.dataclass
class _Held:
    table: BlockTable
    length: int
    reserved: int  # pages promised to this request and not yet taken


class PagedDecodeEngine(SlotControls):
    """Requests decoded together from pages of one pool (module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        num_pages: int,
        block_size: int,
        max_slots: int,
        max_len: int,
        impl: Impl | str = Impl.CHUNK,
        buckets: Sequence[int] | None = None,
        paged_attention: bool = False,
    ) -> None:
        super().__init__(cfg, max_slots, max_len)
        # Attention layers read their pages through the paged-attention ops (the Pallas kernels
        # under impl pallas) instead of a gathered dense cache.
        self.paged_attention = paged_attention
        # Capacities a step gathers the caches to: powers of two (the prefill engine's buckets)
        # unless given; one compile per bucket and power-of-two batch.
        self.buckets = default_buckets(max_len) if buckets is None else tuple(buckets)
        self.params, self.impl = params, Impl(impl)
        self.layout = page_layout(cfg, block_size)
        if np.dtype(cfg.state_dtype).itemsize % np.dtype(cfg.dtype).itemsize:
            raise EngineError(
                f"a {cfg.state_dtype} state cannot be stored in pages of {cfg.dtype} elements"
            )
        self.pool = PagePool(num_pages, self.layout.page_bytes)
        self._pages = jax.device_put(np.zeros((num_pages, self.layout.page_elems), cfg.dtype))
        growing = [self.layout.blocks(k, max_len) for k in cfg.layers if not k.is_linear]
        self._entries = max(*growing, self.layout.ring_pages, 1)
        self._held: list[_Held | None] = [None] * max_slots

    # --- tables -------------------------------------------------------------------------

    def _table_array(self, tables: list[BlockTable | None]) -> np.ndarray:
        """``[rows, layers, entries]`` int32; ``num_pages`` where a row has no page."""
        out = np.full((len(tables), len(self.cfg.layers), self._entries), self.pool.num_pages)
        for row, table in enumerate(tables):
            for layer, pages in enumerate(table.pages if table else []):
                out[row, layer, : len(pages)] = [
                    p if p != EMPTY else self.pool.num_pages for p in pages
                ]
        return out.astype(np.int32)

    def _held_blocks(self, kind: LayerKind, length: int) -> range:
        """Blocks of a layer a request of ``length`` positions holds pages for."""
        count = self.layout.blocks(kind, length)
        if kind is LayerKind.SWA:
            return range(max(0, count - self.layout.ring_pages), count)
        return range(count)

    def _entry(self, kind: LayerKind, block: int) -> int:
        return block % self.layout.ring_pages if kind is LayerKind.SWA else block

    def _future_pages(self, kind: LayerKind, length: int, new: int, mapped: int) -> int:
        """Pages a layer may still take after an insert at ``length``: new blocks, and one copy
        per mapped page it may write."""
        if kind.is_linear:
            return mapped
        grown = len(self._held_blocks(kind, length + new)) - len(self._held_blocks(kind, length))
        if kind is LayerKind.SWA:
            return grown + mapped
        partial = length % self.layout.tokens(kind) != 0
        return grown + (mapped and partial)

    # --- the engine interface -----------------------------------------------------------

    def insert(
        self,
        state: ModelState,
        first_token: int,
        sampling: SamplingParams = GREEDY,
        *,
        max_new_tokens: int,
        eos_id: int | None = None,
        logprobs: int | None = None,
        prefix: PagedPrefix | None = None,
    ) -> int:
        """Start decoding a prefilled request; returns its slot.

        ``state`` is one sequence (any capacity); with ``prefix`` (from ``share``) its first
        ``prefix.length`` positions are taken to be the prefix's, whose pages are mapped
        rather than written (module docstring). Raises ``NoFreePageError`` when the pool cannot
        promise every page the request may need now, ``LengthLimitError`` when even an empty
        pool could not. ``logprobs`` as the slot engine's.
        """
        length = self._check_insert(state, first_token, max_new_tokens)
        self.check_state(state)
        if prefix is not None and (prefix.released or prefix.length > length):
            raise EngineError(
                f"the prefix ({prefix.length} tokens) is released or longer than the state"
            )
        slot = self._free_slot()
        table = BlockTable.empty(self.layout)
        fresh: list[tuple[int, int, int]] = []  # (layer, block, entry) written from the state
        mapped: list[tuple[int, int, int]] = []  # (layer, entry, page) mapped from the prefix
        future = 0
        for layer, kind in enumerate(self.cfg.layers):
            blocks = [0] if kind.is_linear else list(self._held_blocks(kind, length))
            shared = 0
            for block in blocks:
                entry = 0 if kind.is_linear else self._entry(kind, block)
                page = self._prefix_page(prefix, length, layer, kind, block)
                if page is None:
                    fresh.append((layer, block, entry))
                else:
                    mapped.append((layer, entry, page))
                    shared += 1
            future += self._future_pages(kind, length, max_new_tokens, shared)
        if len(fresh) + future > self.pool.num_pages:
            raise LengthLimitError(
                f"a state of {length} tokens and {max_new_tokens} new needs "
                f"{len(fresh) + future} pages; the pool has {self.pool.num_pages}"
            )
        self.pool.reserve(len(fresh) + future)
        for layer, entry, page in mapped:
            self.pool.incref(page)
            self._place(table, layer, entry, page)
        written = []
        for layer, block, entry in fresh:
            page = self.pool.alloc(reserved=True)
            self._place(table, layer, entry, page)
            written.append((layer, block, page))
        self._write(state, written)
        self._held[slot] = _Held(table, length, future)
        self._admit(slot, first_token, sampling, max_new_tokens, eos_id, logprobs)
        return slot

    def _prefix_page(
        self, prefix: PagedPrefix | None, length: int, layer: int, kind: LayerKind, block: int
    ) -> int | None:
        """The prefix's page a request of ``length`` maps for ``block`` of ``layer``, or None
        when the request needs its own: a linear state or a partial block is shared only when
        the request is exactly the prefix; a block must be one the prefix still holds."""
        if prefix is None:
            return None
        exact = prefix.length == length
        if kind.is_linear:
            return prefix.table.pages[layer][0] if exact else None
        full = (block + 1) * self.layout.tokens(kind) <= prefix.length
        if not (exact or full) or block not in self._held_blocks(kind, prefix.length):
            return None
        return prefix.table.pages[layer][self._entry(kind, block)]

    @staticmethod
    def _place(table: BlockTable, layer: int, entry: int, page: int) -> None:
        pages = table.pages[layer]
        if entry < len(pages):
            pages[entry] = page
        else:
            assert entry == len(pages), "blocks are placed in order"
            pages.append(page)

    def _write(self, state: ModelState, written: list[tuple[int, int, int]]) -> None:
        """Write ``(layer, block, page)`` images of ``state`` into the pool (one call)."""
        if not written:
            return
        layers = len(self.cfg.layers)
        per_layer = [[(b, p) for (l, b, p) in written if l == layer] for layer in range(layers)]
        width = _pow2(max(len(items) for items in per_layer))
        blocks = np.zeros((layers, width), np.int32)
        dst = np.full((layers, width), self.pool.num_pages, np.int32)
        for layer, items in enumerate(per_layer):
            for k, (block, page) in enumerate(items):
                blocks[layer, k], dst[layer, k] = block, page
        self._pages = _WRITE(self._pages, state, blocks, dst, cfg=self.cfg, layout=self.layout)

    def _take(self, held: _Held) -> int:
        """A fresh page for ``held``, from its reservation while it lasts."""
        reserved = held.reserved > 0
        held.reserved -= reserved
        return self.pool.alloc(reserved=reserved)

    def _own_next(self, held: _Held, copies: list[tuple[int, int]]) -> None:
        """Make every page the next step writes for ``held`` its own (copy-on-write)."""
        position = held.length
        for layer, kind in enumerate(self.cfg.layers):
            pages = held.table.pages[layer]
            entry = 0 if kind.is_linear else self._entry(kind, position // self.layout.tokens(kind))
            if entry >= len(pages) or pages[entry] == EMPTY:
                self._place(held.table, layer, entry, self._take(held))
                continue
            if self.pool.refcount(pages[entry]) > 1:
                fresh = self._take(held)
                copies.append((pages[entry], fresh))
                self.pool.decref(pages[entry])
                pages[entry] = fresh

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy pages ``(src, dst)`` in one call."""
        if not copies:
            return
        width = _pow2(len(copies))
        src = np.zeros(width, np.int32)
        dst = np.full(width, self.pool.num_pages, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self._pages = _COPY(self._pages, src, dst)

    def step(self) -> list[tuple[int, int]]:
        """One token for every active slot, as ``(slot, token)``; ``[]`` when none is active."""
        active_slots = self.active_slots
        if not active_slots:
            return []
        copies: list[tuple[int, int]] = []
        try:
            for slot in active_slots:
                self._own_next(self._slot(slot), copies)
        finally:
            # Tables already point at the fresh pages: fill them even if a later row found the
            # pool empty (reservations make that a bug), so no table is left on a blank page.
            self._copy(copies)
        # The live rows packed at the front of a power-of-two batch, the caches gathered to the
        # bucket past the longest: idle rows and empty positions cost no work, and the compiles
        # stay a handful.
        rows = np.zeros(_pow2(len(active_slots)), np.int64)
        rows[: len(active_slots)] = active_slots
        lengths = np.array([self._slot(slot).length for slot in active_slots], np.int32)
        capacity = min(pick_bucket(self.buckets, int(lengths.max()) + 1), self.max_len)
        tables = self._table_array([self._slot(slot).table for slot in active_slots])
        padding = len(rows) - len(active_slots)
        tokens, active, *controls = (c[rows] for c in self._controls(active_slots))
        active[len(active_slots) :] = False
        asked, top = self._top(active_slots)
        self._pages, drawn, *scored = _STEP(
            self.params,
            self._pages,
            np.pad(tables, ((0, padding), (0, 0), (0, 0)), constant_values=self.pool.num_pages),
            np.pad(lengths, (0, padding)),
            tokens,
            active,
            *controls,
            cfg=self.cfg,
            impl=self.impl,
            layout=self.layout,
            capacity=capacity,
            paged=self.paged_attention,
            top=top,
        )
        drawn = np.asarray(drawn)
        self._keep_logprobs(asked, {slot: i for i, slot in enumerate(active_slots)}, drawn, scored)
        by_slot = np.zeros(self.max_slots, np.int32)
        by_slot[active_slots] = drawn[: len(active_slots)]
        for slot in active_slots:
            self._slot(slot).length += 1
        return self._advance(active_slots, by_slot)

    def free(self, slot: int) -> None:
        """Release ``slot``: its references, and the pages still promised to it."""
        held = self._slot(slot)
        self._release(slot)
        held.table.release(self.pool)
        self.pool.unreserve(held.reserved)
        self._held[slot] = None

    def _slot(self, slot: int) -> _Held:
        self._request(slot)  # an empty slot is an EngineError
        held = self._held[slot]
        assert held is not None
        return held

    # --- prefixes and views -------------------------------------------------------------

    def share(self, slot: int) -> PagedPrefix:
        """Pin ``slot``'s pages at its current length for other inserts to map; the copies its
        own later writes will then need are reserved now."""
        held, left = self._slot(slot), self._request(slot).remaining
        extra = sum(
            self._future_pages(kind, held.length, left, sum(p != EMPTY for p in pages))
            - self._future_pages(kind, held.length, left, 0)
            for kind, pages in zip(self.cfg.layers, held.table.pages, strict=True)
            if left and not self._request(slot).finished
        )
        self.pool.reserve(extra)
        held.reserved += extra
        table = BlockTable([list(pages) for pages in held.table.pages])
        for page in table.held():
            self.pool.incref(page)
        return PagedPrefix(held.length, table)

    def release(self, prefix: PagedPrefix) -> None:
        """Drop a ``share``'s references (its pages free once no table maps them)."""
        if prefix.released:
            raise EngineError("this prefix is already released")
        prefix.table.release(self.pool)
        prefix.released = True

    def table(self, slot: int) -> BlockTable:
        """``slot``'s block table (the engine's own: read, do not change)."""
        return self._slot(slot).table

    def request_state(self, slot: int) -> ModelState:
        """``slot``'s state gathered from its pages (capacity: its length, at least one)."""
        held = self._slot(slot)
        tables = self._table_array([held.table])
        lengths = np.array([held.length], np.int32)
        return _GATHER(
            self._pages,
            tables,
            lengths,
            cfg=self.cfg,
            layout=self.layout,
            capacity=max(1, held.length),
        )

    def fits(self, requests: list[tuple[int, int]]) -> int:
        """How many of ``requests`` (``(state length, max_new_tokens)`` each), taken in order,
        ``insert`` would take now: a free row each, and every page each may need (no prefix)."""
        rows, pages = len(self.free_slots), self.pool.available
        for count, (length, new) in enumerate(requests):
            need = self.pages_needed(length, new)
            if count == rows or need > pages:
                return count
            pages -= need
        return len(requests)

    def pages_needed(self, length: int, max_new_tokens: int) -> int:
        """Pages an insert of ``length`` positions and ``max_new_tokens`` reserves (no prefix)."""
        future = sum(self._future_pages(k, length, max_new_tokens, 0) for k in self.cfg.layers)
        return self.layout.request_pages(length) + future
