"""The router's record of one request: `RequestRecord`, `Route` (where its latest attempt was
prefilled), `Failure` (why an attempt failed) and `Outcome` (how the request ended).

A request may take several attempts — a prefill worker or its link dies mid-transfer, a state
arrives corrupt, a decode worker dies mid-stream — and the client must still see each token
exactly once; an attempt a worker refused for good (`Failure.retryable`) is the last. The
record is what makes that possible: the prompt, the budget, the sampling settings, and every
token already streamed to the client. An attempt after k streamed tokens
prefills `prompt + streamed` (all of it is context now), asks for the `max_new_tokens − k`
tokens still owed, and samples from index k of the request's key schedule
(`SamplingParams.first_index`), so greedy or seeded, the client gets the tokens one
uninterrupted run would have produced. Tokens an attempt yields beyond what is owed are cut
off, so no fault can make the stream longer than asked.
"""

from __future__ import annotations

import dataclasses
import enum
import threading

import grpc

from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.serving.transport.messages import is_final

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0


def backoff_s(failures: int) -> float:
    """The pause before the next attempt after `failures` failed ones: 50 ms doubling to 1 s."""
    return min(BACKOFF_BASE_S * 2 ** max(failures - 1, 0), BACKOFF_CAP_S)


class Route(enum.StrEnum):
    """Where a request's latest attempt was prefilled: the `route` label of the router's metrics
    and of each `RequestReport`."""

    NONE = "none"  # not routed yet
    PRFAAS = "prfaas"
    PD = "pd"


class Outcome(enum.StrEnum):
    """How a request ended: the `outcome` label of the router's metrics."""

    OK = "ok"  # every token owed was streamed
    ERROR = "error"  # the attempts ran out, or the router failed it
    CANCELLED = "cancelled"  # the client left before the last token
    REJECTED = "rejected"  # refused at admission: counted apart, never as a finished request


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed attempt: the status it ended with, what the worker said, and whether another
    attempt may succeed (`retryable`)."""

    code: grpc.StatusCode
    details: str
    final: bool = False  # the worker marked its refusal final (messages.abort_final)

    @classmethod
    def of(cls, err: grpc.RpcError) -> Failure:
        return cls(err.code(), err.details() or err.code().name, is_final(err))

    @property
    def retryable(self) -> bool:
        """False for a refusal retrying cannot change: a worker refused the request itself (its
        checks, a prompt past its engine's limit) and said so. Everything else is retried — a
        dead worker or link, a deadline, a full queue, a role switch, and a state the decode
        worker rejects, which may have been damaged on the way (docs/serving.md, "Retries")."""
        return not self.final

    def describe(self) -> str:
        return f"{self.code.name.lower()}: {self.details}"


@dataclasses.dataclass(eq=False)
class RequestRecord:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    received: float  # perf_counter at receipt
    logprobs: int | None = None  # alternatives per new token when its log-probabilities are asked
    prompt_logprobs: bool = False  # the prompt's log-probabilities asked
    prompt_scored: bool = False  # and sent
    wire_precision: str = ""  # asked for its PrfaaS attempts (GenerateRequest.wire_precision)
    streamed: list[int] = dataclasses.field(default_factory=list)
    attempts: int = 0
    route: Route = Route.NONE
    ttft_s: float | None = None
    _calls: tuple = ()
    _cancelled: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def context(self) -> list[int]:
        """What the next attempt prefills: the prompt and every token already streamed."""
        return self.prompt + self.streamed

    @property
    def owed(self) -> int:
        return self.max_new_tokens - len(self.streamed)

    def attempt_sampling(self) -> SamplingParams:
        return dataclasses.replace(self.sampling, first_index=len(self.streamed))

    def take(self, tokens: list[int]) -> list[int]:
        """Record the tokens an attempt produced, cut to what is still owed; returns them."""
        tokens = tokens[: self.owed]
        self.streamed.extend(tokens)
        return tokens

    def track(self, *calls: grpc.Future) -> None:
        """The current attempt's calls, cancelled if the client goes away."""
        with self._lock:
            self._calls = calls
            cancelled = self._cancelled
        if cancelled:
            for call in calls:
                call.cancel()

    def cancel(self) -> None:
        """The client went away: stop the current attempt (frees its slot and transfer)."""
        with self._lock:
            self._cancelled = True
            calls = self._calls
        for call in calls:
            call.cancel()

    @property
    def cancelled(self) -> bool:
        with self._lock:
            return self._cancelled
