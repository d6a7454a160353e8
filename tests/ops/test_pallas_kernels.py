"""Pallas kernels against the jnp paths, in interpret mode on CPU (compiled under ``gpu``).

Each kernel must match its jnp counterpart to rms(a - b) / rms(b) <= 1e-4 in float32:
``kda_pallas`` / ``gdn_pallas`` vs the chunked ops (chunk edges T = 1, C-1, C+1, 3C+5 with
C = 16, initial states, GVA, K = 24 / V = 40 padded to tiles, value columns split over programs,
gates down to -2000), ``lightning_pallas`` vs ``lightning_chunk`` (per-row ``valid_len``, decays
down to -2000), ``flash_attention`` vs ``attention`` (GQA, window, sinks, ring-buffer positions,
MLA's expanded 192 / 128 head dims, T not a multiple of the block) and ``mla_decode_pallas`` vs
``mla_decode_absorbed`` (slots of different lengths, split caches). End to end, ``prfaas
generate --impl pallas`` must give ``--impl chunk``'s greedy tokens on every tiny preset.

Interpreted kernels compile slowly, so the shape matrix is pruned to the cases that exercise
distinct kernel paths, and each case checks outputs and final states together.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.attention import attention, mla_decode_absorbed
from prfaas_jax.ops.attention.pallas import flash_attention, mla_decode_pallas
from prfaas_jax.ops.dispatch import Impl, attention_op, linear_op, mla_decode_op
from prfaas_jax.ops.gdn import gdn_chunk
from prfaas_jax.ops.gdn.pallas import gdn_pallas
from prfaas_jax.ops.kda import kda_chunk
from prfaas_jax.ops.kda.pallas import kda_pallas
from prfaas_jax.ops.lightning import lightning_chunk
from prfaas_jax.ops.lightning.pallas import lightning_pallas

from .linear_oracles import (
    delta_rule_inputs,
    delta_rule_oracle,
    lightning_inputs,
    random_state,
    rel_rms,
)

C = 16
TOL = 1e-4
STATIC = ("output_final_state", "chunk_size")
CHUNKED = {
    "kda": (jax.jit(kda_chunk, static_argnames=STATIC), kda_pallas, True),
    "gdn": (jax.jit(gdn_chunk, static_argnames=STATIC), gdn_pallas, False),
}
lightning_jnp = jax.jit(lightning_chunk, static_argnames=STATIC)
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _delta_case(op, seed, length, **kw):
    rng = np.random.default_rng(seed)
    inputs = delta_rule_inputs(rng, length=length, per_channel=CHUNKED[op][2], **kw)
    return inputs, random_state(rng, inputs[0].shape[0], 4)


def _assert_close(got, want, tol=TOL):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert rel_rms(a, b) <= tol


# --- KDA / GDN ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["kda", "gdn"])
@pytest.mark.parametrize("length", [1, 3 * C + 5])
def test_delta_rule_matches_chunk(op, length):
    """One partial chunk, and several chunks ending in a partial one, from a random state."""
    jnp_op, kernel, _ = CHUNKED[op]
    inputs, S0 = _delta_case(op, length, length)
    kw = {"initial_state": S0, "output_final_state": True, "chunk_size": C}
    _assert_close(kernel(*inputs, **kw), jnp_op(*inputs, **kw))


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_delta_rule_gates_down_to_minus_2000(op):
    """A third of the gates uniform in [-2000, 0]: finite, and as exact as the chunked op."""
    jnp_op, kernel, _ = CHUNKED[op]
    inputs, S0 = _delta_case(op, 3, 2 * 64 - 3, extreme=True)
    got = kernel(*inputs, initial_state=S0, output_final_state=True)  # default C = 64
    _assert_close(got, jnp_op(*inputs, initial_state=S0, output_final_state=True))
    o_exp, S_exp = delta_rule_oracle(*inputs, initial_state=S0)
    assert rel_rms(got[0], o_exp) <= 1e-5 and rel_rms(got[1], S_exp) <= 1e-5


def test_kda_bf16_batch_default_state_and_split_value_columns():
    """B = 2 bf16 rows, no initial state (zeros), V = 40 over three 16-column programs.

    bf16 in gives bf16 out (both paths round the same fp32 values) and an fp32 final state.
    """
    inputs, _ = _delta_case("kda", 4, C + 3, batch=2)
    inputs = tuple(x.astype(jnp.bfloat16) for x in inputs)
    o, S = kda_pallas(*inputs, output_final_state=True, chunk_size=C, block_v=16)
    o_ref, S_ref = CHUNKED["kda"][0](*inputs, output_final_state=True, chunk_size=C)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(S, S_ref) <= TOL
    assert kda_pallas(*inputs, chunk_size=C, block_v=16)[1] is None


def test_rejects_bad_blocks_and_shapes():
    inputs, _ = _delta_case("kda", 6, 4)
    with pytest.raises(ValueError, match="power of two"):
        kda_pallas(*inputs, chunk_size=24)
    with pytest.raises(ValueError):
        kda_pallas(*inputs[:3], inputs[3][..., 0], inputs[4])  # GDN's gate shape


# --- Lightning ----------------------------------------------------------------------------

H = 4
DECAYS = {
    "slopes": -(2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32),
    "extreme": np.array([-2000.0, -30.0, -1e-3, 0.0], np.float32),
}


@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("length", [1, 3 * C + 5])
def test_lightning_matches_chunk(length, decay):
    rng = np.random.default_rng(length)
    inputs = lightning_inputs(rng, length=length, heads=H)
    kw = {"decay": DECAYS[decay], "initial_state": random_state(rng, 1, H)}
    kw |= {"output_final_state": True, "chunk_size": C}
    _assert_close(lightning_pallas(*inputs, **kw), lightning_jnp(*inputs, **kw))


def test_lightning_valid_len_padding():
    """Rows padded past valid_len (one fully padded) keep the state of their real tokens."""
    rng = np.random.default_rng(11)
    length, valid = 2 * C + 5, np.array([C + 2, 0, 2 * C + 5])
    inputs = lightning_inputs(rng, length=length, batch=3, heads=H)
    kw = {"decay": DECAYS["slopes"], "initial_state": random_state(rng, 3, H)}
    kw |= {"output_final_state": True, "chunk_size": C, "valid_len": jnp.asarray(valid)}
    (o, S), (o_ref, S_ref) = lightning_pallas(*inputs, **kw), lightning_jnp(*inputs, **kw)
    real = (np.arange(length)[None, :] < valid[:, None])[..., None, None]
    assert rel_rms(np.where(real, o, 0), np.where(real, o_ref, 0)) <= TOL
    assert rel_rms(S, S_ref) <= TOL and np.isfinite(o).all()


# --- flash attention (prefill) ------------------------------------------------------------


def _normal(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_flash_matches_attention_on_ring_positions(window, use_sinks):
    """GQA (6 heads on 2 groups), slots out of order and empty, as a ring buffer holds them."""
    rng = np.random.default_rng(0)
    q, k, v = _normal(rng, 2, 5, 6, 12), _normal(rng, 2, 9, 2, 12), _normal(rng, 2, 9, 2, 10)
    kv_pos = np.array([[4, 0, 1, 2, 3, -1, 5, 6, 7], [8, 9, 2, 3, 4, 5, 6, 7, -1]])
    q_pos = np.array([[3, 4, 5, 6, 7], [5, 6, 7, 8, 9]])
    kw = {"q_pos": q_pos, "kv_pos": kv_pos, "scale": 12**-0.5, "window": window}
    kw["sinks"] = _normal(rng, 6) if use_sinks else None
    _assert_close([flash_attention(q, k, v, **kw, block_k=16)], [attention(q, k, v, **kw)])


@pytest.mark.parametrize("cached", [0, 21])
def test_flash_mla_dims_over_a_growing_cache(cached):
    """q/k 192, v 128; T = 37 new tokens after ``cached`` ones, in a cache with empty tail slots."""
    rng = np.random.default_rng(cached)
    T, S, H_ = 37, 80, 4
    q, k, v = _normal(rng, 1, T, H_, 192), _normal(rng, 1, S, H_, 192), _normal(rng, 1, S, H_, 128)
    kv_pos = np.where(np.arange(S) < cached + T, np.arange(S), -1)[None]
    kw = {"q_pos": cached + np.arange(T)[None], "kv_pos": kv_pos, "scale": 192**-0.5}
    got = flash_attention(q, k, v, **kw, block_q=16, block_k=16)
    _assert_close([got], [attention(q, k, v, **kw)])


def test_flash_query_with_no_visible_key_is_zero():
    q, k = jnp.ones((1, 1, 2, 4)), jnp.ones((1, 3, 1, 4))
    kw = {"q_pos": jnp.array([[0]]), "kv_pos": jnp.array([[-1, -1, -1]]), "scale": 0.5}
    assert float(jnp.max(jnp.abs(flash_attention(q, k, k, **kw)))) == 0.0


# --- MLA decode -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_matches_absorbed_over_slots_of_different_lengths(num_splits):
    rng = np.random.default_rng(num_splits)
    B, T, S, H_, R, N, P, Dv = 3, 2, 70, 4, 20, 12, 6, 10
    lengths = np.array([9, 66, 0])  # slot 2 is empty: it must come out finite (zero)
    kv_pos = np.where(np.arange(S)[None] < lengths[:, None], np.arange(S)[None], -1)
    args = (
        _normal(rng, B, T, H_, N),
        _normal(rng, B, T, H_, P),
        _normal(rng, B, S, R),
        _normal(rng, B, S, P),
        _normal(rng, R, H_, N) / R**0.5,
        _normal(rng, R, H_, Dv) / R**0.5,
    )
    kw = {"q_pos": lengths[:, None] - T + np.arange(T), "kv_pos": kv_pos, "scale": 18**-0.5}
    got = mla_decode_pallas(*args, **kw, block_k=16, num_splits=num_splits)
    want = mla_decode_absorbed(*args, **kw)
    _assert_close([got[:2]], [want[:2]])
    assert float(jnp.max(jnp.abs(got[2]))) == 0.0


def test_dispatch_selects_the_kernels():
    assert linear_op("kda", Impl.PALLAS) is kda_pallas
    assert linear_op("gdn", "pallas") is gdn_pallas
    assert linear_op("lightning", Impl.PALLAS) is lightning_pallas
    assert attention_op(Impl.PALLAS) is flash_attention and attention_op(Impl.CHUNK) is attention
    assert mla_decode_op(Impl.PALLAS) is mla_decode_pallas


# --- end to end ---------------------------------------------------------------------------

PROMPT = [(37 * i + 11) % 256 for i in range(20)]


def test_cli_offers_pallas():
    from prfaas_jax.cli import build_parser

    assert build_parser().parse_args(["generate", "--impl", "pallas"]).impl == "pallas"


@pytest.mark.slow
def test_generate_pallas_matches_chunk(model):
    """What ``prfaas generate --model NAME --impl pallas|chunk`` runs, on every tiny preset
    (``model``: seed-0 weights, as the CLI draws them): the same greedy tokens.

    Prefill runs every kernel of the preset; decode steps linear layers by recurrence and MLA
    through the absorbed decode kernel, GQA/SWA through the flash kernel.
    """
    from prfaas_jax.engine.generate import generate
    from prfaas_jax.engine.sampling import SamplingParams

    cfg, params = model
    runs = {
        impl: generate(params, cfg, PROMPT, 6, SamplingParams(), impl=impl)[0]
        for impl in (Impl.CHUNK, Impl.PALLAS)
    }
    assert runs[Impl.PALLAS] == runs[Impl.CHUNK]


# --- GPU lowering ---------------------------------------------------------------------------


def _cuda_lowerings():
    f32, i32 = jnp.float32, jnp.int32

    def spec(*shape, dtype=f32):
        return jax.ShapeDtypeStruct(shape, dtype)

    B, T, H, K = 1, 200, 2, 128
    linear = (spec(B, T, H, K),) * 3
    state = {"output_final_state": True, "interpret": False}
    return {
        "kda": (
            lambda q, k, v, g, b, s: kda_pallas(q, k, v, g, b, initial_state=s, **state),
            (*linear, spec(B, T, H, K), spec(B, T, H), spec(B, H, K, K)),
        ),
        "gdn": (
            lambda q, k, v, g, b, s: gdn_pallas(q, k, v, g, b, initial_state=s, **state),
            (*linear, spec(B, T, H), spec(B, T, H), spec(B, H, K, K)),
        ),
        "lightning": (
            lambda q, k, v, s, n: lightning_pallas(
                q, k, v, decay=-jnp.ones(H), initial_state=s, valid_len=n, **state
            ),
            (*linear, spec(B, H, K, K), spec(B, dtype=i32)),
        ),
        "flash": (
            lambda q, k, v, qp, kp, sinks: flash_attention(
                q, k, v, q_pos=qp, kv_pos=kp, scale=0.1, window=64, sinks=sinks, interpret=False
            ),
            (
                spec(B, T, 4, 192),
                spec(B, T, 2, 192),
                spec(B, T, 2, 128),
                spec(B, T, dtype=i32),
                spec(B, T, dtype=i32),
                spec(4),
            ),
        ),
        "mla-decode": (
            lambda qn, qr, c, kr, wk, wv, qp, kp: mla_decode_pallas(
                qn, qr, c, kr, wk, wv, q_pos=qp, kv_pos=kp, scale=0.1, num_splits=2, interpret=False
            ),
            (
                spec(4, 1, 8, 128),
                spec(4, 1, 8, 64),
                spec(4, 300, 512),
                spec(4, 300, 64),
                spec(512, 8, 128),
                spec(512, 8, 128),
                spec(4, 1, dtype=i32),
                spec(4, 300, dtype=i32),
            ),
        ),
    }


@pytest.mark.parametrize("name", ["kda", "gdn", "lightning", "flash", "mla-decode"])
def test_kernels_lower_to_triton_without_a_gpu(name):
    """Cross-lowering for CUDA runs every Pallas->Triton rule on CPU-only machines: a primitive
    Triton cannot take fails here, not first on a GPU. (Triton's own compile still needs one.)"""
    fn, args = _cuda_lowerings()[name]
    # Triton, as on GPUs where the kernels pass Triton's parameters (JAX defaults to Mosaic GPU).
    previous = jax.config.jax_pallas_use_mosaic_gpu
    jax.config.update("jax_pallas_use_mosaic_gpu", False)
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        jax.config.update("jax_pallas_use_mosaic_gpu", previous)
    assert "triton" in lowered.as_text()


# --- compiled (GPU) -------------------------------------------------------------------------


def _compiled_case(name, rng, interpret=False):
    """(kernel call, jnp call) on Kimi-like shapes: K = V = 128, C = 64, T not a block multiple."""
    if name in CHUNKED:
        jnp_op, kernel, per_channel = CHUNKED[name]
        inputs = delta_rule_inputs(rng, length=3 * 64 + 5, per_channel=per_channel)
        kw = {"initial_state": random_state(rng, 1, 4), "output_final_state": True}
        return lambda: kernel(*inputs, **kw, interpret=interpret), lambda: jnp_op(*inputs, **kw)
    if name == "lightning":
        inputs = lightning_inputs(rng, length=3 * 64 + 5, heads=H)
        kw = {"decay": DECAYS["slopes"], "initial_state": random_state(rng, 1, H)}
        kw |= {"output_final_state": True, "valid_len": jnp.array([150])}
        return (
            lambda: lightning_pallas(*inputs, **kw, interpret=interpret),
            lambda: lightning_jnp(*inputs, **kw),
        )
    if name == "flash":
        q, k = _normal(rng, 1, 100, 4, 192), _normal(rng, 1, 128, 2, 192)
        v = _normal(rng, 1, 128, 2, 128)
        kw = {"q_pos": 28 + np.arange(100)[None], "kv_pos": np.arange(128)[None], "scale": 0.07}
        kw |= {"window": 40, "sinks": _normal(rng, 4)}
        return (
            lambda: [flash_attention(q, k, v, **kw, interpret=interpret)],
            lambda: [attention(q, k, v, **kw)],
        )
    B, S, H_, R = 3, 300, 8, 512
    lengths = np.array([1, 150, 300])
    args = (
        _normal(rng, B, 1, H_, 128),
        _normal(rng, B, 1, H_, 64),
        _normal(rng, B, S, R),
        _normal(rng, B, S, 64),
        _normal(rng, R, H_, 128) / R**0.5,
        _normal(rng, R, H_, 128) / R**0.5,
    )
    kv_pos = np.where(np.arange(S)[None] < lengths[:, None], np.arange(S)[None], -1)
    kw = {"q_pos": (lengths - 1)[:, None], "kv_pos": kv_pos, "scale": 192**-0.5}
    return (
        lambda: [mla_decode_pallas(*args, **kw, num_splits=2, interpret=interpret)],
        lambda: [mla_decode_absorbed(*args, **kw)],
    )


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", ["kda", "gdn", "lightning", "flash", "mla-decode"])
def test_compiled_kernel_matches_jnp(name):
    kernel, reference = _compiled_case(name, np.random.default_rng(8))
    _assert_close(kernel(), reference())
