"""A bounded soak under faults: `SoakOptions`, `run_soak` → `SoakReport`, and `check_stream`.

`run_soak` starts a fake-engine cluster (serving/launcher.py, `restart_workers=True`; the
config's `[chaos]` section makes the prefill workers corrupt frames and drop transfers,
serving/chaos.py), sends Poisson arrivals at `rate` for `duration_s` — prompts half at or below
the routing threshold t (uniform on [8, t]) and half above (uniform on (t, min(4t, max_len −
max_new_tokens)]), greedy, max_new_tokens uniform on [8, 32] — while a killer thread SIGKILLs a
worker every `kill_every_s` (the roles in turn: PD decode, PrfaaS prefill, PD prefill; a random
instance of the role, except that a decode kill picks the decode worker with the most requests
mid-stream, so that it tests resumption), then waits for every request to end.

Per request, as the client sees it:

- rejected: RESOURCE_EXHAUSTED before any token (refused at admission); every other request is
  accepted;
- completed: the stream finished with a report; failed: it ended with another non-OK status
  (the code and the time to failure are kept); lost: neither, within `deadline_s` (a hang);
- duplicated: more tokens than asked, or tokens that read as the expected ones with some
  delivered again (`check_stream`: a replay from an earlier position);
- wrong: a completed request whose tokens ≠ `fake_tokens(prompt, n, V)` (duplicates included),
  or a failed or lost one whose tokens are not a prefix of it. Fake tokens depend on the whole
  sequence before them, so a request resumed from the wrong place gets wrong tokens.

The report adds the faults (kills; injected corruptions and drops, counted from the `chaos: …`
lines of the workers' logs; the launcher's restarts; the router's retries and resumed requests)
and their cost: TTFT and end-to-end latency of completed requests with one attempt, with
retries before the first token, and resumed mid-stream (`RequestReport.attempts`,
`resumed_from`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import grpc
import numpy as np

from prfaas_jax.config import load_model_config
from prfaas_jax.errors import UserError
from prfaas_jax.serving.chaos import CORRUPT_MARK, DROP_MARK
from prfaas_jax.serving.cluster_config import ClusterConfig
from prfaas_jax.serving.fake_engine import fake_tokens
from prfaas_jax.serving.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.security import router_channel

KILL_ORDER = ("pd_decode", "prfaas_prefill", "pd_prefill")
BUSY_WAIT_S = 3.0  # how long a decode kill waits for a decode worker with streams to cut


@dataclasses.dataclass(frozen=True)
class SoakOptions:
    duration_s: float = 180.0  # arrivals stop after this; the run then waits for the rest
    rate: float = 2.0  # requests per second (Poisson)
    kill_every_s: float = 20.0  # 0: no kills
    seed: int = 0
    min_new_tokens: int = 8
    max_new_tokens: int = 32
    deadline_s: float = 150.0  # a request still open this long after it was sent is lost

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and self.rate > 0 and self.deadline_s > 0):
            raise UserError("duration, rate and deadline must be positive")
        if self.kill_every_s < 0:
            raise UserError("kill_every_s must be ≥ 0")
        if not 1 <= self.min_new_tokens <= self.max_new_tokens:
            raise UserError("need 1 ≤ min_new_tokens ≤ max_new_tokens")


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

    @property
    def duplicated(self) -> bool:
        return check_stream(self.tokens, self.expected) == "duplicated"

    @property
    def wrong(self) -> bool:
        if self.outcome == "completed":
            return self.tokens != self.expected
        return self.tokens != self.expected[: len(self.tokens)]


def check_stream(received: Sequence[int], expected: Sequence[int]) -> str:
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


def _workload(options: SoakOptions, config: ClusterConfig, vocab: int) -> list[tuple]:
    """(send offset, prompt, max_new_tokens) for every request of the run."""
    rng = random.Random(options.seed)
    t = max(int(config.router.threshold), 8)
    longest = max(min(4 * t, config.engine.max_len - options.max_new_tokens + 1), t + 1)
    plan, offset = [], rng.expovariate(options.rate)
    while offset < options.duration_s:
        length = rng.randint(8, t) if rng.random() < 0.5 else rng.randint(t + 1, longest)
        prompt = [rng.randrange(vocab) for _ in range(length)]
        n = rng.randint(options.min_new_tokens, options.max_new_tokens)
        plan.append((offset, prompt, n))
        offset += rng.expovariate(options.rate)
    return plan


def _send(
    stub: pb_grpc.RouterStub, result: RequestResult, request_id: str, deadline: float
) -> None:
    request = pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=result.prompt, max_new_tokens=result.max_new_tokens
    )
    try:
        for message in stub.Generate(request, timeout=deadline):
            if message.token_ids and result.ttft_s is None:
                result.ttft_s = time.monotonic() - result.sent
            result.tokens.extend(message.token_ids)
            if message.finished:
                report = message.report
                result.outcome, result.route = "completed", report.route
                result.attempts, result.resumed_from = report.attempts, report.resumed_from
    except grpc.RpcError as err:
        code = err.code()
        hung = code is grpc.StatusCode.DEADLINE_EXCEEDED
        if hung and time.monotonic() - result.sent >= 0.99 * deadline:
            result.outcome = "lost"  # the client's own deadline: no answer came
        elif code is grpc.StatusCode.RESOURCE_EXHAUSTED and not result.tokens:
            result.outcome, result.code = "rejected", code.name
        else:
            result.outcome, result.code = "failed", code.name
    result.end_s = time.monotonic() - result.sent


class _Killer(threading.Thread):
    """SIGKILLs a worker every `every_s` seconds until `stop` is set: the roles in KILL_ORDER
    in turn, a random instance of the role — but a decode kill first waits up to BUSY_WAIT_S
    for a decode worker that has requests mid-stream (`active_slots` from the router's stats)
    and kills the busiest, so decode kills test resumption rather than an idle process."""

    def __init__(
        self,
        cluster: ClusterProcesses,
        every_s: float,
        seed: int,
        active_slots: Callable[[], dict[str, int]],
    ) -> None:
        super().__init__(name="soak-killer", daemon=True)
        self.cluster, self.every_s, self.rng = cluster, every_s, random.Random(seed + 1)
        self.active_slots = active_slots
        self.stop = threading.Event()
        self.kills: list[dict] = []
        assert cluster.ready is not None
        self.by_role = collections.defaultdict(list)
        for name, info in cluster.ready["workers"].items():
            self.by_role[info["role"]].append(name)
        self.started = 0.0

    def run(self) -> None:
        self.started = time.monotonic()
        roles = [role for role in KILL_ORDER if self.by_role[role]]
        turn = 0
        while roles and not self.stop.wait(self.every_s):
            role = roles[turn % len(roles)]
            turn += 1
            names = self.by_role[role][:]
            self.rng.shuffle(names)
            if role == "pd_decode":
                names = self._busiest_first(names)
            for name in names:
                pid = self.cluster.worker_pid(name)
                if pid is None:
                    continue  # being replaced: try another instance of the role
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                at = time.monotonic() - self.started
                self.kills.append({"at_s": round(at, 2), "name": name, "role": role, "pid": pid})
                break

    def _busiest_first(self, names: list[str]) -> list[str]:
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            active = self.active_slots()
            if any(active.get(name, 0) for name in names) or time.monotonic() > deadline:
                return sorted(names, key=lambda name: -active.get(name, 0))
            if self.stop.wait(0.1):
                return names


def count_faults(log_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Injected faults, from the `chaos: …` lines of every worker log (restarts included)."""
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
    options: SoakOptions
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
            "options": dataclasses.asdict(self.options),
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
        roles = collections.Counter(k["role"] for k in self.kills)
        killed = ", ".join(f"{role} {n}" for role, n in sorted(roles.items())) or "-"
        lines = [
            f"{'requests sent':<34}{c['sent']:>8}",
            f"{'rejected at admission':<34}{c['rejected']:>8}",
            f"{'accepted':<34}{c['accepted']:>8}",
            f"{'completed':<34}{c['completed']:>8}  ({share:.1f}% of accepted)",
            f"{'failed fast':<34}{c['failed']:>8}  ({codes}"
            + (f"; P90 time to failure {worst / 1e3:.1f} s)" if worst is not None else ")"),
            f"{'lost (no answer)':<34}{c['lost']:>8}",
            f"{'duplicated':<34}{c['duplicated']:>8}",
            f"{'outputs wrong':<34}{c['wrong']:>8}",
            f"{'workers killed (SIGKILL)':<34}{len(self.kills):>8}  ({killed})",
            f"{'workers restarted':<34}{self.restarts:>8}",
            f"{'frames corrupted (injected)':<34}{self.faults['corrupted_frames']:>8}",
            f"{'transfers dropped (injected)':<34}{self.faults['dropped_transfers']:>8}",
            f"{'router retries':<34}{self.router.get('retries', 0):>8}",
            f"{'requests resumed mid-stream':<34}{self.router.get('resumed', 0):>8}",
            "",
            f"{'completed requests':<28}{'n':>5}{'TTFT mean':>11}{'P50':>8}{'P90':>8}"
            f"{'E2E mean':>10}{'P50':>8}{'P90':>8}  (ms)",
        ]
        labels = {
            "clean": "1 attempt",
            "retried": "retried before 1st token",
            "resumed": "resumed mid-stream",
        }
        for name, g in d["latency"].items():
            cells = [g["ttft"][k] for k in ("mean_ms", "p50_ms", "p90_ms")]
            cells += [g["e2e"][k] for k in ("mean_ms", "p50_ms", "p90_ms")]
            text = ["-" if v is None else f"{v:.0f}" for v in cells]
            lines.append(
                f"{labels[name]:<28}{g['requests']:>5}{text[0]:>11}{text[1]:>8}{text[2]:>8}"
                f"{text[3]:>10}{text[4]:>8}{text[5]:>8}"
            )
        cost = d["ttft_cost_of_retry_ms"]
        if cost["mean_ms"] is not None:
            lines.append(
                f"TTFT cost of a retry: {cost['mean_ms']:+.0f} ms mean, "
                f"{cost['p50_ms']:+.0f} ms P50"
            )
        arrivals = self.options.duration_s
        lines.append(f"wall time {self.wall_s:.0f} s ({arrivals:.0f} s of arrivals)")
        return "\n".join(lines)


def _active_slots(stub: pb_grpc.RouterStub) -> dict[str, int]:
    """Each worker's active decode slots as the router last polled them."""
    try:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=2)
    except grpc.RpcError:
        return {}
    return {w.name: w.active_slots for w in stats.workers}


def _router_counts(stub: pb_grpc.RouterStub) -> dict[str, int]:
    try:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    except grpc.RpcError:
        return {}
    return {
        "retries": stats.retries,
        "resumed": stats.resumed,
        "rejected": stats.rejected,
        "failed": stats.requests_failed,
    }


def run_soak(
    config_path: str | os.PathLike[str],
    options: SoakOptions,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    progress: TextIO | None = sys.stderr,
) -> SoakReport:
    """Start the cluster of `config_path` (fake engines), run the soak, stop the cluster."""
    started = time.monotonic()
    with ClusterProcesses(config_path, log_dir=log_dir, restart_workers=True) as cluster:
        config = cluster.config
        if config.model.engine != "fake":
            raise UserError(
                f"{config.path}: the soak checks outputs by hand: [model] engine = fake"
            )
        vocab = load_model_config(config.model.preset).vocab_size
        ready = cluster.start()
        plan = _workload(options, config, vocab)
        results: list[RequestResult] = []
        with router_channel(ready["router"], config.security) as channel:
            stub = pb_grpc.RouterStub(channel)
            killer = None
            if options.kill_every_s:
                busy = functools.partial(_active_slots, stub)
                killer = _Killer(cluster, options.kill_every_s, options.seed, busy)
            threads, start = [], time.monotonic()
            if killer is not None:
                killer.start()
            next_note = 10.0
            for i, (offset, prompt, n) in enumerate(plan):
                while (wait := start + offset - time.monotonic()) > 0:
                    time.sleep(min(wait, 0.5))
                    if progress and time.monotonic() - start >= next_note:
                        done = sum(r.end_s is not None for r in results)
                        kills = len(killer.kills) if killer else 0
                        print(
                            f"soak: {next_note:.0f} s, {len(results)} sent, {done} ended, "
                            f"{kills} kills",
                            file=progress,
                            flush=True,
                        )
                        next_note += 10.0
                expected = fake_tokens(prompt, n, vocab)
                result = RequestResult(prompt, n, expected, sent=time.monotonic())
                results.append(result)
                thread = threading.Thread(
                    target=_send, args=(stub, result, f"soak-{i:05d}", options.deadline_s)
                )
                thread.start()
                threads.append(thread)
            if killer is not None:
                killer.stop.set()
                killer.join()
            for thread in threads:
                thread.join(options.deadline_s + 10)
            router = _router_counts(stub)
        faults = count_faults(cluster.log_dir)
        restarts = cluster.restarts
    return SoakReport(
        options=options,
        results=results,
        kills=killer.kills if killer else [],
        restarts=restarts,
        faults=faults,
        router=router,
        wall_s=time.monotonic() - started,
    )
