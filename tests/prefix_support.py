"""Helpers for the prefix-cache tests on real presets: `absorb` (prefill in fixed-shape
segments, so every call reuses one compiled program) and `random_prompt`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from conftest import jit_prefill

SEG = 16  # tokens per prefill call


def absorb(params, cfg, tokens, state):
    """Prefill ``tokens`` in segments padded to SEG (one compiled shape); all logits, state."""
    outs = []
    for start in range(0, len(tokens), SEG):
        seg = tokens[start : start + SEG]
        padded = jnp.asarray([seg + [0] * (SEG - len(seg))], jnp.int32)
        logits, state = jit_prefill(
            params, cfg, padded, state, valid_len=jnp.array([len(seg)], jnp.int32)
        )
        outs.append(logits[0, : len(seg)])
    return jnp.concatenate(outs), state


def random_prompt(seed, n, vocab):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]
