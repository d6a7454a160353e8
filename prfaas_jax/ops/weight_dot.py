"""``weight_dot(x, w)``: an activation ``[..., D]`` times a weight ``[D, O]``, with a weight
narrower than the activation (bfloat16 under float32 activations) read as it is stored.

Same dtypes: ``x @ w``, nothing else. A narrower weight: ``x`` is rounded to the weight's dtype and
the dot accumulates in ``x``'s dtype (``preferred_element_type``), so the weight is never widened
into a full-size copy — which is what ``x @ w`` does after type promotion, and on CPU costs more
than the dot itself. XLA:CPU runs a bfloat16 dot with fewer than 8 rows several times slower
than with 8 (a 512 × 32,000 head: 6× at one row, ``python bench/weight_dots.py``), so rows are
padded to 8 and the padding dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MIN_NARROW_ROWS = 8  # XLA:CPU's bfloat16 dot below this many rows takes a slow path


def weight_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., D] @ w [D, O]`` in ``x``'s dtype; a narrower ``w`` is read as stored."""
    if jnp.dtype(w.dtype).itemsize >= jnp.dtype(x.dtype).itemsize:
        return x @ w
    lead, dim = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, dim).astype(w.dtype)
    count = rows.shape[0]
    if count < _MIN_NARROW_ROWS:
        rows = jnp.pad(rows, ((0, _MIN_NARROW_ROWS - count), (0, 0)))
    out = jnp.matmul(rows, w, preferred_element_type=x.dtype)[:count]
    return out.reshape(*lead, w.shape[-1])
