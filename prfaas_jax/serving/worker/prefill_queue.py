"""`PrefillQueue`: a prefill worker's engine, shared by the requests waiting for it; it takes
several queued short prompts into one `prefill_batch` call.

Also exposes `QueuedPrefill`, one request as the queue sees it, and `WithdrawnError`, what
`run` raises for a request cancelled while it waited.

A request's thread hands its `QueuedPrefill` to `PrefillQueue.run` and gets back its prefill
output, or the exception its own part raised. Whoever finds the engine free takes it: its own
request first, then — when that one is batchable — other batchable requests already waiting,
in arrival order, while the batch stays within `max_rows` rows and `max_tokens` prompt tokens.
It never waits for more to arrive: a request alone on an idle node runs at once, by itself
(`alone`: prefill through the prefix cache, chunk by chunk), as every request does with
`max_rows = 1`. A batch whose calls are not all compiled yet (`ready`: the worker compiles
them while it serves, serving/worker/batch_warmup.py) is not formed: the request runs alone and
the others wait for the engine, each to take it in turn — a one-prompt call is compiled before
the worker serves, so no request waits for a compile. The requests it took run in one
`prefill_batch` call, whose rows are what
batch-1 prefill gives — the first token exactly, the state to fp32 rounding
(engine/batched_prefill.py); the others' threads wake with their result.

A request is batchable when the engine has `prefill_batch`, its prompt fits one chunk (a
longer one chunks and streams chunk by chunk, alone) and no cached or fetched prefix covers
any of it (a hit computes only the rest, alone): the service decides (`batchable`), when the
request is taken. For such a prompt alone, `on_chunk` sees the whole state once, at its end,
and the prefix cache keeps that state: a batched row does the same (`row_done`), after the call.

Each request keeps its own part: `start` (the engine is now this request's: its push opens)
runs for each request taken before the call, `row_done` after it, and what one of them raises
fails that request alone; an error of the call itself fails every request in it. A request
cancelled while it waits (`stopped`; the service calls `wake`) leaves the queue at once, and is
never taken into another's batch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

from prfaas_jax.engine.api import PrefillEngineLike, PrefillOutput
from prfaas_jax.engine.sampling_params import SamplingParams


class WithdrawnError(Exception):
    """The request was cancelled while it waited for the engine: it never took it."""


@dataclasses.dataclass(eq=False)
class QueuedPrefill:
    """One request's prompt and its part of a prefill (module docstring)."""

    tokens: list[int]
    sampling: SamplingParams
    start: Callable[[], None]  # the engine is this request's turn: raises to drop it
    alone: Callable[[], PrefillOutput]  # after `start`: prefill it by itself
    row_done: Callable[[PrefillOutput], None]  # after a batched call: its chunk, its cache
    batchable: Callable[[], bool]
    stopped: Callable[[], bool]  # cancelled: not taken into another request's batch
    _result: PrefillOutput | None = None
    _error: BaseException | None = None
    _done: bool = False

    def _settle(self, work: Callable[[], PrefillOutput]) -> None:
        try:
            self._result = work()
        except BaseException as err:  # re-raised in the request's own thread
            self._error = err
        self._done = True

    def _outcome(self) -> PrefillOutput:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class PrefillQueue:
    """The engine's one user at a time; batches of waiting short prompts (module docstring)."""

    def __init__(
        self,
        *,
        max_rows: int = 1,
        max_tokens: int = 4096,
        max_len: int,
        ready: Callable[[Sequence[int]], bool] | None = None,
    ) -> None:
        """`max_rows` prompts, `max_tokens` prompt tokens at most per batched call; `max_len`:
        the capacity of every state the calls return; `ready(lengths)`: whether a batched call
        of prompts of those lengths may run now (None: always)."""
        self.max_rows, self.max_tokens, self.max_len = max_rows, max_tokens, max_len
        self.ready = ready
        self._cond = threading.Condition()
        self._pending: list[QueuedPrefill] = []
        self._busy = False
        self.calls: collections.Counter[int] = collections.Counter()  # rows -> engine calls

    @property
    def waiting(self) -> int:
        """Requests waiting for the engine, not yet taken."""
        with self._cond:
            return len(self._pending)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine for something else (scoring a prompt), once no prefill holds it."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def wake(self) -> None:
        """Let the waiting requests look at themselves again: call when one is cancelled."""
        with self._cond:
            self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def run(self, request: QueuedPrefill, engine: PrefillEngineLike) -> PrefillOutput:
        """Prefill `request` on `engine`, alone or in a batch that another request's thread
        or this one runs; returns its output or raises what its part raised."""
        with self._cond:
            self._pending.append(request)
            while self._busy and not request._done and not request.stopped():
                self._cond.wait()
            if not request._done and self._busy:  # stopped while it waited: it leaves now
                self._pending.remove(request)
                raise WithdrawnError(f"cancelled while {len(self._pending)} others waited")
            taken = [] if request._done else self._take(request, engine)
            if taken:  # the engine was free: this thread runs them
                self._busy = True
        if taken:
            try:
                self._run(taken, engine)
            finally:
                self._release()
        return request._outcome()

    def _take(self, first: QueuedPrefill, engine: PrefillEngineLike) -> list[QueuedPrefill]:
        """`first` and the waiting requests that join its batch, out of the queue."""
        self._pending.remove(first)
        taken = [first]
        batched = self.max_rows > 1 and hasattr(engine, "prefill_batch")
        if not batched or not first.batchable():
            return taken
        tokens = len(first.tokens)
        for other in self._pending:
            if len(taken) == self.max_rows:
                break
            if tokens + len(other.tokens) > self.max_tokens or other.stopped():
                continue
            if other.batchable():
                taken.append(other)
                tokens += len(other.tokens)
        if len(taken) > 1 and self.ready and not self.ready([len(r.tokens) for r in taken]):
            return [first]  # the others keep their place
        for other in taken[1:]:
            self._pending.remove(other)
        return taken

    def _run(self, taken: Sequence[QueuedPrefill], engine: PrefillEngineLike) -> None:
        started = []
        for request in taken:
            try:
                request.start()
            except BaseException as err:  # re-raised in the request's own thread
                request._error, request._done = err, True
            else:
                started.append(request)
        if len(started) == 1:
            self.calls[1] += 1
            started[0]._settle(started[0].alone)
        if len(started) < 2:
            return
        self.calls[len(started)] += 1
        try:
            outputs = engine.prefill_batch(  # type: ignore[attr-defined]
                [r.tokens for r in started],
                max_len=self.max_len,
                max_batch_tokens=self.max_tokens,
                sampling=[r.sampling for r in started],
            )
        except BaseException as err:
            for request in started:
                request._settle(lambda err=err: _raise(err))
            return
        for request, output in zip(started, outputs, strict=True):
            request._settle(lambda r=request, o=output: _row(r, o))


def _row(request: QueuedPrefill, output: PrefillOutput) -> PrefillOutput:
    request.row_done(output)
    return output


def _raise(err: BaseException) -> PrefillOutput:
    raise err
