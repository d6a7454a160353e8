"""The fake engines' whole-state check under a lossy wire precision (engine/fake.py,
engine/fake_precision.py): a state that crossed the real codec in bf16, int8 or fp8_e4m3 is
accepted and decodes to the same tokens, and one quantum more than the precision allows,
anywhere, is refused."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.layout import canonical_arrays, state_from_arrays
from prfaas_jax.engine.fake import STATE_MISMATCH, FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.errors import EngineError
from prfaas_jax.wire_precision import WirePrecision

PROMPT = [(37 * i + 11) % 256 for i in range(24)]
LOSSY = ("int8", "fp8_e4m3")


def _crossed(cfg, encoding: str):
    """The fake state of PROMPT and its first token, through the real codec in `encoding`."""
    result = FakePrefillEngine(cfg).prefill(PROMPT, max_len=64)
    frames = codec.encode(result.state, cfg, precision=WirePrecision.parse(encoding))
    return result, codec.decode(list(frames), cfg, max_len=64)


def _arrays(cfg, state):
    return [(spec, np.array(array)) for spec, array in canonical_arrays(state, cfg, 0)[1]]


def _decoded_tokens(cfg, state, first_token: int) -> list[int]:
    engine = FakeDecodeEngine(cfg, max_slots=1, max_len=64)
    slot = engine.insert(state, first_token, max_new_tokens=5)
    tokens = [first_token]
    while not engine.is_finished(slot):
        tokens += [token for _, token in engine.step()]
    return tokens


@pytest.mark.parametrize("name", ["tiny", "tiny-gdn"])
@pytest.mark.parametrize("encoding", ["bf16", *LOSSY])
def test_a_state_that_crossed_in_any_precision_is_taken_and_decodes_the_same(name, encoding):
    cfg = load_model_config(name)
    result, state = _crossed(cfg, encoding)
    exact = _arrays(cfg, result.state)
    got = _arrays(cfg, state)
    if encoding in LOSSY:  # the precision did round the values, the token ids among them
        assert any(not np.array_equal(a, b) for (_, a), (_, b) in zip(got, exact, strict=True))
    assert _decoded_tokens(cfg, state, result.first_token) == fake_tokens(PROMPT, 6, 256)


def _one_quantum_up(value: np.float32, scale: np.float32, encoding: str) -> np.float32:
    """The value one step of `encoding` away from `value` in a vector of `scale`: the next
    int8, or the next float8_e4m3fn, towards zero at the top of its range."""
    if encoding == "int8":
        q = int(np.rint(value / scale))
        step = q + 1 if q < 127 else q - 1
        return np.float32(np.float32(step) * scale)
    q = np.array([value / scale], np.float32).astype(ml_dtypes.float8_e4m3fn)
    bits = q.view(np.uint8)
    bits += np.uint8(1) if abs(float(q[0])) < 448 else np.uint8(255)  # +1 / −1 in its code
    return np.float32(np.float32(q.astype(np.float32)[0]) * scale)


@pytest.mark.parametrize("encoding", LOSSY)
def test_one_quantum_more_than_the_precision_allows_is_refused(encoding):
    """In the token row of the growing cache (the token id itself and a value beside it) and in
    a recurrent state: the element moved by one step of the precision's grid in its vector."""
    cfg = load_model_config("tiny")
    result, state = _crossed(cfg, encoding)
    arrays = _arrays(cfg, state)
    token_tensor = next(n for n, (spec, _) in enumerate(arrays) if spec.token_axis)
    decode = FakeDecodeEngine(cfg, max_slots=1, max_len=64)
    for tensor, element in [(token_tensor, 5 * 32), (token_tensor, 5 * 32 + 3), (0, 17)]:
        moved = [(spec, array.copy()) for spec, array in arrays]
        spec, array = moved[tensor]
        flat = array.reshape(-1)
        vector = array.reshape(-1, spec.shape[-1])[element // spec.shape[-1]]
        limit = 127 if encoding == "int8" else 448
        scale = np.float32(np.abs(vector).max() / np.float32(limit))
        before = flat[element]
        flat[element] = _one_quantum_up(flat[element], scale, encoding)
        assert 0 < abs(flat[element] - before) <= 32.5 * scale  # one step: fp8 steps are ≤ 32
        damaged = state_from_arrays(cfg, len(PROMPT), moved, state.capacity)
        with pytest.raises(EngineError, match=re.escape(f"{STATE_MISMATCH}: {spec} ")):
            decode.insert(damaged, result.first_token, max_new_tokens=1)
    decode.insert(state, result.first_token, max_new_tokens=1)  # undamaged, it goes in


def test_rows_of_a_growing_cache_may_come_from_two_transfers():
    """A decode worker's cached prefix (native rows) followed by rows pushed in int8, as a
    receiver with a reserved prefix assembles them; a fixed-size tensor must be one encoding
    whole."""
    cfg = load_model_config("tiny")
    result, int8 = _crossed(cfg, "int8")
    exact, lossy = _arrays(cfg, result.state), _arrays(cfg, int8)
    mixed = [
        (spec, np.concatenate([e[:10], q[10:]]) if spec.token_axis else q)
        for (spec, e), (_, q) in zip(exact, lossy, strict=True)
    ]
    state = state_from_arrays(cfg, len(PROMPT), mixed, int8.capacity)
    assert _decoded_tokens(cfg, state, result.first_token) == fake_tokens(PROMPT, 6, 256)
    spec, recurrent = mixed[0]
    recurrent[0] = exact[0][1][0]  # its first vector native, the rest int8
    state = state_from_arrays(cfg, len(PROMPT), mixed, int8.capacity)
    with pytest.raises(EngineError, match=re.escape(f"{STATE_MISMATCH}: {spec} ")):
        FakeDecodeEngine(cfg, max_slots=1, max_len=64).check_state(state)
