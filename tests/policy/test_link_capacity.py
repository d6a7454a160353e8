"""The link capacity learned from transfers (policy/link_capacity.py), against hand-computed
samples and estimates."""

from __future__ import annotations

import pytest

from prfaas_jax.policy.link_capacity import CapacityMeter, FrameArrival, backlog_sample
from prfaas_jax.policy.link_rtt import RttMeter


def test_a_sample_times_the_later_half_of_the_frames_that_queued_behind_another():
    # (arrival, bytes, queued at the sender, the sender's previous arrival)
    frames = [
        FrameArrival(0.000, 100, False, None),  # the header: nothing before it
        FrameArrival(0.010, 5_000, True, 0.000),  # 10 ms behind the header on the wire
        FrameArrival(0.050, 5_000, False, 0.010),  # made after the link went idle: not timed
        FrameArrival(0.055, 4_000, True, 0.050),
        FrameArrival(0.055, 6_000, True, 0.055),  # read in one batch with the previous one
        FrameArrival(0.070, 2_000, True, 0.062),  # another transfer's frame arrived at 62 ms
    ]
    # Timed: 5,000 B in 10 ms, 4,000 B in 5 ms, 6,000 B in 0 ms, 2,000 B in 8 ms: a mean pace
    # of 23 ms / 17,000 B. From the first frame (10 ms ≥ half of 5,000 B at that pace): half of
    # its 5,000 B (it straddles the start), then the rest.
    assert backlog_sample(frames, skip=0.0) == (14_500, pytest.approx(0.023))
    # Past 8,500 of the 17,000 timed bytes, the first frame whose gap is at least half its
    # bytes' time at the mean pace is the last one (the 6,000-B frame lies inside the clump
    # before it, 0 ms): half of its bytes.
    assert backlog_sample(frames) == (1_000, pytest.approx(0.008))
    assert backlog_sample(frames[:1]) == (0, 0.0)
    assert backlog_sample([FrameArrival(1.0, 9, True, None)]) == (0, 0.0)  # nothing to follow
    with pytest.raises(ValueError, match="skip"):
        backlog_sample(frames, skip=1.0)


def test_small_frames_of_a_smooth_stream_are_timed():
    """A state's tail of small fixed-size frames at 1 MB/s: short gaps, but each its bytes'
    time. They must count, not be taken for the inside of a clump."""
    sizes = [16_000, 16_000, 16_000, 3_000, 2_000, 1_000, 2_000, 1_000, 2_000, 1_000]
    frames, at = [FrameArrival(0.0, 500, False, None)], 0.0
    for size in sizes:
        frames.append(FrameArrival(at + size / 1e6, size, True, at))
        at += size / 1e6
    # Past 30,000 of the 60,000 timed bytes: the third 16,000-B frame (counted half, as the
    # first of the interval), then every small one — 20,000 B in 28 ms, half a frame low.
    assert backlog_sample(frames) == (20_000, pytest.approx(0.028))


def test_a_link_that_delivers_in_clumps_is_timed_from_a_clump_start():
    """A `tbf` at 250 kB/s releasing 64 KiB at a time: four 16 KiB frames every 262 ms, read
    0.1 ms apart. Counting from inside a clump would credit its frames with no time."""
    rate, frame = 250_000.0, 16_384
    frames, previous = [FrameArrival(0.0, 500, False, None)], 0.0
    for clump in range(1, 7):
        for k in range(4):
            at = clump * 4 * frame / rate + k * 1e-4
            frames.append(FrameArrival(at, frame, True, previous))
            previous = at
    nbytes, seconds = backlog_sample(frames)
    # The last three clumps (past half of the 24 timed frames), their first frame counted half:
    # here the link carried it whole inside the interval, so the rate reads half a frame low.
    assert nbytes == 11.5 * frame
    assert nbytes / seconds == pytest.approx(rate * 11.5 / 12, rel=0.01)


def test_the_estimate_is_a_weighted_mean_of_the_samples_rates():
    meter = CapacityMeter(weight=0.5, min_seconds=0.001, min_bytes=1_000)
    assert meter.estimate(0.0) == 0.0 and meter.samples == 0
    assert meter.add(100_000, 0.1, now=1.0)  # 1 MB/s: the first sample is the estimate
    assert meter.estimate(1.0) == pytest.approx(1e6)
    assert meter.add(100_000, 0.8, now=2.0)  # cut by 8x: halfway to 125 kB/s
    assert meter.estimate(2.0) == pytest.approx(562_500)
    for i in range(6):
        meter.add(100_000, 0.8, now=3.0 + i)
    # The gap to 125 kB/s (437,500 after the first) halves with each of the six more.
    assert meter.estimate(8.0) == pytest.approx(125_000 + 437_500 / 64)
    assert meter.samples == 8


def test_an_estimate_without_fresh_samples_is_dropped_and_learned_anew():
    meter = CapacityMeter(stale_s=10.0)
    meter.add(100_000, 0.8, now=0.0)
    assert meter.estimate(10.0) == pytest.approx(125_000)
    assert meter.estimate(10.1) == 0.0  # unknown: the caller uses the configured bandwidth
    meter.add(100_000, 0.1, now=11.0)  # the link recovered: the old samples do not weigh
    assert meter.estimate(11.0) == pytest.approx(1e6)
    assert meter.samples == 2


def test_samples_too_short_to_time_are_ignored():
    meter = CapacityMeter(min_seconds=0.002, min_bytes=16_384)
    assert not meter.add(1_000_000, 0.001, now=0.0)
    assert not meter.add(10_000, 0.5, now=0.0)
    assert not meter.add(0, 0.0, now=0.0)
    assert meter.samples == 0 and meter.estimate(0.0) == 0.0
    with pytest.raises(ValueError, match="weight"):
        CapacityMeter(weight=0.0)


def test_the_round_trip_meter_smooths_and_forgets():
    meter = RttMeter(weight=0.25, stale_s=30.0)
    assert meter.estimate(0.0) == 0.0 and not meter.add(0.0, 0.0)  # unmeasured: ignored
    assert meter.add(0.040, 1.0) and meter.estimate(1.0) == pytest.approx(0.040)
    meter.add(0.080, 2.0)  # 0.040 + ¼ · (0.080 − 0.040)
    assert meter.estimate(2.0) == pytest.approx(0.050) and meter.samples == 2
    assert meter.estimate(32.5) == 0.0  # no sample for more than 30 s
    meter.add(0.020, 40.0)  # starts afresh
    assert meter.estimate(40.0) == pytest.approx(0.020)
