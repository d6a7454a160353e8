"""The engines' page allocator and per-request block tables: `PagePool`, `BlockTable`,
`NoFreePageError`.

`PagePool` is the host-side bookkeeping of ``num_pages`` equal pages (engine/page_layout.py
says what a page holds): a free list, a reference count per page and a count of pages promised
to live requests (``reserved``), so a request admitted with a reservation never meets a full
pool in the middle of its decode. A page is *shared* while its count is above one (a prefix
mapped into several requests' tables); ``writable`` is copy-on-write: it returns the page itself
when the caller holds the only reference, else a fresh page and the page to copy from.

`BlockTable` is one request's pages, per layer: the blocks of an MLA or GQA layer in position
order, the ring of an SWA layer (block ``b`` in ring entry ``b mod ring_pages``) and the one page
of a linear layer. The device arrays the pages index live in the engine (engine/paged_decode.py).
"""

from __future__ import annotations

import dataclasses

from prfaas_jax.config import LayerKind
from prfaas_jax.engine.page_layout import PageLayout
from prfaas_jax.errors import EngineError

EMPTY = -1  # a ring entry that holds no page yet


class NoFreePageError(EngineError):
    """The pool has too few unpromised pages for what was asked."""


class PagePool:
    """Reference-counted pages ``0 … num_pages − 1`` with reservations (module docstring)."""

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if num_pages < 1:
            raise EngineError(f"a pool needs at least one page, got {num_pages}")
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.reserved = 0

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def available(self) -> int:
        """Free pages not promised to a live request."""
        return len(self._free) - self.reserved

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def reserve(self, count: int) -> None:
        if count > self.available:
            raise NoFreePageError(
                f"{count} pages wanted, {self.available} of {self.num_pages} free and unpromised"
            )
        self.reserved += count

    def unreserve(self, count: int) -> None:
        if not 0 <= count <= self.reserved:
            raise EngineError(f"cannot return {count} of {self.reserved} reserved pages")
        self.reserved -= count

    def alloc(self, *, reserved: bool = False) -> int:
        """A fresh page with one reference; from the caller's reservation if ``reserved``."""
        if reserved:
            self.unreserve(1)
        elif self.available < 1:
            raise NoFreePageError(f"all {self.num_pages} pages are used or promised")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self._refs[page] < 1:
            raise EngineError(f"page {page} is free: it cannot be shared")
        self._refs[page] += 1

    def decref(self, page: int) -> None:
        """Drop one reference; the page is free again when none is left."""
        if self._refs[page] < 1:
            raise EngineError(f"page {page} is already free")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def writable(self, page: int, *, reserved: bool = False) -> tuple[int, int | None]:
        """Copy-on-write: ``(page, None)`` when the caller holds its only reference, else
        ``(fresh, page)`` — the caller's reference moves to ``fresh``, whose contents must be
        copied from ``page`` before it is written."""
        if self._refs[page] == 1:
            return page, None
        fresh = self.alloc(reserved=reserved)
        self.decref(page)
        return fresh, page


@dataclasses.dataclass
class BlockTable:
    """One request's pages, per layer (module docstring)."""

    pages: list[list[int]]  # per layer: blocks (MLA/GQA), ring entries (SWA), [page] (linear)

    @classmethod
    def empty(cls, layout: PageLayout) -> BlockTable:
        def entries(kind: LayerKind) -> list[int]:
            return [EMPTY] * layout.ring_pages if kind is LayerKind.SWA else []

        return cls([entries(kind) for kind in layout.layers])

    def held(self) -> list[int]:
        """Every page this table references (with repeats across layers: none)."""
        return [page for layer in self.pages for page in layer if page != EMPTY]

    def release(self, pool: PagePool) -> None:
        for page in self.held():
            pool.decref(page)
        self.pages = [[] for _ in self.pages]
