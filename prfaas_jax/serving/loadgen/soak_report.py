"""The soak's report: `RequestResult` (one request as the client saw it), `classify_stream` and
`SoakReport` (counts, latency groups, `to_dict`, `format_table`), and `count_faults`.

Separate from serving/loadgen/soak.py, which drives the run (workload, killer, cluster): this
module only classifies what came back and renders it, so it needs no cluster or network.

Per request, as the client sees it:

- rejected: RESOURCE_EXHAUSTED before any token (refused at admission); every other request is
  accepted;
- completed: the stream finished with a report; failed: it ended with another non-OK status
  (the code and the time to failure are kept); lost: neither, within `deadline_s` (a hang);
- duplicated: more tokens than asked, or tokens that read as the expected ones with some
  delivered again (`classify_stream`: a replay from an earlier position);
- wrong: a completed request whose tokens ≠ `fake_tokens(prompt, n, V)` (duplicates included),
  or a failed or lost one whose tokens are not a prefix of it. Fake tokens depend on the whole
  sequence before them, so a request resumed from the wrong place gets wrong tokens.

The report adds the faults (kills; injected corruptions and drops, counted from the `faults: …`
lines of the workers' logs; the launcher's restarts; the router's retries and resumed requests)
and their cost: TTFT and end-to-end latency of completed requests with one attempt, with
retries before the first token, and resumed mid-stream (`RequestReport.attempts`,
`resumed_from`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from prfaas_jax.serving.transfer.faults import CORRUPT_MARK, DROP_MARK
from prfaas_jax.tables import table


@dataclasses.dataclass
class RequestResult:
    prompt: list[int]
    max_new_tokens: int
    expected: list[int]
    sent: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    ttft_s: float | None = None
    end_s: float | None = None  # since sent
    outcome: str = "lost"  # rejected | completed | failed | lost
    code: str = ""
    attempts: int = 0
    resumed_from: int = 0
    route: str = ""
    wire_precision: str = ""  # the report's: asked or narrowed; "": the cluster's
    cached_len: int = 0  # the report's: prompt tokens reused from a cached prefix

    @property
    def duplicated(self) -> bool:
        return classify_stream(self.tokens, self.expected) == "duplicated"

    @property
    def wrong(self) -> bool:
        if self.outcome == "completed":
            return self.tokens != self.expected
        return self.tokens != self.expected[: len(self.tokens)]


def classify_stream(received: Sequence[int], expected: Sequence[int]) -> str:
    """What a client's tokens are against the expected ones: "ok" (a prefix of them),
    "duplicated" (more tokens than expected, or a walk through `expected` in which each token
    is the next position or repeats an earlier one, with at least one repeat), or "wrong"."""
    if list(received) == list(expected[: len(received)]) and len(received) <= len(expected):
        return "ok"
    if len(received) > len(expected):
        return "duplicated"
    states = {(0, False)}  # (next position, replayed yet)
    for token in received:
        states = {
            (q + 1, repeated or q < p)
            for p, repeated in states
            for q in range(min(p + 1, len(expected)))
            if expected[q] == token
        }
    return "duplicated" if any(repeated for _, repeated in states) else "wrong"


def count_faults(log_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Injected faults, from the `faults: …` lines of every worker log (restarts included)."""
    counts = {"corrupted_frames": 0, "dropped_transfers": 0}
    for path in Path(log_dir).glob("*.log"):
        text = path.read_text(errors="replace")
        counts["corrupted_frames"] += text.count(CORRUPT_MARK)
        counts["dropped_transfers"] += text.count(DROP_MARK)
    return counts


def _latency(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p90_ms": None}
    ms = np.asarray(values) * 1e3
    return {
        "mean_ms": float(ms.mean()),
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
    }


@dataclasses.dataclass
class SoakReport:
    # The run's `SoakOptions` as a record (serving/loadgen/soak.py drives the run; the report
    # only renders what it was asked for, so it does not import the driver).
    options: dict[str, float | int]
    results: list[RequestResult]
    kills: list[dict]
    restarts: int
    faults: dict[str, int]
    router: dict[str, int]
    wall_s: float

    def counts(self) -> dict[str, int]:
        accepted = [r for r in self.results if r.outcome != "rejected"]
        outcomes = collections.Counter(r.outcome for r in self.results)
        return {
            "sent": len(self.results),
            "rejected": outcomes["rejected"],
            "accepted": len(accepted),
            "completed": outcomes["completed"],
            "failed": outcomes["failed"],
            "lost": outcomes["lost"],
            "duplicated": sum(r.duplicated for r in accepted),
            "wrong": sum(r.wrong for r in accepted),
        }

    def groups(self) -> dict[str, list[RequestResult]]:
        """Completed requests by what happened to them (attempts 0: a router without the
        field counts as one attempt)."""
        done = [r for r in self.results if r.outcome == "completed" and r.ttft_s is not None]
        return {
            "clean": [r for r in done if r.attempts <= 1],
            "retried": [r for r in done if r.attempts > 1 and r.resumed_from == 0],
            "resumed": [r for r in done if r.resumed_from > 0],
        }

    def _cost(self) -> dict[str, float | None]:
        """TTFT of requests retried before their first token minus that of clean ones."""
        groups = self.groups()
        clean = _latency([r.ttft_s for r in groups["clean"]])
        retried = _latency([r.ttft_s for r in groups["retried"]])
        return {
            k: None if clean[k] is None or retried[k] is None else retried[k] - clean[k]
            for k in ("mean_ms", "p50_ms")
        }

    def to_dict(self) -> dict:
        failed = [r for r in self.results if r.outcome == "failed"]
        return {
            "options": dict(self.options),
            "counts": self.counts(),
            "failures": {
                "codes": dict(collections.Counter(r.code for r in failed)),
                "time_to_failure": _latency([r.end_s for r in failed if r.end_s is not None]),
            },
            "latency": {
                name: {
                    "requests": len(group),
                    "ttft": _latency([r.ttft_s for r in group]),
                    "e2e": _latency([r.end_s for r in group]),
                }
                for name, group in self.groups().items()
            },
            "ttft_cost_of_retry_ms": self._cost(),
            "kills": self.kills,
            "restarts": self.restarts,
            "faults": {"kills": len(self.kills), **self.faults},
            "router": self.router,
            "wall_s": self.wall_s,
        }

    def format_table(self) -> str:
        d = self.to_dict()
        c, f = d["counts"], d["failures"]
        share = 100 * c["completed"] / max(c["accepted"], 1)
        codes = ", ".join(f"{k} {v}" for k, v in sorted(f["codes"].items())) or "-"
        worst = f["time_to_failure"]["p90_ms"]
        if worst is not None:
            codes += f"; P90 time to failure {worst / 1e3:.1f} s"
        roles = collections.Counter(k["role"] for k in self.kills)
        killed = ", ".join(f"{role} {n}" for role, n in sorted(roles.items())) or "-"
        counts = [
            ("requests sent", c["sent"], ""),
            ("rejected at admission", c["rejected"], ""),
            ("accepted", c["accepted"], ""),
            ("completed", c["completed"], f"({share:.1f}% of accepted)"),
            ("failed fast", c["failed"], f"({codes})"),
            ("lost (no answer)", c["lost"], ""),
            ("duplicated", c["duplicated"], ""),
            ("outputs wrong", c["wrong"], ""),
            ("workers killed (SIGKILL)", len(self.kills), f"({killed})"),
            ("workers restarted", self.restarts, ""),
            ("frames corrupted (injected)", self.faults["corrupted_frames"], ""),
            ("transfers dropped (injected)", self.faults["dropped_transfers"], ""),
            ("router retries", self.router.get("retries", 0), ""),
            ("requests resumed mid-stream", self.router.get("resumed", 0), ""),
        ]
        labels = {
            "clean": "1 attempt",
            "retried": "retried before 1st token",
            "resumed": "resumed mid-stream",
        }
        latency = []
        for name, g in d["latency"].items():
            cells = [g["ttft"][k] for k in ("mean_ms", "p50_ms", "p90_ms")]
            cells += [g["e2e"][k] for k in ("mean_ms", "p50_ms", "p90_ms")]
            latency.append(
                (labels[name], g["requests"], *("-" if v is None else f"{v:.0f}" for v in cells))
            )
        headers = ("completed requests (ms)", "n", "TTFT mean", "P50", "P90")
        headers += ("E2E mean", "P50", "P90")
        lines = [table(counts, align="lrl"), "", table(latency, headers)]
        cost = d["ttft_cost_of_retry_ms"]
        if cost["mean_ms"] is not None:
            lines.append(
                f"TTFT cost of a retry: {cost['mean_ms']:+.0f} ms mean, "
                f"{cost['p50_ms']:+.0f} ms P50"
            )
        arrivals = self.options["duration_s"]
        lines.append(f"wall time {self.wall_s:.0f} s ({arrivals:.0f} s of arrivals)")
        return "\n".join(lines)
