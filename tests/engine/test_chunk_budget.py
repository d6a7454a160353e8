"""`ChunkBudget`: the block a mixed step carries, from the step costs it was told.

Oracle: the choices worked out by hand from the rule in engine/chunk_budget.py (the largest
size whose cost — the median of its last measurements, or carried over from the next smaller
size — is within ``(1 + share) ×`` the decode step's; at least the smallest size).
"""

from __future__ import annotations

import pytest

from prfaas_jax.engine.chunk_budget import ChunkBudget, block_sizes
from prfaas_jax.errors import EngineError


def test_block_sizes_are_powers_of_two_up_to_the_cap():
    assert block_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert block_sizes(24, 3) == (4, 8, 16, 24)
    assert block_sizes(1) == (1,)
    with pytest.raises(EngineError):
        block_sizes(8, 9)


def test_token_budget_and_idle_rows_take_the_largest_block():
    tokens = ChunkBudget(32, share=None)
    assert not tokens.needs_decode_cost(8)
    assert tokens.block(8, 100) == 32 and tokens.block(8, 5) == 8  # a last, padded block
    timed = ChunkBudget(32, share=0.5)
    assert timed.block(0, 100) == 32  # no decode row: no time between tokens to keep


def test_time_budget_follows_measured_costs():
    budget = ChunkBudget(32, share=0.5, window=3, stale_after=6)
    assert budget.needs_decode_cost(8) and budget.limit(8) == 1  # nothing known: the smallest
    budget.observe_decode(8, 1.0)
    assert not budget.needs_decode_cost(8)
    assert budget.limit(8) == 32  # unmeasured sizes are tried
    budget.observe_mixed(8, 32, 2.0)  # over 1.5
    budget.observe_mixed(8, 16, 1.4)
    assert budget.limit(8) == 16 and budget.block(8, 100) == 16 and budget.block(8, 5) == 8
    assert budget.limit(4) == 1 and budget.needs_decode_cost(4)  # another batch: its own costs
    budget.observe_mixed(8, 16, 2.4)  # the median of 1.4 and 2.4: 1.9 > 1.5
    assert budget.limit(8) == 8
    budget.observe_mixed(8, 16, 1.0)  # 1.0, 1.4, 2.4: 1.4
    assert budget.limit(8) == 16
    budget.observe_mixed(8, 16, 1.0)  # 2.4, 1.0, 1.0: 1.0
    budget.observe_mixed(8, 16, 30.0)  # a stalled step: 1.0, 1.0, 30: still 1.0
    assert budget.limit(8) == 16
    budget.observe_mixed(8, 16, 1.0)  # the 32-token cost goes stale: 7 observations ago
    budget.observe_decode(8, 1.0)
    assert budget.limit(8) == 32  # tried again
    budget.observe_mixed(8, 1, 9.0)  # the smallest is kept whatever it costs
    assert budget.limit(8) == 1


def test_bad_settings_are_refused():
    with pytest.raises(EngineError):
        ChunkBudget(8, share=0)
    with pytest.raises(EngineError):
        ChunkBudget(8, window=0)
