"""KDA and GDN (the gated delta rule with per-channel / per-head gates): chunked vs token-by-token
reference vs the float64 oracle, every test run once per op (ids ``kda`` and ``gdn``).

Covers chunk edges (T = 1, C-1, C, C+1, 3C+5), initial states, GVA (H = 2 q/k heads, HV = 4 value
heads), non-power-of-two head dims (K = 24, V = 40), gates down to -2000 and a prefill split at a
non-chunk boundary. Metric: rms(a - b) / rms(b) <= 1e-4 in float32.

Compiles dominate the runtime, so most tests reuse the calls of ``test_chunk_matches_reference``
(B = 1, T in LENGTHS, an initial-state array, final state requested). There "without an initial
state" is a zero state; that ``initial_state=None`` means zeros is checked once, on its own.
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.delta_rule import gdn_chunk, gdn_reference, kda_chunk, kda_reference
from prfaas_jax.ops.delta_rule.chunk import unit_lower_inverse

from .linear_oracles import delta_rule_inputs, delta_rule_oracle, random_state, rel_rms

C = 16
LENGTHS = (1, C - 1, C, C + 1, 3 * C + 5)
TOL = 1e-4
# Under -2000 gates the chunked op must lose nothing: it sits near 1e-7 of the oracle, while taking
# exponents as differences of fp32 prefix sums (instead of segment sums) lands near 1e-4.
STRICT_TOL = 1e-5


@dataclass(frozen=True)
class DeltaRuleOp:
    chunk_op: Callable
    reference_op: Callable
    chunk: Callable  # jitted chunk_op, one compile cache per op for the module
    reference: Callable
    per_channel: bool  # g is [B,T,HV,K] (KDA) or [B,T,HV] (GDN)

    def inputs(self, seed, length, **kw):
        rng = np.random.default_rng(seed)
        return delta_rule_inputs(rng, length=length, per_channel=self.per_channel, **kw)


def _op(chunk_op, reference_op, per_channel):
    return DeltaRuleOp(
        chunk_op=chunk_op,
        reference_op=reference_op,
        chunk=jax.jit(chunk_op, static_argnames=("output_final_state", "chunk_size")),
        reference=jax.jit(reference_op, static_argnames=("output_final_state",)),
        per_channel=per_channel,
    )


OPS = {
    "kda": _op(kda_chunk, kda_reference, per_channel=True),
    "gdn": _op(gdn_chunk, gdn_reference, per_channel=False),
}


@pytest.fixture(params=list(OPS))
def op(request) -> DeltaRuleOp:
    return OPS[request.param]


def _state(seed, batch=1):
    return random_state(np.random.default_rng(seed), batch, 4)


def _zero_state(batch=1):
    return np.zeros((batch, 4, 24, 40), np.float32)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
def test_chunk_matches_reference(op, length, with_state):
    inputs = op.inputs(length, length)
    S0 = _state(1) if with_state else _zero_state()
    o_ref, S_ref = op.reference(*inputs, initial_state=S0, output_final_state=True)
    o, S = op.chunk(*inputs, initial_state=S0, output_final_state=True, chunk_size=C)
    assert o.shape == o_ref.shape == (1, length, 4, 40)
    assert S.shape == S_ref.shape == (1, 4, 24, 40)
    assert rel_rms(o, o_ref) <= TOL
    assert rel_rms(S, S_ref) <= TOL


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", [1, 3 * C + 5])
def test_reference_matches_oracle(op, length, with_state):
    inputs = op.inputs(7, length)
    S0 = _state(2) if with_state else _zero_state()
    o_exp, S_exp = delta_rule_oracle(*inputs, initial_state=S0 if with_state else None)
    o, S = op.reference(*inputs, initial_state=S0, output_final_state=True)
    assert rel_rms(o, o_exp) <= TOL
    assert rel_rms(S, S_exp) <= TOL


@pytest.mark.parametrize(("chunk_size", "length"), [(C, 3 * C + 5), (None, 2 * 64 - 3)])
def test_gates_down_to_minus_2000_match_oracle(op, chunk_size, length):
    """Real checkpoints give log gates near -2000: nothing may overflow, and accuracy must hold.

    ``chunk_size=None`` runs the default (64); for KDA, pairs then span several 8-token
    sub-chunks.
    """
    inputs = op.inputs(3, length, extreme=True)
    S0 = _state(4)
    o_exp, S_exp = delta_rule_oracle(*inputs, initial_state=S0)
    sizes = {} if chunk_size is None else {"chunk_size": chunk_size}
    results = {
        "reference": op.reference(*inputs, initial_state=S0, output_final_state=True),
        "chunk": op.chunk(*inputs, initial_state=S0, output_final_state=True, **sizes),
    }
    for name, (o, S) in results.items():
        assert np.isfinite(o).all() and np.isfinite(S).all(), name
        assert rel_rms(o, o_exp) <= STRICT_TOL, name
        assert rel_rms(S, S_exp) <= STRICT_TOL, name


def test_prefill_split_off_chunk_boundary_matches_one_pass(op):
    """T = C + 1 cut after one token: the two passes chunk the sequence differently."""
    q, k, v, g, beta = op.inputs(5, C + 1)
    S0 = _state(6)
    o_all, S_all = op.chunk(
        q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=C
    )
    cut = 1
    head = (x[:, :cut] for x in (q, k, v, g, beta))
    tail = (x[:, cut:] for x in (q, k, v, g, beta))
    o1, S1 = op.chunk(*head, initial_state=S0, output_final_state=True, chunk_size=C)
    o2, S2 = op.chunk(*tail, initial_state=S1, output_final_state=True, chunk_size=C)
    assert rel_rms(jnp.concatenate([o1, o2], axis=1), o_all) <= TOL
    assert rel_rms(S2, S_all) <= TOL


def test_no_initial_state_means_zeros_and_final_state_only_when_requested(op):
    inputs = op.inputs(8, C + 1)
    o_zero, _ = op.chunk(
        *inputs, initial_state=_zero_state(), output_final_state=True, chunk_size=C
    )
    o, S = op.chunk(*inputs, chunk_size=C)
    o_ref, S_ref = op.reference(*inputs)
    assert S is None and S_ref is None
    assert rel_rms(o, o_zero) <= TOL
    assert rel_rms(o_ref, o_zero) <= TOL


def test_scale_multiplies_q(op):
    inputs, S0 = op.inputs(9, C + 1), _zero_state()
    o_default, _ = op.chunk(*inputs, initial_state=S0, output_final_state=True, chunk_size=C)
    o_scaled, _ = op.chunk(
        *inputs, scale=2 * 24**-0.5, initial_state=S0, output_final_state=True, chunk_size=C
    )
    assert rel_rms(o_scaled, 2 * o_default) <= TOL


def test_bf16_inputs_give_bf16_output_and_fp32_state(op):
    inputs, S0 = tuple(jnp.asarray(x, jnp.bfloat16) for x in op.inputs(10, C + 1)), _zero_state()
    o, S = op.chunk(*inputs, initial_state=S0, output_final_state=True, chunk_size=C)
    inputs_f32 = (x.astype(jnp.float32) for x in inputs)
    o_f32, S_f32 = op.chunk(*inputs_f32, initial_state=S0, output_final_state=True, chunk_size=C)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert rel_rms(o, o_f32) <= 1e-2
    assert rel_rms(S, S_f32) <= TOL


def test_rejects_mismatched_shapes(op):
    q, k, v, g, beta = op.inputs(11, 4)
    # The other op's gate: a per-head gate is GDN's, a per-channel one KDA's.
    other_g = g[..., 0] if op.per_channel else np.repeat(g[..., None], 24, -1)
    with pytest.raises(ValueError):
        op.chunk_op(q, k, v, other_g, beta)
    with pytest.raises(ValueError):  # HV = 3 value heads cannot share H = 2 q/k heads
        op.reference_op(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


@pytest.mark.parametrize("size", (1, 2, 5, 8, 13, 64))
def test_unit_lower_inverse_is_the_inverse(size):
    """The chunk's (I + L)^-1 by blocked inversion, against NumPy's float64 inverse; sizes off a
    power of two are padded inside."""
    rng = np.random.default_rng(size)
    L = np.tril(rng.normal(size=(3, 2, size, size)) * 0.3, -1).astype(np.float32)
    want = np.linalg.inv(np.eye(size) + L.astype(np.float64))
    got = np.asarray(unit_lower_inverse(jnp.asarray(L)), np.float64)
    assert got.shape == want.shape
    assert rel_rms(got, want) <= 1e-6
