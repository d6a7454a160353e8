"""The hand-computable engines: their tokens survive the real codec, and only if the state does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
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


def test_a_damaged_state_gives_other_tokens():
    state = FakePrefillEngine(CFG).prefill([1, 2, 3]).state
    c_kv = np.asarray(state.layers[3].c_kv).copy()
    c_kv[0, 1, 0] = 7.0  # token 2 → 7 at position 1
    damaged = type(state)(
        state.lengths, (*state.layers[:3], type(state.layers[3])(c_kv, state.layers[3].k_rope))
    )
    engine = FakeDecodeEngine(CFG, max_slots=1, max_len=16)
    slot = engine.insert(damaged, fake_tokens([1, 2, 3], 1, 256)[0], max_new_tokens=1)
    # The decoder continues [1, 7, 3, 15]: 2·26 + 4 = 56, not fake_tokens([1, 2, 3])[1] = 46.
    assert engine.step() == [(slot, 56)]


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
