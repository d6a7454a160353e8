"""What `draw_tokens` samples (engine/sampling.py): temperature, top-k and top-p give the
distribution they promise, and a token they mask never comes.

For one fixed logits vector (8 tokens, distinct values, not in sorted order, so the sort's
mapping back to token ids is exercised), each setting draws N = 20,000 tokens in one call:
tokens 0 … N − 1 of one seeded request, i.e. N rows with the same logits whose keys
`fold_in(request_key(seed), i)` come from the engines' own key schedule (vmapped over rows).

The expected distribution is computed here in float64 NumPy, independently of the code's
formulation: softmax(logits / T) over the tokens sorted by logit; top-k keeps the k largest
(k = 0, or k ≥ the vocabulary, keeps all) and renormalises; top-p then keeps the *smallest
prefix whose cumulative probability reaches p* (so the first token always survives) and
renormalises — the convention engine/sampling.py documents. Settings are chosen so that no
cumulative sum lies within 0.01 of p, where float32 rounding could decide the boundary.

Checks: every token outside the kept set has count 0 (exact); the counts of the kept tokens pass
Pearson's chi-square goodness-of-fit test at α = 0.001 (df = kept − 1, every expected count
≥ 5; scipy, a dependency of jax); temperature 0, top_k = 1 and a tiny top_p draw the argmax
every time. The draws are seeded, so each check gives the same answer on every run. A last test
shows the check has power: the same draws fail it against the untempered distribution and
against the other top-p convention (the prefix whose mass stays ≤ p).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from prfaas_jax.engine.sampling import draw_tokens, greedy_tokens, request_key

LOGITS = np.array([1.2, -0.3, 2.0, 0.4, -1.5, 0.9, 0.0, -0.8], np.float32)
VOCAB = LOGITS.size
ARGMAX = int(np.argmax(LOGITS))
N = 20_000
ALPHA = 1e-3
MARGIN = 0.01  # no cumulative probability this close to top_p


def expected(temperature: float, top_k: int, top_p: float, *, inclusive: bool = True):
    """Per token id, the probability of drawing it (float64). `inclusive=False` is the other
    top-p convention — keep the longest prefix whose mass stays ≤ top_p — for the power check."""
    z = LOGITS.astype(np.float64) / temperature
    order = np.argsort(-z)  # token ids, most likely first (the logits are distinct)
    q = np.exp(z[order] - z[order].max())
    q /= q.sum()
    k = top_k if 0 < top_k < VOCAB else VOCAB
    q[k:] = 0.0
    q /= q.sum()
    cumulative = np.cumsum(q)
    if top_p < 1.0:
        assert np.all(np.abs(cumulative[:k] - top_p) > MARGIN), "top_p sits on a boundary"
    if inclusive:
        kept = next((m for m in range(1, k + 1) if cumulative[m - 1] >= top_p), k)
    else:
        kept = max(1, sum(1 for m in range(1, k + 1) if cumulative[m - 1] <= top_p))
    q[kept:] = 0.0
    q /= q.sum()
    out = np.zeros(VOCAB)
    out[order] = q
    return out


@functools.partial(jax.jit, static_argnames=("n",))
def _draw(temperature, top_k, top_p, key, n):
    def full(value, dtype):
        return jnp.full((n,), value, dtype)

    return draw_tokens(
        jnp.broadcast_to(jnp.asarray(LOGITS), (n, VOCAB)),
        jnp.broadcast_to(key, (n, 2)),
        jnp.arange(n, dtype=jnp.int32),  # tokens 0 … n − 1 of the request
        full(temperature, jnp.float32),
        full(top_k, jnp.int32),
        full(top_p, jnp.float32),
    )


def counts(temperature: float, top_k: int, top_p: float, seed: int) -> np.ndarray:
    tokens = _draw(temperature, top_k, top_p, jnp.asarray(request_key(seed)), n=N)
    return np.bincount(np.asarray(tokens), minlength=VOCAB)


def chi_square_p_value(observed: np.ndarray, probabilities: np.ndarray) -> float:
    """Pearson's test of `observed` counts against `probabilities` over the tokens they keep;
    a count where the probability is 0 makes the fit impossible (0.0)."""
    kept = probabilities > 0
    if observed[~kept].any():
        return 0.0
    want = N * probabilities[kept]
    assert want.min() >= 5, "too few expected draws for the chi-square approximation"
    statistic = float(np.sum((observed[kept] - want) ** 2 / want))
    return float(stats.chi2.sf(statistic, df=int(kept.sum()) - 1))


SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),  # plain softmax
    (0.5, 0, 1.0),  # sharper
    (2.0, 0, 1.0),  # flatter
    (1.0, 3, 1.0),  # top-k
    (1.0, VOCAB, 1.0),  # k = the vocabulary: keeps all
    (1.0, 3 * VOCAB, 1.0),  # k beyond it: keeps all
    (1.0, 0, 0.8),  # top-p
    (0.6, 0, 0.9),  # top-p on a sharpened distribution
    (0.7, 5, 0.8),  # all three: top-p over the top-k renormalised distribution
    (1.5, 6, 0.95),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_draws_follow_the_masked_renormalised_distribution(temperature, top_k, top_p):
    probabilities = expected(temperature, top_k, top_p)
    seed = SETTINGS.index((temperature, top_k, top_p)) + 1
    observed = counts(temperature, top_k, top_p, seed)
    assert observed.sum() == N
    masked = np.flatnonzero(probabilities == 0)
    assert observed[masked].tolist() == [0] * masked.size, "a masked token was drawn"
    p_value = chi_square_p_value(observed, probabilities)
    assert p_value > ALPHA, (
        f"chi-square p = {p_value:.2e}: counts {observed.tolist()}, "
        f"expected {np.round(N * probabilities, 1).tolist()}"
    )


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.0, 0, 1.0), (0.0, 3, 0.5), (1.0, 1, 1.0), (2.0, 0, 0.05), (1.0, 4, 0.01)],
)
def test_degenerate_settings_draw_the_argmax(temperature, top_k, top_p):
    observed = counts(temperature, top_k, top_p, seed=99)
    assert observed[ARGMAX] == N


def test_the_check_rejects_a_nearby_wrong_distribution():
    sharp = counts(0.5, 0, 1.0, seed=SETTINGS.index((0.5, 0, 1.0)) + 1)
    assert chi_square_p_value(sharp, expected(1.0, 0, 1.0)) < 1e-12  # temperature ignored
    nucleus = counts(1.0, 0, 0.8, seed=SETTINGS.index((1.0, 0, 0.8)) + 1)
    exclusive = expected(1.0, 0, 0.8, inclusive=False)
    boundary = np.flatnonzero((expected(1.0, 0, 0.8) > 0) & (exclusive == 0))
    assert boundary.size == 1 and nucleus[boundary[0]] > 0  # the token that reaches p is drawn
    assert chi_square_p_value(nucleus, exclusive) == 0.0


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.lists(
            st.sampled_from([0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan, 1e30, -0.0]),
            min_size=1,
            max_size=12,
        ),
        min_size=1,
        max_size=4,
    ).filter(lambda rows: len({len(r) for r in rows}) == 1)
)
def test_greedy_tokens_equal_numpys_argmax(rows):
    """The first index of the maximum, ties, infinities and NaNs (the first NaN wins) included,
    as `np.argmax` gives it."""
    logits = np.array(rows, np.float32)
    got = np.asarray(_greedy(logits))
    assert got.dtype == np.int32 and got.tolist() == np.argmax(logits, axis=-1).tolist()


_greedy = jax.jit(greedy_tokens)
