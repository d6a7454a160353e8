"""What a serving run sums to, for bench/serving.py: `Reply` (one request as the client timed
it), `Objective` (the latency objective goodput counts against), `summarize` (one server at one
request rate), `compare` (the two servers side by side, with their goodput ratios) and
`format_table`.

Definitions, as `vllm bench serve` and DistServe state them: TTFT is send → first token; ITL the
gaps between token-carrying chunks after it; TPOT = (E2EL − TTFT) / (n − 1) over a reply's n
tokens; throughput = completed requests (output tokens) over the run's wall time, first send to
last reply; goodput = the requests that meet every objective over the same time. A request that
failed, or came back with fewer tokens than asked, counts in neither. Pure Python and NumPy: the
arithmetic is tested against hand-computed numbers (tests/serving/test_serving_bench.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)


@dataclasses.dataclass
class Reply:
    """One request as the client saw it: times in seconds from its send."""

    prompt_len: int
    max_tokens: int
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Answered in full: no error, a first token, and every token asked for."""
        return (
            self.error is None
            and self.ttft is not None
            and self.e2el is not None
            and self.output_tokens == self.max_tokens
        )

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclasses.dataclass(frozen=True)
class Objective:
    """The latency objective a request must meet to count in goodput, in milliseconds."""

    ttft_ms: float
    tpot_ms: float

    def met_by(self, reply: Reply) -> bool:
        tpot = reply.tpot
        return (
            reply.complete
            and reply.ttft * 1e3 <= self.ttft_ms
            and (tpot is None or tpot * 1e3 <= self.tpot_ms)
        )


def percentiles_ms(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """``{"p50": …, …}`` in milliseconds (NumPy's linear interpolation); NaN for no values."""
    ms = np.asarray(values, dtype=float) * 1e3
    return {f"p{p:g}": float(np.percentile(ms, p)) if ms.size else math.nan for p in percentiles}


def summarize(replies: Sequence[Reply], duration_s: float, objective: Objective) -> dict:
    """One server at one request rate (module docstring)."""
    done = [r for r in replies if r.complete]
    errors = sorted({r.error or "short reply" for r in replies if not r.complete})
    return {
        "requests": len(replies),
        "completed": len(done),
        "failed": len(replies) - len(done),
        "errors": errors[:3],
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_throughput": sum(r.output_tokens for r in done) / duration_s,
        "goodput": sum(objective.met_by(r) for r in replies) / duration_s,
        "met_objective": sum(objective.met_by(r) for r in replies),
        "ttft_ms": percentiles_ms([r.ttft for r in done]),
        "itl_ms": percentiles_ms([gap for r in done for gap in r.itl]),
        "tpot_ms": percentiles_ms([r.tpot for r in done if r.tpot is not None]),
    }


def _ratio(ours: float, theirs: float) -> float:
    if theirs > 0:
        return ours / theirs
    return math.inf if ours > 0 else math.nan


def compare(ours: dict[float, dict], theirs: dict[float, dict]) -> dict:
    """Both servers' summaries by request rate → the goodput ratio at each rate, and of each
    server's best goodput over the sweep ("at the best rate for both")."""
    rates = sorted(set(ours) & set(theirs))
    best_ours = max((ours[r]["goodput"] for r in rates), default=0.0)
    best_theirs = max((theirs[r]["goodput"] for r in rates), default=0.0)
    return {
        "goodput_ratio": {r: _ratio(ours[r]["goodput"], theirs[r]["goodput"]) for r in rates},
        "throughput_ratio": {
            r: _ratio(ours[r]["output_throughput"], theirs[r]["output_throughput"]) for r in rates
        },
        "best_goodput": {"prfaas": best_ours, "transformers": best_theirs},
        "best_goodput_ratio": _ratio(best_ours, best_theirs),
    }


def _x(value: float) -> str:
    return "–" if math.isnan(value) else ("∞" if math.isinf(value) else f"{value:.1f}x")


def format_table(ours: dict[float, dict], theirs: dict[float, dict], ratios: dict) -> str:
    """A Markdown table: a row per server and rate, and the ratios."""
    header = (
        "| rate (req/s) | server | done | req/s | out tok/s | goodput (req/s) "
        "| TTFT P50 / P90 / P99 (ms) | ITL P50 / P90 / P99 (ms) | goodput ratio |"
    )
    lines = [header, "|" + "---|" * 9]
    for rate in sorted(ratios["goodput_ratio"]):
        for name, runs in (("prfaas serve", ours), ("transformers serve", theirs)):
            s = runs[rate]
            ttft = " / ".join(f"{v:,.0f}" for v in s["ttft_ms"].values())
            itl = " / ".join(f"{v:,.1f}" for v in s["itl_ms"].values())
            ratio = _x(ratios["goodput_ratio"][rate]) if name == "prfaas serve" else ""
            lines.append(
                f"| {rate:g} | {name} | {s['completed']}/{s['requests']} "
                f"| {s['request_throughput']:.2f} | {s['output_throughput']:.1f} "
                f"| {s['goodput']:.2f} | {ttft} | {itl} | {ratio} |"
            )
    best = ratios["best_goodput"]
    lines.append(
        f"\nbest goodput over the sweep: prfaas serve {best['prfaas']:.2f} req/s, transformers "
        f"serve {best['transformers']:.2f} req/s: {_x(ratios['best_goodput_ratio'])}"
    )
    return "\n".join(lines)
