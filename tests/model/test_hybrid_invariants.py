"""Prefill/decode invariants of the hybrid stack, for every layer kind (one preset per family).

prefill(T) in one call == prefill split at a non-chunk boundary == prefill(T−1) + decode_step
== the same with the token-by-token reference ops; padded rows equal unpadded ones; −2000 gates
stay finite. Every call uses batch 2 and capacity 96 so the suite compiles few shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_decode, jit_prefill, preset

from prfaas_jax.config import LayerKind
from prfaas_jax.model import init_state
from prfaas_jax.model.hybrid import param_specs

TOL = 1e-4
T = 70  # longer than the 64-token chunk and the 8-token SWA window of the tiny presets
SPLIT = 29  # not a multiple of the chunk
BATCH, CAPACITY = 2, 96


def _tokens(cfg, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (BATCH, T), 0, cfg.vocab_size)


def _prefill(params, cfg, tokens, state=None, *, valid=None, impl="chunk"):
    state = init_state(cfg, BATCH, CAPACITY) if state is None else state
    if valid is None:
        valid = jnp.full((BATCH,), tokens.shape[1], jnp.int32)
    return jit_prefill(params, cfg, tokens, state, impl=impl, valid_len=valid)


def _decode(params, cfg, tokens, state, active=(True, True)):
    return jit_decode(params, cfg, tokens, state, active=jnp.asarray(active))


def _max_err(a, b):
    return float(jnp.max(jnp.abs(a - b)))


def test_split_prefill_and_decode_match_one_prefill(model):
    cfg, params = model
    tokens = _tokens(cfg)
    whole, whole_state = _prefill(params, cfg, tokens)
    first, state = _prefill(params, cfg, tokens[:, :SPLIT])
    second, state = _prefill(params, cfg, tokens[:, SPLIT : T - 1], state)
    last, state = _decode(params, cfg, tokens[:, T - 1], state)
    stitched = jnp.concatenate([first, second, last[:, None]], axis=1)

    assert _max_err(stitched, whole) <= TOL
    np.testing.assert_array_equal(state.lengths, [T, T])
    np.testing.assert_array_equal(whole_state.lengths, [T, T])
    # The logits vary across tokens, so agreement above is not agreement between constants.
    assert float(jnp.std(whole)) > 0.1


def test_chunked_ops_match_reference_ops(model):
    cfg, params = model
    tokens = _tokens(cfg)
    chunk, chunk_state = _prefill(params, cfg, tokens)
    ref, ref_state = _prefill(params, cfg, tokens, impl="reference")
    assert _max_err(chunk, ref) <= TOL
    for a, b in zip(jax.tree.leaves(chunk_state), jax.tree.leaves(ref_state), strict=True):
        assert _max_err(a.astype(jnp.float32), b.astype(jnp.float32)) <= TOL


def test_decode_token_by_token_matches_prefill(model):
    cfg, params = model
    tokens = _tokens(cfg, seed=3)
    whole, _ = _prefill(params, cfg, tokens)
    _, state = _prefill(params, cfg, tokens[:, :SPLIT])
    for t in range(SPLIT, SPLIT + 12):
        logits, state = _decode(params, cfg, tokens[:, t], state)
        assert _max_err(logits, whole[:, t]) <= TOL, f"position {t}"


def test_padding_leaves_state_exact(model):
    """A row padded past its valid length ends in the state the unpadded prompt gives."""
    cfg, params = model
    tokens = _tokens(cfg, seed=5)
    short = 17
    padded_logits, padded = _prefill(
        params, cfg, tokens[:, SPLIT:], valid=jnp.array([T - SPLIT, short], jnp.int32)
    )
    # Reference: row 1 fed exactly `short` tokens (the rest of the batch is irrelevant).
    exact_logits, exact = _prefill(
        params, cfg, tokens[:, SPLIT : SPLIT + 41], valid=jnp.array([41, short], jnp.int32)
    )
    assert _max_err(padded_logits[1, :short], exact_logits[1, :short]) <= TOL
    np.testing.assert_array_equal(padded.lengths, [T - SPLIT, short])
    nxt = tokens[:, 0]
    a, _ = _decode(params, cfg, nxt, padded)
    b, _ = _decode(params, cfg, nxt, exact)
    assert _max_err(a[1], b[1]) <= TOL


def test_inactive_decode_rows_are_untouched(model):
    cfg, params = model
    tokens = _tokens(cfg, seed=7)
    _, state = _prefill(params, cfg, tokens[:, :SPLIT])
    _, after = _decode(params, cfg, tokens[:, 0], state, active=(True, False))
    for before_leaf, after_leaf in zip(jax.tree.leaves(state), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(before_leaf[1]), np.asarray(after_leaf[1]))
    np.testing.assert_array_equal(after.lengths, [SPLIT + 1, SPLIT])


def _with_extreme_gates(cfg, params):
    """Raise the decay rates so per-step log gates reach about −2000 (real-checkpoint range)."""
    layers = []
    for kind, layer in zip(cfg.layers, params["layers"], strict=True):
        if kind in (LayerKind.KDA, LayerKind.GDN):
            mixer = dict(layer["mixer"], A_log=jnp.full_like(layer["mixer"]["A_log"], 7.6))
            layer = dict(layer, mixer=mixer)
        layers.append(layer)
    return dict(params, layers=tuple(layers))


@pytest.mark.parametrize("name", ["tiny", "tiny-gdn"])
def test_extreme_gates_stay_finite_and_consistent(name):
    cfg, params = preset(name)
    params = _with_extreme_gates(cfg, params)
    tokens = _tokens(cfg, seed=11)
    whole, state = _prefill(params, cfg, tokens)
    assert bool(jnp.all(jnp.isfinite(whole)))
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(state))
    first, s = _prefill(params, cfg, tokens[:, :SPLIT])
    second, _ = _prefill(params, cfg, tokens[:, SPLIT:], s)
    assert _max_err(jnp.concatenate([first, second], axis=1), whole) <= TOL


def test_param_specs_are_the_shapes_of_a_real_init(model):
    """`param_specs` builds the module abstractly with a shape-only key stream; it must describe
    exactly what `init_params` returns (structure, shapes, dtypes)."""
    _, params = model
    specs = param_specs(model[0])
    assert jax.tree.structure(specs) == jax.tree.structure(params)
    for spec, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(params), strict=True):
        assert (spec.shape, spec.dtype) == (leaf.shape, leaf.dtype)
