"""The synthetic tasks against their definitions, checked example by example in NumPy.

MQAR: keys from [1, V/2) without repeats, values from [V/2, V), the N pairs first, every key
asked once at an even offset after them, the target the key's value. The query gaps are checked
against NumPy's own weighted sampling without replacement (the same power law), by the marginal
frequency of each gap. Retrieval: the facts (key, two-token value) open the sequence; an asked
key occurs once before the query point, in its fact; each question repeats its fact, scored on
both value tokens; answers are the second tokens; the filler never holds a key.
``recall_prompt`` ends with an asked key and its answer is the second token of that key's value.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prfaas_jax.errors import UserError
from prfaas_jax.train.tasks import TaskSpec, make_batch, recall_prompt

MQAR = TaskSpec(task="mqar", vocab_size=64, seq_len=48, num_pairs=6)
RETRIEVAL = TaskSpec(task="retrieval", vocab_size=64, seq_len=96, num_pairs=5, num_queries=3)


def _np(batch):
    return (np.asarray(x) for x in (batch.tokens, batch.targets, batch.mask, batch.answer))


def test_mqar_examples_follow_the_definition():
    tokens, targets, mask, answer = _np(make_batch(jax.random.PRNGKey(0), MQAR, 200))
    n, half = MQAR.num_pairs, MQAR.vocab_size // 2
    assert (mask == answer).all()
    for row in range(tokens.shape[0]):
        keys, values = tokens[row, 0 : 2 * n : 2], tokens[row, 1 : 2 * n : 2]
        assert len(set(keys.tolist())) == n and ((keys >= 1) & (keys < half)).all()
        assert ((half <= values) & (values < MQAR.vocab_size)).all()
        asked = np.flatnonzero(mask[row])
        assert len(asked) == n and (asked >= 2 * n).all() and ((asked - 2 * n) % 2 == 0).all()
        pairs = dict(zip(keys.tolist(), values.tolist(), strict=True))
        assert sorted(tokens[row, asked].tolist()) == sorted(keys.tolist())
        for position in asked:
            assert targets[row, position] == pairs[tokens[row, position]]


def test_mqar_query_gaps_follow_the_power_law():
    spec = TaskSpec(task="mqar", vocab_size=64, seq_len=40, num_pairs=4)
    _tokens, _, mask, _ = _np(make_batch(jax.random.PRNGKey(1), spec, 4000))
    space = (spec.seq_len - 2 * spec.num_pairs) // 2
    gaps = (np.nonzero(mask)[1] - 2 * spec.num_pairs) // 2
    ours = np.bincount(gaps, minlength=space) / len(gaps)
    g = np.arange(1, space + 1, dtype=np.float64)
    p = spec.power_a * g ** (spec.power_a - 1)
    rng = np.random.default_rng(0)
    draws = [rng.choice(space, spec.num_pairs, replace=False, p=p / p.sum()) for _ in range(4000)]
    numpy_freq = np.bincount(np.concatenate(draws), minlength=space) / (4000 * spec.num_pairs)
    # 16,000 gaps each: the binomial standard error of a frequency near 1/16 is ~0.002.
    np.testing.assert_allclose(ours, numpy_freq, atol=0.012)
    assert ours[0] > ours[-1]


def test_retrieval_examples_follow_the_definition():
    tokens, targets, mask, answer = _np(make_batch(jax.random.PRNGKey(2), RETRIEVAL, 200))
    half = RETRIEVAL.vocab_size // 2
    for row in range(tokens.shape[0]):
        seconds_at = np.flatnonzero(answer[row])  # where w is scored: at the question's v
        firsts_at = np.flatnonzero(mask[row] & ~answer[row])  # where v is scored: at the key
        assert len(seconds_at) == RETRIEVAL.num_queries and (firsts_at + 1 == seconds_at).all()
        assert (np.diff(firsts_at) == 3).all()
        point = firsts_at[0]
        asked = tokens[row, firsts_at]
        assert (asked < half).all() and len(set(asked.tolist())) == len(asked)
        facts = tokens[row, : 3 * RETRIEVAL.num_pairs].reshape(-1, 3)
        assert (facts[:, 0] < half).all() and (facts[:, 1:] >= half).all()
        for key, at in zip(asked, firsts_at, strict=True):
            before = np.flatnonzero(tokens[row, :point] == key)
            assert len(before) == 1, "an asked key occurs once before the questions"
            assert before[0] < 3 * RETRIEVAL.num_pairs and before[0] % 3 == 0, "in its fact"
            v, w = tokens[row, before[0] + 1 : before[0] + 3]
            assert half <= v and half <= w and v != w
            assert targets[row, at] == v and targets[row, at + 1] == w
            assert tuple(tokens[row, at + 1 : at + 3]) == (v, w)  # the question's own answer
        values = tokens[row][tokens[row] >= half]
        assert len(values) == 2 * (RETRIEVAL.num_pairs + RETRIEVAL.num_queries)
        assert len(set(values.tolist())) == 2 * RETRIEVAL.num_pairs, "values are never shared"
        assert mask[row].sum() == 2 * RETRIEVAL.num_queries


def test_a_batch_is_a_function_of_its_key():
    a = make_batch(jax.random.PRNGKey(3), RETRIEVAL, 8)
    b = make_batch(jax.random.PRNGKey(3), RETRIEVAL, 8)
    c = make_batch(jax.random.PRNGKey(4), RETRIEVAL, 8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


def test_recall_prompt_ends_with_an_asked_key():
    for seed in range(20):
        prompt, answer = recall_prompt(jax.random.PRNGKey(seed), RETRIEVAL)
        key = prompt[-1]
        earlier = [i for i, t in enumerate(prompt[:-1]) if t == key]
        assert len(earlier) == 1 and prompt[earlier[0] + 2] == answer
        assert answer >= RETRIEVAL.vocab_size // 2
        assert RETRIEVAL.seq_len // 4 + 1 <= len(prompt) <= RETRIEVAL.seq_len


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_pairs": 0}, "--num-pairs"),
        ({"vocab_size": 7}, "--vocab-size"),
        ({"vocab_size": 8, "num_pairs": 4}, "distinct keys"),
        ({"seq_len": 10, "num_pairs": 4}, "4·num_pairs = 16"),
        ({"task": "retrieval", "seq_len": 16, "num_pairs": 4}, "--seq-len ≥ 48"),
        ({"task": "retrieval", "vocab_size": 16, "num_pairs": 5}, "10 distinct values"),
        ({"task": "retrieval", "num_queries": 9}, "questions"),
    ],
)
def test_impossible_tasks_are_user_errors(fields, message):
    with pytest.raises(UserError, match=message):
        TaskSpec(**fields)
