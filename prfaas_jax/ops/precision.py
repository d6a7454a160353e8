"""The precision rule of every op and layer: ``compute_dtype`` and ``upcast``.

Statistics, gates, recurrences, softmaxes and logits run in at least float32: bfloat16 and
float16 operands are widened to float32 and float32 stays as it is. Wider operands keep their
width — float64 only appears in tests, under ``jax.enable_x64``, where gradients are checked
against central finite differences and a silent narrowing to float32 would drown the check in
rounding noise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compute_dtype(*operands: jax.Array | jnp.dtype) -> jnp.dtype:
    """The dtype to compute in for ``operands``: the widest of theirs and float32."""
    dtypes = [getattr(x, "dtype", x) for x in operands]
    return jnp.result_type(jnp.float32, *dtypes)


def upcast(x: jax.Array) -> jax.Array:
    """``x`` in ``compute_dtype(x)``."""
    return x.astype(compute_dtype(x))
