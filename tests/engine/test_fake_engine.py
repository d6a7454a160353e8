"""The hand-computable engines: their tokens survive the real codec, and a state that differs
in any bit from the one its tokens make is refused."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.cached_prefill import CachedPrefill
from prfaas_jax.engine.codec.layout import (
    TensorSpec,
    canonical_arrays,
    canonical_tensors,
    state_from_arrays,
)
from prfaas_jax.engine.fake import (
    STATE_MISMATCH,
    FakeDecodeEngine,
    FakePrefillEngine,
    fake_tokens,
)
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError
from prfaas_jax.model.state import state_nbytes

CFG = load_model_config("tiny")


def test_tokens_by_hand():
    # S = 1 + 2 + 3 = 6, L = 3: token 0 = 2·6 + 3 = 15, then 3·15 + 1 = 46, 3·46 + 1 = 139,
    # 3·139 + 1 = 418 ≡ 162 (mod 256).
    assert fake_tokens([1, 2, 3], 4, 256) == [15, 46, 139, 162]


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=40),
    n=st.integers(1, 40),
    data=st.data(),
)
def test_tokens_are_autoregressive(prompt, n, data):
    """Resuming from prompt + the first k tokens gives the rest: what a request continued on
    another decode worker must produce."""
    k = data.draw(st.integers(0, n - 1))
    head = fake_tokens(prompt, k, 256)
    assert fake_tokens(prompt + head, n - k, 256) == fake_tokens(prompt, n, 256)[k:]


def test_decode_resumes_from_a_longer_state():
    prompt, n, k = [9, 8, 7, 6], 10, 4
    expected = fake_tokens(prompt, n, 256)
    result = FakePrefillEngine(CFG).prefill(prompt + expected[:k], max_len=64)
    assert result.first_token == expected[k]
    engine = FakeDecodeEngine(CFG, max_slots=1, max_len=64)
    slot = engine.insert(result.state, result.first_token, max_new_tokens=n - k - 1)
    tokens = [result.first_token]
    while not engine.is_finished(slot):
        tokens += [token for _, token in engine.step()]
    assert tokens == expected[k:]


def test_prefill_codec_decode_round_trip():
    prompt = [5, 250, 17, 3, 99]
    result = FakePrefillEngine(CFG).prefill(prompt, max_len=64)
    frames = list(codec.encode(result.state, CFG))
    assert codec.payload_nbytes(frames) == state_nbytes(CFG, len(prompt))
    engine = FakeDecodeEngine(CFG, max_slots=2, max_len=64)
    slot = engine.insert(
        codec.decode(frames, CFG, max_len=64), result.first_token, max_new_tokens=3
    )
    tokens = [result.first_token]
    while not engine.is_finished(slot):
        tokens += [token for _, token in engine.step()]
    assert tokens == fake_tokens(prompt, 4, 256)
    engine.free(slot)
    assert engine.step() == [] and engine.free_slots == [0, 1]


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=2**40 + 3)


def splitmix_finaliser(x: int) -> int:
    """splitmix64's finaliser on Python integers (the oracle for the engines' numpy one)."""
    mask = 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_sampled_tokens_by_hand():
    # Greedy token 0 of [1, 2, 3] is 15; a sampled one moves by a hash of (seed, 0) within the
    # ⌊256 · 0.9⌋ = 230 candidates top_p keeps, and each next token follows the sampled one.
    seed = splitmix_finaliser(SAMPLED.seed)
    tokens, total, length = [], 6, 3
    for i in range(4):
        offset = splitmix_finaliser((seed + i) % 2**64) % 230
        tokens.append((2 * total + length + offset) % 256)
        total, length = total + tokens[-1], length + 1
    assert fake_tokens([1, 2, 3], 4, 256, SAMPLED) == tokens
    assert tokens != fake_tokens([1, 2, 3], 4, 256)
    other_seed = dataclasses.replace(SAMPLED, seed=SAMPLED.seed + 1)
    assert fake_tokens([1, 2, 3], 4, 256, other_seed) != tokens
    # top_k = 1 keeps one candidate: greedy, as the real sampler.
    top_1 = dataclasses.replace(SAMPLED, top_k=1)
    assert fake_tokens([1, 2, 3], 4, 256, top_1) == fake_tokens([1, 2, 3], 4, 256, GREEDY)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=20),
    n=st.integers(2, 20),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_sampled_requests_resume_and_survive_the_codec(prompt, n, seed, data):
    """The engines draw token i from the request's key and index: resumed after k tokens at
    ``first_index = k``, a request continues with the tokens one run makes; each slot keeps its
    own settings."""
    sampling = dataclasses.replace(SAMPLED, seed=seed)
    expected = fake_tokens(prompt, n, 256, sampling)
    k = data.draw(st.integers(0, n - 1))
    resumed = dataclasses.replace(sampling, first_index=k)
    result = FakePrefillEngine(CFG).prefill(prompt + expected[:k], sampling=resumed, max_len=64)
    engine = FakeDecodeEngine(CFG, max_slots=2, max_len=64)
    greedy = FakePrefillEngine(CFG).prefill(prompt, max_len=64)
    beside = engine.insert(greedy.state, greedy.first_token, max_new_tokens=n - 1)
    state = codec.decode(list(codec.encode(result.state, CFG)), CFG, max_len=64)
    made = {beside: [greedy.first_token]}
    if k < n - 1:
        made[engine.insert(state, result.first_token, resumed, max_new_tokens=n - k - 1)] = []
    while steps := engine.step():
        for slot, token in steps:
            made[slot].append(token)
    assert [result.first_token, *made.get(1 - beside, [])] == expected[k:]
    assert made[beside] == fake_tokens(prompt, n, 256)


def test_a_damaged_token_is_refused():
    state = FakePrefillEngine(CFG).prefill([1, 2, 3]).state
    c_kv = np.asarray(state.layers[3].c_kv).copy()
    c_kv[0, 1, 0] = 7.0  # token 2 → 7 at position 1: a state of [1, 7, 3] with [1, 2, 3]'s values
    damaged = type(state)(
        state.lengths, (*state.layers[:3], type(state.layers[3])(c_kv, state.layers[3].k_rope))
    )
    engine = FakeDecodeEngine(CFG, max_slots=1, max_len=16)
    with pytest.raises(
        EngineError, match=r"layer 3 mla c_kv .* differs at position 1, element \(1,\)"
    ):
        engine.insert(damaged, fake_tokens([1, 2, 3], 1, 256)[0], max_new_tokens=1)
    assert engine.free_slots == [0]


def test_limits():
    with pytest.raises(EngineError):
        FakePrefillEngine(CFG).prefill([])
    with pytest.raises(EngineError):
        FakePrefillEngine(CFG).prefill([256])
    engine = FakeDecodeEngine(CFG, max_slots=1, max_len=8)
    state = FakePrefillEngine(CFG).prefill([1] * 6).state
    with pytest.raises(EngineError):
        engine.insert(state, 0, max_new_tokens=3)
    engine.insert(state, 0, max_new_tokens=2)
    with pytest.raises(EngineError):
        engine.insert(state, 0, max_new_tokens=1)
    engine.check_state(state)  # no slot needed
    with pytest.raises(EngineError, match="exceeds max_len 8"):
        engine.check_state(FakePrefillEngine(CFG).prefill([1] * 9).state)


def test_bfloat16_states():
    """Every value is exact in bfloat16 too, and so is every token id up to 2^8."""
    cfg = dataclasses.replace(CFG, dtype="bfloat16", state_dtype="bfloat16")
    prompt = [255, 0, 128, 7]
    result = FakePrefillEngine(cfg).prefill(prompt, max_len=16)
    engine = FakeDecodeEngine(cfg, max_slots=1, max_len=16)
    state = codec.decode(list(codec.encode(result.state, cfg)), cfg, max_len=16)
    slot = engine.insert(state, result.first_token, max_new_tokens=2)
    tokens = [result.first_token]
    while not engine.is_finished(slot):
        tokens += [token for _, token in engine.step()]
    assert tokens == fake_tokens(prompt, 3, 256)
    with pytest.raises(EngineError, match="cannot hold 'tiny''s token ids exactly"):
        FakePrefillEngine(dataclasses.replace(cfg, vocab_size=257))


# --- the state: every value set, every value checked ----------------------------------------

PRESETS = ["tiny", "tiny-swa", "tiny-gdn", "tiny-lightning"]  # KDA, SWA, GDN, Lightning layers


def canonical(cfg, state) -> list[tuple[TensorSpec, np.ndarray]]:
    return canonical_arrays(state, cfg, 0)[1]


def with_bit_flipped(cfg, state, tensor: int, element: int):
    """`state` with the lowest bit of one element of its `tensor`-th canonical tensor flipped."""
    arrays = [(spec, np.array(array)) for spec, array in canonical(cfg, state)]
    spec, array = arrays[tensor]
    array.view(f"u{spec.itemsize}").reshape(-1)[element] ^= 1
    return state_from_arrays(cfg, int(state.lengths[0]), arrays, state.capacity)


@pytest.mark.parametrize("name", PRESETS)
@settings(max_examples=20, deadline=None)
@given(tokens=st.lists(st.integers(0, 255), min_size=1, max_size=20), data=st.data())
def test_every_value_depends_on_the_tokens_it_summarises(name, tokens, data):
    """Changing token j changes every row of a growing cache or window from position j on and
    none before, and every recurrent state and conv tail."""
    cfg = load_model_config(name)
    j = data.draw(st.integers(0, len(tokens) - 1))
    other = [*tokens[:j], (tokens[j] + data.draw(st.integers(1, 255))) % 256, *tokens[j + 1 :]]
    engine = FakePrefillEngine(cfg)
    before = canonical(cfg, engine.prefill(tokens).state)
    after = canonical(cfg, engine.prefill(other).state)
    for (spec, a), (_, b) in zip(before, after, strict=True):
        if spec.token_axis:
            for row, position in enumerate(range(len(tokens) - spec.shape[0], len(tokens))):
                assert np.array_equal(a[row], b[row]) == (position < j), (str(spec), position)
        else:
            assert not np.array_equal(a, b), str(spec)


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_after_a_prefix_is_the_cold_state_bit_for_bit(name):
    cfg = load_model_config(name)
    tokens = [(7 * i + 3) % 256 for i in range(21)]  # longer than tiny-swa's window of 8
    engine = FakePrefillEngine(cfg)
    cold = engine.prefill(tokens, max_len=32)
    for k in (1, 8, 20):
        prefix = engine.prefill(tokens[:k], max_len=32).state
        warm = engine.prefill(tokens[k:], prefix=prefix, max_len=32)
        assert (warm.first_token, warm.prefix_len, warm.num_tokens) == (cold.first_token, k, 21 - k)
        for (spec, a), (_, b) in zip(
            canonical(cfg, warm.state), canonical(cfg, cold.state), strict=True
        ):
            assert a.tobytes() == b.tobytes(), (str(spec), k)


@pytest.mark.parametrize("name", PRESETS)
def test_one_flipped_bit_anywhere_is_refused(name):
    """In every tensor of every layer — recurrent states, conv tails, k_rope, windows — the
    first, a middle and the last element, its lowest bit flipped: decode's insert and prefill
    after that prefix both refuse the state, naming the tensor."""
    cfg = load_model_config(name)
    prompt = [(11 * i + 5) % 256 for i in range(12)]
    state = FakePrefillEngine(cfg).prefill(prompt, max_len=32).state
    decode = FakeDecodeEngine(cfg, max_slots=1, max_len=32)
    for tensor, (spec, array) in enumerate(canonical(cfg, state)):
        for element in sorted({0, array.size // 2 + 1, array.size - 1}):
            damaged = with_bit_flipped(cfg, state, tensor, element)
            names = re.escape(f"{STATE_MISMATCH}: {spec} ")
            with pytest.raises(EngineError, match=f"the state {names}"):
                decode.insert(damaged, 0, max_new_tokens=1)
            with pytest.raises(EngineError, match=f"the state {names}"):
                decode.check_state(damaged)
            with pytest.raises(EngineError, match=f"the prefix state {names}"):
                FakePrefillEngine(cfg).prefill([1], prefix=damaged, max_len=32)
    assert decode.free_slots == [0]
    decode.check_state(state)  # the undamaged state passes, and takes no slot
    assert decode.free_slots == [0]
    decode.insert(state, 0, max_new_tokens=1)  # the undamaged state still goes in


@pytest.mark.parametrize("name", ["tiny", "tiny-swa"])
@pytest.mark.parametrize("wrong", ["another prefix", "another length"])
def test_a_prefix_hit_with_the_wrong_checkpoint_is_refused(name, wrong):
    """A prefix cache whose hit serves the right KV blocks with the linear checkpoint (recurrent
    states and conv tails, or SWA windows) of a prefix that differs only in its last token, or
    of the same prompt one token shorter: prefill after it fails, naming the first such tensor."""
    cfg = load_model_config(name)
    prompt = [(3 * i + 1) % 256 for i in range(16)]
    follow_up = [*prompt, 9, 9, 9]
    cache = PrefixCache(cfg, capacity_bytes=1 << 20, block_size=4)
    reuse, engine = CachedPrefill(cache), FakePrefillEngine(cfg)
    reuse.prefill(engine, prompt, max_len=64)  # saves its checkpoint at 16
    good = reuse.prefill(engine, follow_up, max_len=64)
    assert (good.prefix_len, good.first_token) == (16, fake_tokens(follow_up, 1, 256)[0])

    donor = [*prompt[:-1], prompt[-1] + 1] if wrong == "another prefix" else prompt[:-1]
    fixed = [
        array
        for spec, array in canonical(cfg, engine.prefill(donor).state)
        if not spec.kind.has_growing_state
    ]
    hit = cache.match(follow_up, record=False)
    assert hit is not None and hit.length == 16
    for stored, array in zip(hit.checkpoint.fixed, fixed, strict=True):
        np.copyto(stored, array)
    first_fixed = next(s for s in canonical_tensors(cfg, 16) if not s.kind.has_growing_state)
    with pytest.raises(EngineError, match=re.escape(f"{STATE_MISMATCH}: {first_fixed} ")):
        reuse.prefill(engine, follow_up, max_len=64)


def test_chunked_prefill_hands_over_each_prefix_state():
    """With ``chunk_len``, ``on_chunk`` sees the state at every chunk end past the prefix, each
    bit-equal to a prefill of just those tokens; a prefix cache then holds checkpoints inside
    the prompt (at its stride), which one chunk would not give it."""
    prompt = [(5 * i + 2) % 256 for i in range(20)]
    seen = []
    result = FakePrefillEngine(CFG, chunk_len=8).prefill(
        prompt, on_chunk=lambda state, n: seen.append((n, state)), max_len=64
    )
    assert [n for n, _ in seen] == [8, 16, 20] and seen[-1][1] is result.state
    for n, state in seen:
        alone = FakePrefillEngine(CFG).prefill(prompt[:n], max_len=64).state
        for (_, got), (_, want) in zip(canonical(CFG, state), canonical(CFG, alone), strict=True):
            np.testing.assert_array_equal(got, want)
    # After a 4-token prefix the chunks are counted from it: 12, 20.
    prefix = FakePrefillEngine(CFG).prefill(prompt[:4], max_len=64).state
    ends = []
    FakePrefillEngine(CFG, chunk_len=8).prefill(
        prompt[4:], prefix=prefix, on_chunk=lambda _, n: ends.append(n), max_len=64
    )
    assert ends == [12, 20]

    def cached_after(chunk_len: int) -> int:
        cache = PrefixCache(CFG, capacity_bytes=1 << 20, block_size=4, checkpoint_every=2)
        reuse = CachedPrefill(cache)
        reuse.prefill(FakePrefillEngine(CFG, chunk_len=chunk_len), prompt, max_len=64)
        return reuse.cached_len([*prompt[:16], 7, 7])

    assert (cached_after(8), cached_after(0)) == (16, 0)
