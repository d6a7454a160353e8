"""Request streams for the simulator: `Request`, `generate_requests`, `read_trace`,
`sample_lengths`, and the specs they read (`WorkloadSpec`, `Arrivals`, `PrefixSpec`,
`TraceRecord`).

Arrivals (the conventions of vLLM's `bench serve`, as `prfaas bench` uses; docs/simulator.md):

- Poisson: exponential gaps of mean 1/rate;
- gamma: gaps ~ Gamma(shape = burstiness, scale = 1/(rate · burstiness)), vLLM's convention, so
  the mean rate is `rate` whatever the burstiness; burstiness 1 is Poisson, < 1 burstier;
- trace replay in the Mooncake format (kvcache-ai/Mooncake FAST25-release): one JSON object per
  line, `{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int, …]}`,
  where `hash_ids[i]` names the prefix ending with the i-th block of `block_len` (512) tokens.

Synthetic prompt lengths are drawn from the plan's length distribution; with `PrefixSpec`, each
request also joins one of `groups` prefix groups (Zipf-popular) and shares that group's first
`shared_len` tokens, which gives it hash_ids the prefix caches can match.

`generate_requests(spec, rate=…)` rescales time so that the same seed gives the same requests at
any rate (common random numbers: a saturation search compares like with like).
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prfaas_jax.errors import ConfigError
from prfaas_jax.policy.length_distribution import (
    EmpiricalLengths,
    LengthDistribution,
    TruncatedLogNormal,
)

CHUNK = 4096  # requests drawn per batch of random numbers


class Request:
    """One request and what the simulator has done with it so far."""

    __slots__ = (
        "arrival",
        "body_done",
        "cached_pd",
        "decode",
        "first_token",
        "hash_ids",
        "kv_bytes",
        "offloaded",
        "output_len",
        "prefill",
        "prefill_done",
        "prefill_end",
        "prompt_len",
        "recall_loss",
        "rid",
        "uncached_len",
    )

    def __init__(
        self,
        rid: int,
        arrival: float,
        prompt_len: int,
        output_len: int,
        hash_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.rid, self.arrival = rid, arrival
        self.prompt_len, self.output_len, self.hash_ids = prompt_len, output_len, hash_ids
        self.uncached_len = prompt_len
        self.cached_pd = 0
        self.offloaded = False
        self.prefill = self.decode = None
        self.kv_bytes = 0.0
        self.recall_loss = 0.0  # what its state's wire precision costs (0: native)
        self.first_token = self.prefill_end = math.nan
        self.body_done = self.prefill_done = False


class Arrivals(enum.StrEnum):
    """How request arrival times are drawn (module docstring)."""

    POISSON = "poisson"
    GAMMA = "gamma"
    TRACE = "trace"


@dataclass(frozen=True)
class PrefixSpec:
    groups: int  # distinct shared prefixes
    shared_len: int  # tokens of the group's prefix a request shares
    zipf: float = 1.0  # group g (1-based) is chosen with weight g^-zipf

    def __post_init__(self) -> None:
        if self.groups < 1 or self.shared_len < 1 or self.zipf < 0:
            raise ValueError("prefix groups and shared_len must be ≥ 1 and zipf ≥ 0")


@dataclass(frozen=True)
class TraceRecord:
    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class WorkloadSpec:
    arrivals: Arrivals
    rate: float  # requests/s; a trace is replayed with its timestamps rescaled to this rate
    requests: int
    lengths: LengthDistribution
    output_len: int
    burstiness: float = 1.0
    seed: int = 0
    block_len: int = 512
    prefix: PrefixSpec | None = None
    trace: tuple[TraceRecord, ...] = ()

    def __post_init__(self) -> None:
        if self.arrivals not in tuple(Arrivals):
            choices = ", ".join(Arrivals)
            raise ValueError(f"arrivals must be one of {choices}, got {self.arrivals!r}")
        if not (self.rate > 0 and self.burstiness > 0):
            raise ValueError("rate and burstiness must be positive")
        if min(self.requests, self.output_len, self.block_len) < 1:
            raise ValueError("requests, output_len and block_len must be at least 1")
        if self.arrivals == Arrivals.TRACE and not self.trace:
            raise ValueError("trace arrivals need trace records")


def sample_lengths(dist: LengthDistribution, rng: np.random.Generator, n: int) -> np.ndarray:
    """n integer lengths from `dist`: truncated log-normal by rejection, a trace by resampling."""
    if isinstance(dist, EmpiricalLengths):
        return rng.choice(np.asarray(dist.lengths, dtype=np.int64), size=n)
    if not isinstance(dist, TruncatedLogNormal):
        raise ValueError(f"cannot sample lengths from {type(dist).__name__}")
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        draw = rng.lognormal(dist.mu, dist.sigma, size=2 * (n - out.size) + 16)
        draw = draw[(draw >= dist.min_len) & (draw <= dist.max_len)]
        out = np.concatenate([out, np.round(draw).astype(np.int64)])
    return np.maximum(out[:n], 1)


def read_trace(path: Path) -> tuple[TraceRecord, ...]:
    """Mooncake JSONL records, in timestamp order, times in seconds from the first."""
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"cannot read trace {path}: {err.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            record = TraceRecord(
                float(item["timestamp"]) / 1000.0,
                int(item["input_length"]),
                int(item["output_length"]),
                tuple(int(h) for h in item.get("hash_ids", ())),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{path}:{number}: not a Mooncake trace record ({err})") from None
        if record.input_len < 1 or record.output_len < 1:
            raise ConfigError(f"{path}:{number}: input_length and output_length must be ≥ 1")
        records.append(record)
    if len(records) < 2:
        raise ConfigError(f"{path}: a trace needs at least two records")
    records.sort(key=lambda r: r.timestamp_s)
    start = records[0].timestamp_s
    return tuple(
        TraceRecord(r.timestamp_s - start, r.input_len, r.output_len, r.hash_ids) for r in records
    )


def trace_rate(records: Sequence[TraceRecord]) -> float:
    """The trace's mean arrival rate: (n − 1) gaps over its time span."""
    span = records[-1].timestamp_s - records[0].timestamp_s
    if span <= 0:
        raise ConfigError("a trace's timestamps must span a positive time")
    return (len(records) - 1) / span


def _gaps(spec: WorkloadSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    if spec.arrivals == Arrivals.GAMMA:
        return rng.gamma(spec.burstiness, 1.0 / (spec.rate * spec.burstiness), size=n)
    return rng.exponential(1.0 / spec.rate, size=n)


def _prefix_ids(spec: WorkloadSpec, group: int, prompt_len: int, unique: int) -> tuple[int, ...]:
    """Block hashes: the group's shared blocks, then blocks no other request has."""
    assert spec.prefix is not None
    num_blocks = -(-prompt_len // spec.block_len)
    shared = min(spec.prefix.shared_len // spec.block_len, num_blocks)
    # Shared ids are small, unique ids start above every shared id: the two never collide.
    base = spec.prefix.groups * (spec.prefix.shared_len // spec.block_len + 1)
    head = tuple(group * (spec.prefix.shared_len // spec.block_len + 1) + i for i in range(shared))
    return head + tuple(range(base + unique, base + unique + num_blocks - shared))


def generate_requests(spec: WorkloadSpec, *, rate: float | None = None) -> Iterator[Request]:
    """`spec.requests` requests in arrival order; `rate` rescales time (module docstring)."""
    target = spec.rate if rate is None else rate
    if spec.arrivals == Arrivals.TRACE:
        yield from _replay(spec, trace_rate(spec.trace) / target)
        return
    scale = spec.rate / target
    rng = np.random.default_rng(spec.seed)
    weights = None
    if spec.prefix is not None:
        ranks = np.arange(1, spec.prefix.groups + 1, dtype=np.float64)
        weights = ranks**-spec.prefix.zipf
        weights /= weights.sum()
    now, unique, rid = 0.0, 0, 0
    while rid < spec.requests:
        n = min(CHUNK, spec.requests - rid)
        arrivals = now + np.cumsum(_gaps(spec, rng, n)) * scale
        lengths = sample_lengths(spec.lengths, rng, n)
        groups = rng.choice(spec.prefix.groups, size=n, p=weights) if weights is not None else None
        now = float(arrivals[-1])
        for i, (at, length) in enumerate(zip(arrivals.tolist(), lengths.tolist(), strict=True)):
            hash_ids = None
            if groups is not None:
                hash_ids = _prefix_ids(spec, int(groups[i]), length, unique)
                unique += len(hash_ids)
            yield Request(rid, at, length, spec.output_len, hash_ids)
            rid += 1


def _replay(spec: WorkloadSpec, scale: float) -> Iterator[Request]:
    for rid, record in enumerate(spec.trace[: spec.requests]):
        hash_ids = record.hash_ids or None
        yield Request(
            rid, record.timestamp_s * scale, record.input_len, record.output_len, hash_ids
        )
