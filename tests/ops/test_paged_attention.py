"""Decode attention over pages: the jnp forms equal dense attention over the same cache laid out
contiguously (the independent oracle: ``attention`` / ``mla_decode_absorbed`` on the cache
before it was cut into shuffled pages), the Pallas kernel interpreted equals the jnp forms, and
the kernel lowers for TPU v5e / v6e and a CUDA GPU from this CPU (as test_kernel_lowering.py
lowers the other kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.attention import (
    attention,
    mla_decode_absorbed,
    paged_attention,
    paged_attention_pallas,
    paged_mla_decode,
    paged_mla_decode_pallas,
)

from .kernel_layouts import layouts
from .test_kernel_lowering import DEVICES, _lower

PAGE = 4
LENGTHS = np.array([1, 4, 9, 15], np.int32)  # one token, a full page, partial pages
BLOCKS = 4  # table entries per row: 16 positions


def _paged(dense_BSX: np.ndarray, rng: np.random.Generator, num_pages: int):
    """``dense [B, S, ...]`` cut into pages ``[P, T, ...]`` at shuffled indices, and the table."""
    batch = dense_BSX.shape[0]
    order = rng.permutation(num_pages)[: batch * BLOCKS].reshape(batch, BLOCKS)
    pages = np.zeros((num_pages, PAGE, *dense_BSX.shape[2:]), dense_BSX.dtype)
    for b in range(batch):
        for n in range(BLOCKS):
            pages[order[b, n]] = dense_BSX[b, n * PAGE : (n + 1) * PAGE]
    return pages, order.astype(np.int32)


def _dense_pos(lengths: np.ndarray, size: int) -> np.ndarray:
    slots = np.arange(size)[None, :]
    return np.where(slots < lengths[:, None], slots, -1).astype(np.int32)


def _gqa_case(window: int = 0, sinks: bool = False):
    rng = np.random.default_rng(window)
    B, H, G, D, Dv = len(LENGTHS), 4, 2, 8, 6
    k = rng.normal(size=(B, BLOCKS * PAGE, G, D)).astype(np.float32)
    v = rng.normal(size=(B, BLOCKS * PAGE, G, Dv)).astype(np.float32)
    q = rng.normal(size=(B, H, D)).astype(np.float32)
    k_pages, table = _paged(k, rng, 20)
    v_pages = np.zeros((20, PAGE, G, Dv), np.float32)
    for b in range(B):
        for n in range(BLOCKS):
            v_pages[table[b, n]] = v[b, n * PAGE : (n + 1) * PAGE]
    pages = (jnp.asarray(k_pages.transpose(2, 0, 1, 3)), jnp.asarray(v_pages.transpose(2, 0, 1, 3)))
    kw = {"scale": D**-0.5, "window": window}
    if sinks:
        kw["sinks"] = jnp.asarray(rng.normal(size=H), jnp.float32)
    dense = attention(
        jnp.asarray(q)[:, None],
        jnp.asarray(k),
        jnp.asarray(v),
        q_pos=jnp.asarray(LENGTHS - 1)[:, None],
        kv_pos=jnp.asarray(_dense_pos(LENGTHS, BLOCKS * PAGE)),
        **kw,
    )[:, 0]
    return (jnp.asarray(q), *pages, jnp.asarray(LENGTHS), jnp.asarray(table)), kw, dense


@pytest.mark.parametrize(("window", "sinks"), [(0, False), (6, True)])
def test_gqa_pages_equal_dense_attention_and_the_kernel(window, sinks):
    args, kw, dense = _gqa_case(window, sinks)
    paged = paged_attention(*args, **kw)
    np.testing.assert_allclose(paged, dense, rtol=1e-6, atol=1e-6)
    kernel = paged_attention_pallas(*args, **kw, interpret=True)
    np.testing.assert_allclose(kernel, paged, rtol=1e-5, atol=1e-5)


def test_a_ring_of_pages_equals_the_window_over_all_of_them():
    """A sliding window of 6 over 3 ring pages (⌈6/4⌉ + 1): row b's block n lives in entry
    n mod 3. The oracle keeps every block in its own page."""
    args, kw, dense = _gqa_case(window=6, sinks=True)
    q, k_pages, v_pages, lengths, table = args
    ring = np.array(table)[:, :3].copy()
    for b, length in enumerate(LENGTHS):
        for n in range(-(-int(length) // PAGE)):
            ring[b, n % 3] = table[b, n]  # the latest block wins its entry
    ring_args = (q, k_pages, v_pages, lengths, jnp.asarray(ring))
    paged = paged_attention(*ring_args, **kw, ring_pages=3)
    np.testing.assert_allclose(paged, dense, rtol=1e-6, atol=1e-6)
    kernel = paged_attention_pallas(*ring_args, **kw, ring_pages=3, interpret=True)
    np.testing.assert_allclose(kernel, paged, rtol=1e-5, atol=1e-5)


def _mla_case():
    rng = np.random.default_rng(1)
    B, H, R, Dr, N, V = len(LENGTHS), 2, 16, 8, 8, 8
    c = rng.normal(size=(B, BLOCKS * PAGE, R)).astype(np.float32)
    r = rng.normal(size=(B, BLOCKS * PAGE, Dr)).astype(np.float32)
    c_pages, table = _paged(c, rng, 24)
    r_pages = np.zeros((24, PAGE, Dr), np.float32)
    for b in range(B):
        for n in range(BLOCKS):
            r_pages[table[b, n]] = r[b, n * PAGE : (n + 1) * PAGE]
    q_nope = rng.normal(size=(B, H, N)).astype(np.float32)
    q_rope = rng.normal(size=(B, H, Dr)).astype(np.float32)
    w_uk = rng.normal(size=(R, H, N)).astype(np.float32)
    w_uv = rng.normal(size=(R, H, V)).astype(np.float32)
    scale = (N + Dr) ** -0.5
    dense = mla_decode_absorbed(
        *(jnp.asarray(x)[:, None] for x in (q_nope, q_rope)),
        jnp.asarray(c),
        jnp.asarray(r),
        jnp.asarray(w_uk),
        jnp.asarray(w_uv),
        q_pos=jnp.asarray(LENGTHS - 1)[:, None],
        kv_pos=jnp.asarray(_dense_pos(LENGTHS, BLOCKS * PAGE)),
        scale=scale,
    )[:, 0]
    args = (q_nope, q_rope, c_pages, r_pages, w_uk, w_uv, LENGTHS, table)
    return tuple(jnp.asarray(x) for x in args), scale, dense


def test_mla_pages_equal_dense_absorbed_decode_and_the_kernel():
    args, scale, dense = _mla_case()
    paged = paged_mla_decode(*args, scale=scale)
    np.testing.assert_allclose(paged, dense, rtol=1e-5, atol=1e-5)
    kernel = paged_mla_decode_pallas(*args, scale=scale, interpret=True)
    np.testing.assert_allclose(kernel, paged, rtol=1e-5, atol=1e-5)


def _abstract(args):
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("case", ["gqa", "swa-ring-sinks", "mla"])
def test_paged_kernel_lowers(case, device):
    if case == "mla":
        args, scale, _ = _mla_case()

        def fn(*a):
            return paged_mla_decode_pallas(*a, scale=scale, interpret=False)

    else:
        args, kw, _ = _gqa_case(*((6, True) if case != "gqa" else (0, False)))
        ring = {"ring_pages": 3} if case != "gqa" else {}

        def fn(*a):
            return paged_attention_pallas(*a, **kw, **ring, interpret=False)

    text = _lower(device, fn, _abstract(args))
    target = DEVICES[device][2]
    calls = [line for line in text.splitlines() if f"custom_call @{target}(" in line]
    assert calls and all('name = "paged_attention"' in line for line in calls)


# Every preset's decode layouts (GQA and SWA heads and head dims, MLA's latent and rope dims),
# over 40 pages of 16 positions, two rows of 9 table entries (off the pow-2 grid).
LAYOUTS = layouts()
PRESET_CASES = [
    layout for layout in LAYOUTS["flash"] if not layout.name.endswith("-mla")
] + LAYOUTS["mla-decode"]


def _spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("layout", PRESET_CASES, ids=lambda layout: layout.name)
def test_paged_kernel_lowers_for_every_preset(layout, device):
    H, G, K, V = layout.heads, layout.groups, layout.k_dim, layout.v_dim
    pages, table = 40, (_spec(2, 9, dtype=jnp.int32),)
    lengths = (_spec(2, dtype=jnp.int32),)
    if layout.nope_dim:
        N, P = layout.nope_dim, layout.rope_dim

        def fn(*a):
            return paged_mla_decode_pallas(*a, scale=0.1, interpret=False)

        args = (_spec(2, H, N), _spec(2, H, P), _spec(pages, 16, K), _spec(pages, 16, P))
        args += (_spec(K, H, N), _spec(K, H, V), *lengths, *table)
    else:
        ring = -(-layout.window // 16) + 1 if layout.window else 0
        sinks = jnp.zeros(H) if layout.sinks else None

        def fn(*a):
            return paged_attention_pallas(
                *a, scale=0.1, window=layout.window, sinks=sinks, ring_pages=ring, interpret=False
            )

        args = (_spec(2, H, K), _spec(G, pages, 16, K), _spec(G, pages, 16, V), *lengths, *table)
    text = _lower(device, fn, args)
    target = DEVICES[device][2]
    assert any(f"custom_call @{target}(" in line for line in text.splitlines())
