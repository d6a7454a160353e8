"""`PushDecoder`: a pushed state decoded while it arrives.

Each frame a `PushState` stream brings is placed into the state being built as soon as the
stream has moved two frames past it (`codec.StreamDecoder`), so the decode worker holds at most
two frames of a push and the memory a frame arrived in is reused for the next. The last two
frames of a complete push, its trailer and its handoff frame, wait for the stream's end: a
striped push's other stripes bring data frames that go before the trailer (`finish`). Malformed
frames raise `StateDecodeError` as they are placed, so a bad stream is refused before it is
read to the end. On a data connection (serving/transfer/data_path.py) a data frame's payload
may be received straight into the state (`place`), so it is never held at all.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.decoder import PlacedFrame
from prfaas_jax.engine.codec.format import data_prefix
from prfaas_jax.engine.codec.handoff import Handoff, is_handoff_frame, parse_handoff
from prfaas_jax.engine.codec.layout import KvPrefix
from prfaas_jax.model.state import ModelState

_HELD = 2  # the trailer and the handoff frame


class PushDecoder:
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        self.decoder = codec.StreamDecoder(cfg, max_len=max_len)
        self.frames = 0  # taken so far
        self._held: collections.deque[bytes] = collections.deque()

    def take(self, frame: bytes | PlacedFrame) -> None:
        """The stream's next frame; the one two before it is placed now (a `PlacedFrame`, whose
        payload `place` had received into the state, is checked at once)."""
        self.frames += 1
        if isinstance(frame, PlacedFrame):
            self.decoder.feed(frame)
            return
        self._held.append(frame)
        if len(self._held) > _HELD:
            self.decoder.feed(self._held.popleft())

    def place(self, prefix: memoryview, frame_bytes: int) -> PlacedFrame | None:
        """Where the next frame's payload may be received straight into the state (a data
        connection, serving/transfer/data_path.py): if it is a data frame, the frames held
        so far go to the decoder first, in order, then `StreamDecoder.target` says. None: take
        the frame whole (the trailer and the handoff frame always are, and wait as ever)."""
        if data_prefix(prefix) is None:
            return None
        while self._held:
            self.decoder.feed(self._held.popleft())
        return self.decoder.target(prefix, frame_bytes)

    @property
    def ends_with_handoff(self) -> bool:
        """Whether the last frame taken is a handoff frame (a push that was not cut)."""
        return bool(self._held) and is_handoff_frame(self._held[-1])

    def handoff(self, others: Iterable[bytes] = ()) -> Handoff:
        """Places ``others`` (a striped push's other data frames) and the trailer; the handoff
        frame that ended the stream, checked against its header."""
        for frame in others:
            self.decoder.feed(frame)
        if not self.frames:
            raise codec.StateDecodeError("no frames: a state stream starts with a header frame")
        if self.frames < 2:
            self.decoder.feed(self._held.popleft())  # the header: its own errors come first
            raise codec.StateDecodeError(
                "the stream has no handoff frame (first token) after its header"
            )
        if not self._held:  # the last frame was a data frame, received in place
            raise codec.StateDecodeError(
                "the stream ends with a data frame: no trailer and handoff frame after it"
            )
        *rest, last = self._held
        for frame in rest:
            self.decoder.feed(frame)
        header = self.decoder.header
        assert header is not None  # the first frame fed was the header
        return parse_handoff(bytes(last), header.stream_id)

    @property
    def payload_nbytes(self) -> int:
        """The state's tensor bytes the stream carried (its header's count)."""
        header = self.decoder.header
        return 0 if header is None else header.payload_nbytes

    def state(self, base: KvPrefix | None) -> ModelState:
        """The decoded state, once `handoff` placed everything (``base``: the receiver's rows
        of an increment's leading positions)."""
        return self.decoder.finish(base)
