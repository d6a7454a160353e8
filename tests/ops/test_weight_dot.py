"""``weight_dot`` and ``expert_dot`` against a float64 NumPy product: the same-dtype case is the
plain product; a bfloat16 weight under float32 activations is the product of the
bfloat16-rounded operands, accumulated wide, at every row count (the padding to 8 rows never
shows) and leading shape. ``expert_dot`` multiplies each expert's rows by its own weight, reading
the weights in place (no weight-sized copy in the compiled program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from prfaas_jax.ops.weight_dot import expert_dot, weight_dot


def _rounded(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16, as float64."""
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def test_same_dtype_is_the_plain_product():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 5)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(weight_dot(x, w)), np.asarray(x @ w))


@pytest.mark.parametrize("lead", [(1,), (3,), (8,), (11,), (2, 1, 3)])
def test_narrow_weight_is_the_product_of_rounded_operands(lead):
    rng = np.random.default_rng(len(lead) * 100 + lead[0])
    x = rng.standard_normal((*lead, 48)).astype(np.float32)
    w = rng.standard_normal((48, 24)).astype(np.float32)
    out = weight_dot(jnp.asarray(x), jnp.asarray(w, jnp.bfloat16))
    assert out.dtype == jnp.float32 and out.shape == (*lead, 24)
    oracle = _rounded(x) @ _rounded(w)
    # Products of bfloat16 values are exact in float32: only the float32 sums round.
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle, rtol=1e-5, atol=1e-4)
    # …and it is not the full-width product: the weight was read narrow.
    assert np.abs(np.asarray(out, np.float64) - x.astype(np.float64) @ w).max() > 1e-3


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("narrow", [False, True])
def test_expert_dot_is_each_experts_product(rows, narrow):
    rng = np.random.default_rng(rows + 10 * narrow)
    x = rng.standard_normal((4, rows, 32)).astype(np.float32)
    w = rng.standard_normal((4, 32, 12)).astype(np.float32)
    out = expert_dot(jnp.asarray(x), jnp.asarray(w, jnp.bfloat16 if narrow else jnp.float32))
    assert out.dtype == jnp.float32 and out.shape == (4, rows, 12)
    xs, ws = (_rounded(x), _rounded(w)) if narrow else (x.astype(np.float64), w)
    oracle = np.stack([xs[e] @ ws[e] for e in range(4)])
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle, rtol=1e-5, atol=1e-4)


def test_expert_dot_reads_the_weights_in_place():
    x, w = jnp.ones((8, 512)), jnp.ones((8, 512, 256))
    every = jax.jit(lambda x, w: expert_dot(jnp.broadcast_to(x, (8, 8, 512)), w))
    program = every.lower(x, w).compile().as_text()
    weight_sized = [line for line in program.splitlines() if "f32[512,2048]" in line]
    assert "f32[8,512,256]" in program and not weight_sized, weight_sized
