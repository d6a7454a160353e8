"""``ChunkBudget``: how many prompt tokens a mixed step (engine/mixed_step.py) carries beside
its decode rows, chosen from the step costs it has measured so that a step costs at most
``1 + share`` decode steps alone.

A chunk runs as a block of one of ``sizes`` (powers of two up to ``max_tokens``, which is
always a size: one compile per size). For each decode batch (``rows``, as the decode engine
runs it) the budget keeps the last ``window`` costs of a decode step alone and of a mixed step
per block size, as the caller reports them, and reads each as their median: one step that the
machine stalled (another process took the core) moves no choice. A step's block is the largest
size whose mixed cost stays within ``(1 + share) ×`` the decode step's, and never less than the
smallest size: a waiting prompt advances every step. A size not yet measured is assumed to cost
what the next smaller one does, so it is tried once and then kept or dropped by its own cost; a
size not measured for ``stale_after`` steps is tried again the same way, so the choice follows a
machine whose speed changes. A decode cost never measured, or not for ``stale_after`` steps, is
asked for (``needs_decode_cost``): the caller runs that step without a chunk. With ``share``
None the budget is in tokens only: every block is ``max_tokens``. With no decode row there is
no time between tokens to keep, and the block is ``max_tokens`` too.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

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
class _Costs:
    seconds: collections.deque  # the last `window` measurements
    at: int  # the budget's step count when last measured

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


class ChunkBudget:
    """Block sizes for a mixed step from measured step costs (module docstring)."""

    def __init__(
        self,
        max_tokens: int,
        *,
        share: float | None = 0.5,
        min_tokens: int = 1,
        window: int = 8,
        stale_after: int = 64,
    ) -> None:
        if share is not None and share <= 0:
            raise EngineError(f"share must be > 0, got {share}")
        if window < 1:
            raise EngineError(f"window must be ≥ 1, got {window}")
        self.sizes = block_sizes(max_tokens, min_tokens)
        self.max_tokens, self.share = max_tokens, share
        self.window, self.stale_after = window, stale_after
        self._decode: dict[int, _Costs] = {}  # rows -> a decode step alone
        self._mixed: dict[tuple[int, int], _Costs] = {}  # (rows, block) -> a mixed step
        self._steps = 0

    def _due(self, cost: _Costs | None) -> bool:
        """Never measured, or not for ``stale_after`` steps."""
        return cost is None or self._steps - cost.at > self.stale_after

    def _observe(self, table: dict, key: object, seconds: float) -> None:
        self._steps += 1
        cost = table.setdefault(key, _Costs(collections.deque(maxlen=self.window), 0))
        cost.seconds.append(seconds)
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
        return timed and self._due(self._decode.get(rows))

    def limit(self, rows: int) -> int:
        """The largest block a step over ``rows`` decode rows may carry now."""
        if self.share is None or rows == 0:
            return self.max_tokens
        decode = self._decode.get(rows)
        if decode is None:
            return self.sizes[0]
        allowed, estimate = self.sizes[0], decode.median
        for size in self.sizes:
            cost = self._mixed.get((rows, size))
            if not self._due(cost):
                assert cost is not None
                estimate = cost.median
            if estimate > (1 + self.share) * decode.median:
                break
            allowed = size
        return allowed

    def block(self, rows: int, remaining: int) -> int:
        """The block of the next step for a prompt with ``remaining`` tokens to absorb: the
        smallest size that holds ``min(remaining, limit)``; the chunk takes that many tokens."""
        want = min(remaining, self.limit(rows))
        return next(size for size in self.sizes if size >= want)
