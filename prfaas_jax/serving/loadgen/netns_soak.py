"""The soak over the emulated WAN (`prfaas soak --netns`): `NetnsSoakOptions` and
`run_netns_soak` → `NetnsSoakReport`; `mixed_workload`, the requests of a run.

`run_netns_soak` starts the cluster of a fake-engine config with a link in packets
(configs/clusters/soak-wan.toml: the PrfaaS and PD clusters in network namespaces of their own,
joined through the delay line of a third, serving/cluster/netns.py and wan.py) with worker
restarts on, and an OpenAI front door (`prfaas openai`) in front of its router; sends Poisson
arrivals at `rate` for `duration_s` while a `FaultRunner` (serving/loadgen/fault_runner.py)
applies the seeded `fault_schedule` (serving/loadgen/fault_schedule.py); samples the RSS of
every process (the launcher, the router, each worker and its replacements, the delay line, the
front door) every `rss_every_s` (the report judges whether each stayed bounded:
serving/loadgen/soak_memory.py); then waits for every request to end and stops everything.

The requests (`mixed_workload`): prompt lengths half at or below the routing threshold t, the
rest above it up to 4t, and a share `long_share` long ones, from 4K tokens up to `longest` (16K
by default: the fake engine holds a real state of that length, so the codec carries it);
`prefix_share` of them open with one of four shared prefixes of 256-1024 tokens (the prefill
workers' prefix caches reuse them); `sampled_share` sampled with a seed
(temperature 0.8, top-p 0.875, top-k 0 or 50), the rest greedy; max_new_tokens uniform on [8, 32];
`frontdoor_share` of all, greedy ones, through the front door (streamed completions), the rest
on the router's gRPC API. Those ask, in turn, each wire precision of `WIRE_MIX` (native, bf16,
int8, fp8_e4m3: `GenerateRequest.wire_precision`) for their state when it crosses the link on
the PrfaaS route; front-door requests cross in the config's `[link] precision`; PD pushes are
native. The fake decode engines take a state as its precision delivers it and nothing else
(engine/fake.py).

Each request is judged by the soak's oracle (serving/loadgen/soak_report.py): the fake engines'
tokens for that prompt and sampling, which depend on the whole sequence and the sampling key, so
a state resumed from the wrong place or sampled with the wrong key shows as wrong; front-door
requests on their text, the byte tokenizer's decode of those tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster_config import ClusterConfig, instance_roles
from prfaas_jax.serving.cluster_sections import EngineKind
from prfaas_jax.serving.loadgen.fault_runner import RECOVER_WAIT_S, FaultRunner
from prfaas_jax.serving.loadgen.fault_schedule import fault_schedule
from prfaas_jax.serving.loadgen.netns_soak_report import NetnsSoakReport, corrupt_detections
from prfaas_jax.serving.loadgen.soak import SoakProgress, router_counts, send
from prfaas_jax.serving.loadgen.soak_frontdoor import FrontDoorProcess, send_http
from prfaas_jax.serving.loadgen.soak_report import RequestResult, count_faults
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.lifecycle import write_json
from prfaas_jax.serving.transport.security import router_channel
from prfaas_jax.wire_precision import ENCODINGS

LONG_FROM = 4096
PREFIXES = 4
WIRE_MIX = ENCODINGS  # asked in turn by the requests on the router's API


@dataclasses.dataclass(frozen=True)
class NetnsSoakOptions:
    duration_s: float = 600.0  # arrivals stop after this; the run then waits for the rest
    rate: float = 2.0  # requests per second (Poisson)
    seed: int = 0
    deadline_s: float = 150.0  # a request still open this long after it was sent is lost
    min_new_tokens: int = 8
    max_new_tokens: int = 32
    long_share: float = 0.05
    longest: int = 16384
    prefix_share: float = 0.3
    sampled_share: float = 0.5
    frontdoor_share: float = 0.15
    rss_every_s: float = 5.0

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and self.rate > 0 and self.deadline_s > 0):
            raise UserError("duration, rate and deadline must be positive")
        if not 1 <= self.min_new_tokens <= self.max_new_tokens:
            raise UserError("need 1 ≤ min_new_tokens ≤ max_new_tokens")
        shares = (self.long_share, self.prefix_share, self.sampled_share, self.frontdoor_share)
        if not all(0 <= share <= 1 for share in shares):
            raise UserError("the workload's shares must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Planned:
    offset_s: float
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    frontdoor: bool = False
    wire_precision: str = ""  # asked for the PrfaaS push; "": the config's


def mixed_workload(options: NetnsSoakOptions, config: ClusterConfig, vocab: int) -> list[Planned]:
    """Every request of the run, in send order (module docstring)."""
    rng = random.Random(options.seed)
    t = max(int(config.router.threshold), 8)
    room = config.engine.max_len - options.max_new_tokens + 1
    longest = min(options.longest, room)
    prefixes = [
        [rng.randrange(vocab) for _ in range(rng.randint(256, 1024))] for _ in range(PREFIXES)
    ]
    plan, offset = [], rng.expovariate(options.rate)
    while offset < options.duration_s:
        draw = rng.random()
        if draw < options.long_share and longest > LONG_FROM:
            length = rng.randint(LONG_FROM, longest)
        elif draw < options.long_share + (1 - options.long_share) / 2:
            length = rng.randint(8, t)
        else:
            length = rng.randint(t + 1, min(4 * t, room))
        prompt = [rng.randrange(vocab) for _ in range(length)]
        if rng.random() < options.prefix_share:
            prompt = [*rng.choice(prefixes), *prompt[: rng.randint(8, t)]][:room]
        n = rng.randint(options.min_new_tokens, options.max_new_tokens)
        sampling, frontdoor = GREEDY, False
        if rng.random() < options.sampled_share:
            top_k = rng.choice((0, 50))
            # top-p 0.875 is exact in float32, the wire's type: the oracle keeps what the
            # engines keep (⌊top_k · top_p⌋ candidates).
            sampling = SamplingParams(0.8, top_k, 0.875, rng.randrange(2**63))
        else:
            frontdoor = rng.random() < options.frontdoor_share / (1 - options.sampled_share)
        wire = "" if frontdoor else WIRE_MIX[len(plan) % len(WIRE_MIX)]
        plan.append(Planned(round(offset, 4), prompt, n, sampling, frontdoor, wire))
        offset += rng.expovariate(options.rate)
    return plan


class RssSampler(threading.Thread):
    """The resident memory of every process of the run, every `every_s`: (seconds since start,
    process label, pid, RSS bytes) rows in `samples`."""

    def __init__(self, processes: Callable[[], dict[str, int]], every_s: float) -> None:
        super().__init__(name="soak-rss", daemon=True)
        self.processes, self.every_s = processes, every_s
        self.samples: list[tuple[float, str, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while True:
            now = time.monotonic() - start
            for label, pid in self.processes().items():
                if (rss := rss_bytes(pid)) is not None:
                    self.samples.append((round(now, 2), label, pid, rss))
            if self.stop.wait(self.every_s):
                return


def rss_bytes(pid: int) -> int | None:
    """VmRSS of ``pid`` (None: gone, or a zombie)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _processes(cluster: ClusterProcesses, frontdoor: FrontDoorProcess) -> dict[str, int]:
    labels = {"soak": os.getpid()}
    for child in list(cluster.children):
        for process in child.group():
            labels[process.log_path.stem] = process.popen.pid
    if (pid := frontdoor.pid) is not None:
        labels[f"frontdoor-{frontdoor.starts}"] = pid
    return labels


def memory_budgets(config: ClusterConfig) -> dict[str, float]:
    """The MiB each process may fill by its configuration (serving/loadgen/soak_memory.py): a
    prefill worker its prefix cache."""
    if not config.prefix_cache.enabled:
        return {}
    return {
        name: float(config.prefix_cache.capacity_mib)
        for name, role in instance_roles(config).items()
        if role.is_prefill
    }


def _busy(stub: pb_grpc.RouterStub) -> dict[str, int]:
    """Each worker's requests in hand as the router last polled them: prefill queue, decode
    slots and states still arriving."""
    try:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=2)
    except grpc.RpcError:
        return {}
    return {w.name: w.queue_depth + w.active_slots + w.pending_states for w in stats.workers}


class _Requests:
    """Starts each request on a thread of its own and keeps its `RequestResult`."""

    def __init__(
        self, stub, frontdoor: FrontDoorProcess, model: str, vocab: int, deadline_s: float
    ):
        self.stub, self.frontdoor, self.model = stub, frontdoor, model
        self.vocab, self.deadline_s = vocab, deadline_s
        self.results: list[RequestResult] = []
        self.sampling: list[SamplingParams] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def start(self, planned: Planned) -> None:
        expected = fake_tokens(planned.prompt, planned.max_new_tokens, self.vocab, planned.sampling)
        if planned.frontdoor:
            expected = list(ByteTokenizer().decode(expected).encode())
        result = RequestResult(
            planned.prompt, planned.max_new_tokens, expected, sent=time.monotonic()
        )
        with self.lock:
            index = len(self.results)
            self.results.append(result)
            self.sampling.append(planned.sampling)
        if planned.frontdoor:
            target = functools.partial(
                send_http, self.frontdoor, self.model, result, self.deadline_s
            )
        else:
            target = functools.partial(
                send,
                self.stub,
                result,
                f"soak-{index:05d}",
                self.deadline_s,
                planned.sampling,
                planned.wire_precision,
            )
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self.threads.append(thread)

    def ended(self) -> int:
        return sum(r.end_s is not None for r in list(self.results))


def _load(requests: _Requests, rng: random.Random, vocab: int, t: int, kind: str) -> None:
    """Requests that the fault `kind` will find in flight: long PrfaaS prompts before the
    PrfaaS prefill worker is asked to stop, streamed completions before the front door is."""
    for _ in range(3):
        if kind == "sigterm:frontdoor":
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 4 * t))]
            requests.start(Planned(0.0, prompt, 48, frontdoor=True))
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(LONG_FROM, 2 * LONG_FROM))]
            requests.start(Planned(0.0, prompt, 16))


def run_netns_soak(
    config_path: str | os.PathLike[str],
    options: NetnsSoakOptions,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[SoakProgress], None] | None = None,
) -> NetnsSoakReport:
    """Start the cluster of `config_path` under `--netns` with its front door, run the soak
    with the fault schedule, stop everything (also on Ctrl-C)."""
    started = time.monotonic()
    cluster = ClusterProcesses(config_path, log_dir=log_dir, restart_workers=True, netns=True)
    with cluster:
        config = cluster.config
        if config.model.engine is not EngineKind.FAKE:
            raise UserError(
                f"{config.path}: the soak checks outputs by hand: [model] engine = fake"
            )
        if not config.link.in_packets:
            raise UserError(
                f"{config.path}: the soak's link faults need the delay line: set [link] rtt_ms"
            )
        vocab = load_model_config(config.model.preset).vocab_size
        ready = cluster.start()
        ready_file = cluster.log_dir / "ready.json"
        write_json(ready_file, ready)
        frontdoor = FrontDoorProcess(ready_file, cluster.log_dir)
        runner = sampler = None
        try:
            frontdoor.start()
            if not frontdoor.wait_serving(0):
                raise UserError(f"the front door did not start: see {cluster.log_dir}")
            with router_channel(ready["router"], config.security) as channel:
                stub = pb_grpc.RouterStub(channel)
                model, deadline = config.model.preset, options.deadline_s
                requests = _Requests(stub, frontdoor, model, vocab, deadline)
                rng = random.Random(options.seed + 3)
                t = max(int(config.router.threshold), 8)
                faults = fault_schedule(options.duration_s, options.seed)
                runner = FaultRunner(
                    cluster,
                    faults,
                    seed=options.seed,
                    frontdoor=frontdoor,
                    busy=functools.partial(_busy, stub),
                    load=functools.partial(_load, requests, rng, vocab, t),
                )
                sampler = RssSampler(
                    functools.partial(_processes, cluster, frontdoor), options.rss_every_s
                )
                plan = mixed_workload(options, config, vocab)
                start = runner.start_time = time.monotonic()

                def report() -> None:
                    if progress is not None:
                        elapsed = time.monotonic() - start
                        sent, ended = len(requests.results), requests.ended()
                        progress(SoakProgress(elapsed, sent, ended, len(runner.injections)))

                runner.start()
                sampler.start()
                for planned in plan:
                    while (wait := start + planned.offset_s - time.monotonic()) > 0:
                        time.sleep(min(wait, 0.5))
                        report()
                    requests.start(planned)
                # The last fault ended before the arrivals did; its recovery may take longer.
                runner.join(RECOVER_WAIT_S + 60)
                runner.stop.set()
                runner.join()
                for thread in list(requests.threads):
                    thread.join(options.deadline_s + 10)
                    report()
                sampler.stop.set()
                sampler.join()
                router = router_counts(stub)
        finally:
            if runner is not None:
                runner.stop.set()
                if runner.is_alive():
                    runner.join(30)
                runner.undo()
            if sampler is not None:
                sampler.stop.set()
            frontdoor.stop()
        faults_seen = count_faults(cluster.log_dir)
        corrupt_ids, unexplained = corrupt_detections(cluster.log_dir)
        restarts = cluster.restarts
    return NetnsSoakReport(
        options=dataclasses.asdict(options),
        results=requests.results,
        sampled=[not s.greedy for s in requests.sampling],
        injections=runner.injections,
        schedule=[dataclasses.asdict(f) for f in faults],
        restarts=restarts,
        faults=faults_seen,
        router=router,
        rss=sampler.samples,
        start=start,
        wall_s=time.monotonic() - started,
        corrupt_ids=corrupt_ids,
        checksum_unexplained=unexplained,
        memory_budgets=memory_budgets(config),
        link_precision=str(config.link.wire_precision),
    )
