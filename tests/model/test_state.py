"""State layout and the byte formula, checked against hand-computed numbers."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from prfaas_jax.config import LayerKind, load_model_config
from prfaas_jax.model import init_state, state_nbytes


def test_tiny_state_bytes_by_hand():
    cfg = load_model_config("tiny")  # 3 KDA + 1 MLA, fp32 everywhere
    kda = 2 * 16 * 16 * 4 + 3 * (2 * 2 * 16 + 2 * 16) * 4  # recurrent + conv tail of 96 channels
    mla_per_token = (32 + 8) * 4
    assert state_nbytes(cfg, 0) == 3 * kda
    assert state_nbytes(cfg, 100) == 3 * kda + 100 * mla_per_token


def test_swa_bytes_stop_at_the_window():
    cfg = load_model_config("tiny-swa")  # 1 GQA (1 kv head, 16+12) + 3 SWA (2 kv heads, W=8)
    gqa, swa = 1 * (16 + 12) * 4, 2 * (16 + 12) * 4
    assert state_nbytes(cfg, 5) == 5 * gqa + 3 * 5 * swa
    assert state_nbytes(cfg, 50) == 50 * gqa + 3 * 8 * swa


@pytest.mark.parametrize("name", ["tiny", "tiny-gdn", "tiny-lightning", "tiny-swa"])
def test_initial_state_arrays_match_the_formula(name):
    """With capacity == length the arrays hold exactly the canonical state."""
    cfg = load_model_config(name)
    for length in (3, 8, 40):
        state = init_state(cfg, 1, length)
        measured = sum(leaf.nbytes for leaf in jax.tree.leaves(state.layers))
        assert measured == state_nbytes(cfg, length)


def test_bf16_model_keeps_fp32_recurrent_state():
    cfg = dataclasses.replace(load_model_config("tiny"), dtype="bfloat16")
    state = init_state(cfg, 1, 4)
    kinds = dict(zip(cfg.layers, state.layers, strict=True))
    assert kinds[LayerKind.KDA].recurrent.dtype.name == "float32"
    assert kinds[LayerKind.KDA].conv.dtype.name == "bfloat16"
    assert kinds[LayerKind.MLA].c_kv.dtype.name == "bfloat16"
