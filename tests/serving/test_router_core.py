"""The router in process: `RouterCore` and `RouterService` over fake-engine workers on loopback.

One gRPC server per instance, as in a cluster — PrfaaS prefill (prfaas-0), PD prefill (pd-0),
PD decode (pd-1) — each a `PrefillService` or `DecodeService` over the hand-computable engines
(engine/fake.py), and the router's `Router` service on a server of its own, built from the same
cluster config a `prfaas serve` would read (t = 64, max_len 512). No process is started, so
faults are injected by hand: an engine that fails its next call, a worker whose server stops.

Checked: each request prefills where the threshold says (uncached length > t → PrfaaS) and on
that instance's engine, yields `fake_tokens` and an exact report; the router follows a new t; a
failed prefill, a decode engine dying mid-stream and a dead prefill worker are retried, and the
client still sees each token once, as from one run; malformed requests are INVALID_ARGUMENT;
and fuzzed `Generate` calls are either served exactly or refused with INVALID_ARGUMENT.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import pathlib
from collections.abc import Iterator, Sequence

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_support import MALFORMED_REQUESTS, fake_config, generate, serve_in_process

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import (
    FakeDecodeEngine,
    FakePrefillEngine,
    FakePrefillResult,
    fake_tokens,
)
from prfaas_jax.engine.sampling_params import INT32_MAX
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.router.core import RouterCore
from prfaas_jax.serving.transport.link import LinkProfile, LinkShaper
from prfaas_jax.serving.transport.messages import (
    check_prompt,
    check_request_id,
    sampling_from_proto,
)
from prfaas_jax.serving.transport.server import ServingServer

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
THRESHOLD = 64
MAX_LEN = 512


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 29 * i) % VOCAB for i in range(n)]


class CountingPrefill(FakePrefillEngine):
    """The fake prefill engine, noting each prompt it prefills; `fail_next` calls raise."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.lengths: list[int] = []
        self.fail_next = 0

    def prefill(self, tokens: Sequence[int], **options: object) -> FakePrefillResult:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected prefill fault")
        self.lengths.append(len(tokens))
        return super().prefill(tokens, **options)

    def prefill_batch(self, prompts: Sequence[Sequence[int]], **options: object) -> list:
        # Short prompts waiting together share a call: each is still one prompt prefilled.
        self.lengths.extend(len(tokens) for tokens in prompts)
        return super().prefill_batch(prompts, **options)


class FlakyDecode(FakeDecodeEngine):
    """The fake decode engine; with `fail_after` set, the step after that many more raises."""

    def __init__(self, step_s: float) -> None:
        super().__init__(CFG, max_slots=4, max_len=MAX_LEN, step_s=step_s)
        self.fail_after: int | None = None

    def step(self) -> list[tuple[int, int]]:
        if self.fail_after is not None:
            if self.fail_after == 0:
                self.fail_after = None
                raise RuntimeError("injected decode fault")
            self.fail_after -= 1
        return super().step()


@dataclasses.dataclass
class Cluster:
    core: RouterCore
    router: pb_grpc.RouterStub
    prefill: dict[str, CountingPrefill]  # by instance name
    decode: FlakyDecode
    servers: dict[str, ServingServer]


@contextlib.contextmanager
def serve_cluster(root: pathlib.Path, decode_step_s: float) -> Iterator[Cluster]:
    """The three workers and the router, each on its own loopback server, until closed."""
    config = load_cluster_config(fake_config(root / "cluster.toml"))
    assert (config.router.threshold, config.engine.max_len) == (THRESHOLD, MAX_LEN)
    engines = {name: CountingPrefill() for name in ("prfaas-0", "pd-0")}
    decode_engine = FlakyDecode(decode_step_s)
    instances = {
        "prfaas-0": (Role.PRFAAS_PREFILL, engines["prfaas-0"]),
        "pd-0": (Role.PD_PREFILL, engines["pd-0"]),
        "pd-1": (Role.PD_DECODE, decode_engine),
    }
    with serve_in_process(config, instances) as running:
        yield Cluster(running.core, running.router, engines, decode_engine, running.servers)


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    # Decode steps of 20 ms: a test can act between two tokens of one stream.
    with serve_cluster(tmp_path, decode_step_s=0.02) as running:
        yield running


# --- routing and outputs ---------------------------------------------------------------------


def test_routes_by_uncached_length_against_the_threshold(cluster):
    lengths = [1, 10, 63, 64, 65, 100, 300, 200, 5]
    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        replies = list(pool.map(lambda n: generate(cluster.router, prompt(n, n), 6), lengths))
    for n, reply in zip(lengths, replies, strict=True):
        report, long = reply.report, n > THRESHOLD
        assert report.route == ("prfaas" if long else "pd"), n
        assert report.prefill_instance == ("prfaas-0" if long else "pd-0")
        assert report.decode_instance == "pd-1"
        assert (report.prompt_len, report.cached_len, report.uncached_len) == (n, 0, n)
        assert report.threshold == THRESHOLD and report.ttft_s > 0
        assert (report.attempts, report.resumed_from) == (1, 0)
        assert report.state_bytes == state_nbytes(CFG, n)
        assert reply.tokens == fake_tokens(prompt(n, n), 6, VOCAB)
    # Each prompt was prefilled once, on the engine of the instance the report names.
    assert sorted(cluster.prefill["prfaas-0"].lengths) == sorted(n for n in lengths if n > 64)
    assert sorted(cluster.prefill["pd-0"].lengths) == sorted(n for n in lengths if n <= 64)
    stats = cluster.router.GetStats(pb.GetStatsRequest())
    assert (stats.requests_prfaas, stats.requests_pd) == (4, 5)
    assert stats.requests_in_flight == 0 and stats.retries == 0


def test_the_report_times_the_transfer_compute_did_not_hide(tmp_path):
    """PrfaaS ships through a 25 KB/s link: a long prompt's state (57.6 KB) takes longer on the
    link than its prefill on the fake engine, so what the prefill could hide is at most its own
    time: the exposed transfer is at least the bytes beyond the shaper's burst over the rate,
    less the prefill time, and prefill + exposed transfer fit in the TTFT. A short prompt's,
    unshaped, is small."""
    rate, burst = 25_000.0, 16384.0
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml"))
    instances = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(CFG)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(CFG)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=MAX_LEN)),
    }
    shaper = LinkShaper(LinkProfile(bandwidth_bytes_per_s=rate, burst_bytes=burst))
    with serve_in_process(config, instances, shapers={"prfaas-0": shaper}) as running:
        long = generate(running.router, prompt(300), 2).report
        short = generate(running.router, prompt(30), 2).report
        snapshot = running.core.exposed_transfer
    assert (long.route, short.route) == ("prfaas", "pd")
    floor = (state_nbytes(CFG, 300) - burst) / rate
    assert floor - long.prefill_s > 0.5, (floor, long.prefill_s)
    assert floor - long.prefill_s <= long.exposed_transfer_s
    assert long.prefill_s + long.exposed_transfer_s <= long.ttft_s
    assert 0 < short.exposed_transfer_s < 0.1
    assert short.prefill_s + short.exposed_transfer_s <= short.ttft_s
    assert (snapshot["prfaas"].count, snapshot["pd"].count) == (1, 1)
    assert snapshot["prfaas"].total == pytest.approx(long.exposed_transfer_s)


def test_layerwise_streaming_hides_the_first_layers_transfer(tmp_path):
    """The fake prefill takes 2 ms a token, spread evenly over tiny's 4 layers (3 KDA, then MLA),
    and PrfaaS ships through a 50 KB/s link with a 16 KiB burst. Whole-chunk, the 57.6 KB
    state of a 300-token prompt leaves after the 0.6 s prefill: exposed ≈ (57.6 − 16.4) KB /
    50 KB/s = 0.82 s. Streamed by layers, the three KDA layers' 9.6 KB leave while the MLA layer
    computes and the bucket refills, so only the MLA layer's 48 KB are exposed, ≈ 0.63 s: the
    difference is what layer-wise emission hides. Same tokens either way."""
    rate, burst, seconds_per_token = 50_000.0, 16384.0, 0.002
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml"))
    exposed = {}
    for groups in (1, 4):
        prfaas = FakePrefillEngine(CFG, seconds_per_token=seconds_per_token, layer_groups=groups)
        instances = {
            "prfaas-0": (Role.PRFAAS_PREFILL, prfaas),
            "pd-0": (Role.PD_PREFILL, FakePrefillEngine(CFG)),
            "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=MAX_LEN)),
        }
        shaper = LinkShaper(LinkProfile(bandwidth_bytes_per_s=rate, burst_bytes=burst))
        with serve_in_process(config, instances, shapers={"prfaas-0": shaper}) as running:
            reply = generate(running.router, prompt(300), 3)
        assert reply.tokens == fake_tokens(prompt(300), 3, VOCAB)
        assert reply.report.route == "prfaas"
        exposed[groups] = reply.report.exposed_transfer_s
    mla_bytes = 48_000  # tiny's MLA layer at 300 tokens: c_kv and k_rope rows
    assert exposed[1] >= (state_nbytes(CFG, 300) - burst) / rate
    # The last group's frames start leaving from inside the prefill call, before the worker
    # stamps its end: the lower bound allows that moment (well under 10 ms; one run measured
    # 0.6319 s against the 0.6323 s the bytes alone take).
    assert (mla_bytes - burst) / rate - 0.01 <= exposed[4] <= exposed[1] - 0.1, exposed


def test_the_router_follows_a_new_threshold(cluster):
    cluster.core.threshold = 200.0  # as the controller sets it
    reply = generate(cluster.router, prompt(100), 3)
    assert reply.report.route == "pd" and reply.report.threshold == 200
    cluster.core.threshold = 50.0
    reply = generate(cluster.router, prompt(60), 3)
    assert reply.report.route == "prfaas" and reply.tokens == fake_tokens(prompt(60), 3, VOCAB)


def test_one_token_and_longest_requests(cluster):
    assert generate(cluster.router, prompt(7), 1).tokens == fake_tokens(prompt(7), 1, VOCAB)
    longest = prompt(500)  # 500 + 13 − 1 = max_len
    assert generate(cluster.router, longest, 13).tokens == fake_tokens(longest, 13, VOCAB)


# --- retries ---------------------------------------------------------------------------------


def test_a_failed_prefill_is_retried(cluster):
    cluster.prefill["prfaas-0"].fail_next = 1
    reply = generate(cluster.router, prompt(100), 5)
    assert reply.tokens == fake_tokens(prompt(100), 5, VOCAB)
    assert (reply.report.attempts, reply.report.resumed_from) == (2, 0)
    assert cluster.prefill["prfaas-0"].lengths == [100]  # the failed call computed nothing
    assert cluster.core.retries == 1


def test_a_decode_failure_mid_stream_resumes_where_it_stopped(cluster):
    """The decode engine dies after three tokens were streamed: the retry prefills the prompt
    plus those tokens and decodes only the rest, so the client gets each token once."""
    cluster.decode.fail_after = 2  # the first token comes from prefill, two from steps
    reply = generate(cluster.router, prompt(30), 12)
    assert reply.tokens == fake_tokens(prompt(30), 12, VOCAB)
    report = reply.report
    assert report.attempts == 2 and 1 <= report.resumed_from <= 3
    # The retry's prefill covered the prompt and every token streamed before the fault.
    assert cluster.prefill["pd-0"].lengths == [30, 30 + report.resumed_from]
    assert (cluster.core.retries, cluster.core.resumed) == (1, 1)


def test_a_dead_prefill_worker_is_routed_around(cluster):
    cluster.servers["pd-0"].stop(grace_s=0)
    reply = generate(cluster.router, prompt(20), 4)  # short: bound for pd-0 first
    assert reply.tokens == fake_tokens(prompt(20), 4, VOCAB)
    assert reply.report.attempts == 2 and reply.report.prefill_instance == "prfaas-0"
    assert cluster.core.workers["pd-0"].down
    # Until it answers again, short prompts go to PrfaaS at once.
    reply = generate(cluster.router, prompt(10), 2)
    assert reply.report.attempts == 1 and reply.report.prefill_instance == "prfaas-0"


# --- request validation ----------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "message"), MALFORMED_REQUESTS)
def test_bad_requests_are_invalid_argument(cluster, fields, message):
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.router.Generate(pb.GenerateRequest(**fields), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert not cluster.prefill["prfaas-0"].lengths and not cluster.prefill["pd-0"].lengths
    # The router keeps serving.
    assert generate(cluster.router, [5, 6], 2).tokens == fake_tokens([5, 6], 2, VOCAB)


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """One cluster for every fuzzed example, decoding without pauses."""
    with serve_cluster(tmp_path_factory.mktemp("fuzz"), decode_step_s=0.0) as running:
        yield running


INT32 = st.integers(-(2**31), INT32_MAX)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
# Each field of a `GenerateRequest`: values a client may send, then anything the wire carries.
WELL_FORMED = {
    "prompt_token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    "max_new_tokens": st.integers(1, 24),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.0, 0.9, 1.0]),
    "top_k": st.integers(0, 2 * VOCAB),
    "seed": st.integers(0, 2**64 - 1),
    "request_id": st.just("") | st.text(st.characters(codec="ascii", categories=["L", "N"])),
}
ANY_VALUE = {
    "prompt_token_ids": st.lists(INT32 | st.integers(0, VOCAB - 1), max_size=40)
    | st.builds(lambda n, k: [k] * n, st.integers(MAX_LEN - 20, MAX_LEN + 2), st.integers(0, 9)),
    "max_new_tokens": INT32 | st.integers(-2, MAX_LEN + 2),
    "temperature": FLOAT32,
    "top_p": FLOAT32,
    "top_k": INT32,
    "seed": st.integers(0, 2**64 - 1),
    "request_id": st.text(max_size=300) | st.sampled_from(["a\nb", "\x00", "x" * 257]),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> dict[str, object]:
    """A well-formed request with up to three of its fields replaced by anything."""
    fields = {name: draw(strategy) for name, strategy in WELL_FORMED.items()}
    for name in draw(st.lists(st.sampled_from(sorted(ANY_VALUE)), max_size=3, unique=True)):
        fields[name] = draw(ANY_VALUE[name])
    return fields


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=generate_requests())
def test_fuzzed_generate_is_served_or_invalid_argument(fuzz_cluster, fields):
    request = pb.GenerateRequest(**fields)
    tokens, max_new_tokens = list(request.prompt_token_ids), request.max_new_tokens
    try:  # the router's own checks, in its order: they decide which outcome is right
        check_prompt(tokens, CFG, max_len=MAX_LEN, max_new_tokens=max_new_tokens)
        sampling = sampling_from_proto(
            request.temperature, request.top_p, request.top_k, request.seed
        )
        check_request_id(request.request_id)
    except UserError:
        valid = False
    else:
        valid = True
    event("valid" if valid else "malformed")
    try:
        stream = fuzz_cluster.router.Generate(request, timeout=60)
        streamed = [token for message in stream for token in message.token_ids]
    except grpc.RpcError as err:
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert not valid, err.details()
        return
    assert valid
    # The fake engines sample as a function of the seed, the knobs and each token's index.
    assert streamed == fake_tokens(tokens, max_new_tokens, VOCAB, sampling)
