"""``ChunkBudget``: how many prompt tokens a mixed step (engine/mixed_step.py) carries beside
its decode rows, chosen from the step costs it has measured so that a step costs at most
``1 + share`` decode steps alone.

A chunk runs as a block of one of ``sizes`` (powers of two up to ``max_tokens``, which is
always a size: one compile per size). For each decode batch (``rows``, as the decode engine
runs it) the budget keeps a smoothed cost of a decode step alone and of a mixed step per block
size, as the caller reports them. A step's block is the largest size whose mixed cost stays
within ``(1 + share) ×`` the decode step's, and never less than the smallest size: a waiting
prompt advances every step. A size not yet measured is assumed to cost what the next smaller one
does, so it is tried once and then kept or dropped by its own cost; a cost not refreshed for
``stale_after`` steps is forgotten the same way, so the choice follows a machine whose speed
changes. A decode cost never measured, or gone stale, is asked for (``needs_decode_cost``):
the caller runs that step without a chunk. With ``share`` None the budget is in tokens only:
every block is ``max_tokens``. With no decode row there is no time between tokens to keep,
and the block is ``max_tokens`` too.
"""

from __future__ import annotations

import dataclasses

from prfaas_jax.errors import EngineError


def block_sizes(max_tokens: int, min_tokens: int = 1) -> tuple[int, ...]:
    """Powers of two from ``min_tokens`` (rounded up to one) below ``max_tokens``, then
    ``max_tokens``."""
    if not 1 <= min_tokens <= max_tokens:
        raise EngineError(f"need 1 ≤ min_tokens ≤ max_tokens, got {min_tokens}, {max_tokens}")
    size, sizes = 1, []
    while size < max_tokens:
        if size >= min_tokens:
            sizes.append(size)
        size *= 2
    return (*sizes, max_tokens)


@dataclasses.dataclass
class _Cost:
    seconds: float
    at: int  # the budget's step count when last measured


class ChunkBudget:
    """Block sizes for a mixed step from measured step costs (module docstring)."""

    def __init__(
        self,
        max_tokens: int,
        *,
        share: float | None = 0.5,
        min_tokens: int = 1,
        smoothing: float = 0.25,
        stale_after: int = 64,
    ) -> None:
        if share is not None and share <= 0:
            raise EngineError(f"share must be > 0, got {share}")
        if not 0 < smoothing <= 1:
            raise EngineError(f"smoothing must be in (0, 1], got {smoothing}")
        self.sizes = block_sizes(max_tokens, min_tokens)
        self.max_tokens, self.share = max_tokens, share
        self.smoothing, self.stale_after = smoothing, stale_after
        self._decode: dict[int, _Cost] = {}  # rows -> a decode step alone
        self._mixed: dict[tuple[int, int], _Cost] = {}  # (rows, block) -> a mixed step
        self._steps = 0

    def _fresh(self, cost: _Cost | None) -> float | None:
        if cost is None or self._steps - cost.at > self.stale_after:
            return None
        return cost.seconds

    def _observe(self, table: dict, key: object, seconds: float) -> None:
        self._steps += 1
        cost = table.get(key)
        if self._fresh(cost) is None:
            table[key] = _Cost(seconds, self._steps)
        else:
            assert cost is not None
            cost.seconds += self.smoothing * (seconds - cost.seconds)
            cost.at = self._steps

    def observe_decode(self, rows: int, seconds: float) -> None:
        """A decode step alone over ``rows`` rows took ``seconds``."""
        self._observe(self._decode, rows, seconds)

    def observe_mixed(self, rows: int, block: int, seconds: float) -> None:
        """A mixed step (``rows`` decode rows and a ``block``-token chunk) took ``seconds``."""
        self._observe(self._mixed, (rows, block), seconds)

    def needs_decode_cost(self, rows: int) -> bool:
        """Whether the next step over ``rows`` rows should run alone, to measure it."""
        timed = self.share is not None and rows > 0
        return timed and self._fresh(self._decode.get(rows)) is None

    def limit(self, rows: int) -> int:
        """The largest block a step over ``rows`` decode rows may carry now."""
        decode = self._fresh(self._decode.get(rows))
        if self.share is None or rows == 0 or decode is None:
            return self.max_tokens if self.share is None or rows == 0 else self.sizes[0]
        allowed, estimate = self.sizes[0], decode
        for size in self.sizes:
            measured = self._fresh(self._mixed.get((rows, size)))
            estimate = estimate if measured is None else measured
            if estimate > (1 + self.share) * decode:
                break
            allowed = size
        return allowed

    def block(self, rows: int, remaining: int) -> int:
        """The block of the next step for a prompt with ``remaining`` tokens to absorb: the
        smallest size that holds ``min(remaining, limit)``; the chunk takes that many tokens."""
        want = min(remaining, self.limit(rows))
        return next(size for size in self.sizes if size >= want)
