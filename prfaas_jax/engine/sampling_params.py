"""A request's sampling settings: ``SamplingParams`` (validated) and ``GREEDY``.

Kept free of JAX: the router and the wire messages carry these settings without importing it;
`prfaas_jax.engine.sampling` draws the tokens.
"""

from __future__ import annotations

import dataclasses
import math
import struct

from prfaas_jax.errors import UserError

INT32_MAX = 2**31 - 1  # the integer knobs travel to the device as int32


def _as_float32(value: float) -> float | None:
    """``value`` as the device sees it (float32), or None when that is not a finite number."""
    try:
        if not math.isfinite(value):
            return None
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # beyond float32, or an int beyond any float (JSON can hold one)
        return None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's settings; UserError unless every knob is finite and in range."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off; ≥ the vocabulary size keeps every token, so also off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0
    # Index of the request's first token in its key schedule: 0 for a new request; a request
    # resumed after k delivered tokens starts at k and so draws the tokens it would have drawn.
    first_index: int = 0

    def __post_init__(self) -> None:
        # Proto floats and JSON numbers can be NaN or ±inf: NaN passes every comparison below,
        # and an infinite temperature scales the logits to NaN. The float knobs are checked as
        # the device's float32 sees them: a tiny float64 top_p would reach it as 0, keeping
        # no token at all.
        device = {name: _as_float32(getattr(self, name)) for name in ("temperature", "top_p")}
        for name, value in device.items():
            if value is None:
                raise UserError(f"{name} must be a finite float32, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise UserError(f"temperature must be ≥ 0, got {self.temperature}")
        if not 0 <= self.top_k <= INT32_MAX:
            raise UserError(f"top_k must be in [0, 2**31), got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise UserError(f"seed must be in [0, 2**64), got {self.seed}")
        if not (device["top_p"] > 0.0 and self.top_p <= 1.0):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        # The key-schedule index is int32 on the device and the decode engine adds one.
        if not 0 <= self.first_index < INT32_MAX:
            raise UserError(f"first_index must be in [0, 2**31 − 1), got {self.first_index}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()
