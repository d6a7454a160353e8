"""``narrow_weights`` casts exactly the projection matrices, and a decode step on them stays
within bfloat16 rounding of the full-width step (the tiny Kimi-Linear preset: KDA, MLA, a dense
MLP, MoE, a separate LM head); ``DecodeEngine(weight_dtype=...)`` holds them narrowed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import jit_decode, preset

from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.model import init_state
from prfaas_jax.model.narrow_weights import NARROWED, narrow_weights


def _named_leaves(params: dict) -> list[tuple[str, jax.Array]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [(getattr(path[-1], "key", None), leaf) for path, leaf in flat]


def test_only_the_projection_matrices_narrow():
    _, params = preset("tiny")
    narrowed = _named_leaves(narrow_weights(params, "bfloat16"))
    names = set()
    for (name, before), (_, after) in zip(_named_leaves(params), narrowed, strict=True):
        if name in NARROWED:
            names.add(name)
            assert after.dtype == jnp.bfloat16 and after.shape == before.shape, name
            np.testing.assert_array_equal(
                np.asarray(after), np.asarray(before.astype(jnp.bfloat16)), err_msg=name
            )
        else:
            assert after is before, name
    # The preset reaches every kind of narrowed matrix it has, and keeps the rest wide.
    assert {"lm_head", "experts_gate", "kv_a", "o_proj", "q_proj", "down"} <= names
    assert {"embed", "kv_b", "router", "conv"} <= {n for n, _ in narrowed} - names


def test_a_decode_step_on_narrow_weights_stays_within_rounding():
    cfg, params = preset("tiny")
    state = init_state(cfg, 2, 16)  # a first token: every layer kind still runs all its weights
    step = jnp.asarray([5, 7], jnp.int32)
    wide, _ = jit_decode(params, cfg, step, state)
    narrow, _ = jit_decode(narrow_weights(params, "bfloat16"), cfg, step, state)
    assert narrow.dtype == jnp.float32
    gap = float(jnp.max(jnp.abs(narrow - wide)) / jnp.max(jnp.abs(wide)))
    assert 0 < gap < 2e-2, gap


def test_the_decode_engine_holds_its_weights_narrowed():
    cfg, params = preset("tiny")
    engine = DecodeEngine(cfg, params, max_slots=1, max_len=8, weight_dtype="bfloat16")
    assert engine.params["lm_head"].dtype == jnp.bfloat16
    assert engine.params["embed"].dtype == jnp.float32
    wide = DecodeEngine(cfg, params, max_slots=1, max_len=8).params
    assert wide["layers"][0]["mixer"]["q_proj"] is params["layers"][0]["mixer"]["q_proj"]
    assert wide["embed"] is params["embed"]
