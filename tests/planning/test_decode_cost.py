"""What a decode step must read and compute (planning/decode_cost.py), for `tiny`, against the
real tensors (`param_specs`, `init_state`) and a count by hand from configs/models/tiny.toml:
D = 64, V = 256 (untied), float32; KDA ×3 (2 value heads of 16 × 16) and one MLA (2 heads,
d_qk = 16 + 8, d_v = 16); one dense block, then 3 MoE blocks of 8 experts, top-2, each expert
3 · 64 · 32 = 6,144 parameters."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.model import init_state
from prfaas_jax.model.hybrid import param_specs
from prfaas_jax.planning.decode_cost import (
    decode_step_bytes,
    decode_step_flops,
    decode_weight_bytes,
    experts_touched,
)

CFG = load_model_config("tiny")
D, V, F32 = 64, 256, 4
EXPERT = 3 * D * 32


def nbytes(tree) -> int:
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def test_experts_touched_is_top_k_for_one_token_and_all_for_many():
    assert experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert experts_touched(8, 2, 200) == pytest.approx(8.0)


def test_weights_are_every_parameter_but_the_unread_table_rows_and_experts():
    specs = param_specs(CFG)
    table = nbytes(specs["embed"])
    assert table == V * D * F32
    # Many rows touch every expert: all the weights, the table only at its B rows.
    batch = 10_000
    assert decode_weight_bytes(CFG, batch) == pytest.approx(nbytes(specs) - table + batch * D * F32)
    # One row: 6 of each MoE block's 8 experts stay unread.
    assert decode_weight_bytes(CFG, 1) == nbytes(specs) - table + D * F32 - 3 * 6 * EXPERT * F32


def test_the_state_part_is_every_rows_real_state_tensors():
    batch, context = 3, 100
    state = init_state(CFG, batch, context)
    tensors = nbytes(state.layers)  # KV caches at capacity = context, recurrent states, tails
    weights = decode_weight_bytes(CFG, batch)
    assert decode_step_bytes(CFG, batch, context) == pytest.approx(weights + tensors)


def test_flops_by_hand():
    per_row = (
        2 * 125_312  # active matmul weights (prefill_cost's count, checked against init_params)
        + 2 * D * V  # LM head
        + 2 * 2 * (24 + 16) * 100  # MLA over 100 cached tokens
        + 3 * 2 * 2 * (2 * 16 * 16)  # KDA: update and readout of a 16 × 16 state per head
    )
    assert decode_step_flops(CFG, 2, 100) == 2 * per_row == 611_072


def test_bad_batch_is_refused():
    with pytest.raises(ValueError, match="batch"):
        decode_weight_bytes(CFG, 0)
    assert np.isfinite(decode_step_bytes(CFG, 1, 0))
