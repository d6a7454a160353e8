"""Shared fixtures: jitted model entry points (one compile cache for the whole session)."""

from __future__ import annotations

import functools

import jax
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.model import decode_step, init_params, prefill

jax.config.update("jax_numpy_rank_promotion", "allow")

PRESETS = ("tiny", "tiny-gdn", "tiny-lightning", "tiny-swa")

jit_prefill = jax.jit(prefill, static_argnames=("cfg", "impl"))
jit_decode = jax.jit(decode_step, static_argnames=("cfg", "impl"))


@functools.cache
def preset(name: str):
    """``(cfg, params)`` of a preset with seed-0 weights, built once per session."""
    cfg = load_model_config(name)
    return cfg, init_params(jax.random.PRNGKey(0), cfg)


@pytest.fixture(params=PRESETS)
def model(request):
    return preset(request.param)
