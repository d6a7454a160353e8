"""``decode_weights`` splits MLA's ``kv_b`` into exactly its per-head halves and holds a separate
LM head beside its transpose, and decode (one row and several) and prefill on those weights give
the logits of the weights as loaded (the tiny Kimi-Linear preset: KDA and MLA layers);
``DecodeEngine`` holds them so, every other weight shared; a head narrowed for decode stays as it
is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import jit_decode, jit_prefill, preset

from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.model import init_state
from prfaas_jax.model.decode_weights import decode_weights
from prfaas_jax.model.hybrid import HeadLayouts
from prfaas_jax.model.mixers.mla import AbsorbedKvB


def _mla_layers(params: dict) -> list[int]:
    return [i for i, block in enumerate(params["layers"]) if "kv_b" in block["mixer"]]


def test_the_halves_are_kv_b_per_head():
    cfg, params = preset("tiny")
    split = decode_weights(cfg, params)
    heads, nope = cfg.mla.num_heads, cfg.mla.qk_nope_head_dim
    (index,) = _mla_layers(params)
    kv_b = np.asarray(params["layers"][index]["mixer"]["kv_b"])  # [R, H·(N + V)]
    halves = split["layers"][index]["mixer"]["kv_b"]
    assert isinstance(halves, AbsorbedKvB)
    per_head = (nope + cfg.mla.v_head_dim) * np.arange(heads)
    for h, start in enumerate(per_head):  # column blocks of kv_b, head by head
        np.testing.assert_array_equal(halves.w_uk[h], kv_b[:, start : start + nope])
        np.testing.assert_array_equal(
            halves.w_uv[h], kv_b[:, start + nope : start + nope + cfg.mla.v_head_dim].T
        )


def test_the_head_is_held_as_loaded_and_transposed():
    cfg, params = preset("tiny")
    assert not cfg.tie_embeddings
    head = decode_weights(cfg, params)["lm_head"]
    assert isinstance(head, HeadLayouts) and head.as_loaded is params["lm_head"]
    np.testing.assert_array_equal(np.asarray(head.by_vocab), np.asarray(params["lm_head"]).T)
    narrow = {**params, "lm_head": params["lm_head"].astype(jnp.bfloat16)}
    assert decode_weights(cfg, narrow)["lm_head"] is narrow["lm_head"]


def test_decode_steps_on_the_split_weights_match():
    cfg, params = preset("tiny")
    split = decode_weights(cfg, params)
    plain_state = split_state = init_state(cfg, 2, 8)
    for step in ([5, 7], [3, 9], [1, 2]):  # a cache of several tokens: the softmax weighs them
        step = jnp.asarray(step, jnp.int32)
        plain, plain_state = jit_decode(params, cfg, step, plain_state)
        ours, split_state = jit_decode(split, cfg, step, split_state)
        np.testing.assert_allclose(ours, plain, rtol=1e-6, atol=1e-6)
    one = jnp.asarray([4], jnp.int32)  # one row reads the head as loaded
    plain, _ = jit_decode(params, cfg, one, init_state(cfg, 1, 8))
    ours, _ = jit_decode(split, cfg, one, init_state(cfg, 1, 8))
    np.testing.assert_allclose(ours, plain, rtol=1e-6, atol=1e-6)


def test_a_prefill_on_the_decode_weights_matches():
    cfg, params = preset("tiny")
    tokens = jnp.asarray([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], jnp.int32)
    plain, _ = jit_prefill(params, cfg, tokens, init_state(cfg, 2, 8))
    ours, _ = jit_prefill(decode_weights(cfg, params), cfg, tokens, init_state(cfg, 2, 8))
    assert ours.shape == plain.shape == (2, 5, cfg.vocab_size)
    np.testing.assert_allclose(ours, plain, rtol=1e-6, atol=1e-6)


def test_the_decode_engine_holds_kv_b_split():
    cfg, params = preset("tiny")
    engine = DecodeEngine(cfg, params, max_slots=1, max_len=8)
    (index,) = _mla_layers(params)
    assert isinstance(engine.params["layers"][index]["mixer"]["kv_b"], AbsorbedKvB)
    held = dict(jax.tree_util.tree_leaves_with_path(engine.params))
    assert isinstance(engine.params["lm_head"], HeadLayouts)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jax.tree_util.keystr(path).endswith(("['kv_b']", "['lm_head']")):
            assert held[path] is leaf, jax.tree_util.keystr(path)
