"""``weight_dot(x, w)``: an activation ``[..., D]`` times a weight ``[D, O]``, with a weight
narrower than the activation (bfloat16 under float32 activations) read as it is stored.

Same dtypes: ``x @ w``, nothing else. A narrower weight: ``x`` is rounded to the weight's dtype and
the dot accumulates in ``x``'s dtype (``preferred_element_type``), so the weight is never widened
into a full-size copy — which is what ``x @ w`` does after type promotion, and on CPU costs more
than the dot itself. XLA:CPU runs a bfloat16 dot with fewer than 8 rows several times slower
than with 8 (a 512 × 32,000 head: 6× at one row, ``python bench/weight_dots.py``), so rows are
padded to 8 and the padding dropped.

``expert_dot(x, w)`` is the same for a stack of experts: each expert's rows ``[E, M, D]`` times its
own weight ``[E, D, O]``, one batched product that reads every weight in place. (A token's rows
broadcast to every expert and multiplied as ``vmap(weight_dot, in_axes=(None, 0))`` is the same
product, but XLA:CPU folds the broadcast away by transposing the weights into one ``[D, E·O]``
matrix, a copy of every expert on every call that costs more than the product.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MIN_NARROW_ROWS = 8  # XLA:CPU's bfloat16 dot below this many rows takes a slow path


def _narrow_rows(rows: jax.Array, w: jax.Array) -> jax.Array:
    """``rows [..., M, D]`` in ``w``'s dtype, ``M`` padded to at least 8."""
    rows = rows.astype(w.dtype)
    count = rows.shape[-2]
    if count < _MIN_NARROW_ROWS:
        pad = [(0, 0)] * (rows.ndim - 2) + [(0, _MIN_NARROW_ROWS - count), (0, 0)]
        rows = jnp.pad(rows, pad)
    return rows


def weight_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., D] @ w [D, O]`` in ``x``'s dtype; a narrower ``w`` is read as stored."""
    if jnp.dtype(w.dtype).itemsize >= jnp.dtype(x.dtype).itemsize:
        return x @ w
    lead, dim = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, dim)
    out = jnp.matmul(_narrow_rows(rows, w), w, preferred_element_type=x.dtype)
    return out[: rows.shape[0]].reshape(*lead, w.shape[-1])


def expert_dot(x_EMD: jax.Array, w_EDO: jax.Array) -> jax.Array:
    """``x [E, M, D]`` times ``w [E, D, O]`` expert by expert, ``[E, M, O]`` in ``x``'s dtype;
    a narrower ``w`` is read as stored."""
    batched = (((2,), (1,)), ((0,), (0,)))
    if jnp.dtype(w_EDO.dtype).itemsize >= jnp.dtype(x_EMD.dtype).itemsize:
        return jax.lax.dot_general(x_EMD, w_EDO, batched)
    rows = _narrow_rows(x_EMD, w_EDO)
    out = jax.lax.dot_general(rows, w_EDO, batched, preferred_element_type=x_EMD.dtype)
    return out[:, : x_EMD.shape[1]]
