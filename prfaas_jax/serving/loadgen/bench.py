"""`prfaas bench`: a load generator for a running router, with `vllm bench serve` conventions.

Exposes `BenchOptions`, `LinkDevice`, `InputDist`, `BenchResult` (one request as the client
timed it), `arrival_times`, `input_lengths`, `make_prompts` and `run_bench`; what a run's
records sum to, and the table, are serving/loadgen/bench_report.py (`summarize`,
`format_summary`).

Arrivals (vLLM's `get_request`): inter-arrival gaps ~ Gamma(shape = burstiness,
scale = 1 / (rate · burstiness)), so the mean gap is 1/rate for any burstiness (1: Poisson,
< 1: burstier, large: nearly even), then rescaled so the whole run spans exactly N / rate;
rate = inf sends everything at once. `max_concurrency` caps requests in flight.

Input lengths: `fixed`, `uniform` (input_len · [1 − r, 1 + r]), `lognormal` (ln L ~ N(μ, σ²)
truncated to [1, max]), or `paper`: the PrfaaS case study's truncated log-normal
(μ = 9.90, σ = 1.00 on [128, 131072], arXiv 2604.15039 §4.1) scaled by `length_scale`:
μ + ln(scale) on [128·scale, 131072·scale], so its shape survives on a toy model. Prompts are
random token ids. With `prefix_len` P, each prompt opens with one of `num_prefixes` shared
random P-token prefixes, picked uniformly (a system prompt, a few-shot header: what prefix
caches and the router's cache index are for), and the length drawn is the rest's.

Each request is timed as vLLM times it: the send, the first token, the gap before each
token-carrying message, the end. With `openai_url` the requests go through an OpenAI front door
instead (`prfaas openai`), timed from its SSE stream as `vllm bench serve` times it
(serving/loadgen/openai_client.py). Besides the records `run_bench` returns the run's context:
the router's egress counter and threshold before and after, its costs (`_router_costs`) and,
given the link's network device (`LinkDevice`: under `prfaas serve --netns`, the ready file names
it), the bytes the kernel sent through it.

A router behind TLS or a bearer token (the `[security]` section, serving/transport/security.py) is
reached with `security`: its CA certificate, and the token file or a client certificate.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.loadgen.openai_client import HTTPError, parse_base_url, stream_completion
from prfaas_jax.serving.loadgen.warm_wait import wait_warm
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.kernel_link import KernelLinkError, device_bytes
from prfaas_jax.serving.transport.security import read_token, router_channel

PAPER_MU, PAPER_SIGMA, PAPER_MIN, PAPER_MAX = 9.90, 1.00, 128, 131072


class InputDist(enum.StrEnum):
    """How prompt lengths are drawn (`--input-dist`; module docstring)."""

    FIXED = "fixed"
    UNIFORM = "uniform"
    LOGNORMAL = "lognormal"
    PAPER = "paper"


@dataclasses.dataclass(frozen=True)
class LinkDevice:
    """The inter-cluster link's network device on this machine, in ``namespace`` (None: this
    process's)."""

    device: str
    namespace: str | None = None

    @classmethod
    def parse(cls, text: str) -> LinkDevice:
        """``DEV`` or ``NAMESPACE/DEV``."""
        namespace, _, device = text.rpartition("/")
        if not device:
            raise UserError(f"bad link device {text!r}: expected DEV or NAMESPACE/DEV")
        return cls(device, namespace or None)

    def tx_bytes(self) -> int:
        try:
            return device_bytes(self.device, namespace=self.namespace)[0]
        except KernelLinkError as err:
            raise UserError(f"cannot read the link device's counters: {err}") from None

    def __str__(self) -> str:
        return f"{self.namespace}/{self.device}" if self.namespace else self.device


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    router: str
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_dist: InputDist = InputDist.PAPER
    input_len: int = 64
    range_ratio: float = 0.5
    lognormal_mu: float = 4.0
    lognormal_sigma: float = 1.0
    length_scale: float | None = None  # paper: default fits the router's max_len
    output_len: int = 16
    prefix_len: int = 0  # shared prefix opening every prompt (0: none)
    num_prefixes: int = 1  # distinct shared prefixes
    seed: int = 0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    goodput: dict[str, float] = dataclasses.field(default_factory=dict)  # metric → SLO in ms
    timeout_s: float = 300.0
    security: SecuritySection | None = None  # the router's CA, client cert, token (None: plain)
    link_device: LinkDevice | None = None  # count the kernel's bytes on the link (None: don't)
    openai_url: str | None = None  # send through an OpenAI front door at this base URL
    # Wait for every worker's batched prefill calls to compile first (serving/loadgen/
    # warm_wait.py); it needs the router's control loop, which a `prfaas serve` router runs.
    wait_warm: bool = False

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.output_len < 1 or self.input_len < 1:
            raise UserError("--num-prompts, --input-len and --output-len must be ≥ 1")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise UserError("--request-rate and --burstiness must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise UserError("--max-concurrency must be ≥ 1")
        if self.input_dist not in tuple(InputDist):
            choices = ", ".join(InputDist)
            raise UserError(f"unknown --input-dist {self.input_dist!r} (choices: {choices})")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise UserError("--prefix-len must be ≥ 0 and --num-prefixes ≥ 1")
        if not 0 <= self.range_ratio < 1:
            raise UserError("--range-ratio must be in [0, 1)")
        for name in self.goodput:
            if name not in ("ttft", "tpot", "e2el"):
                raise UserError(f"--goodput takes ttft, tpot or e2el SLOs, got {name!r}")
        if self.openai_url is not None:
            parse_base_url(self.openai_url)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send offsets in seconds (module docstring)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
    span = times[-1] if n > 1 else 0.0
    # Rescale so the run lasts exactly n / rate, as vLLM does: results stop depending on the
    # luck of one seed's total.
    return times * ((n - 1) / rate / span) if span > 0 else times


def input_lengths(opts: BenchOptions, max_prompt: int, rng: np.random.Generator) -> np.ndarray:
    n = opts.num_prompts
    if opts.input_dist == InputDist.FIXED:
        lengths = np.full(n, opts.input_len)
    elif opts.input_dist == InputDist.UNIFORM:
        low = max(1, int(opts.input_len * (1 - opts.range_ratio)))
        high = max(low, int(opts.input_len * (1 + opts.range_ratio)))
        lengths = rng.integers(low, high + 1, size=n)
    else:
        if opts.input_dist == InputDist.PAPER:
            scale = opts.length_scale or max_prompt / PAPER_MAX
            mu, sigma = PAPER_MU + math.log(scale), PAPER_SIGMA
            low, high = max(1.0, PAPER_MIN * scale), PAPER_MAX * scale
        else:
            mu, sigma, low, high = opts.lognormal_mu, opts.lognormal_sigma, 1.0, float(max_prompt)
        lengths = np.empty(n)
        filled = 0
        while filled < n:  # rejection sampling: exact truncation
            draw = rng.lognormal(mu, sigma, size=2 * n)
            keep = draw[(draw >= low) & (draw <= high)][: n - filled]
            lengths[filled : filled + keep.size] = keep
            filled += keep.size
        lengths = np.rint(lengths)
    lengths = np.clip(lengths.astype(int), 1, max_prompt)
    return lengths


def make_prompts(
    opts: BenchOptions, lengths: np.ndarray, vocab_size: int, rng: np.random.Generator
) -> list[list[int]]:
    """Random token ids, `lengths[i]` of them after prompt i's shared prefix (if any)."""
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]
    if opts.prefix_len:
        prefixes = rng.integers(0, vocab_size, size=(opts.num_prefixes, opts.prefix_len))
        picks = rng.integers(0, opts.num_prefixes, size=len(prompts))
        prompts = [[*prefixes[k].tolist(), *p] for k, p in zip(picks, prompts, strict=True)]
    return prompts


@dataclasses.dataclass
class BenchResult:
    prompt_len: int
    sent: float = 0.0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    route: str = ""
    uncached_len: int = 0
    state_bytes: int = 0
    wire_precision: str = ""  # the report's: how the state crossed when [wire] narrowed it
    exposed_transfer: float | None = None  # prefill end → first token (the report's), s
    prefill_s: float | None = None  # the prefill on its engine (the report's), s
    error: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the tokens received


def _one(stub: pb_grpc.RouterStub, prompt: list[int], opts: BenchOptions, rec: BenchResult) -> None:
    rec.sent = time.perf_counter()
    last = None
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=opts.output_len)
    try:
        for message in stub.Generate(request, timeout=opts.timeout_s):
            now = time.perf_counter()
            if message.token_ids:
                if rec.ttft is None:
                    rec.ttft = now - rec.sent
                else:
                    rec.itl.append(now - last)
                last = now
                rec.output_tokens += len(message.token_ids)
                rec.token_ids.extend(message.token_ids)
            if message.finished:
                rec.route, rec.uncached_len = message.report.route, message.report.uncached_len
                rec.state_bytes = message.report.state_bytes
                rec.wire_precision = message.report.wire_precision
                if message.report.attempts == 1:  # else it covers the last attempt only
                    rec.exposed_transfer = message.report.exposed_transfer_s
                    rec.prefill_s = message.report.prefill_s
        rec.e2el = time.perf_counter() - rec.sent
    except grpc.RpcError as err:
        rec.error = f"{err.code().name}: {err.details()}"


def _one_openai(
    url: str, model: str, token: str | None, prompt: list[int], opts: BenchOptions, rec: BenchResult
) -> None:
    """`_one` through an OpenAI front door, timed as `vllm bench serve` times it: TTFT at the
    first chunk with choices, an ITL sample at each later one, the output tokens from the usage
    chunk. The route and the transfer are not in OpenAI's reply (the run's offload fraction
    comes from the router's counters instead)."""
    rec.sent = last = time.perf_counter()
    try:
        for now, chunk in stream_completion(
            url, model, prompt, opts.output_len, token=token, timeout_s=opts.timeout_s
        ):
            if "error" in chunk:
                raise HTTPError(chunk["error"].get("message", "error event"))
            if chunk.get("choices"):
                if rec.ttft is None:
                    rec.ttft = now - rec.sent
                else:
                    rec.itl.append(now - last)
                last = now
            if chunk.get("usage"):
                rec.output_tokens = int(chunk["usage"]["completion_tokens"])
        rec.e2el = time.perf_counter() - rec.sent
    except (HTTPError, OSError, ValueError) as err:
        rec.ttft = None
        rec.error = f"{type(err).__name__}: {err}"


def run_bench(
    opts: BenchOptions,
    *,
    on_done: Callable[[int, int], None] | None = None,
    prompts: list[list[int]] | None = None,
) -> tuple[list[BenchResult], dict]:
    """Send the workload; returns the records and the run's context (duration, egress, t).

    ``on_done(done, total)`` is called as each request ends, from the sending threads.
    ``prompts``: send these (``opts.num_prompts`` of them) instead of drawing them, so several
    runs send the same requests and their outputs can be checked against one reference.
    """
    if prompts is not None and len(prompts) != opts.num_prompts:
        raise UserError(f"{len(prompts)} prompts given for --num-prompts {opts.num_prompts}")
    rng = np.random.default_rng(opts.seed)
    with router_channel(opts.router, opts.security) as channel:
        stub = pb_grpc.RouterStub(channel)
        try:
            if opts.wait_warm:  # its batched prefill calls compiled before any timing
                before = wait_warm(stub)
            else:
                before = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        except grpc.RpcError as err:
            # The details say why (e.g. a refused token or TLS handshake); they hold no secret.
            why = f"{err.code().name}: {err.details()}"
            raise UserError(f"cannot reach the router at {opts.router}: {why}") from None
        max_prompt = before.max_len - opts.output_len + 1 - opts.prefix_len
        if max_prompt < 1:
            raise UserError(
                f"--output-len {opts.output_len} and --prefix-len {opts.prefix_len} leave no "
                f"room in max_len {before.max_len}"
            )
        link = opts.link_device
        link_before = link.tx_bytes() if link is not None else 0
        lengths = input_lengths(opts, max_prompt, rng)
        offsets = arrival_times(opts.num_prompts, opts.request_rate, opts.burstiness, rng)
        if prompts is None:
            prompts = make_prompts(opts, lengths, before.vocab_size, rng)
        records = [BenchResult(len(p)) for p in prompts]
        done = itertools.count(1)
        lock = threading.Lock()

        def ended(_: concurrent.futures.Future) -> None:
            if on_done is not None:
                with lock:
                    on_done(next(done), opts.num_prompts)

        send = functools.partial(_one, stub)
        if opts.openai_url is not None:
            token = read_token(opts.security)
            send = functools.partial(_one_openai, opts.openai_url, before.model, token)
        workers = min(opts.num_prompts, opts.max_concurrency or 256)
        start = time.perf_counter()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
        try:
            futures = []
            for prompt, rec, offset in zip(prompts, records, offsets, strict=True):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                future = pool.submit(send, prompt, opts, rec)
                future.add_done_callback(ended)
                futures.append(future)
            for future in futures:
                future.result()
        except BaseException:
            # Ctrl-C: the requests not sent yet are dropped, and closing the channel (leaving
            # the `with`) cancels those in flight, instead of waiting for the whole run.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        duration = time.perf_counter() - start
        time.sleep(1.0)  # the router polls link counters every control period
        after = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        link_after = link.tx_bytes() if link is not None else 0
    context = {
        "duration_s": duration,
        "egress_bytes": after.egress_bytes - before.egress_bytes,
        "link_kernel_bytes": link_after - link_before if link is not None else None,
        # What TCP measured on the transfers: the round trip at the end of the run, and the
        # segments it retransmitted during it (on the data connections; and in the PrfaaS
        # namespace as a whole, where the kernel counts it: --netns).
        "link_rtt_s": after.link_rtt_s,
        "link_retransmitted": (
            after.link_data_retransmitted_segments - before.link_data_retransmitted_segments
        ),
        "namespace_retransmitted": (
            after.tcp_retransmitted_segments - before.tcp_retransmitted_segments
        ),
        "threshold_start": before.threshold,
        "threshold_end": after.threshold,
        "model": before.model,
        # Requests per route by the router's counters (an OpenAI reply does not name its route).
        "routed": (
            after.requests_prfaas - before.requests_prfaas,
            after.requests_pd - before.requests_pd,
        ),
        "router": _router_costs(before, after),
        # PrfaaS prefills the router sent narrowed ([wire]), by precision.
        "wire_narrowed": {
            p: n - before.wire_narrowed.get(p, 0)
            for p, n in after.wire_narrowed.items()
            if n > before.wire_narrowed.get(p, 0)
        },
    }
    return records, context


def _router_costs(before: pb.RouterStats, after: pb.RouterStats) -> dict:
    """What the run cost the router, from its counters: its process's CPU time, its cached-
    prefix lookups (count, wall time, and how many per-instance lengths its cache index gave
    or had to ask), and the token hit rate."""
    index_before, index_after = before.cache_index, after.cache_index
    prompt = after.prompt_tokens - before.prompt_tokens
    return {
        "cpu_s": after.router_cpu_s - before.router_cpu_s,
        "lookups": after.lookups - before.lookups,
        "lookup_s": after.lookup_s - before.lookup_s,
        "cache_index": index_after.enabled,
        "index_answered": index_after.answered - index_before.answered,
        "index_asked": index_after.asked - index_before.asked,
        "index_entries": index_after.block_entries + index_after.checkpoint_entries,
        "hit_rate": (after.cached_tokens - before.cached_tokens) / prompt if prompt else 0.0,
    }
