"""The memory rule of `prfaas soak --netns` (serving/loadgen/soak_memory.py) on synthetic RSS
samples: each incarnation a series of its own, and per process bounded, growing or too short to
judge, with the soak failing on growing."""

from __future__ import annotations

import pytest

from prfaas_jax.serving.loadgen.netns_soak_report import NetnsSoakReport
from prfaas_jax.serving.loadgen.soak_memory import (
    JUDGE_S,
    MARGIN_MIB,
    SLOPE_TOL_MIB_PER_MIN,
    growing,
    memory_verdicts,
    process_of,
    rss_trends,
)

MIB = 2**20


def _series(label, pid, mib_at, start=0.0, end=300.0, every=5.0):
    """(t, label, pid, bytes) rows of an RSS `mib_at(seconds into its life)`."""
    out, t = [], start
    while t <= end:
        out.append((t, label, pid, int(mib_at(t - start) * MIB)))
        t += every
    return out


def test_rss_trends_fit_a_slope_per_minute():
    samples = [(t, "router", 9, (100 + 0.05 * t) * MIB) for t in range(0, 120, 5)]
    samples += [(0.0, "pd-0", 10, 50 * MIB), (5.0, "pd-0", 10, 60 * MIB)]
    trends = rss_trends(samples)
    assert trends["router"]["slope_mib_per_min"] == pytest.approx(3.0, abs=1e-3)
    assert trends["router"]["late_slope_mib_per_min"] == pytest.approx(3.0, abs=1e-3)
    assert trends["router"]["first_mib"] == 100.0 and trends["router"]["samples"] == 24
    assert trends["pd-0"]["slope_mib_per_min"] is None  # too short to say
    assert trends["pd-0"]["max_mib"] == 60.0
    # Warm-up, then flat: growth over the life, none in its second half.
    warm = [(t, "pd-1", 11, (50 + min(t, 20)) * MIB) for t in range(0, 200, 5)]
    trend = rss_trends(warm)["pd-1"]
    assert trend["slope_mib_per_min"] > 1 and trend["late_slope_mib_per_min"] == 0.0


def test_a_restarted_process_is_a_series_of_its_own():
    assert process_of("prfaas-0.restart-3") == process_of("prfaas-0") == "prfaas-0"
    assert process_of("frontdoor-2") == "frontdoor" and process_of("pd-10") == "pd-10"
    # The first life grew 100 MiB and was killed; its replacement starts low and holds flat.
    first = _series("prfaas-0", 7, lambda t: 200 + t / 3, end=300)
    second = _series("prfaas-0.restart-1", 8, lambda t: 150.0, start=305, end=500)
    trends = rss_trends(first + second)
    assert trends["prfaas-0"]["late_slope_mib_per_min"] == pytest.approx(20.0, abs=1e-3)
    assert trends["prfaas-0.restart-1"]["first_mib"] == 150.0
    assert trends["prfaas-0.restart-1"]["process"] == "prfaas-0"
    # One label, two pids (a sampler that saw the pid change): two series still.
    twice = _series("wan", 3, lambda t: 20.0, end=10) + _series("wan", 4, lambda t: 30.0, end=10)
    assert set(rss_trends(twice)) == {"wan@3", "wan@4"}


def test_bounded_by_a_flat_late_half_or_by_base_plus_budget():
    # Fills its 16 MiB budget in a minute, then holds: bounded by the slope.
    cache = _series("prfaas-0", 1, lambda t: 200 + 16 * min(t, 60) / 60)
    # Noisy but within base + budget + margin, though its late half still rises.
    noisy = _series("pd-0", 2, lambda t: 200 + (t / 300) * (MARGIN_MIB - 1) + (t % 10))
    # A leak of 40 MiB/min from the start: past the bound and still rising.
    leak = _series("pd-2", 3, lambda t: 200 + 40 * t / 60)
    # Too short to judge, however it grows.
    young = _series("pd-3", 4, lambda t: 200 + 100 * t, end=JUDGE_S - 5)
    verdicts = memory_verdicts(cache + noisy + leak + young, {"prfaas-0": 16.0})
    assert verdicts["prfaas-0"]["verdict"] == "bounded"
    assert verdicts["prfaas-0"]["budget_mib"] == 16.0
    judged = verdicts["prfaas-0"]["judged"]["prfaas-0"]
    assert judged["late_slope_mib_per_min"] == pytest.approx(0.0, abs=1e-6)
    assert judged["bound_mib"] == pytest.approx(208 + 16 + MARGIN_MIB, abs=0.1)  # base at 30 s
    assert verdicts["pd-0"]["judged"]["pd-0"]["late_slope_mib_per_min"] > SLOPE_TOL_MIB_PER_MIN
    assert verdicts["pd-0"]["verdict"] == "bounded"
    assert verdicts["pd-2"]["verdict"] == "growing"
    assert verdicts["pd-3"] == {"verdict": "too short", "budget_mib": 0.0, "judged": {}}
    assert growing(verdicts) == ["pd-2"]
    # Still rising late, 140 MiB above its base at 30 s: within base + 16 MiB budget + the
    # margin, past base + the margin alone.
    big = _series("prfaas-0", 1, lambda t: 200 + 160 * min(t, 240) / 240)
    assert big[-1][3] / MIB - (200 + 160 * 30 / 240) == pytest.approx(140, abs=0.01)
    assert memory_verdicts(big, {"prfaas-0": 16.0})["prfaas-0"]["verdict"] == "bounded"
    assert memory_verdicts(big, {})["prfaas-0"]["verdict"] == "growing"
    # One judged life that grows is enough, whatever the others did.
    flat = _series("pd-2.restart-1", 5, lambda t: 200.0, start=305, end=600)
    assert memory_verdicts(leak + flat, {})["pd-2"]["verdict"] == "growing"


def test_a_growing_process_fails_the_soak():
    def report(rss):
        return NetnsSoakReport(
            options={"duration_s": 0.5},
            results=[],
            sampled=[],
            injections=[],
            schedule=[],
            restarts=0,
            faults={},
            router={},
            rss=rss,
            start=0.0,
            wall_s=1.0,
        )

    flat = report(_series("router", 1, lambda t: 60.0))
    assert flat.passed() and flat.to_dict()["memory"]["router"]["verdict"] == "bounded"
    leak = report(_series("router", 1, lambda t: 60 + t))
    assert not leak.passed()
    assert "growing" in leak.format_table()
