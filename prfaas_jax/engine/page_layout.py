"""The page rule of the engines' block pool, and what one request holds in it: `PageLayout`,
`page_layout(cfg, block_size)`, `PagedSize` and `paged_size(layout, length)`.

One pool of equal pages serves every layer of a hybrid model (docs/kv.md, "Paged: the
allocator's bytes"). A page belongs to one layer of one request at a time and holds either
``tokens_per_page`` consecutive positions of an attention layer (MLA: ``c_kv ‖ k_rope`` per
token; GQA, SWA: ``k ‖ v`` per token) or one whole linear state (the recurrent state, then the
short-conv tail). The page is the smallest that holds both a block of the requested
``block_size`` tokens of the widest attention kind and the largest linear state, in whole tokens
of that kind; a narrower attention kind puts as many tokens in that page as fit, and a linear
state pads up to it:

    tokens_per_page = max(N, ⌈s_max / t_max⌉)            (N when the model has no linear layer)
    page_bytes      = tokens_per_page · t_max             (⌈s_max⌉ to the dtype when no attention)
    tokens(kind)    = ⌊page_bytes / t_kind⌋               (for each attention kind)

with ``t_kind`` the per-token bytes of an attention kind, ``t_max`` the largest, and ``s_max``
the largest linear state. vLLM's hybrid allocator raises the block to a multiple of N instead
(``N · ⌈s_max / (N · t_max)⌉``): that pads a linear state by up to N tokens' bytes and gives
every attention layer longer pages to round up to, where this rule pads a linear state by less
than one token (docs/kv.md, "Paged: the allocator's bytes", compares the two). A request of L
positions holds ⌈L / tokens(kind)⌉ pages per MLA / GQA layer, one page per linear layer, and per
SWA layer a ring of at most ``ring_pages = ⌈W / tokens(swa)⌉ + 1`` pages (the fewest that hold
the window and the position being written without two live blocks sharing a page). Pure
Python, the config and the byte formula only: `prfaas kv --allocator paged` prices the
full-size presets with it, and the pool of engine/block_pool.py counts with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prfaas_jax.config import LayerKind, ModelConfig, dtype_nbytes
from prfaas_jax.state_bytes import layer_fixed_nbytes, layer_token_nbytes, state_nbytes


@dataclass(frozen=True)
class PageLayout:
    """Page geometry of one model in a pool of ``block_size``-token attention blocks."""

    model: str
    block_size: int  # the requested attention block (tokens)
    tokens_per_page: int  # the block of the widest attention kind: block_size or more
    page_bytes: int
    dtype_bytes: int  # a page is stored as page_bytes / dtype_bytes elements of the model dtype
    layers: tuple[LayerKind, ...]
    window: int  # SWA window (0 without SWA layers)
    by_kind: tuple[tuple[LayerKind, int], ...] = ()  # tokens a page holds, per attention kind

    def tokens(self, kind: LayerKind) -> int:
        """Positions one page of an attention layer of ``kind`` holds."""
        return dict(self.by_kind)[kind]

    @property
    def page_elems(self) -> int:
        return self.page_bytes // self.dtype_bytes

    @property
    def ring_pages(self) -> int:
        """Pages of one SWA layer's ring (0 without SWA)."""
        return math.ceil(self.window / self.tokens(LayerKind.SWA)) + 1 if self.window else 0

    def blocks(self, kind: LayerKind, length: int) -> int:
        """Blocks of an attention layer of ``kind`` that ``length`` positions touch."""
        return -(-length // self.tokens(kind))

    def layer_pages(self, kind: LayerKind, length: int) -> int:
        """Pages one layer of kind ``kind`` holds for a request of ``length`` positions."""
        if kind.is_linear:
            return 1
        if kind is LayerKind.SWA:
            return min(self.blocks(kind, length), self.ring_pages)
        return self.blocks(kind, length)

    def request_pages(self, length: int) -> int:
        """Pages a request of ``length`` positions holds, over all layers."""
        return sum(self.layer_pages(kind, length) for kind in self.layers)

    def checkpoint_pages(self, length: int) -> int:
        """Pages a linear-state checkpoint at every full block of ``length`` positions adds
        (what exact-length prefix hits at any block boundary cost)."""
        linear = sum(kind.is_linear for kind in self.layers)
        return linear * (length // self.tokens_per_page)


def page_layout(cfg: ModelConfig, block_size: int) -> PageLayout:
    """The page rule (module docstring) for ``cfg`` and a requested block of ``block_size``."""
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    kinds = tuple(dict.fromkeys(cfg.layers))
    per_token = max((layer_token_nbytes(cfg, k) for k in kinds if not k.is_linear), default=0)
    linear = max((layer_fixed_nbytes(cfg, k) for k in kinds if k.is_linear), default=0)
    item = dtype_nbytes(cfg.dtype)
    if per_token:
        tokens = max(block_size, -(-linear // per_token))
        page = tokens * per_token
    else:
        tokens, page = block_size, -(-linear // item) * item
    window = cfg.swa.window if LayerKind.SWA in kinds else 0
    by_kind = tuple((k, page // layer_token_nbytes(cfg, k)) for k in kinds if not k.is_linear)
    return PageLayout(cfg.name, block_size, tokens, page, item, cfg.layers, window, by_kind)


@dataclass(frozen=True)
class PagedSize:
    """What a request of ``length`` positions holds in the pool, beside the canonical bytes."""

    length: int
    formula_bytes: int  # state_nbytes: the canonical state
    pages: int
    paged_bytes: int  # pages · page_bytes: what the allocator really holds
    checkpoint_bytes: int  # a linear checkpoint at every full block, on top

    @property
    def overhead(self) -> float:
        """paged_bytes / formula_bytes."""
        return self.paged_bytes / self.formula_bytes if self.formula_bytes else math.inf


def paged_size(layout: PageLayout, cfg: ModelConfig, length: int) -> PagedSize:
    """`PagedSize` of ``cfg`` at ``length`` positions under ``layout``."""
    pages = layout.request_pages(length)
    return PagedSize(
        length=length,
        formula_bytes=state_nbytes(cfg, length),
        pages=pages,
        paged_bytes=pages * layout.page_bytes,
        checkpoint_bytes=layout.checkpoint_pages(length) * layout.page_bytes,
    )
