"""The link in packets (serving/cluster/wan.py) without a network: the loss process against its
defining rates, the delay line against hand-computed release times, the bandwidth schedule the
kernel link follows (serving/transport/link.py: `schedule_factor`) against its definition, and
the `[link]` keys that ask for it.

Statistical bounds are ±5 σ of the estimate over the draws taken (seeded, so each run draws the
same), far from flaky and still tight enough to tell a wrong parameterisation (a burst length
off by one, a rate off by a factor) apart."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from prfaas_jax.errors import ConfigError, UserError
from prfaas_jax.serving.cluster import netns, wan
from prfaas_jax.serving.cluster.wan import (
    DelayLine,
    Direction,
    GilbertLoss,
    WanControl,
    WanModel,
    model_of,
)
from prfaas_jax.serving.cluster_sections import LinkSection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.router.handles import one_way_delay_s
from prfaas_jax.serving.transport.lifecycle import write_json
from prfaas_jax.serving.transport.link import schedule_factor


def _runs(flags: list[bool]) -> list[int]:
    """Lengths of the runs of consecutive True values."""
    runs, current = [], 0
    for flag in flags:
        if flag:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs + ([current] if current else [])


@pytest.mark.parametrize(("loss", "burst"), [(0.005, 1.0), (0.02, 1.0), (0.02, 4.0), (0.1, 8.0)])
def test_the_loss_process_has_its_rate_and_burst_length(loss, burst):
    n = 400_000
    process = GilbertLoss(loss, burst, random.Random(7))
    flags = [process.lost() for _ in range(n)]
    rate = sum(flags) / n
    # Bursts correlate the draws: the variance of the mean grows by about (1 + ρ)/(1 − ρ) with
    # ρ = 1 − p − r, the chain's lag-1 correlation, i.e. ≈ 2·burst for long bursts.
    inflation = 1.0 if process.independent else 2.0 * burst
    sigma = math.sqrt(loss * (1 - loss) * inflation / n)
    assert abs(rate - loss) < 5 * sigma
    runs = _runs(flags)
    want = 1.0 / (1.0 - loss) if process.independent else burst  # independent: geometric runs
    mean = sum(runs) / len(runs)
    sigma_mean = want / math.sqrt(len(runs))  # a geometric run's spread is about its mean
    assert abs(mean - want) < 5 * sigma_mean
    assert process.independent == (burst == 1.0)


def test_no_loss_loses_nothing():
    process = GilbertLoss(0.0, 5.0, random.Random(1))
    assert not any(process.lost() for _ in range(10_000))


def test_each_packet_leaves_after_the_delay_in_order():
    line = Direction(WanModel(delay_s=0.020), seed=0)
    for i in range(5):
        line.push(bytes([i]), now=1.0 + i * 0.001)
    assert line.due(1.0205) == [b"\x00"]  # 1.020 released; 1.021 not yet
    assert line.due(1.0241) == [b"\x01", b"\x02", b"\x03", b"\x04"]
    assert line.due(10.0) == [] and line.stats()["max_queued"] == 5


def test_jitter_keeps_the_order_unless_told_to_reorder():
    times = [i * 0.0005 for i in range(4000)]  # a packet every 0.5 ms, jitter 5 ms
    for reorder in (False, True):
        line = Direction(WanModel(delay_s=0.05, jitter_s=0.005, reorder=reorder), seed=3)
        for i, t in enumerate(times):
            line.push(i.to_bytes(2, "big"), t)
        order = [int.from_bytes(p, "big") for p in line.due(math.inf)]
        inversions = sum(1 for a, b in itertools.pairwise(order) if b < a)
        assert sorted(order) == list(range(len(times)))
        assert (inversions > 100) if reorder else (inversions == 0)


def test_jitter_has_its_standard_deviation():
    line = Direction(WanModel(delay_s=0.1, jitter_s=0.004, reorder=True), seed=5)
    n = 20_000
    for i in range(n):
        line.push(i.to_bytes(2, "big"), now=float(i))  # far apart: each its own draw
    extra = []
    while (release := line.next_release()) < math.inf:
        (packet,) = line.due(release)
        extra.append(release - int.from_bytes(packet, "big") - 0.1)
    mean = sum(extra) / n
    std = math.sqrt(sum((e - mean) ** 2 for e in extra) / n)
    assert abs(mean) < 5 * 0.004 / math.sqrt(n)
    assert abs(std - 0.004) < 5 * 0.004 / math.sqrt(2 * n)


def test_the_delay_line_tells_the_directions_apart_by_destination():
    def packet(dest: str) -> bytes:
        return bytes(16) + bytes(int(x) for x in dest.split(".")) + bytes(20)

    line = DelayLine(WanModel(delay_s=0.01), forward_dest="198.18.3.3")
    line.push(packet("198.18.3.3"), 0.0)
    line.push(packet("198.18.3.2"), 0.0)
    line.push(packet("198.18.3.3"), 0.001)
    stats = line.stats()
    assert stats["forward"]["packets"] == 2 and stats["backward"]["packets"] == 1
    assert line.next_release() == pytest.approx(0.01)
    assert len(line.due(0.0105)) == 2 and len(line.due(0.0115)) == 1


def test_a_control_file_changes_the_link_while_it_runs(tmp_path):
    """`--control-file` (`WanControl`): a blackhole drops every packet and counts it apart, a
    spiked delay applies to packets from then on (queued ones keep their times), and a control
    without fields restores the configured model."""

    def packet() -> bytes:
        return bytes(16) + bytes((198, 18, 3, 3)) + bytes(20)

    line = DelayLine(WanModel(delay_s=0.01, loss=0.0), forward_dest="198.18.3.3")
    control = wan._ControlFile(str(tmp_path / "control.json"))
    control.apply(line)  # no file yet: the configured model
    line.push(packet(), 0.0)
    (tmp_path / "control.json").write_text(json.dumps({"blackhole": True}))
    control.apply(line)
    applied = wan.applied_path(tmp_path / "control.json")
    assert json.loads(applied.read_text()) == {"blackhole": True}  # what a writer waits for
    for i in range(5):
        line.push(packet(), 0.001 * i)
    stats = line.stats()["forward"]
    assert (stats["packets"], stats["blackholed"], stats["lost"]) == (6, 5, 0)
    assert len(line.due(1.0)) == 1  # the packet before the blackhole still arrives
    write_json(tmp_path / "control.json", {"delay_s": 0.2})
    control.apply(line)
    line.push(packet(), 2.0)
    assert line.next_release() == pytest.approx(2.2)
    write_json(tmp_path / "control.json", {"loss": 0.5, "loss_burst": 4.0})
    control.apply(line)
    assert line.backward.model == WanModel(delay_s=0.01, loss=0.5, loss_burst=4.0)
    write_json(tmp_path / "control.json", {})
    control.apply(line)
    line.push(packet(), 3.0)
    assert line.forward.model == line.model and not line.forward.blackhole
    assert [round(r, 3) for r, _, _ in sorted(line.forward._queue)] == [2.2, 3.01]
    assert WanControl(delay_s=0.3).applied_to(WanModel(loss=0.1)) == WanModel(0.3, loss=0.1)


@pytest.mark.parametrize(
    ("offset", "want"),
    [
        (0.0, (1.0, 10.0)),  # before the first entry: 1.0, until 10 s
        (10.0, (0.3, 70.0)),
        (69.9, (0.3, 70.0)),
        (70.0, (1.0, 100.0)),  # the last entry holds until the period ends
        (100.0, (1.0, 110.0)),  # the next period: 1.0 again until 100 + 10
        (215.0, (0.3, 270.0)),
    ],
)
def test_the_schedule_repeats_as_defined(offset, want):
    schedule = ((10.0, 0.3), (70.0, 1.0))
    factor, next_offset = schedule_factor(schedule, 100.0, offset)
    assert (factor, next_offset) == pytest.approx(want)


def test_a_schedule_without_repeat_holds_its_last_factor():
    assert schedule_factor(((5.0, 0.5),), 0.0, 3.0) == (1.0, 5.0)
    assert schedule_factor(((5.0, 0.5),), 0.0, 500.0) == (0.5, math.inf)
    assert schedule_factor((), 0.0, 1.0) == (1.0, math.inf)


def test_the_link_keys():
    default = LinkSection()
    assert not default.in_packets and default.one_way_delay_s == pytest.approx(0.005)
    wan = LinkSection(rtt_ms=40.0, loss_percent=0.5, loss_burst=3.0, jitter_ms=2.0)
    assert wan.in_packets and wan.one_way_delay_s == pytest.approx(0.020)
    model = model_of(wan, seed=9)
    assert model == WanModel(delay_s=0.020, jitter_s=0.002, loss=0.005, loss_burst=3.0, seed=9)
    assert LinkSection(loss_percent=0.1).in_packets  # loss alone needs the packet path
    for bad, words in [
        ({"loss_percent": 100.0}, "link.loss_percent"),
        ({"loss_burst": 0.5}, "link.loss_burst"),
        ({"rtt_ms": -1.0}, "rtt_ms"),
    ]:
        with pytest.raises(ConfigError, match=words):
            LinkSection(**bad)


def test_a_link_in_packets_without_a_tun_device_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.os, "access", lambda path, mode: False)
    netns.require_netns()  # the direct veth needs no TUN device
    with pytest.raises(UserError, match=r"needs TUN devices \(/dev/net/tun\)") as refused:
        netns.require_netns(wan=True)
    assert "\n" not in str(refused.value)


def test_the_routers_delay_adds_the_senders_to_half_the_measured_round_trip():
    # In process: the shaper adds 5 ms, TCP on loopback sees ~0.1 ms.
    assert one_way_delay_s(pb.LinkState(latency_s=0.005, measured_rtt_s=0.0001)) == (
        pytest.approx(0.00505)
    )
    # In packets: the sender adds nothing, TCP measured 41 ms.
    assert one_way_delay_s(pb.LinkState(latency_s=0.0, measured_rtt_s=0.041)) == (
        pytest.approx(0.0205)
    )
