"""The blocked path of ``attention`` (online softmax over key blocks, skipped blocks) against a
float64 NumPy softmax: GQA, windows, sinks, ring-buffer positions, continued prefill, empty
slots, a chunk of a prompt in a mostly empty cache, and ``attention``'s own switch to it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.attention import attention
from prfaas_jax.ops.attention.reference import BLOCK_LEN, blocked_attention

TOL = 1e-5


def _oracle(q, k, v, q_pos, kv_pos, scale, window=0, sinks=None):
    """Dense masked softmax in float64, sinks in the denominator; rows that see nothing → 0."""
    heads, groups = q.shape[2], k.shape[2]
    k = np.repeat(k, heads // groups, axis=2)
    v = np.repeat(v, heads // groups, axis=2)
    logits = scale * np.einsum("bthd,bshd->bhts", q, k)
    qp, kp = q_pos[:, None, :, None], kv_pos[:, None, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if window:
        visible &= qp - kp < window
    logits = np.where(visible, logits, -np.inf)
    sink = np.full((1, heads, 1, 1), -np.inf) if sinks is None else sinks[None, :, None, None]
    peak = np.maximum(np.max(logits, axis=-1, keepdims=True), sink)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(logits - peak)
    denom = weights.sum(-1, keepdims=True) + np.exp(sink - peak)
    out = np.einsum("bhts,bshv->bthv", weights / np.maximum(denom, 1e-300), v)
    return out


def _case(rng, *, batch, seq_len, slots, heads, groups, lengths, ring=False, window=0, sinks=False):
    q = rng.normal(size=(batch, seq_len, heads, 12))
    k = rng.normal(size=(batch, slots, groups, 12))
    v = rng.normal(size=(batch, slots, groups, 10))
    lengths = np.asarray(lengths)
    q_pos = lengths[:, None] + np.arange(seq_len)[None]
    new_len, slot = lengths[:, None] + seq_len, np.arange(slots)[None]
    if ring:  # slot s holds the latest position ≡ s (mod slots); negative: never written
        kv_pos = new_len - 1 - np.mod(new_len - 1 - slot, slots)
    else:
        kv_pos = np.where(slot < new_len, slot, -1)
    sink = rng.normal(size=(heads,)) if sinks else None
    args = (q, k, v, q_pos, kv_pos, 0.3, window, sink)
    jargs = dict(
        q_pos=jnp.asarray(q_pos, jnp.int32),
        kv_pos=jnp.asarray(kv_pos, jnp.int32),
        scale=0.3,
        window=window,
        sinks=None if sink is None else jnp.asarray(sink, jnp.float32),
    )
    arrays = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
    return args, arrays, jargs


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2))


CASES = {
    "causal-gqa": dict(batch=2, seq_len=13, slots=20, heads=6, groups=2, lengths=[0, 5]),
    "sinks": dict(batch=2, seq_len=13, slots=20, heads=6, groups=2, lengths=[0, 5], sinks=True),
    "window": dict(batch=2, seq_len=13, slots=20, heads=4, groups=4, lengths=[2, 7], window=3),
    "ring-window-sinks": dict(
        batch=2,
        seq_len=9,
        slots=8,
        heads=4,
        groups=2,
        lengths=[3, 20],
        ring=True,
        window=5,
        sinks=True,
    ),
    "chunk-in-large-cache": dict(batch=2, seq_len=3, slots=40, heads=4, groups=1, lengths=[5, 30]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_len", [4, 8])
def test_blocked_matches_oracle(name, block_len):
    args, arrays, kw = _case(np.random.default_rng(0), **CASES[name])
    got = blocked_attention(*arrays, block_len=block_len, **kw)
    assert _rel_err(got, _oracle(*args)) <= TOL


def test_padding_rows_that_see_nothing_are_zero():
    """Queries at position −1 (a padded block) see no key: output 0, never NaN."""
    _, arrays, kw = _case(np.random.default_rng(1), **CASES["sinks"])
    kw["q_pos"] = kw["q_pos"].at[1, 5:].set(-1)
    got = np.asarray(blocked_attention(*arrays, block_len=4, **kw))
    assert np.isfinite(got).all() and not got[1, 5:].any()


def test_attention_switches_to_blocks_past_block_len():
    """More than BLOCK_LEN slots: ``attention`` itself runs blocked and still matches."""
    case = dict(batch=1, seq_len=40, slots=BLOCK_LEN + 88, heads=4, groups=2, lengths=[560])
    args, arrays, kw = _case(np.random.default_rng(2), **case)
    assert _rel_err(attention(*arrays, **kw), _oracle(*args)) <= TOL
