"""``FakeMixedStep``: the fake engines (engine/fake.py) as one node that prefills and decodes,
with ``MixedStep``'s interface (engine/mixed_step.py), so a mixed worker is tested without a
model.

A step is a decode step of the fake decode engine, then, when a prompt is given, the whole
prompt through the fake prefill engine (its ``prefill_s_per_token`` paid at once): the fakes'
tokens are functions of the tokens and the request's key, so they are the disaggregated
cluster's whatever the steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prfaas_jax.engine.api import PromptFill
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams


class FakeMixedStep:
    """A fake prefill engine and a fake decode engine, stepped as one (module docstring)."""

    def __init__(self, prefill: FakePrefillEngine, decode: FakeDecodeEngine) -> None:
        self.prefill, self.decode = prefill, decode

    def start_fill(self, tokens: Sequence[int], sampling: SamplingParams = GREEDY) -> PromptFill:
        """A prompt to absorb through ``advance``; no working state until it is in."""
        return PromptFill(np.asarray(tokens, np.int32), sampling, state=None)

    def advance(self, fill: PromptFill | None) -> list[tuple[int, int]]:
        """A decode step, then ``fill``'s whole prompt (``MixedStep.advance``)."""
        made = self.decode.step()
        if fill is not None:
            result = self.prefill.prefill(
                fill.tokens.tolist(), sampling=fill.sampling, max_len=self.decode.max_len
            )
            fill.state, fill.first_token = result.state, result.first_token
            fill.done = fill.tokens.size
        return made
