"""The router's per-request record (resume point, sampling index, cancellation), its backoff,
and the stall watchdog, with a fake clock."""

from __future__ import annotations

import threading

from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.serving.router.record import RequestRecord, backoff_s
from prfaas_jax.serving.transport.watchdog import Watchdog


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> bool:
        self.cancelled += 1
        return True


def test_record_resumes_where_the_client_stopped():
    record = RequestRecord("r", [5, 6, 7], 5, SamplingParams(temperature=0.5, seed=3), 0.0)
    assert record.context == [5, 6, 7] and record.owed == 5
    assert record.attempt_sampling().first_index == 0
    assert record.take([1, 2]) == [1, 2]
    # The next attempt prefills prompt + streamed tokens and samples from index 2.
    assert record.context == [5, 6, 7, 1, 2] and record.owed == 3
    sampling = record.attempt_sampling()
    assert (sampling.first_index, sampling.seed, sampling.temperature) == (2, 3, 0.5)
    # Surplus tokens from an attempt are cut: the stream never exceeds the budget.
    assert record.take([3, 4, 9, 9]) == [3, 4, 9]
    assert record.owed == 0 and record.streamed == [1, 2, 3, 4, 9]


def test_cancel_reaches_current_and_later_calls():
    record = RequestRecord("r", [1], 2, SamplingParams(), 0.0)
    first = FakeCall()
    record.track(first)
    record.cancel()
    assert first.cancelled == 1 and record.cancelled
    late = FakeCall()  # an attempt started as the client left
    record.track(late)
    assert late.cancelled == 1


def test_backoff_doubles_to_a_cap():
    assert [backoff_s(k) for k in (0, 1, 2, 3, 5, 10)] == [0.05, 0.05, 0.1, 0.2, 0.8, 1.0]


def test_watchdog_cancels_only_silent_calls():
    now = [100.0]
    dog = Watchdog(period_s=3600, clock=lambda: now[0])
    quiet, busy, closed = FakeCall(), FakeCall(), FakeCall()
    w_quiet, w_busy = dog.watch(quiet, 2.0), dog.watch(busy, 2.0)
    dog.close(dog.watch(closed, 2.0))
    now[0] = 101.5
    w_busy.touch()
    assert dog.check() == 0
    now[0] = 102.5  # quiet: 2.5 s silent; busy: 1.0 s
    assert dog.check() == 1
    assert (quiet.cancelled, busy.cancelled, closed.cancelled) == (1, 0, 0)
    assert w_quiet.fired and not w_busy.fired
    now[0] = 110.0
    assert dog.check() == 1 and busy.cancelled == 1
    assert dog.check() == 0  # a fired watch is dropped, never cancelled twice
    assert quiet.cancelled == 1


def test_a_watch_kept_alive_waits_until_its_signs_of_life_stop():
    """A decode stream silent while its prompt prefills: the watch counts from the later of its
    last touch and the last sign of life `alive` reports; None (the prefill is over) or a sign
    that stops advancing (a worker stopped answering) leaves only the touches."""
    now = [100.0]
    dog = Watchdog(period_s=3600, clock=lambda: now[0])
    seen: list[float | None] = [None]
    call = FakeCall()
    watch = dog.watch(call, 2.0, alive=lambda: seen[0])
    for t in (101.0, 102.0, 103.0, 104.0, 105.0):  # 5 s of prefill, the workers answering
        now[0], seen[0] = t + 0.5, t
        assert dog.check() == 0
    now[0] = 107.4  # 2.4 s since the last answer: the prefill worker stopped answering
    assert dog.check() == 1 and watch.fired and call.cancelled == 1
    done = dog.watch(FakeCall(), 2.0, alive=lambda: None)  # the prefill is over
    now[0] = 108.0
    done.touch()  # its reply came: progress
    now[0] = 109.5
    assert dog.check() == 0
    now[0] = 110.5  # 2.5 s silent since the touch, `alive` saying nothing
    assert dog.check() == 1 and done.fired


def test_watchdog_thread_fires_on_its_own():
    dog = Watchdog(period_s=0.01)
    call = FakeCall()
    done = threading.Event()
    call.cancel = lambda: bool(done.set()) or True  # type: ignore[method-assign]
    dog.watch(call, 0.05)
    assert done.wait(5.0)
