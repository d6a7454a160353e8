"""The report of `prfaas soak --netns`: `NetnsSoakReport` (per fault kind, the requests and the
memory of every process; `to_dict`, `format_table`, `passed`) and `corrupt_detections`.

Per request the soak's oracle decides (serving/loadgen/soak_report.py: lost, duplicated, wrong).
Per fault kind (serving/loadgen/fault_schedule.py; what detected and recovered mean for each is in
serving/loadgen/fault_runner.py):

- scheduled, injected, detected, recovered: counts of faults; a link fault counts as recovered
  when a PrfaaS-route request sent after its restore completed right; corrupted frames count as
  injected from the workers' `faults: corrupted` lines, as detected from the router's lines
  of an attempt that failed on a CRC or checksum for a request a worker had corrupted (other
  checksum failures are listed apart), and as recovered when that request then
  completed right (a front-door request's id is the router's: those count as recovered when
  every front-door request that reached the router completed right);
- in flight: requests open at some moment of the fault (from its start to `AFTER_S` after its
  end); affected: those of them retried, resumed, failed or lost.

The mix counts the requests completed on the PrfaaS route by the wire precision their state
last crossed in (`by_precision`, from the router's reports), and those that reused a cached
prefix (their report's `cached_len`; the router's count of prompt tokens reused beside it).

Memory (serving/loadgen/soak_memory.py): each incarnation's RSS trend (`rss_trends`: a
restarted process is a series of its own) and each process's verdict (`memory_verdicts`:
bounded, growing or too short to judge, by the rule stated there).

`passed`: nothing lost, duplicated or wrong, every kind injected as often as scheduled up to
twice (a kind the run was too short to schedule twice needs what was scheduled), and no process
whose memory is growing.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from pathlib import Path

from prfaas_jax.serving.loadgen.fault_schedule import (
    CORRUPT_FRAMES,
    FAULT_KINDS,
    LINK_KINDS,
    ROUNDS,
    allows_twice,
)
from prfaas_jax.serving.loadgen.soak_memory import growing, memory_verdicts, rss_trends
from prfaas_jax.serving.loadgen.soak_report import RequestResult, SoakReport
from prfaas_jax.serving.transfer.faults import CORRUPT_MARK
from prfaas_jax.tables import table

AFTER_S = 10.0  # a request this long after a fault ended still counts as in flight during it
_CORRUPT_FAILURE = re.compile(r"(\S+): attempt \d+ failed \([^\n]*(?:CRC|checksum)", re.I)
_CORRUPTED = re.compile(rf"{CORRUPT_MARK} [^\n]* of (\S+)\.[0-9a-f]+ ")
# How a front-door request fails that never reached the router (the front door was restarting).
NOT_SENT = ("NO_FRONT_DOOR", "ConnectionRefusedError")


def corrupt_detections(log_dir: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """Request ids whose attempt the router saw fail on a CRC or checksum (its logs): those
    whose transfer a worker had corrupted (`faults: corrupted … of <request id>.<attempt>`), and
    those without (a checksum failure no injected corruption explains). `soak-<i>` for the
    soak's own requests, the router's id for a front-door request."""
    injected, failed = set(), []
    for path in Path(log_dir).glob("*.log"):
        text = path.read_text(errors="replace")
        injected |= {m[1] for m in _CORRUPTED.finditer(text)}
        if path.name.startswith("router"):
            failed += [m[1] for m in _CORRUPT_FAILURE.finditer(text)]
    return [i for i in failed if i in injected], [i for i in failed if i not in injected]


@dataclasses.dataclass
class NetnsSoakReport:
    options: dict
    results: list[RequestResult]
    sampled: list[bool]  # per result: a seeded-sampled request
    injections: list  # fault_runner.Injection records
    schedule: list[dict]
    restarts: int
    faults: dict[str, int]  # injected by the workers ([faults]): corrupted frames, drops
    router: dict[str, int]
    rss: list[tuple[float, str, int, int]]
    start: float  # monotonic time arrivals began
    wall_s: float
    corrupt_ids: list[str] = dataclasses.field(default_factory=list)  # `corrupt_detections`
    checksum_unexplained: list[str] = dataclasses.field(default_factory=list)
    memory_budgets: dict[str, float] = dataclasses.field(default_factory=dict)  # MiB by process
    link_precision: str = "native"  # the config's `[link] precision`

    def by_precision(self) -> dict[str, int]:
        """Requests completed on the PrfaaS route by the precision their state last crossed in
        (the router's report; "" there is the config's)."""
        counts = collections.Counter(
            r.wire_precision or self.link_precision
            for r in self.results
            if r.route == "prfaas" and r.outcome == "completed"
        )
        return dict(sorted(counts.items()))

    def memory(self) -> dict[str, dict]:
        return memory_verdicts(self.rss, self.memory_budgets)

    @property
    def requests(self) -> SoakReport:
        return SoakReport(
            options=self.options,
            results=self.results,
            kills=[],
            restarts=self.restarts,
            faults=self.faults,
            router=self.router,
            wall_s=self.wall_s,
        )

    def _window(self, at_s: float, end_s: float) -> list[RequestResult]:
        """Requests open at some moment of [at_s, end_s + AFTER_S] (seconds of the run)."""
        out = []
        for r in self.results:
            sent = r.sent - self.start
            ended = sent + (r.end_s if r.end_s is not None else float("inf"))
            if sent <= end_s + AFTER_S and ended >= at_s:
                out.append(r)
        return out

    def _link_recovered(self, end_s: float) -> bool:
        return any(
            r.sent - self.start >= end_s
            and r.route == "prfaas"
            and r.outcome == "completed"
            and not r.wrong
            for r in self.results
        )

    def by_kind(self) -> dict[str, dict]:
        scheduled = collections.Counter(f["kind"] for f in self.schedule)
        rows = {}
        for kind in FAULT_KINDS:
            mine = [i for i in self.injections if i.kind == kind and i.injected]
            in_flight: set[int] = set()
            affected: set[int] = set()
            recovered = 0
            for injection in mine:
                window = self._window(injection.at_s, injection.end_s or injection.at_s)
                in_flight |= {id(r) for r in window}
                affected |= {
                    id(r)
                    for r in window
                    if r.attempts > 1 or r.resumed_from > 0 or r.outcome in ("failed", "lost")
                }
                if kind in LINK_KINDS:
                    recovered += self._link_recovered(injection.end_s)
                else:
                    recovered += bool(injection.recovered)
            rows[kind] = {
                "scheduled": scheduled[kind],
                "injected": len(mine),
                "detected": sum(i.detected for i in mine),
                "recovered": recovered,
                "in_flight": len(in_flight),
                "affected": len(affected),
            }
        rows[CORRUPT_FRAMES] = self._corrupt_row()
        return rows

    def _corrupt_row(self) -> dict:
        """A front-door request reaches the router under an id of the router's: such a one
        recovered when every front-door request that reached the router completed right."""
        by_id = {f"soak-{i:05d}": r for i, r in enumerate(self.results)}
        hit = [by_id[i] for i in self.corrupt_ids if i in by_id]
        untraced = len(self.corrupt_ids) - len(hit)
        door = [r for r in self.results if r.route == "frontdoor" and r.code not in NOT_SENT]
        door_right = all(r.outcome == "completed" and not r.wrong for r in door)
        recovered = sum(r.outcome == "completed" and not r.wrong for r in hit)
        return {
            "scheduled": None,
            "injected": self.faults.get("corrupted_frames", 0),
            "detected": len(self.corrupt_ids),
            "recovered": recovered + (untraced if door_right else 0),
            "in_flight": len(self.corrupt_ids),
            "affected": len(self.corrupt_ids),
        }

    def bad_requests(self, limit: int = 10) -> list[dict]:
        """The first `limit` requests lost, duplicated or wrong, enough to find them in the
        logs (`soak-<index>`)."""
        bad = []
        for index, r in enumerate(self.results):
            if r.outcome == "rejected" or not (r.outcome == "lost" or r.duplicated or r.wrong):
                continue
            bad.append(
                {
                    "request_id": f"soak-{index:05d}",
                    "outcome": r.outcome,
                    "route": r.route,
                    "sampled": self.sampled[index],
                    "prompt_tokens": len(r.prompt),
                    "attempts": r.attempts,
                    "resumed_from": r.resumed_from,
                    "received": r.tokens[:12],
                    "expected": r.expected[:12],
                }
            )
            if len(bad) == limit:
                break
        return bad

    def missing(self) -> list[str]:
        """Kinds injected fewer times than required (module docstring)."""
        twice = allows_twice(float(self.options["duration_s"]))
        out = []
        for kind, row in self.by_kind().items():
            need = ROUNDS if twice else min(row["scheduled"] or 0, ROUNDS)
            if row["injected"] < need:
                out.append(kind)
        return out

    def passed(self) -> bool:
        counts = self.requests.counts()
        clean = not (counts["lost"] or counts["duplicated"] or counts["wrong"])
        return clean and not self.missing() and not growing(self.memory())

    def to_dict(self) -> dict:
        requests = self.requests.to_dict()
        sampled = sum(self.sampled)
        return {
            "options": dict(self.options),
            "counts": requests["counts"],
            "mix": {
                "sampled": sampled,
                "greedy": len(self.results) - sampled,
                "frontdoor": sum(
                    r.route == "frontdoor" or r.code == "NO_FRONT_DOOR" for r in self.results
                ),
                "longest_prompt": max((len(r.prompt) for r in self.results), default=0),
                "prompts_over_4k": sum(len(r.prompt) > 4096 for r in self.results),
                "prfaas_by_precision": self.by_precision(),
                "prefix_hits": sum(
                    r.outcome == "completed" and r.cached_len > 0 for r in self.results
                ),
            },
            "failures": requests["failures"],
            "latency": requests["latency"],
            "bad_requests": self.bad_requests(),
            "by_kind": self.by_kind(),
            "missing_kinds": self.missing(),
            "checksum_failures_not_injected": self.checksum_unexplained,
            "injections": [dataclasses.asdict(i) for i in self.injections],
            "restarts": self.restarts,
            "faults": self.faults,
            "router": self.router,
            "rss": rss_trends(self.rss),
            "memory": self.memory(),
            "passed": self.passed(),
            "wall_s": self.wall_s,
        }

    def format_table(self) -> str:
        d = self.to_dict()
        c = d["counts"]
        codes = ", ".join(f"{k} {v}" for k, v in sorted(d["failures"]["codes"].items())) or "-"
        mix = d["mix"]
        counts = [
            (
                "requests sent",
                c["sent"],
                f"({mix['sampled']} sampled, {mix['frontdoor']} via "
                f"the front door, {mix['prompts_over_4k']} over 4K tokens, longest "
                f"{mix['longest_prompt']})",
            ),
            (
                "PrfaaS pushes completed",
                sum(mix["prfaas_by_precision"].values()),
                "(" + ", ".join(f"{p} {n}" for p, n in mix["prfaas_by_precision"].items()) + ")",
            ),
            (
                "prefix hits",
                mix["prefix_hits"],
                f"({self.router.get('cached_tokens', 0)} of "
                f"{self.router.get('prompt_tokens', 0)} prompt tokens reused)",
            ),
            ("rejected at admission", c["rejected"], ""),
            ("completed", c["completed"], f"of {c['accepted']} accepted"),
            ("failed fast", c["failed"], f"({codes})"),
            ("lost (no answer)", c["lost"], ""),
            ("duplicated", c["duplicated"], ""),
            ("outputs wrong", c["wrong"], ""),
            ("workers restarted", self.restarts, ""),
            ("router retries", self.router.get("retries", 0), ""),
            ("requests resumed mid-stream", self.router.get("resumed", 0), ""),
        ]
        kinds = [
            (
                kind,
                *(
                    "-" if row[k] is None else row[k]
                    for k in (
                        "scheduled",
                        "injected",
                        "detected",
                        "recovered",
                        "in_flight",
                        "affected",
                    )
                ),
            )
            for kind, row in d["by_kind"].items()
        ]
        headers = (
            "fault",
            "scheduled",
            "injected",
            "detected",
            "recovered",
            "in flight",
            "affected",
        )
        memory = [
            (
                label,
                t["samples"],
                t["first_mib"],
                t["last_mib"],
                t["max_mib"],
                *(
                    "-" if v is None else f"{v:+.2f}"
                    for v in (t["slope_mib_per_min"], t["late_slope_mib_per_min"])
                ),
            )
            for label, t in d["rss"].items()
        ]
        rss_headers = ("process", "samples", "RSS first MiB", "last", "max", "MiB/min")
        rss_headers += ("late MiB/min",)
        lines = [
            table(counts, align="lrl"),
            "",
            table(kinds, headers),
            "",
            table(memory, rss_headers),
            "",
            table(_verdict_rows(d["memory"]), VERDICT_HEADERS),
        ]
        if d["missing_kinds"]:
            lines.append(f"injected fewer times than required: {', '.join(d['missing_kinds'])}")
        arrivals = self.options["duration_s"]
        lines.append(f"wall time {self.wall_s:.0f} s ({arrivals:.0f} s of arrivals)")
        return "\n".join(lines)


VERDICT_HEADERS = ("process", "memory", "incarnation", "lived s", "late MiB/min", "max", "bound")


def _verdict_rows(verdicts: dict[str, dict]) -> list[tuple]:
    """A row per judged incarnation (serving/loadgen/soak_memory.py), one for a process with
    none."""
    rows: list[tuple] = []
    for process, entry in verdicts.items():
        judged = entry["judged"] or {"-": None}
        for name, j in judged.items():
            if j is None:
                rows.append((process, entry["verdict"], "-", "-", "-", "-", "-"))
                continue
            slope = j["late_slope_mib_per_min"]
            rows.append(
                (
                    process,
                    entry["verdict"],
                    name,
                    j["seconds"],
                    "-" if slope is None else f"{slope:+.2f}",
                    j["max_mib"],
                    j["bound_mib"],
                )
            )
    return rows
