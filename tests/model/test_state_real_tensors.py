"""Real prefill on reduced-depth versions of every full-size preset: state nbytes == the formula.

Each preset keeps every section that defines a layer's state exactly ([linear], [attention],
[swa], [mla], ``dtype``, ``state_dtype``) and one block per layer kind. What a layer does not
store is shrunk so that the test stays cheap on a CPU: hidden width 64, vocabulary 256, dense
MLPs of width 64, no MoE. (A layer's state depends on its head counts, head dims, latent rank,
conv channels and window, never on the residual width or the MLP.) Prefill runs for real, on
concrete random weights, at two lengths: below and above MiMo's 128-token window, neither a
multiple of the 64-token chunk. The real codec then encodes each state. Linear layers run the
token-by-token reference ops: the same layer code and state writes as the chunked ops (the two
are checked equal in tests/model/test_hybrid_invariants.py) at half the compile time.

This is a consistency check: real tensors against model/state.py's own per-layer formula. The
independent oracle of that formula is the hand-computed table of tests/engine/test_kvsize.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.config import LayerKind, MlpKind, ModelConfig, load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.kvsize import serialized_nbytes
from prfaas_jax.model import init_params, prefill
from prfaas_jax.model.state import (
    init_state,
    layer_fixed_nbytes,
    layer_nbytes,
    layer_token_nbytes,
    state_nbytes,
)

PRESETS = (
    "kimi-linear-48b",
    "qwen3-next-80b",
    "qwen3.5-397b",
    "mimo-v2-flash",
    "ring-2.5-1t",
    "minimax-m2.5",
    "qwen3-235b",
    "deepseek-v3",
    "prfaas-1t",
)
SHORT, LONG = 100, 1000
IMPL = "reference"  # see the module docstring


def reduced(name: str) -> ModelConfig:
    """One block per layer kind of the preset, with its exact state-defining sections."""
    cfg = load_model_config(name)
    kinds = tuple(dict.fromkeys(cfg.layers))
    return dataclasses.replace(
        cfg,
        name=f"{name}-reduced",
        layers=kinds,
        mlps=(MlpKind.DENSE,) * len(kinds),
        mlp_dim=64,
        moe=None,
        hidden_dim=64,
        vocab_size=256,
    )


def random_params(cfg: ModelConfig, seed: int = 0):
    """Concrete weights of `init_params`'s shapes and dtypes, drawn with NumPy (no compile)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(seed), cfg))
    return jax.tree.map(
        lambda s: jnp.asarray((0.05 * rng.standard_normal(s.shape, np.float32)).astype(s.dtype)),
        shapes,
    )


def _nbytes(layer) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(layer))


@functools.cache
def _run(name: str) -> tuple[ModelConfig, dict[int, object]]:
    cfg = reduced(name)
    params = random_params(cfg)
    run = jax.jit(lambda p, t, s: prefill(p, cfg, t, s, impl=IMPL)[1])
    rng = np.random.default_rng(1)
    states = {}
    for length in (SHORT, LONG):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, length)), jnp.int32)
        states[length] = run(params, tokens, init_state(cfg, 1, length))
    return cfg, states


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_state_nbytes_equal_the_formula_per_layer(name):
    cfg, states = _run(name)
    for length, state in states.items():
        assert int(state.lengths[0]) == length
        for kind, layer in zip(cfg.layers, state.layers, strict=True):
            assert _nbytes(layer) == layer_nbytes(cfg, kind, length), (kind, length)
            for leaf in jax.tree.leaves(layer):
                assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32)))), (kind, length)
        assert sum(_nbytes(layer) for layer in state.layers) == state_nbytes(cfg, length)


@pytest.mark.parametrize("name", PRESETS)
def test_fixed_state_does_not_grow_and_windows_stop(name):
    cfg, states = _run(name)
    for index, kind in enumerate(cfg.layers):
        short, long = (_nbytes(states[n].layers[index]) for n in (SHORT, LONG))
        per_token = layer_token_nbytes(cfg, kind)
        if kind.is_linear:
            assert short == long == layer_fixed_nbytes(cfg, kind) > 0
        elif kind is LayerKind.SWA:
            assert cfg.swa.window < LONG
            assert (short, long) == (SHORT * per_token, cfg.swa.window * per_token)
        else:
            assert (short, long) == (SHORT * per_token, LONG * per_token)


@pytest.mark.parametrize("name", PRESETS)
def test_the_codec_ships_exactly_the_formula(name):
    cfg, states = _run(name)
    for length, state in states.items():
        payload = codec.payload_nbytes(codec.encode(state, cfg))
        assert payload == serialized_nbytes(cfg, length) == state_nbytes(cfg, length)
