"""Striped transfers: the sender's lanes (serving/transfer/outbox.py) and the decode worker's
gathering of the streams (serving/transfer/stripes.py), on literal frames."""

from __future__ import annotations

import threading

import pytest

from prfaas_jax.engine.codec.format import DATA_MAGIC
from prfaas_jax.policy.link_capacity import FrameArrival
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.outbox import Outbox, striped_sample
from prfaas_jax.serving.transfer.stripes import StripeError, StripeSet


class Context:
    def is_active(self) -> bool:
        return True


def data(k: int) -> bytes:
    return DATA_MAGIC + bytes([k])


def test_data_frames_go_round_robin_and_the_rest_on_lane_zero():
    outbox = Outbox(None, Context(), lanes=3)
    frames = [b"PRFSTATE-header", *(data(k) for k in range(7)), b"PRFT-trailer", b"PRFH-handoff"]
    outbox.put_all(frames)
    outbox.close()
    lanes = [[frame for frame, _ in outbox.frames_to_send(lane)] for lane in range(3)]
    assert lanes == [
        [b"PRFSTATE-header", data(0), data(3), data(6), b"PRFT-trailer", b"PRFH-handoff"],
        [data(1), data(4)],
        [data(2), data(5)],
    ]
    assert outbox.frames == len(frames) and outbox.wire_bytes == sum(map(len, frames))


def test_the_primary_gets_every_stripes_frames_in_decodable_order():
    stripes = StripeSet(timeout_s=5.0)
    own = [b"header", b"d0", b"d3", b"trailer", b"handoff"]
    # Stripe 2 before the primary asks, stripe 1 while it waits.
    stripes.deposit("r", 2, 3, [b"d2", b"d5"])
    late = threading.Timer(0.05, stripes.deposit, args=("r", 1, 3, [b"d1", b"d4"]))
    late.start()
    merged, arrivals = stripes.gather("r", 3, own)
    late.join()
    assert merged == [b"header", b"d0", b"d3", b"d1", b"d4", b"d2", b"d5", b"trailer", b"handoff"]
    assert arrivals == []
    # Gathered once: the parts are gone.
    with pytest.raises(StripeError, match="did not arrive"):
        StripeSet(timeout_s=0.05).gather("r", 3, own)


def test_a_cut_missing_or_inconsistent_stripe_fails_the_transfer():
    stripes = StripeSet(timeout_s=5.0)
    stripes.deposit("a", 1, 3, [b"d1"])
    stripes.fail("a", 3, "stripe 2 of 3 was cut")
    with pytest.raises(StripeError, match="a: stripe 2 of 3 was cut"):
        stripes.gather("a", 3, [b"h", b"d", b"t", b"x"])
    with pytest.raises(StripeError, match=r"stripes \[2\] of 3 did not arrive"):
        quick = StripeSet(timeout_s=0.05)
        quick.deposit("b", 1, 3, [b"d1"])
        quick.gather("b", 3, [b"h", b"d", b"t", b"x"])
    stripes.deposit("c", 1, 2, [b"d1"])
    with pytest.raises(StripeError, match="arrived twice"):
        stripes.deposit("c", 1, 2, [b"d1"])
    with pytest.raises(StripeError, match="a stream says 3 stripes, another 2"):
        stripes.deposit("c", 2, 3, [b"d2"])


def test_the_stripes_arrivals_are_timed_together_on_one_clock():
    stripes = StripeSet(timeout_s=5.0)
    # Frames from one sender, alternating stripes 0 and 1, 10 ms apart on the sender's clock.
    own = [FrameArrival(0.00, 100, False, None), FrameArrival(0.02, 1000, True, 0.01)]
    other = [FrameArrival(0.01, 1000, True, 0.00), FrameArrival(0.03, 1000, True, 0.02)]
    stripes.deposit("r", 1, 2, [b"d1", b"d3"], other)
    _, arrivals = stripes.gather("r", 2, [b"h", b"d2", b"t", b"x"], own)
    assert [a.at for a in arrivals] == [0.0, 0.01, 0.02, 0.03]
    # The stream-0 reply carries the whole transfer's sample; the others none.
    replies = [pb.PushStateReply(backlog_bytes=1500, backlog_s=0.015), pb.PushStateReply()]
    assert striped_sample(replies) == (1500, 0.015)
