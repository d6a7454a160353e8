"""Token ids to text as they stream in, with OpenAI ``stop`` strings.

The presets speak the byte tokenizer (engine/tokenizer.py): token ``i`` < 256 is the byte
``i``. A character may span several tokens, so `TextStream` decodes incrementally and holds back
an unfinished UTF-8 sequence until it completes; the concatenation of its pieces equals
``ByteTokenizer.decode`` of all the ids (invalid bytes and ids ≥ 256 become U+FFFD alike). With
stop strings it also holds back the longest tail that could still begin one, and ends the text
just before the first stop string that appears (which is not returned, as OpenAI does).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"


class TextStream:
    """Feed token ids with `push`; each call returns the text now safe to send. `stopped`
    turns true once a stop string appeared; `finish` returns what was held back."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not yet sent (a possible stop-string start)
        self.stopped = False

    def _decode(self, token_ids: Sequence[int]) -> str:
        out, run = [], bytearray()
        for t in token_ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            out.append(self._decoder.decode(bytes(run), final=True) + REPLACEMENT)
            self._decoder.reset()
            run.clear()
        out.append(self._decoder.decode(bytes(run)))
        return "".join(out)

    def _first_stop(self) -> int:
        found = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        return min(found, default=-1)

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._pending += self._decode(token_ids)
        cut = self._first_stop()
        if cut >= 0:
            self.stopped = True
            text, self._pending = self._pending[:cut], ""
            return text
        text = self._pending[: max(len(self._pending) - self._hold, 0)]
        self._pending = self._pending[len(text) :]
        return text

    def finish(self) -> str:
        """The held-back text, an unfinished UTF-8 sequence as U+FFFD (up to a stop string)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        cut = self._first_stop()
        self.stopped = cut >= 0
        text, self._pending = self._pending[: cut if cut >= 0 else None], ""
        return text
