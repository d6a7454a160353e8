"""Short causal conv: the shifted-sum form against the token-by-token scan and a NumPy loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.conv import short_conv, short_conv_reference


def _numpy_conv(x, w, tail):
    """y[t] = Σ_j w[j] · x̃[t + j] with x̃ = tail ‖ x, one row."""
    ext = np.concatenate([tail, x], axis=0)
    width = w.shape[0]
    return np.stack([(w * ext[t : t + width]).sum(0) for t in range(x.shape[0])])


@pytest.mark.parametrize("seq_len", [1, 2, 3, 9])
def test_conv_matches_numpy_and_reference(seq_len):
    rng = np.random.default_rng(seq_len)
    batch, channels, width = 2, 5, 4
    x = rng.normal(size=(batch, seq_len, channels)).astype(np.float32)
    w = rng.normal(size=(width, channels)).astype(np.float32)
    tail = rng.normal(size=(batch, width - 1, channels)).astype(np.float32)
    valid = np.array([seq_len, max(seq_len - 2, 0)], np.int32)

    y, new_tail = short_conv(
        jnp.asarray(x), jnp.asarray(w), tail=jnp.asarray(tail), valid_len=jnp.asarray(valid)
    )
    y_ref, tail_ref = short_conv_reference(
        jnp.asarray(x), jnp.asarray(w), tail=jnp.asarray(tail), valid_len=jnp.asarray(valid)
    )
    for b in range(batch):
        np.testing.assert_allclose(y[b], _numpy_conv(x[b], w, tail[b]), rtol=1e-5, atol=1e-5)
        ext = np.concatenate([tail[b], x[b]], axis=0)
        np.testing.assert_array_equal(new_tail[b], ext[valid[b] : valid[b] + width - 1])
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_tail, tail_ref)


def test_split_sequence_equals_whole():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 11, 3))
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    whole, _ = short_conv(x, w)
    first, tail = short_conv(x[:, :5], w)
    second, _ = short_conv(x[:, 5:], w, tail=tail)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-6, atol=1e-6)
