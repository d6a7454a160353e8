"""The fault schedule of `prfaas soak --netns` (serving/loadgen/fault_schedule.py) against its
definition, and the report's accounting of faults (serving/loadgen/netns_soak_report.py) on
hand-made runs (its memory rule: tests/serving/test_soak_memory.py). The soak itself runs a
cluster in namespaces: tests/cluster/test_netns_soak.py."""

from __future__ import annotations

import collections
import itertools

import pytest

from prfaas_jax.serving.loadgen.fault_runner import Injection
from prfaas_jax.serving.loadgen.fault_schedule import (
    FAULT_KINDS,
    HOLD_S,
    MIN_GAP_S,
    allows_twice,
    fault_schedule,
)
from prfaas_jax.serving.loadgen.netns_soak_report import NetnsSoakReport, corrupt_detections
from prfaas_jax.serving.loadgen.soak_report import RequestResult

K = len(FAULT_KINDS)


def test_ten_minutes_hold_two_even_rounds_of_every_kind():
    faults = fault_schedule(600.0, seed=3)
    counts = collections.Counter(f.kind for f in faults)
    assert set(counts) == set(FAULT_KINDS) and min(counts.values()) >= 2
    assert allows_twice(600.0)
    # Each round is every kind once, in its own order.
    assert {f.kind for f in faults[:K]} == set(FAULT_KINDS)
    assert {f.kind for f in faults[K : 2 * K]} == set(FAULT_KINDS)
    # One at a time, the same gap between each end and the next start: the gap that spreads two
    # rounds over the arrivals (5 s warm-up, 10 s settling at the end).
    gap = (600 - 5 - 10 - 2 * sum(HOLD_S.get(kind, 0.0) for kind in FAULT_KINDS)) / (2 * K)
    assert faults[0].at_s == 5.0
    for before, after in itertools.pairwise(faults):
        assert after.at_s - before.end_s == pytest.approx(gap, abs=2e-3)
    assert faults[2 * K - 1].end_s == pytest.approx(600 - 10 - gap, abs=0.05)
    assert all(f.end_s <= 590 for f in faults)
    assert all(f.hold_s == HOLD_S.get(f.kind, 0.0) for f in faults)
    assert HOLD_S["sigstop:pd_decode"] > 5  # beyond soak-wan's stall timeout


def test_the_schedule_is_a_function_of_its_seed():
    assert fault_schedule(600.0, seed=1) == fault_schedule(600.0, seed=1)
    orders = {tuple(f.kind for f in fault_schedule(600.0, seed=s)) for s in range(4)}
    assert len(orders) == 4


def test_a_short_run_gets_what_fits_at_the_least_gap():
    faults = fault_schedule(40.0, seed=0)
    assert not allows_twice(40.0)
    assert 3 <= len(faults) < K
    assert len({f.kind for f in faults}) == len(faults)  # still the first round
    for before, after in itertools.pairwise(faults):
        assert after.at_s - before.end_s == pytest.approx(MIN_GAP_S)
    assert faults[-1].end_s <= 30.0
    assert fault_schedule(12.0, seed=0) == []  # nothing ends 10 s before the end


def _result(sent: float, end: float, **fields) -> RequestResult:
    result = RequestResult([1, 2, 3], 2, [7, 8], sent=sent, end_s=end, outcome="completed")
    result.tokens = fields.pop("tokens", [7, 8])
    for name, value in fields.items():
        setattr(result, name, value)
    return result


def _report(results, injections, schedule, duration=40.0) -> NetnsSoakReport:
    return NetnsSoakReport(
        options={"duration_s": duration},
        results=results,
        sampled=[False] * len(results),
        injections=injections,
        schedule=[{"at_s": i.at_s, "kind": i.kind} for i in schedule],
        restarts=0,
        faults={"corrupted_frames": 2, "dropped_transfers": 0},
        router={},
        rss=[],
        start=100.0,
        wall_s=50.0,
        corrupt_ids=["soak-00003", "a0f3"],  # the second: a front-door request's
    )


def test_the_report_counts_each_kind():
    results = [
        _result(101.0, 3.0, route="pd"),  # 1-4 s: before the blackhole
        # Never reached the router (the front door was restarting): not the router's to judge.
        _result(170.0, 0.0, route="frontdoor", outcome="failed", code="ConnectionRefusedError"),
        _result(104.0, 3.0, route="pd", attempts=2),  # 4-7 s: in it, retried
        _result(106.0, 1.0, route="prfaas"),  # 6-7 s: in it, untouched
        _result(109.0, 1.0, route="prfaas", attempts=3),  # after its end: the restored link
        _result(180.0, 1.0, route="frontdoor"),
        _result(125.0, 2.0, route="pd", outcome="failed"),  # in the stop (24-32 s)
    ]
    blackhole = Injection("blackhole", 5.0, end_s=8.0, injected=True, detected=True)
    stop = Injection(
        "sigstop:pd_decode", 24.0, end_s=32.0, injected=True, detected=True, recovered=True
    )
    report = _report(results, [blackhole, stop], [blackhole, stop])
    rows = report.by_kind()
    assert rows["blackhole"] == {
        "scheduled": 1,
        "injected": 1,
        "detected": 1,
        "recovered": 1,  # a PrfaaS request sent after the restore completed right
        "in_flight": 3,  # open at some moment of 5 s to 8 s + 10 s: the 2nd to the 4th
        "affected": 2,  # of those, the retried ones
    }
    assert rows["sigstop:pd_decode"]["recovered"] == 1
    assert rows["sigstop:pd_decode"]["affected"] == 1
    assert rows["corrupt_frames"]["injected"] == 2
    # soak-00003 then completed right, and so did every front-door request the router saw.
    assert rows["corrupt_frames"]["detected"] == rows["corrupt_frames"]["recovered"] == 2
    assert report.missing() == [] and report.passed()
    results[5].outcome = "failed"  # a front-door request the router saw did not complete
    assert report.by_kind()["corrupt_frames"]["recovered"] == 1
    results[5].outcome = "completed"
    # A wrong reply fails the run, and so does a scheduled kind never injected.
    results[3].tokens = [7, 9]
    assert not report.passed()
    results[3].tokens = [7, 8]
    lost = Injection("sigkill:pd_prefill", 12.0)  # its target was never found
    assert _report(results, [blackhole, stop, lost], [blackhole, stop, lost]).missing() == [
        "sigkill:pd_prefill"
    ]
    # A link fault after which no PrfaaS request came back is not recovered.
    late = Injection("blackhole", 20.0, end_s=23.0, injected=True, detected=True)
    assert _report(results, [late], [late]).by_kind()["blackhole"]["recovered"] == 0


def test_the_mix_counts_prfaas_requests_by_precision_and_prefix_hits():
    results = [
        _result(101.0, 1.0, route="prfaas", wire_precision="int8"),
        _result(102.0, 1.0, route="prfaas", wire_precision="int8"),
        _result(103.0, 1.0, route="prfaas", wire_precision="fp8_e4m3"),
        _result(104.0, 1.0, route="prfaas"),  # the config's
        _result(105.0, 1.0, route="pd", wire_precision=""),  # pushed natively, not counted
        _result(106.0, 1.0, route="prfaas", wire_precision="native", outcome="failed"),
    ]
    results[2].cached_len = 256  # a prefix hit
    report = _report(results, [], [])
    report.link_precision = "bf16"
    report.router = {"cached_tokens": 256, "prompt_tokens": 1024}
    assert report.to_dict()["mix"]["prefix_hits"] == 1
    table = report.format_table()
    assert "prefix hits                  1  (256 of 1024 prompt tokens reused)" in table
    assert report.to_dict()["mix"]["prfaas_by_precision"] == {"bf16": 1, "fp8_e4m3": 1, "int8": 2}
    assert "PrfaaS pushes completed      4  (bf16 1, fp8_e4m3 1, int8 2)" in report.format_table()


def test_checksum_failures_are_told_apart_by_whether_a_worker_corrupted_the_request(tmp_path):
    (tmp_path / "prfaas-0.log").write_text(
        "t prfaas-0 faults: corrupted data frame 2 (byte 9) of soak-00007.9f2a → 198.18.0.3:1\n"
        "t prfaas-0 faults: corrupted data frame 1 (byte 3) of 4be1.77aa → 198.18.0.3:1\n"
        "t prfaas-0 faults: dropped the link after 9 of 18 frames of soak-00009.0c1d → x\n"
    )
    (tmp_path / "router.log").write_text(
        "t router soak-00007: attempt 1 failed (invalid_argument: soak-00007.9f2a: its state "
        "was rejected: data frame 2 checksum mismatch: the frame is corrupt)\n"
        "t router 4be1: attempt 2 failed (invalid_argument: tensor 3 fails its CRC32)\n"
        "t router soak-00009: attempt 1 failed (invalid_argument: data frame 1 checksum "
        "mismatch: the frame is corrupt)\n"
        "t router soak-00011: attempt 1 failed (unavailable: link dropped after 3 of 9)\n"
    )
    assert corrupt_detections(tmp_path) == (["soak-00007", "4be1"], ["soak-00009"])
