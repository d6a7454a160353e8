"""Log-probabilities from the engines (engine/logprobs.py): a prompt's from `PrefillEngine.score`
against a float64 log-softmax of the model's own full prefill logits; the decode engine's per
token against `score` over the generated sequence (prefill and decode_step reach them by
different programs); the fake engines' against their formula by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.generate import decode_alone, prompt_logits
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.model.seeded_weights import seeded_params

CFG = load_model_config("tiny")
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def params():
    return seeded_params(CFG, 0)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("length", [2, 77])  # buckets 32 and 128, padded
def test_prompt_logprobs_are_the_full_prefills_log_softmax(params, length):
    tokens = np.random.default_rng(length).integers(0, CFG.vocab_size, length).tolist()
    engine = PrefillEngine(CFG, params, buckets=[32, 128], chunk_len=128)
    scored = engine.score(tokens, top=5)
    reference = log_softmax64(prompt_logits(params, CFG, tokens))[:-1]  # position p: token p+1
    assert [s.token for s in scored] == tokens[1:]
    got = np.array([s.logprob for s in scored])
    np.testing.assert_allclose(got, reference[np.arange(length - 1), tokens[1:]], atol=1e-4)
    for row, s in zip(reference, scored, strict=True):
        ids = [t for t, _ in s.top]
        assert len(ids) == 5 and ids == np.argsort(-row, kind="stable")[:5].tolist()
        np.testing.assert_allclose([v for _, v in s.top], row[ids], atol=1e-4)
    assert engine.score(tokens[:1]) == []


def test_decode_logprobs_match_a_prefill_over_the_generated_sequence(params):
    prompt = np.random.default_rng(3).integers(0, CFG.vocab_size, 20).tolist()
    prefill = PrefillEngine(CFG, params, buckets=[32, 128], chunk_len=128)
    first = prefill.prefill(prompt, sampling=SAMPLED, max_len=128)
    engine = DecodeEngine(CFG, params, max_slots=2, max_len=128)
    plain = engine.insert(first.state, first.first_token, SAMPLED, max_new_tokens=8)
    asked = engine.insert(first.state, first.first_token, SAMPLED, max_new_tokens=8, logprobs=3)
    made: dict[int, list] = {plain: [], asked: []}
    while engine.active_slots:
        for slot, token in engine.step():
            made[slot].append((token, engine.logprobs(slot)))
    assert [t for t, _ in made[plain]] == [t for t, _ in made[asked]]  # the variant samples alike
    assert all(lp is None for _, lp in made[plain])
    tokens = [t for t, _ in made[asked]]
    reference = prefill.score([*prompt, first.first_token, *tokens], top=3)[len(prompt) :]
    for (token, lp), ref in zip(made[asked], reference, strict=True):
        assert lp.token == token == ref.token
        assert abs(lp.logprob - ref.logprob) < 1e-4
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
    # One process's generation is unchanged by the variant existing.
    again = DecodeEngine(CFG, params, max_slots=1, max_len=128)
    slot = again.insert(first.state, first.first_token, SAMPLED, max_new_tokens=8)
    assert decode_alone(again, slot) == tokens


def test_fake_logprobs_by_hand():
    vocab = CFG.vocab_size
    log_z = math.log(sum(math.exp(-d / 4) for d in range(vocab)))
    prompt = [1, 2, 3]
    scored = FakePrefillEngine(CFG).score(prompt, top=2)
    # After [1]: next = 2·1 + 1 = 3, token 2 is 255 places on (mod 256); after [1, 2]: 8, 3 is 251.
    assert [(s.token, s.logprob) for s in scored] == pytest.approx(
        [(2, -255 / 4 - log_z), (3, -251 / 4 - log_z)]
    )
    assert [t for t, _ in scored[0].top] == [3, 4]
    assert [v for _, v in scored[1].top] == pytest.approx([-log_z, -1 / 4 - log_z])
    # Decode: each token's log-probability is the score of the sequence it extends.
    result = FakePrefillEngine(CFG).prefill(prompt, sampling=SAMPLED, max_len=32)
    engine = FakeDecodeEngine(CFG, max_slots=1, max_len=32)
    engine.insert(result.state, result.first_token, SAMPLED, max_new_tokens=5, logprobs=4)
    got = []
    while engine.active_slots:
        got += [engine.logprobs(s) for s, _ in engine.step()]
    tokens = fake_tokens(prompt, 6, vocab, SAMPLED)
    assert got == FakePrefillEngine(CFG).score(prompt + tokens, top=4)[len(prompt) :]
