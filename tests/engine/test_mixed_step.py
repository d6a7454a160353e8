"""`MixedStep`: prompts prefilled a chunk per decode step on one node give the tokens of
single-process generation, and a decoding request gets a token after every chunk of a prompt
that arrives.

Oracle: each prompt alone, prefilled in one call (chunk 512) and decoded alone in an engine of
its own.
"""

from __future__ import annotations

import numpy as np
from conftest import preset

from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.generate import decode_alone
from prfaas_jax.engine.mixed_step import MixedStep
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams

MAX_LEN, BUDGET = 64, 16


def test_mixed_steps_give_single_process_tokens_and_interleave():
    cfg, params = preset("tiny")
    cfg = cfg.with_max_len(MAX_LEN)
    mixed = MixedStep(
        PrefillEngine(cfg, params, chunk_len=BUDGET, buckets=(16, MAX_LEN)),
        DecodeEngine(cfg, params, max_slots=2, max_len=MAX_LEN),
        share=None,  # every chunk BUDGET tokens: the interleaving below is fixed
    )
    rng = np.random.default_rng(3)
    asks = [(10, 12, GREEDY), (40, 5, GREEDY), (25, 1, GREEDY)]
    asks.append((20, 6, SamplingParams(temperature=0.9, top_k=8, seed=11)))
    requests = [
        mixed.submit(rng.integers(0, cfg.vocab_size, n).tolist(), new, sampling)
        for n, new, sampling in asks
    ]
    mixed.run()
    first, second, *_ = requests
    # The 40-token prompt runs as 3 chunks, each followed by a decode step of the first request
    # (its tokens 1–3), and only then yields its own first token.
    assert first.times[3] < second.times[0] < first.times[4]
    assert mixed.chunks == 1 + 3 + 2 + 2  # ⌈n / BUDGET⌉ per prompt
    alone_prefill = PrefillEngine(cfg, params, buckets=(16, MAX_LEN))
    alone_decode = DecodeEngine(cfg, params, max_slots=2, max_len=MAX_LEN)  # one slot used
    for request in requests:
        assert request.done and len(request.tokens) == request.max_new_tokens
        assert len(request.times) == len(request.tokens)
        alone = alone_prefill.prefill(request.prompt, sampling=request.sampling, max_len=MAX_LEN)
        expected = [alone.first_token]
        if request.max_new_tokens > 1:
            slot = alone_decode.insert(
                alone.state,
                alone.first_token,
                request.sampling,
                max_new_tokens=request.max_new_tokens - 1,
            )
            expected += decode_alone(alone_decode, slot)
        assert request.tokens == expected
