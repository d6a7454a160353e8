"""The synthetic tasks against their definitions, checked example by example in NumPy.

MQAR: keys from [1, V/2) without repeats, values from [V/2, V), the N pairs first, every key
asked once at an even offset after them, the target the key's value. The query gaps are checked
against NumPy's own weighted sampling without replacement (the same power law), by the marginal
frequency of each gap. Needle: the asked key occurs once before the query point, right before
its value; SEP follows each asked key; answers are the paired values; the filler never holds a
key. ``recall_prompt`` ends with an asked key whose value is the answer.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prfaas_jax.errors import UserError
from prfaas_jax.train.tasks import SEP, TaskSpec, make_batch, recall_prompt

MQAR = TaskSpec(task="mqar", vocab_size=64, seq_len=48, num_pairs=6)
NEEDLE = TaskSpec(task="needle", vocab_size=64, seq_len=96, num_pairs=5, num_queries=3)


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


def test_needle_examples_follow_the_definition():
    tokens, targets, mask, answer = _np(make_batch(jax.random.PRNGKey(2), NEEDLE, 200))
    half = NEEDLE.vocab_size // 2
    for row in range(tokens.shape[0]):
        values_at = np.flatnonzero(answer[row])
        seps_at = np.flatnonzero(mask[row] & ~answer[row])
        assert len(values_at) == NEEDLE.num_queries and (seps_at + 1 == values_at).all()
        point = seps_at[0]
        asked = tokens[row, seps_at]
        assert (tokens[row, values_at] == SEP).all() and (targets[row, seps_at] == SEP).all()
        for key, value_pos in zip(asked, values_at, strict=True):
            before = np.flatnonzero(tokens[row, :point] == key)
            assert len(before) == 1, "an asked key occurs once before the questions"
            value = tokens[row, before[0] + 1]
            assert half <= value and targets[row, value_pos] == value
            assert tokens[row, value_pos + 1] == value  # the question's own answer follows it
        assert len(asked) == len(set(asked.tolist()))


def test_a_batch_is_a_function_of_its_key():
    a = make_batch(jax.random.PRNGKey(3), NEEDLE, 8)
    b = make_batch(jax.random.PRNGKey(3), NEEDLE, 8)
    c = make_batch(jax.random.PRNGKey(4), NEEDLE, 8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


def test_recall_prompt_ends_with_an_asked_key():
    for seed in range(20):
        prompt, value = recall_prompt(jax.random.PRNGKey(seed), NEEDLE)
        key = prompt[-1]
        earlier = [i for i, t in enumerate(prompt[:-1]) if t == key]
        assert len(earlier) == 1 and prompt[earlier[0] + 1] == value
        assert NEEDLE.seq_len // 4 + 1 <= len(prompt) <= NEEDLE.seq_len


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_pairs": 0}, "--num-pairs"),
        ({"vocab_size": 7}, "--vocab-size"),
        ({"vocab_size": 8, "num_pairs": 4}, "distinct keys"),
        ({"seq_len": 10, "num_pairs": 4}, "4·num_pairs = 16"),
        ({"task": "needle", "seq_len": 16, "num_pairs": 4}, "--seq-len ≥ 32"),
        ({"task": "needle", "num_queries": 9}, "questions"),
    ],
)
def test_impossible_tasks_are_user_errors(fields, message):
    with pytest.raises(UserError, match=message):
        TaskSpec(**fields)
