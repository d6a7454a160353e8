"""Token ids to text as they stream in, with OpenAI ``stop`` strings.

A character may span several tokens, so `TextStream` decodes through the served tokenizer's
incremental decoder (engine/tokenizer.py; the byte-level one by default), which holds back what
is not final yet; the concatenation of its pieces equals the tokenizer's ``decode`` of all the
ids (for the byte tokenizer invalid bytes and ids ≥ 256 become U+FFFD alike). With stop strings
it also holds back the longest tail that could still begin one, and ends the text just before
the first stop string that appears (which is not returned, as OpenAI does).
"""

from __future__ import annotations

from collections.abc import Sequence

from prfaas_jax.engine.tokenizer import ByteDetokenizer, Detokenizer


class TextStream:
    """Feed token ids with `push`; each call returns the text now safe to send. `stopped`
    turns true once a stop string appeared; `finish` returns what was held back."""

    def __init__(self, stop: Sequence[str] = (), detokenizer: Detokenizer | None = None) -> None:
        self._decoder = detokenizer if detokenizer is not None else ByteDetokenizer()
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not yet sent (a possible stop-string start)
        self.stopped = False

    def _first_stop(self) -> int:
        found = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        return min(found, default=-1)

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._pending += self._decoder.push(token_ids)
        cut = self._first_stop()
        if cut >= 0:
            self.stopped = True
            text, self._pending = self._pending[:cut], ""
            return text
        text = self._pending[: max(len(self._pending) - self._hold, 0)]
        self._pending = self._pending[len(text) :]
        return text

    def finish(self) -> str:
        """The held-back text, an unfinished character as the tokenizer decodes it (U+FFFD for
        the byte tokenizer), up to a stop string."""
        if self.stopped:
            return ""
        self._pending += self._decoder.finish()
        cut = self._first_stop()
        self.stopped = cut >= 0
        text, self._pending = self._pending[: cut if cut >= 0 else None], ""
        return text
