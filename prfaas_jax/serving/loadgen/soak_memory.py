"""The memory of `prfaas soak --netns`'s processes: `rss_trends` (each incarnation's RSS series)
and `memory_verdicts` (per process, whether its memory stayed bounded), with the rule's
constants.

The samples are (seconds, label, pid, RSS bytes) rows (serving/loadgen/netns_soak.py's
`RssSampler`). An *incarnation* is one process: one label and pid (a worker's replacement is
labelled `<name>.restart-<n>`, each front door `frontdoor-<n>`), so a restarted process starts a
series of its own. A *process* is what the incarnations stand for: the label without
`.restart-<n>` (`frontdoor` for every front door).

`rss_trends`, per incarnation: its samples, first, last and largest RSS, and the least-squares
slope in MiB per minute over its life and over its second half (a process that warms up and
then holds shows a slope over its life and none late; None below 3 samples or 30 s).

`memory_verdicts`, per process, judges every incarnation that lived at least `JUDGE_S` (120 s:
a second half of a minute, a dozen samples at the soak's 5 s) — the run is long enough to judge
a process when one of its incarnations lived that long. A judged incarnation is *bounded* when

- its second-half slope is at most `SLOPE_TOL_MIB_PER_MIN` (2 MiB/min), or
- its largest RSS is at most its *base* + its *budget* + `MARGIN_MIB` (128 MiB): the base is
  its RSS at its first sample `WARM_S` (30 s) or more into its life (imports done, engine built),
  the budget what its configuration lets it fill (a prefill worker's `[prefix_cache]
  capacity_mib`, nothing for the others), the margin the states in flight and the allocator's
  slack.

The process is "bounded" when every judged incarnation is, "growing" when one is not (the soak
then fails), "too short" when none lived `JUDGE_S`. The margin means a leak slower than
128 MiB over an incarnation's life passes the second test; the slope test alone catches one
that is still growing at its end.
"""

from __future__ import annotations

import collections
import re

import numpy as np

MIB = 2**20
JUDGE_S = 120.0
SLOPE_TOL_MIB_PER_MIN = 2.0
WARM_S = 30.0
MARGIN_MIB = 128.0
_INCARNATION = re.compile(r"\.restart-\d+$|(?<=^frontdoor)-\d+$")


def process_of(label: str) -> str:
    """The process an incarnation's label stands for (module docstring)."""
    return _INCARNATION.sub("", label)


def _slope_per_min(times: list[float], values: list[float]) -> float | None:
    if len(times) < 3 or times[-1] - times[0] < 30:
        return None
    return float(np.polyfit(np.asarray(times) / 60, np.asarray(values), 1)[0])


def _series(samples: list[tuple[float, str, int, int]]) -> dict[str, list[tuple[float, float]]]:
    """(t, MiB) per incarnation, named by its label (label@pid when a label had two pids)."""
    by_key: dict[tuple[str, int], list[tuple[float, float]]] = collections.defaultdict(list)
    for at, label, pid, rss in samples:
        by_key[(label, pid)].append((at, rss / MIB))
    pids = collections.Counter(label for label, _ in by_key)
    return {
        (label if pids[label] == 1 else f"{label}@{pid}"): rows
        for (label, pid), rows in sorted(by_key.items())
    }


def _late(rows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    middle = (rows[0][0] + rows[-1][0]) / 2
    return [row for row in rows if row[0] >= middle]


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def rss_trends(samples: list[tuple[float, str, int, int]]) -> dict[str, dict]:
    """Per incarnation (module docstring)."""
    trends = {}
    for name, rows in _series(samples).items():
        times, mib = [t for t, _ in rows], [m for _, m in rows]
        late = _late(rows)
        trends[name] = {
            "process": process_of(name.split("@")[0]),
            "samples": len(rows),
            "seconds": round(times[-1] - times[0], 1),
            "first_mib": round(mib[0], 1),
            "last_mib": round(mib[-1], 1),
            "max_mib": round(max(mib), 1),
            "slope_mib_per_min": _rounded(_slope_per_min(times, mib)),
            "late_slope_mib_per_min": _rounded(
                _slope_per_min([t for t, _ in late], [m for _, m in late])
            ),
        }
    return trends


def _judge(rows: list[tuple[float, float]], budget_mib: float) -> dict:
    late = _late(rows)
    slope = _slope_per_min([t for t, _ in late], [m for _, m in late])
    base = next(m for t, m in rows if t >= rows[0][0] + WARM_S)
    bound = base + budget_mib + MARGIN_MIB
    peak = max(m for _, m in rows)
    flat = slope is not None and slope <= SLOPE_TOL_MIB_PER_MIN
    return {
        "seconds": round(rows[-1][0] - rows[0][0], 1),
        "late_slope_mib_per_min": _rounded(slope),
        "max_mib": round(peak, 1),
        "bound_mib": round(bound, 1),
        "bounded": flat or peak <= bound,
    }


def memory_verdicts(
    samples: list[tuple[float, str, int, int]], budgets_mib: dict[str, float]
) -> dict[str, dict]:
    """Per process (module docstring): its verdict and each judged incarnation's figures.
    `budgets_mib`: the budget of each process by name (absent: none)."""
    verdicts: dict[str, dict] = {}
    for name, rows in _series(samples).items():
        process = process_of(name.split("@")[0])
        entry = verdicts.setdefault(
            process,
            {"verdict": "too short", "budget_mib": budgets_mib.get(process, 0.0), "judged": {}},
        )
        if rows[-1][0] - rows[0][0] >= JUDGE_S:
            entry["judged"][name] = _judge(rows, entry["budget_mib"])
    for entry in verdicts.values():
        if entry["judged"]:
            bounded = all(j["bounded"] for j in entry["judged"].values())
            entry["verdict"] = "bounded" if bounded else "growing"
    return verdicts


def growing(verdicts: dict[str, dict]) -> list[str]:
    """The processes whose memory was not bounded by the rule."""
    return [process for process, entry in verdicts.items() if entry["verdict"] == "growing"]
