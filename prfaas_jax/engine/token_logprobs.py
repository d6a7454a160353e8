"""One scored position, as the engines report it and the serving plane carries it: `TokenLogprobs`
and `MAX_TOP_LOGPROBS`.

Kept free of JAX, like `sampling_params.py`: the router and the front door carry and check these
without importing it; engine/logprobs.py computes them.
"""

from __future__ import annotations

import dataclasses

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs; one compiled width serves every request


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One position: its token, that token's log-probability, and the most likely tokens there
    (``(token, logprob)``, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
