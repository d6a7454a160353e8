"""The block pool's page rule and accounting against numbers computed by hand from the tiny
presets' TOMLs (configs/models/tiny*.toml), and its allocator: reference counts,
copy-on-write, reservations."""

from __future__ import annotations

import dataclasses

import pytest

from prfaas_jax.config import LayerKind, load_model_config
from prfaas_jax.engine.block_pool import EMPTY, BlockTable, NoFreePageError, PagePool
from prfaas_jax.engine.page_layout import page_layout, paged_size
from prfaas_jax.errors import EngineError

# (preset, per-token bytes of the widest attention kind, largest linear state, block 4 becomes)
#   tiny:           MLA (32 + 8)·4 = 160;  KDA 2·16·16·4 + 3·(2·16 + 2·16 + 2·16)·4 = 3200
#   tiny-gdn:       GQA 2·(16 + 16)·4 = 256;  GDN 4·16·12·4 + 3·(2·16·2 + 4·12)·4 = 4416
#   tiny-lightning: MLA 160;  Lightning 4·16·16·4 = 4096
#   tiny-swa:       SWA 2·(16 + 12)·4 = 224 (GQA 1·28·4 = 112: 8 tokens a page);  no linear state
# tokens = max(4, ⌈s / t⌉), page = tokens·t.
RULE = {
    "tiny": (160, 3200, 20, 3200),
    "tiny-gdn": (256, 4416, 18, 4608),
    "tiny-lightning": (160, 4096, 26, 4160),
    "tiny-swa": (224, 0, 4, 896),
}


@pytest.mark.parametrize("name", sorted(RULE))
def test_page_rule_by_hand(name):
    per_token, linear, tokens, page = RULE[name]
    layout = page_layout(load_model_config(name), 4)
    assert (layout.tokens_per_page, layout.page_bytes) == (tokens, page)
    assert layout.page_bytes >= linear  # a page holds a whole linear state
    assert layout.page_bytes - linear < per_token or tokens == 4  # padded by under a token
    assert layout.page_bytes == tokens * per_token


def test_request_pages_by_hand():
    tiny = page_layout(load_model_config("tiny"), 4)  # kda·3, mla; 20 tokens a page
    # 50 positions: ⌈50/20⌉ = 3 MLA pages + 3 KDA pages, 6 · 3200 bytes; the canonical state is
    # 50·160 + 3·3200 = 17,600 bytes.
    size = paged_size(tiny, load_model_config("tiny"), 50)
    assert (size.pages, size.paged_bytes, size.formula_bytes) == (6, 19_200, 17_600)
    # Checkpoints at every full block: ⌊50/20⌋ = 2 per linear layer, 6 pages.
    assert size.checkpoint_bytes == 6 * 3200
    swa = page_layout(load_model_config("tiny-swa"), 4)  # gqa, swa·3; window 8
    assert swa.ring_pages == 3  # ⌈8/4⌉ + 1
    assert swa.layer_pages(LayerKind.SWA, 5) == 2  # blocks 0 and 1, not yet a full ring
    # GQA's 112 B a token: 896 / 112 = 8 tokens in the same page, ⌈50/8⌉ = 7 blocks.
    assert (swa.tokens(LayerKind.GQA), swa.tokens(LayerKind.SWA)) == (8, 4)
    assert swa.request_pages(50) == 7 + 3 * 3


def test_no_attention_page_is_the_state():
    cfg = load_model_config("tiny")
    linear_only = dataclasses.replace(cfg, layers=(LayerKind.KDA,), mlps=cfg.mlps[:1])
    layout = page_layout(linear_only, 16)
    assert (layout.page_bytes, layout.request_pages(1000)) == (3200, 1)


def test_refcounts_and_copy_on_write():
    pool = PagePool(3, 100)
    a = pool.alloc()
    assert (a, pool.used_pages, pool.used_bytes) == (0, 1, 100)
    assert pool.writable(a) == (a, None)  # the only reference: written in place
    pool.incref(a)
    fresh, source = pool.writable(a)
    assert (fresh, source) == (1, a)
    assert (pool.refcount(a), pool.refcount(fresh), pool.used_pages) == (1, 1, 2)
    pool.decref(a)
    pool.decref(fresh)
    assert pool.used_pages == 0
    with pytest.raises(EngineError, match="already free"):
        pool.decref(a)
    with pytest.raises(EngineError, match="cannot be shared"):
        pool.incref(a)


def test_reservations_bound_what_others_take():
    pool = PagePool(4, 1)
    pool.reserve(3)
    assert pool.available == 1
    pool.alloc()
    with pytest.raises(NoFreePageError):
        pool.alloc()  # the other three are promised
    with pytest.raises(NoFreePageError):
        pool.reserve(1)
    pool.alloc(reserved=True)
    assert (pool.reserved, pool.used_pages) == (2, 2)
    pool.unreserve(2)
    assert pool.available == 2


def test_table_release_returns_every_page():
    layout = page_layout(load_model_config("tiny-swa"), 4)
    pool = PagePool(8, layout.page_bytes)
    table = BlockTable.empty(layout)
    assert table.pages[1] == [EMPTY] * layout.ring_pages and table.pages[0] == []
    table.pages[0] += [pool.alloc(), pool.alloc()]
    table.pages[1][2] = pool.alloc()
    assert sorted(table.held()) == [0, 1, 2]
    table.release(pool)
    assert pool.used_pages == 0
