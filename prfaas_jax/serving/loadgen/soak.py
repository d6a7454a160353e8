"""A bounded soak under faults (`prfaas soak`): `SoakOptions` and `run_soak` → `SoakReport`,
with `SoakProgress` for a progress display.

`run_soak` starts a fake-engine cluster (serving/cluster/launcher.py, `restart_workers=True`; the
config's `[faults]` section makes the prefill workers corrupt frames and drop transfers,
serving/transfer/faults.py), sends Poisson arrivals at `rate` for `duration_s` — prompts half at or
below the routing threshold t (uniform on [8, t]) and half above (uniform on (t, min(4t, max_len −
max_new_tokens)]), greedy, max_new_tokens uniform on [8, 32] — while a killer thread SIGKILLs a
worker every `kill_every_s` (the roles in turn: PD decode, PrfaaS prefill, PD prefill; a random
instance of the role, except that a decode kill picks the decode worker with the most requests
mid-stream, so that it tests resumption), then waits for every request to end.

The report — what each request's outcome is, and what the run's faults cost — is
serving/loadgen/soak_report.py (`SoakReport`, `classify_stream`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import random
import signal
import threading
import time
from collections.abc import Callable

import grpc

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster_config import ClusterConfig
from prfaas_jax.serving.cluster_sections import EngineKind
from prfaas_jax.serving.loadgen.soak_report import RequestResult, SoakReport, count_faults
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.security import router_channel

KILL_ORDER = ("pd_decode", "prfaas_prefill", "pd_prefill")
BUSY_WAIT_S = 3.0  # how long a decode kill waits for a decode worker with streams to cut
REPLACE_WAIT_S = 60.0  # how long the report waits for the last killed worker's replacement


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


def send(
    stub: pb_grpc.RouterStub,
    result: RequestResult,
    request_id: str,
    deadline: float,
    sampling: SamplingParams = GREEDY,
    wire_precision: str = "",
) -> None:
    """Stream one request (greedy, or seeded-sampled with ``sampling``; its PrfaaS state asked
    to cross in ``wire_precision``, "" for the cluster's) into ``result``."""
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=result.prompt,
        max_new_tokens=result.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        wire_precision=wire_precision,
    )
    if not sampling.greedy:
        request.seed = sampling.seed
    try:
        for message in stub.Generate(request, timeout=deadline):
            if message.token_ids and result.ttft_s is None:
                result.ttft_s = time.monotonic() - result.sent
            result.tokens.extend(message.token_ids)
            if message.finished:
                report = message.report
                result.outcome, result.route = "completed", report.route
                result.attempts, result.resumed_from = report.attempts, report.resumed_from
                result.wire_precision = report.wire_precision
                result.cached_len = report.cached_len
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
                # The pid of the instance's serving process; a replacement still booting (a
                # slow machine) has another, and killing it would count a kill no restart answers.
                assert self.cluster.ready is not None
                if pid is None or pid != self.cluster.ready["workers"][name]["pid"]:
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


def active_slots_of(stub: pb_grpc.RouterStub) -> dict[str, int]:
    """Each worker's active decode slots as the router last polled them."""
    try:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=2)
    except grpc.RpcError:
        return {}
    return {w.name: w.active_slots for w in stats.workers}


def router_counts(stub: pb_grpc.RouterStub) -> dict[str, int]:
    try:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    except grpc.RpcError:
        return {}
    return {
        "retries": stats.retries,
        "resumed": stats.resumed,
        "rejected": stats.rejected,
        "failed": stats.requests_failed,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
    }


@dataclasses.dataclass(frozen=True)
class SoakProgress:
    """Where a run stands, for a progress display."""

    elapsed_s: float  # since arrivals began
    sent: int
    ended: int  # requests whose stream has ended, whatever the outcome
    kills: int


def run_soak(
    config_path: str | os.PathLike[str],
    options: SoakOptions,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[SoakProgress], None] | None = None,
) -> SoakReport:
    """Start the cluster of `config_path` (fake engines), run the soak, stop the cluster.

    ``progress`` is called about twice a second while requests are sent and as they end.
    """
    started = time.monotonic()
    with ClusterProcesses(config_path, log_dir=log_dir, restart_workers=True) as cluster:
        config = cluster.config
        if config.model.engine is not EngineKind.FAKE:
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
                busy = functools.partial(active_slots_of, stub)
                killer = _Killer(cluster, options.kill_every_s, options.seed, busy)
            threads, start = [], time.monotonic()

            def report() -> None:
                if progress is not None:
                    ended = sum(r.end_s is not None for r in results)
                    kills = len(killer.kills) if killer else 0
                    progress(SoakProgress(time.monotonic() - start, len(results), ended, kills))

            if killer is not None:
                killer.start()
            for i, (offset, prompt, n) in enumerate(plan):
                while (wait := start + offset - time.monotonic()) > 0:
                    time.sleep(min(wait, 0.5))
                    report()
                expected = fake_tokens(prompt, n, vocab)
                result = RequestResult(prompt, n, expected, sent=time.monotonic())
                results.append(result)
                thread = threading.Thread(
                    target=send, args=(stub, result, f"soak-{i:05d}", options.deadline_s)
                )
                thread.start()
                threads.append(thread)
            if killer is not None:
                killer.stop.set()
                killer.join()
            for thread in threads:
                thread.join(options.deadline_s + 10)
                report()
            # The report says whether the cluster healed: every kill answered by a replacement
            # (a slow machine may still be booting the last one when the requests end).
            deadline = time.monotonic() + REPLACE_WAIT_S
            kills = len(killer.kills) if killer else 0
            while cluster.restarts < kills and time.monotonic() < deadline:
                time.sleep(0.2)
            router = router_counts(stub)
        faults = count_faults(cluster.log_dir)
        restarts = cluster.restarts
    return SoakReport(
        options=dataclasses.asdict(options),
        results=results,
        kills=killer.kills if killer else [],
        restarts=restarts,
        faults=faults,
        router=router,
        wall_s=time.monotonic() - started,
    )
