"""Lightning: chunked vs token-by-token reference vs the float64 oracle, and ``valid_len`` padding.

Covers chunk edges (T = 1, C-1, C, C+1, 3C+5), initial states, K = 24 / V = 40, the Ling/Ring
ALiBi-style decays and decays down to -2000, and a padded batch whose per-row ``valid_len`` must
give the state of each row run unpadded. Metric: rms(a - b) / rms(b) <= 1e-4 in float32.

Compiles dominate the runtime, so most tests reuse the calls of ``test_chunk_matches_reference``
(B = 1, T in LENGTHS, an initial-state array, final state requested). There "without an initial
state" is a zero state; that ``initial_state=None`` means zeros is checked once, on its own.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.lightning import lightning_chunk, lightning_reference

from .linear_oracles import lightning_inputs, lightning_oracle, random_state, rel_rms

C = 16
LENGTHS = (1, C - 1, C, C + 1, 3 * C + 5)
TOL = 1e-4
H = 4
# Ling/Ring-2.5 layer-0 decays: -2^(-8(h+1)/H), up to the layer factor.
SLOPE_DECAY = -(2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)
EXTREME_DECAY = np.array([-2000.0, -30.0, -1e-3, 0.0], np.float32)

chunk = jax.jit(lightning_chunk, static_argnames=("output_final_state", "chunk_size"))
reference = jax.jit(lightning_reference, static_argnames=("output_final_state",))


def _inputs(seed, length, batch=1):
    return lightning_inputs(np.random.default_rng(seed), length=length, batch=batch, heads=H)


def _state(seed, batch=1):
    return random_state(np.random.default_rng(seed), batch, H)


def _zero_state(batch=1):
    return np.zeros((batch, H, 24, 40), np.float32)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
def test_chunk_matches_reference(length, with_state):
    inputs = _inputs(length, length)
    S0 = _state(1) if with_state else _zero_state()
    kw = {"decay": SLOPE_DECAY, "initial_state": S0, "output_final_state": True}
    o_ref, S_ref = reference(*inputs, **kw)
    o, S = chunk(*inputs, **kw, chunk_size=C)
    assert o.shape == o_ref.shape == (1, length, H, 40)
    assert S.shape == S_ref.shape == (1, H, 24, 40)
    assert rel_rms(o, o_ref) <= TOL
    assert rel_rms(S, S_ref) <= TOL


@pytest.mark.parametrize("decay", [SLOPE_DECAY, EXTREME_DECAY], ids=["slopes", "extreme"])
@pytest.mark.parametrize("with_state", [False, True])
def test_reference_and_chunk_match_oracle(with_state, decay):
    inputs = _inputs(2, 3 * C + 5)
    S0 = _state(3) if with_state else _zero_state()
    o_exp, S_exp = lightning_oracle(*inputs, decay, initial_state=S0 if with_state else None)
    kw = {"decay": decay, "initial_state": S0, "output_final_state": True}
    results = {"reference": reference(*inputs, **kw), "chunk": chunk(*inputs, **kw, chunk_size=C)}
    for name, (o, S) in results.items():
        assert np.isfinite(o).all() and np.isfinite(S).all(), name
        assert rel_rms(o, o_exp) <= TOL, name
        assert rel_rms(S, S_exp) <= TOL, name


def test_default_chunk_size_matches_oracle():
    inputs = _inputs(4, 2 * 64 + 5)
    S0 = _state(5)
    o_exp, S_exp = lightning_oracle(*inputs, EXTREME_DECAY, initial_state=S0)
    o, S = chunk(*inputs, decay=EXTREME_DECAY, initial_state=S0, output_final_state=True)
    assert rel_rms(o, o_exp) <= TOL
    assert rel_rms(S, S_exp) <= TOL


@pytest.mark.parametrize("impl", ["reference", "chunk"])
def test_valid_len_gives_the_state_of_the_unpadded_rows(impl):
    """A prefill padded to a length bucket: padding must neither decay nor update the state."""
    fn = reference if impl == "reference" else functools.partial(chunk, chunk_size=C)
    valid_len = [3 * C + 5, C + 1, 1, 0]
    inputs = _inputs(6, 3 * C + 5, batch=len(valid_len))
    S0 = _state(7, batch=len(valid_len))
    kw = {"decay": SLOPE_DECAY, "output_final_state": True}
    o, S = fn(*inputs, **kw, initial_state=S0, valid_len=jnp.array(valid_len))
    assert np.isfinite(o).all()
    for b, length in enumerate(valid_len):
        if length == 0:
            np.testing.assert_array_equal(S[b], S0[b])
            continue
        row = tuple(x[b : b + 1, :length] for x in inputs)
        o_row, S_row = fn(*row, **kw, initial_state=S0[b : b + 1])
        assert rel_rms(o[b : b + 1, :length], o_row) <= TOL, b
        assert rel_rms(S[b : b + 1], S_row) <= TOL, b


def test_prefill_split_off_chunk_boundary_matches_one_pass():
    """T = C + 1 cut after one token: the two passes chunk the sequence differently."""
    q, k, v = _inputs(8, C + 1)
    kw = {"decay": SLOPE_DECAY, "output_final_state": True, "chunk_size": C}
    o_all, S_all = chunk(q, k, v, initial_state=_state(9), **kw)
    o1, S1 = chunk(q[:, :1], k[:, :1], v[:, :1], initial_state=_state(9), **kw)
    o2, S2 = chunk(q[:, 1:], k[:, 1:], v[:, 1:], initial_state=S1, **kw)
    assert rel_rms(jnp.concatenate([o1, o2], axis=1), o_all) <= TOL
    assert rel_rms(S2, S_all) <= TOL


def test_no_initial_state_means_zeros_and_final_state_only_when_requested():
    inputs = _inputs(10, C + 1)
    kw = {"initial_state": _zero_state(), "output_final_state": True}
    o_zero, _ = chunk(*inputs, decay=SLOPE_DECAY, **kw, chunk_size=C)
    o, S = chunk(*inputs, decay=SLOPE_DECAY, chunk_size=C)
    o_ref, S_ref = reference(*inputs, decay=SLOPE_DECAY)
    assert S is None and S_ref is None
    assert rel_rms(o, o_zero) <= TOL
    assert rel_rms(o_ref, o_zero) <= TOL


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    inputs = tuple(jnp.asarray(x, jnp.bfloat16) for x in _inputs(11, C + 1))
    kw = {"decay": SLOPE_DECAY, "initial_state": _zero_state(), "output_final_state": True}
    o, S = chunk(*inputs, **kw, chunk_size=C)
    o_f32, S_f32 = chunk(*(x.astype(jnp.float32) for x in inputs), **kw, chunk_size=C)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert rel_rms(o, o_f32) <= 1e-2
    assert rel_rms(S, S_f32) <= TOL


def test_rejects_mismatched_shapes():
    q, k, v = _inputs(12, 4)
    with pytest.raises(ValueError):
        lightning_chunk(q, k, v, decay=SLOPE_DECAY[:2])
    with pytest.raises(ValueError):
        lightning_reference(q, k[:, :, :2], v, decay=SLOPE_DECAY)
