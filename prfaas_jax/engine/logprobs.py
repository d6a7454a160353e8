"""Log-probabilities of tokens, as the engines compute them: `log_softmax_top` (traceable),
`top_width`, `as_token_logprobs` and `token_logprobs` (host values, engine/token_logprobs.py's
`TokenLogprobs`, re-exported with `MAX_TOP_LOGPROBS`).

A token's log-probability is the model's log-softmax of the raw logits at the position before it
(before temperature, top-k or top-p: what the model assigns, as OpenAI's API reports it), with
the ``top`` most likely tokens of that position beside it. The engines compute them only for a
request that asks: `PrefillEngine.score` over a whole prompt, the decode engine per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.engine.token_logprobs import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS  # re-exported
from prfaas_jax.engine.token_logprobs import TokenLogprobs as TokenLogprobs  # re-exported


def log_softmax_top(
    logits_NV: jax.Array, tokens_N: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logprob of each token [N], the k most likely ids [N, k], their logprobs [N, k])``."""
    logprobs = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens_N[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
    return chosen, top_ids.astype(jnp.int32), top_logprobs


_LOG_SOFTMAX_TOP = jax.jit(log_softmax_top, static_argnames=("k",))


def top_width(vocab_size: int) -> int:
    """The compiled top-k width: every request's ``top`` fits in it."""
    return min(MAX_TOP_LOGPROBS, vocab_size)


def as_token_logprobs(
    tokens: np.ndarray, chosen: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray, top: int
) -> list[TokenLogprobs]:
    """Host arrays (one row per position) as `TokenLogprobs`, the first ``top`` alternatives."""
    return [
        TokenLogprobs(
            int(tokens[i]),
            float(chosen[i]),
            tuple(zip(top_ids[i, :top].tolist(), top_logprobs[i, :top].tolist(), strict=True)),
        )
        for i in range(len(tokens))
    ]


def token_logprobs(logits_NV: jax.Array, tokens: np.ndarray, top: int) -> list[TokenLogprobs]:
    """`TokenLogprobs` of ``tokens[i]`` under ``logits_NV[i]``."""
    tokens = np.asarray(tokens, np.int32)
    k = top_width(logits_NV.shape[-1])
    chosen, ids, values = jax.device_get(_LOG_SOFTMAX_TOP(logits_NV, tokens, k=k))
    return as_token_logprobs(tokens, chosen, ids, values, top)
