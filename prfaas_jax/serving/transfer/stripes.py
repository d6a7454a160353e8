"""Striped state transfers: `StripeSet`, where a decode worker gathers the streams of one state.

A PrfaaS worker may stripe a state over N `PushState` streams, each on a channel — a TCP
connection — of its own (`[link] streams`; paper §3.3: several connections, so one TCP window
does not cap a long link). Stream 0, the *primary*, carries the header, its share of the data
frames, the trailer and the handoff; streams 1 … N − 1 carry the other data frames (every data
frame places itself: docs/wire-format.md) and end with a `last` message. Each stream's first
message names the request and its stripe (`StateChunk.stripe`, `stripes`).

A secondary stream deposits its frames here when it ends on purpose (`deposit`), or marks the
transfer failed when it is cut (`fail`). The primary, once its own frames are in, waits for the
others (at most `timeout_s`) and gets their data frames (`others`, which go before its trailer),
or the state's frames in decodable order — header, every data frame, trailer, handoff
(`gather`) — or a `StripeError` saying which stripe is missing or failed.
Parts that no primary claims are dropped after `timeout_s`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from prfaas_jax.policy.link_capacity import FrameArrival
from prfaas_jax.serving.transfer.api import StripeError

MAX_STRIPES = 16


@dataclasses.dataclass
class _Parts:
    stripes: int
    frames: dict[int, list[bytes]] = dataclasses.field(default_factory=dict)
    arrivals: list[FrameArrival] = dataclasses.field(default_factory=list)
    failed: str | None = None
    at: float = dataclasses.field(default_factory=time.monotonic)


class StripeSet:
    """The secondary streams' frames of the striped transfers in progress (module docstring)."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._parts: dict[str, _Parts] = {}

    def _entry(self, request_id: str, stripes: int) -> _Parts:
        """The request's parts (caller holds the lock); StripeError on a count mismatch."""
        now = time.monotonic()
        for stale in [r for r, p in self._parts.items() if now - p.at > self.timeout_s]:
            del self._parts[stale]
        parts = self._parts.setdefault(request_id, _Parts(stripes))
        if parts.stripes != stripes:
            raise StripeError(
                f"{request_id}: a stream says {stripes} stripes, another {parts.stripes}"
            )
        return parts

    def deposit(
        self,
        request_id: str,
        stripe: int,
        stripes: int,
        frames: list[bytes],
        arrivals: list[FrameArrival] | None = None,
    ) -> None:
        """Stripe ``stripe`` (≥ 1) of ``stripes`` ended on purpose with ``frames`` (which
        arrived as ``arrivals`` say)."""
        with self._cv:
            parts = self._entry(request_id, stripes)
            if stripe in parts.frames:
                parts.failed = f"stripe {stripe} of {stripes} arrived twice"
            else:
                parts.frames[stripe] = frames
                parts.arrivals += arrivals or []
            self._cv.notify_all()
        if parts.failed:
            raise StripeError(f"{request_id}: {parts.failed}")

    def fail(self, request_id: str, stripes: int, reason: str) -> None:
        """A stripe of the request was cut: its primary stops waiting."""
        with self._cv:
            with contextlib.suppress(StripeError):  # a mismatched count fails it anyway
                self._entry(request_id, stripes).failed = reason
            self._cv.notify_all()

    def gather(
        self,
        request_id: str,
        stripes: int,
        own: list[bytes],
        own_arrivals: list[FrameArrival] | None = None,
    ) -> tuple[list[bytes], list[FrameArrival]]:
        """The primary's ``own`` frames (header, data frames, trailer, handoff) with every other
        stripe's data frames, in decodable order, once all are in; and every stripe's arrivals
        in time order (the link is timed over them together)."""
        others, arrivals = self.others(request_id, stripes, len(own), own_arrivals)
        return [*own[:-2], *others, *own[-2:]], arrivals

    def others(
        self,
        request_id: str,
        stripes: int,
        own_count: int,
        own_arrivals: list[FrameArrival] | None = None,
    ) -> tuple[list[bytes], list[FrameArrival]]:
        """Every other stripe's data frames, once all are in (they go before the primary's
        trailer), for a primary that carried ``own_count`` frames; and every stripe's arrivals
        in time order."""
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            parts = self._entry(request_id, stripes)
            while len(parts.frames) < stripes - 1 and parts.failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, stripes)) - set(parts.frames))
                    parts.failed = f"stripes {missing} of {stripes} did not arrive"
                    break
                self._cv.wait(left)
            del self._parts[request_id]
        if parts.failed is not None:
            raise StripeError(f"{request_id}: {parts.failed}")
        if own_count < 3:
            raise StripeError(f"{request_id}: stripe 0 carries {own_count} frames, fewer than 3")
        others = [frame for k in sorted(parts.frames) for frame in parts.frames[k]]
        arrivals = sorted([*(own_arrivals or []), *parts.arrivals], key=lambda a: a.at)
        return others, arrivals
