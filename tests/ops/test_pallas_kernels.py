"""Pallas kernels against the jnp paths: one test class per kernel, each body run three ways.

``TestX`` compiles the kernels (``INTERPRET = False``; marked ``gpu`` and skipped without one), its
subclass ``TestXInterpret`` (``INTERPRET = True``) runs the same bodies in the interpreter, on
CPU too, and ``TestXInterpretTpuTiling`` runs them interpreted with the block sizes and memory
layout a TPU gets (``forced_tiling("tpu")``: 128-wide value and key blocks, scalars in SMEM), so
the tiling Mosaic will run is a tiling that was checked; where a body picks Triton-sized blocks
that Mosaic's rule refuses, it runs the TPU defaults instead (``triton_blocks``).

Each kernel must match its jnp counterpart to rms(a - b) / rms(b) <= 1e-4 in float32:
``kda_pallas`` / ``gdn_pallas`` vs the chunked ops (chunk edges T = 1, C-1, C+1, 3C+5 with C = 16,
initial states, GVA, K = 24 / V = 40 padded to tiles, value columns split over programs, gates
down to -2000), ``lightning_pallas`` vs ``lightning_chunk`` (per-row ``valid_len``, decays down
to -2000), ``flash_attention`` vs ``attention`` (GQA, window, sinks, ring-buffer positions, MLA's
expanded 192 / 128 head dims, T not a multiple of the block) and ``mla_decode_pallas`` vs
``mla_decode_absorbed`` (slots of different lengths, split caches); each class also runs its
kernel once with the default block sizes at larger sizes. End to end, ``prfaas generate --impl
pallas`` must give ``--impl chunk``'s greedy tokens on every tiny preset, with either tiling.

Interpreted kernels compile slowly, so the shape matrix is pruned to the cases that exercise
distinct kernel paths, and each case checks outputs and final states together.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.ops.attention import (
    FlashBlockSizes,
    MlaDecodeBlockSizes,
    attention,
    flash_attention,
    mla_decode_absorbed,
    mla_decode_pallas,
)
from prfaas_jax.ops.delta_rule import StateBlockSizes, gdn_chunk, gdn_pallas, kda_chunk, kda_pallas
from prfaas_jax.ops.dispatch import Impl, attention_op, linear_op, mla_decode_op
from prfaas_jax.ops.lightning import lightning_chunk, lightning_pallas
from prfaas_jax.ops.pallas_backend import Backend, forced_tiling

from .linear_oracles import (
    delta_rule_inputs,
    delta_rule_oracle,
    lightning_inputs,
    random_state,
    rel_rms,
)

C = 16
TOL = 1e-4
BLOCKS_C = StateBlockSizes(chunk_size=C, block_v=64)
STATIC = ("output_final_state", "chunk_size")
CHUNKED = {
    "kda": (jax.jit(kda_chunk, static_argnames=STATIC), kda_pallas, True),
    "gdn": (jax.jit(gdn_chunk, static_argnames=STATIC), gdn_pallas, False),
}
lightning_jnp = jax.jit(lightning_chunk, static_argnames=STATIC)


def _delta_case(op, seed, length, **kw):
    rng = np.random.default_rng(seed)
    inputs = delta_rule_inputs(rng, length=length, per_channel=CHUNKED[op][2], **kw)
    return inputs, random_state(rng, inputs[0].shape[0], 4)


def _assert_close(got, want, tol=TOL):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert rel_rms(a, b) <= tol


def _normal(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


class PallasTest:
    """Compiled mode, skipped where JAX has no GPU (``tests/ops/conftest.py`` marks it ``gpu``);
    the ``…Interpret`` subclass runs the same bodies with ``INTERPRET = True``, and with
    ``TILING = Backend.TPU`` as well, the ``…InterpretTpuTiling`` one."""

    INTERPRET = False
    TILING: Backend | None = None  # None: the backend's own

    @pytest.fixture(autouse=True)
    def _needs_gpu_unless_interpreted(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Pallas kernels need a GPU (the …Interpret class runs this body)")
        if self.TILING is None:
            yield
            return
        with forced_tiling(self.TILING):
            yield

    def triton_blocks(self, blocks):
        """``blocks``, sized for Triton; under TPU tiling the TPU defaults (``None``) instead,
        since Mosaic's rule refuses blocks narrower than a lane tile that do not cover the
        array."""
        return None if self.TILING is Backend.TPU else blocks


# --- KDA / GDN ----------------------------------------------------------------------------


class TestDeltaRulePallas(PallasTest):
    @pytest.mark.parametrize("op", ["kda", "gdn"])
    @pytest.mark.parametrize("length", [1, 3 * C + 5])
    def test_matches_chunk(self, op, length):
        """One partial chunk, and several chunks ending in a partial one, from a random state."""
        jnp_op, kernel, _ = CHUNKED[op]
        inputs, S0 = _delta_case(op, length, length)
        kw = {"initial_state": S0, "output_final_state": True}
        got = kernel(*inputs, **kw, block_sizes=BLOCKS_C, interpret=self.INTERPRET)
        _assert_close(got, jnp_op(*inputs, **kw, chunk_size=C))

    @pytest.mark.parametrize("op", ["kda", "gdn"])
    def test_gates_down_to_minus_2000(self, op):
        """A third of the gates uniform in [-2000, 0]: finite, and as exact as the chunked op."""
        jnp_op, kernel, _ = CHUNKED[op]
        inputs, S0 = _delta_case(op, 3, 2 * 64 - 3, extreme=True)
        kw = {"initial_state": S0, "output_final_state": True}
        got = kernel(*inputs, **kw, interpret=self.INTERPRET)  # default C = 64
        _assert_close(got, jnp_op(*inputs, **kw))
        o_exp, S_exp = delta_rule_oracle(*inputs, initial_state=S0)
        assert rel_rms(got[0], o_exp) <= 1e-5 and rel_rms(got[1], S_exp) <= 1e-5

    def test_kda_bf16_batch_default_state_and_split_value_columns(self):
        """B = 2 bf16 rows, no initial state (zeros), V = 40 over three 16-column programs.

        bf16 in gives bf16 out (both paths round the same fp32 values) and an fp32 final state.
        """
        inputs, _ = _delta_case("kda", 4, C + 3, batch=2)
        inputs = tuple(x.astype(jnp.bfloat16) for x in inputs)
        blocks = self.triton_blocks(StateBlockSizes(chunk_size=C, block_v=16))
        kw = {"block_sizes": blocks, "interpret": self.INTERPRET}
        o, S = kda_pallas(*inputs, output_final_state=True, **kw)
        o_ref, S_ref = CHUNKED["kda"][0](*inputs, output_final_state=True, chunk_size=C)
        assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
        assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(S, S_ref) <= TOL
        assert kda_pallas(*inputs, **kw)[1] is None

    def test_rejects_bad_blocks_and_shapes(self):
        inputs, _ = _delta_case("kda", 6, 4)
        with pytest.raises(ValueError, match="power of two"):
            StateBlockSizes(chunk_size=24, block_v=64)
        with pytest.raises(ValueError):
            kda_pallas(*inputs[:3], inputs[3][..., 0], inputs[4])  # GDN's gate shape

    @pytest.mark.parametrize("op", ["kda", "gdn"])
    def test_default_blocks_over_several_chunks(self, op):
        """Default block sizes (C = 64) over three chunks and a partial one."""
        jnp_op, kernel, per_channel = CHUNKED[op]
        rng = np.random.default_rng(8)
        inputs = delta_rule_inputs(rng, length=3 * 64 + 5, per_channel=per_channel)
        kw = {"initial_state": random_state(rng, 1, 4), "output_final_state": True}
        _assert_close(kernel(*inputs, **kw, interpret=self.INTERPRET), jnp_op(*inputs, **kw))

    def test_default_blocks_split_wide_value_heads(self):
        """V = 160 at the default block sizes: three 64-column programs per head with Triton's
        tiling, two 128-column ones with Mosaic's; grouped value heads, batch 2, T off the
        chunk grid."""
        rng = np.random.default_rng(9)
        inputs = delta_rule_inputs(rng, length=70, per_channel=True, batch=2, value_dim=160)
        kw = {"initial_state": random_state(rng, 2, 4, value_dim=160), "output_final_state": True}
        got = kda_pallas(*inputs, **kw, interpret=self.INTERPRET)
        _assert_close(got, CHUNKED["kda"][0](*inputs, **kw))


class TestDeltaRulePallasInterpret(TestDeltaRulePallas):
    INTERPRET = True


class TestDeltaRulePallasInterpretTpuTiling(TestDeltaRulePallasInterpret):
    TILING = Backend.TPU


# --- Lightning ----------------------------------------------------------------------------

H = 4
DECAYS = {
    "slopes": -(2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32),
    "extreme": np.array([-2000.0, -30.0, -1e-3, 0.0], np.float32),
}


class TestLightningPallas(PallasTest):
    @pytest.mark.parametrize("decay", list(DECAYS))
    @pytest.mark.parametrize("length", [1, 3 * C + 5])
    def test_matches_chunk(self, length, decay):
        rng = np.random.default_rng(length)
        inputs = lightning_inputs(rng, length=length, heads=H)
        kw = {"decay": DECAYS[decay], "initial_state": random_state(rng, 1, H)}
        kw |= {"output_final_state": True}
        got = lightning_pallas(*inputs, **kw, block_sizes=BLOCKS_C, interpret=self.INTERPRET)
        _assert_close(got, lightning_jnp(*inputs, **kw, chunk_size=C))

    def test_valid_len_padding(self):
        """Rows padded past valid_len (one fully padded) keep the state of their real tokens."""
        rng = np.random.default_rng(11)
        length, valid = 2 * C + 5, np.array([C + 2, 0, 2 * C + 5])
        inputs = lightning_inputs(rng, length=length, batch=3, heads=H)
        kw = {"decay": DECAYS["slopes"], "initial_state": random_state(rng, 3, H)}
        kw |= {"output_final_state": True, "valid_len": jnp.asarray(valid)}
        o, S = lightning_pallas(*inputs, **kw, block_sizes=BLOCKS_C, interpret=self.INTERPRET)
        o_ref, S_ref = lightning_jnp(*inputs, **kw, chunk_size=C)
        real = (np.arange(length)[None, :] < valid[:, None])[..., None, None]
        assert rel_rms(np.where(real, o, 0), np.where(real, o_ref, 0)) <= TOL
        assert rel_rms(S, S_ref) <= TOL and np.isfinite(o).all()

    def test_default_blocks_over_several_chunks(self):
        """Default block sizes (C = 64) over three chunks and a partial one, ``valid_len`` 150."""
        rng = np.random.default_rng(8)
        inputs = lightning_inputs(rng, length=3 * 64 + 5, heads=H)
        kw = {"decay": DECAYS["slopes"], "initial_state": random_state(rng, 1, H)}
        kw |= {"output_final_state": True, "valid_len": jnp.array([150])}
        got = lightning_pallas(*inputs, **kw, interpret=self.INTERPRET)
        _assert_close(got, lightning_jnp(*inputs, **kw))

    def test_default_blocks_split_wide_value_heads(self):
        """V = 160 at the default block sizes (64- or 128-column programs), batch 2 with its
        own ``valid_len`` per row."""
        rng = np.random.default_rng(10)
        inputs = lightning_inputs(rng, length=70, batch=2, heads=H, value_dim=160)
        kw = {"decay": DECAYS["slopes"], "initial_state": random_state(rng, 2, H, value_dim=160)}
        kw |= {"output_final_state": True, "valid_len": jnp.array([70, 41])}
        got = lightning_pallas(*inputs, **kw, interpret=self.INTERPRET)
        _assert_close(got, lightning_jnp(*inputs, **kw))


class TestLightningPallasInterpret(TestLightningPallas):
    INTERPRET = True


class TestLightningPallasInterpretTpuTiling(TestLightningPallasInterpret):
    TILING = Backend.TPU


# --- flash attention (prefill) ------------------------------------------------------------


class TestFlashAttention(PallasTest):
    @pytest.mark.parametrize("window", [0, 3])
    @pytest.mark.parametrize("use_sinks", [False, True])
    def test_matches_attention_on_ring_positions(self, window, use_sinks):
        """GQA (6 heads on 2 groups), slots out of order and empty, as a ring buffer holds them."""
        rng = np.random.default_rng(0)
        q, k, v = _normal(rng, 2, 5, 6, 12), _normal(rng, 2, 9, 2, 12), _normal(rng, 2, 9, 2, 10)
        kv_pos = np.array([[4, 0, 1, 2, 3, -1, 5, 6, 7], [8, 9, 2, 3, 4, 5, 6, 7, -1]])
        q_pos = np.array([[3, 4, 5, 6, 7], [5, 6, 7, 8, 9]])
        kw = {"q_pos": q_pos, "kv_pos": kv_pos, "scale": 12**-0.5, "window": window}
        kw["sinks"] = _normal(rng, 6) if use_sinks else None
        blocks = FlashBlockSizes(block_q=64, block_k=16)
        got = flash_attention(q, k, v, **kw, block_sizes=blocks, interpret=self.INTERPRET)
        _assert_close([got], [attention(q, k, v, **kw)])

    @pytest.mark.parametrize("cached", [0, 21])
    def test_mla_dims_over_a_growing_cache(self, cached):
        """q/k 192, v 128; T = 37 new tokens after ``cached`` ones, in a cache with empty tail
        slots."""
        rng = np.random.default_rng(cached)
        T, S, H_ = 37, 80, 4
        q, k = _normal(rng, 1, T, H_, 192), _normal(rng, 1, S, H_, 192)
        v = _normal(rng, 1, S, H_, 128)
        kv_pos = np.where(np.arange(S) < cached + T, np.arange(S), -1)[None]
        kw = {"q_pos": cached + np.arange(T)[None], "kv_pos": kv_pos, "scale": 192**-0.5}
        blocks = self.triton_blocks(FlashBlockSizes(block_q=16, block_k=16))
        got = flash_attention(q, k, v, **kw, block_sizes=blocks, interpret=self.INTERPRET)
        _assert_close([got], [attention(q, k, v, **kw)])

    def test_query_with_no_visible_key_is_zero(self):
        q, k = jnp.ones((1, 1, 2, 4)), jnp.ones((1, 3, 1, 4))
        kw = {"q_pos": jnp.array([[0]]), "kv_pos": jnp.array([[-1, -1, -1]]), "scale": 0.5}
        out = flash_attention(q, k, k, **kw, interpret=self.INTERPRET)
        assert float(jnp.max(jnp.abs(out))) == 0.0

    def test_default_blocks_mla_prefill_with_window_and_sinks(self):
        """Default block sizes; T = 100 queries after 28 cached tokens, 192 / 128 dims, GQA."""
        rng = np.random.default_rng(8)
        q, k = _normal(rng, 1, 100, 4, 192), _normal(rng, 1, 128, 2, 192)
        v = _normal(rng, 1, 128, 2, 128)
        kw = {"q_pos": 28 + np.arange(100)[None], "kv_pos": np.arange(128)[None], "scale": 0.07}
        kw |= {"window": 40, "sinks": _normal(rng, 4)}
        got = flash_attention(q, k, v, **kw, interpret=self.INTERPRET)
        _assert_close([got], [attention(q, k, v, **kw)])


class TestFlashAttentionInterpret(TestFlashAttention):
    INTERPRET = True


class TestFlashAttentionInterpretTpuTiling(TestFlashAttentionInterpret):
    TILING = Backend.TPU


# --- MLA decode -----------------------------------------------------------------------------


class TestMlaDecodePallas(PallasTest):
    @pytest.mark.parametrize("num_splits", [1, 3])
    def test_matches_absorbed_over_slots_of_different_lengths(self, num_splits):
        if num_splits > 1 and self.TILING is Backend.TPU:
            pytest.skip("splits of 70 slots are narrower than a TPU lane tile (num_splits=1 runs)")
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
        blocks = self.triton_blocks(MlaDecodeBlockSizes(block_k=16, num_splits=num_splits))
        got = mla_decode_pallas(*args, **kw, block_sizes=blocks, interpret=self.INTERPRET)
        want = mla_decode_absorbed(*args, **kw)
        _assert_close([got[:2]], [want[:2]])
        assert float(jnp.max(jnp.abs(got[2]))) == 0.0

    def test_deepseek_dims_over_two_splits(self):
        """R = 512, rope 64, 8 heads; slots of lengths 1, 150 and 300; 2 splits of the cache."""
        rng = np.random.default_rng(8)
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
        blocks = self.triton_blocks(MlaDecodeBlockSizes(block_k=32, num_splits=2))
        got = mla_decode_pallas(*args, **kw, block_sizes=blocks, interpret=self.INTERPRET)
        _assert_close([got], [mla_decode_absorbed(*args, **kw)])


class TestMlaDecodePallasInterpret(TestMlaDecodePallas):
    INTERPRET = True


class TestMlaDecodePallasInterpretTpuTiling(TestMlaDecodePallasInterpret):
    TILING = Backend.TPU


# --- block sizes, dispatch, end to end ------------------------------------------------------


@pytest.mark.parametrize(
    ("blocks", "default", "tpu", "bad", "message"),
    [
        (
            StateBlockSizes,
            dict(chunk_size=64, block_v=64),
            dict(chunk_size=64, block_v=128),
            dict(block_v=48),
            "block_v",
        ),
        (
            FlashBlockSizes,
            dict(block_q=64, block_k=64),
            dict(block_q=128, block_k=128),
            dict(block_q=0),
            "block_q",
        ),
        (
            MlaDecodeBlockSizes,
            dict(block_k=32, num_splits=1),
            dict(block_k=128, num_splits=1),
            dict(num_splits=0),
            "num_splits",
        ),
    ],
)
def test_block_sizes_keep_the_defaults_and_reject_bad_tilings(blocks, default, tpu, bad, message):
    """One default per backend: Triton's small tiles (also the CPU interpreter's), and Mosaic's
    128-wide lane tiles, which ``forced_tiling`` selects anywhere."""
    assert blocks.get_default() == blocks.get_default(Backend.GPU) == blocks(**default)
    assert blocks.get_default(Backend.TPU) == blocks(**tpu)
    with forced_tiling(Backend.TPU):
        assert blocks.get_default() == blocks(**tpu)
    with pytest.raises(ValueError, match=message):
        blocks(**(default | bad))
    assert hash(blocks.get_default()) == hash(blocks(**default))  # a jit static


def test_dispatch_selects_the_kernels():
    assert linear_op("kda", Impl.PALLAS) is kda_pallas
    assert linear_op("gdn", "pallas") is gdn_pallas
    assert linear_op("lightning", Impl.PALLAS) is lightning_pallas
    assert attention_op(Impl.PALLAS) is flash_attention and attention_op(Impl.CHUNK) is attention
    assert mla_decode_op(Impl.PALLAS) is mla_decode_pallas


PROMPT = [(37 * i + 11) % 256 for i in range(20)]
_CHUNK_TOKENS: dict = {}  # preset config → its greedy tokens through the chunked jnp ops


def test_cli_offers_pallas():
    from prfaas_jax.cli import build_parser

    assert build_parser().parse_args(["generate", "--impl", "pallas"]).impl == "pallas"


@pytest.mark.slow
@pytest.mark.parametrize("tiling", list(Backend))
def test_generate_pallas_matches_chunk(model, tiling):
    """What ``prfaas generate --model NAME --impl pallas|chunk`` runs, on every tiny preset
    (``model``: seed-0 weights, as the CLI draws them): the same greedy tokens, with the kernels
    tiled for Triton and for Mosaic.

    Prefill runs every kernel of the preset; decode steps linear layers by recurrence and MLA
    through the absorbed decode kernel, GQA/SWA through the flash kernel.
    """
    from prfaas_jax.engine.generate import generate
    from prfaas_jax.engine.sampling import SamplingParams

    cfg, params = model
    if cfg not in _CHUNK_TOKENS:  # the same for both tilings: computed once per preset
        _CHUNK_TOKENS[cfg] = generate(params, cfg, PROMPT, 6, SamplingParams(), impl=Impl.CHUNK)[0]
    with forced_tiling(tiling):
        pallas = generate(params, cfg, PROMPT, 6, SamplingParams(), impl="pallas")[0]
    assert pallas == _CHUNK_TOKENS[cfg]
