"""MoE routing and combination against a dense per-token computation written here in NumPy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prfaas_jax.config import MoeConfig, MoeScoring
from prfaas_jax.model.mlp import MoE


def _silu(x):
    return x / (1 + np.exp(-x))


def _dense_oracle(p, moe: MoeConfig, x):
    """Every token: score all experts, pick top-k, run each picked expert densely, combine."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    out = np.zeros_like(x, dtype=np.float64)
    for n, token in enumerate(np.asarray(x, np.float64)):
        logits = token @ p["router"]
        if moe.scoring is MoeScoring.SOFTMAX:
            scores = np.exp(logits - logits.max())
            scores /= scores.sum()
        else:
            scores = 1 / (1 + np.exp(-logits))
        select = scores + (p["score_bias"] if moe.use_score_bias else 0.0)
        chosen = np.argsort(-select, kind="stable")[: moe.top_k]
        weights = scores[chosen]
        if moe.renormalize:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights * moe.routed_scale, strict=True):
            hidden = _silu(token @ p["experts_gate"][e]) * (token @ p["experts_up"][e])
            out[n] += w * (hidden @ p["experts_down"][e])
        if moe.num_shared_experts:
            s = p["shared"]
            out[n] += (_silu(token @ s["gate"]) * (token @ s["up"])) @ s["down"]
    return out


BASE = MoeConfig(num_experts=6, top_k=2, expert_dim=8, num_shared_experts=1)


@pytest.mark.parametrize(
    "moe",
    [
        BASE,
        dataclasses.replace(BASE, top_k=1, num_shared_experts=0, renormalize=False),
        dataclasses.replace(
            BASE, top_k=3, scoring=MoeScoring.SIGMOID, use_score_bias=True, routed_scale=2.5
        ),
    ],
    ids=["softmax-top2-shared", "top1-plain", "sigmoid-bias-top3"],
)
def test_moe_matches_dense_computation(moe):
    _check_against_oracle(moe, (3, 7))


# Each form of model/mlp.py's _cpu_experts: 1 token's 2 pairs take the tile loop, 3 tokens' 6 (as
# many as the experts) every expert on every token, and 40 tokens' 80 pairs (over 64) the tile
# loop again.
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_moe_of_a_few_tokens_matches_dense_computation(tokens):
    _check_against_oracle(BASE, (tokens, 1))


def _check_against_oracle(moe: MoeConfig, batch_shape: tuple[int, int]) -> None:
    dim = 10
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    p = {
        "router": jax.random.normal(next(keys), (dim, moe.num_experts)),
        "experts_gate": jax.random.normal(next(keys), (moe.num_experts, dim, moe.expert_dim)) / 3,
        "experts_up": jax.random.normal(next(keys), (moe.num_experts, dim, moe.expert_dim)) / 3,
        "experts_down": jax.random.normal(next(keys), (moe.num_experts, moe.expert_dim, dim)) / 3,
        "score_bias": jax.random.normal(next(keys), (moe.num_experts,)) * 0.3,
        "shared": {
            "gate": jax.random.normal(next(keys), (dim, moe.expert_dim)) / 3,
            "up": jax.random.normal(next(keys), (dim, moe.expert_dim)) / 3,
            "down": jax.random.normal(next(keys), (moe.expert_dim, dim)) / 3,
        },
    }
    x = jax.random.normal(next(keys), (*batch_shape, dim))
    graph, state = nnx.split(MoE(dim, moe, jnp.float32, rngs=nnx.Rngs(0)))
    got = nnx.merge(graph, {name: p[name] for name in state})(x)
    want = _dense_oracle(p, moe, np.asarray(x).reshape(-1, dim)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
