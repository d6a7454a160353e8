"""Property test of the hybrid prefix cache pool: random insert / match sequences under random
byte budgets (so evictions happen), on fake states — no model.

A fake state is a deterministic function of its tokens, as a real one is: the KV row of
position p (MLA, GQA, SWA) is drawn from a seed hashed from ``tokens[:p + 1]``, the fixed-size
tensors (KDA/GDN/Lightning states, conv tails) from ``tokens[:L]``. Then, after every step:

* the pool never holds more than its budget, and its accounting equals what it stores;
* every hit is a checkpoint that was inserted at exactly that length, whose KV blocks are all
  still in the pool (no checkpoint is served whose KV prefix was evicted);
* the state built from a hit equals, bit for bit, the reference state of that prefix;
* until the first eviction, the hit is the longest inserted proper prefix (nothing is lost);
* right after an insert that fits the budget on its own, that insert is served.
"""

from __future__ import annotations

import functools
import hashlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from prfaas_jax.config import LayerKind, load_model_config
from prfaas_jax.engine.codec.layout import canonical_arrays, canonical_tensors, state_from_arrays
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.model.state import state_nbytes

MAX_TOKENS = 24
# Few distinct tokens: prompts share prefixes often, so blocks and checkpoints are reused.
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=MAX_TOKENS).map(tuple)
op_strategy = st.tuples(st.sampled_from(["insert", "match"]), tokens_strategy)


def _seed(tokens: tuple[int, ...], tensor: int) -> int:
    digest = hashlib.blake2b(repr((tensor, tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@functools.cache
def _row(tokens: tuple[int, ...], tensor: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(_seed(tokens, tensor))
    return rng.standard_normal(shape).astype(np.dtype(dtype))


def reference_arrays(cfg, tokens: tuple[int, ...]) -> list[tuple]:
    """The canonical tensors of the fake state of ``tokens``."""
    length, out = len(tokens), []
    for index, spec in enumerate(canonical_tensors(cfg, length)):
        if spec.token_axis:
            first = length - spec.shape[0]  # SWA keeps the last positions, growing KV all
            rows = [
                _row(tokens[: p + 1], index, spec.shape[1:], spec.dtype)
                for p in range(first, length)
            ]
            array = np.stack(rows) if rows else np.zeros(spec.shape, spec.dtype)
        else:
            array = _row(tokens, index, spec.shape, spec.dtype)
        out.append((spec, array))
    return out


def fake_state(cfg, tokens: tuple[int, ...]):
    return state_from_arrays(cfg, len(tokens), reference_arrays(cfg, tokens), len(tokens))


def stored(cache: PrefixCache) -> tuple[int, int, int, set[int]]:
    """Bytes, blocks and checkpoints actually held, and the ids of the blocks in the tree."""
    nbytes, blocks, checkpoints, ids = 0, 0, 0, set()
    stack = [cache._root]
    while stack:
        node = stack.pop()
        ids.add(id(node))
        nbytes += sum(a.nbytes for a in node.kv)
        blocks += node is not cache._root
        for checkpoint in node.checkpoints.values():
            nbytes += checkpoint.nbytes
            checkpoints += 1
        stack.extend(node.children.values())
    return nbytes, blocks, checkpoints, ids


@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-lightning"])
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(op_strategy, min_size=1, max_size=30),
    budget_states=st.floats(0.0, 4.0),
    block_size=st.integers(1, 5),
)
def test_random_insert_match_sequences(name, ops, budget_states, block_size):
    cfg = load_model_config(name)
    capacity = int(budget_states * state_nbytes(cfg, MAX_TOKENS))
    cache = PrefixCache(cfg, capacity_bytes=capacity, block_size=block_size)
    inserted: set[tuple[int, ...]] = set()
    for op, tokens in ops:
        if op == "insert":
            cache.insert(list(tokens), fake_state(cfg, tokens))
            inserted.add(tokens)
            query = (*tokens, 0)
        else:
            query = tokens
        nbytes, blocks, checkpoints, block_ids = stored(cache)
        assert cache.stats.used_bytes == nbytes <= capacity
        assert (cache.stats.blocks, cache.stats.checkpoints) == (blocks, checkpoints)

        hit = cache.match(list(query))
        longest = max(
            (len(t) for t in inserted if len(t) < len(query) and query[: len(t)] == t), default=0
        )
        if op == "insert" and state_nbytes(cfg, len(tokens)) <= capacity:
            assert hit is not None and hit.length == len(tokens)
        if hit is None:
            assert cache.stats.evictions > 0 or longest == 0
            continue
        prefix = query[: hit.length]
        assert prefix in inserted and hit.length <= longest
        assert cache.stats.evictions > 0 or hit.length == longest
        # The hit's KV path is intact: each block is still its parent's child, the checkpoint
        # still hangs off the last one.
        assert all(id(block) in block_ids for block in hit.blocks)
        owner = hit.blocks[-1] if hit.blocks else cache._root
        assert any(c is hit.checkpoint for c in owner.checkpoints.values())
        for capacity_extra in (0, 3):
            state = cache.build_state(hit, hit.length + capacity_extra)
            length, arrays = canonical_arrays(state, cfg, 0)
            assert length == hit.length
            for (spec, got), (_, want) in zip(arrays, reference_arrays(cfg, prefix), strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape, spec
                assert np.array_equal(got, want), f"{spec} differs for a {length}-token hit"


def test_swa_layers_are_checkpointed_not_blocked():
    """SWA windows live in checkpoints (exact length), MLA/GQA KV in blocks."""
    cfg = load_model_config("tiny-swa")
    cache = PrefixCache(cfg, capacity_bytes=1 << 20, block_size=4)
    tokens = tuple(range(10))
    cache.insert(list(tokens), fake_state(cfg, tokens))
    (node,) = cache._root.children.values()
    kinds = [s.kind for s in canonical_tensors(cfg, 10) if s.token_axis]
    growing = [k for k in kinds if k is not LayerKind.SWA]
    assert len(node.kv) == len(growing) == 2  # k and v of the GQA layer, nothing for SWA
