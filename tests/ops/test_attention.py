"""Softmax attention ops against a float64 NumPy oracle written here; MLA absorbed == expanded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.attention import attention, mla_decode_absorbed

TOL = 1e-5


def _oracle(q, k, v, q_pos, kv_pos, scale, window=0, sinks=None):
    """Loop over (batch, query, head): softmax over the visible keys, sink in the denominator."""
    batch, seq_len, heads, _ = q.shape
    groups = k.shape[2]
    out = np.zeros((batch, seq_len, heads, v.shape[-1]))
    for b in range(batch):
        for t in range(seq_len):
            for h in range(heads):
                g = h // (heads // groups)
                keys = [
                    s
                    for s in range(k.shape[1])
                    if 0 <= kv_pos[b, s] <= q_pos[b, t]
                    and (not window or q_pos[b, t] - kv_pos[b, s] < window)
                ]
                logits = np.array([scale * q[b, t, h] @ k[b, s, g] for s in keys])
                extra = [] if sinks is None else [sinks[h]]
                peak = max(list(logits) + extra)
                weights = np.exp(logits - peak)
                denom = weights.sum() + sum(np.exp(x - peak) for x in extra)
                out[b, t, h] = (weights / denom) @ v[b, keys, g]
    return out


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2))


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_gqa_matches_oracle(window, use_sinks):
    rng = np.random.default_rng(0)
    batch, seq_len, slots, heads, groups, dk, dv = 2, 5, 9, 6, 2, 12, 10
    q = rng.normal(size=(batch, seq_len, heads, dk))
    k = rng.normal(size=(batch, slots, groups, dk))
    v = rng.normal(size=(batch, slots, groups, dv))
    # Slots hold positions out of order (as a ring buffer does), some empty (−1).
    kv_pos = np.array([[4, 0, 1, 2, 3, -1, 5, 6, 7], [8, 9, 2, 3, 4, 5, 6, 7, -1]])
    q_pos = np.array([[3, 4, 5, 6, 7], [5, 6, 7, 8, 9]])
    sinks = rng.normal(size=(heads,)) if use_sinks else None
    got = attention(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(k, jnp.float32),
        jnp.asarray(v, jnp.float32),
        q_pos=jnp.asarray(q_pos),
        kv_pos=jnp.asarray(kv_pos),
        scale=dk**-0.5,
        window=window,
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
    )
    want = _oracle(q, k, v, q_pos, kv_pos, dk**-0.5, window, sinks)
    assert _rel_err(got, want) <= TOL


@pytest.mark.parametrize("sinks", [None, (0.3, -1.0)])
def test_query_with_no_visible_key_is_zero(sinks):
    """As on the blocked and flash paths: a row that sees nothing gives 0 (a sink adds no value)."""
    q = jnp.ones((1, 1, 2, 4))
    k = jnp.ones((1, 3, 1, 4))
    kw = {"q_pos": jnp.array([[0]]), "kv_pos": jnp.array([[-1, -1, -1]]), "scale": 0.5}
    out = attention(q, k, k, **kw, sinks=None if sinks is None else jnp.array(sinks))
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(jnp.max(jnp.abs(out))) == 0.0


def test_mla_absorbed_equals_expanded():
    """Absorbed decode over the latent cache == attention over per-head expanded keys/values."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    batch, seq_len, slots, heads, rank, nope, rope, dv = 2, 3, 7, 4, 20, 12, 6, 10
    q_nope = jax.random.normal(keys[0], (batch, seq_len, heads, nope))
    q_rope = jax.random.normal(keys[1], (batch, seq_len, heads, rope))
    c_kv = jax.random.normal(keys[2], (batch, slots, rank))
    k_rope = jax.random.normal(keys[3], (batch, slots, rope))
    w_uk = jax.random.normal(keys[4], (rank, heads, nope)) / rank**0.5
    w_uv = jax.random.normal(keys[5], (rank, heads, dv)) / rank**0.5
    kv_pos = jnp.array([[0, 1, 2, 3, 4, -1, -1], [0, 1, 2, 3, 4, 5, 6]])
    q_pos = jnp.array([[2, 3, 4], [4, 5, 6]])
    scale = (nope + rope) ** -0.5

    absorbed = mla_decode_absorbed(
        q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos=q_pos, kv_pos=kv_pos, scale=scale
    )
    k_full = jnp.concatenate(
        [
            jnp.einsum("bsr,rhn->bshn", c_kv, w_uk),
            jnp.broadcast_to(k_rope[:, :, None], (batch, slots, heads, rope)),
        ],
        axis=-1,
    )
    v_full = jnp.einsum("bsr,rhv->bshv", c_kv, w_uv)
    expanded = _oracle(
        np.asarray(jnp.concatenate([q_nope, q_rope], -1), np.float64),
        np.asarray(k_full, np.float64),
        np.asarray(v_full, np.float64),
        np.asarray(q_pos),
        np.asarray(kv_pos),
        scale,
    )
    assert _rel_err(absorbed, expanded) <= TOL
