"""Bad input never crashes a server: fuzzed requests and state streams, in-process.

Request validation (`messages.check_prompt`, `sampling_from_proto`, `check_request_id`) either
accepts a request whose values then satisfy the documented invariants (checked here
independently) or raises UserError. A decode worker fed mutated state streams (flipped bytes,
truncation, dropped / duplicated / reordered / foreign frames, forged headers with valid CRCs,
garbage) answers INVALID_ARGUMENT and keeps nothing, or accepts a stream that still decodes to
exactly the right tokens; either way it keeps serving. The prefill worker refuses malformed
requests before touching its engine, and a server refuses messages over its receive limit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import time
import uuid
import zlib

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_support import fake_config, serve_in_process, serve_workers

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.format import (
    FORMAT_VERSION,
    HEADER_MAGIC,
    StateHeader,
    StateTrailer,
    TensorEntry,
    pack_data,
    pack_header,
    pack_trailer,
    parse_header,
)
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling import SamplingParams, request_key, sampling_knobs
from prfaas_jax.engine.sampling_params import INT32_MAX
from prfaas_jax.errors import UserError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer.data_path import DataListener, DataSender, push_messages
from prfaas_jax.serving.transport.messages import (
    MAX_REQUEST_ID_LEN,
    check_prompt,
    check_request_id,
    router_max_request_bytes,
    sampling_from_proto,
)
from prfaas_jax.serving.transport.server import ServingServer, full_service_name
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
MAX_LEN = 48
FRAME_BYTES = 512  # several data frames per tensor, so reordering and dropping mean something
INT32 = st.integers(-(2**31), INT32_MAX)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(offset + 37 * i) % VOCAB for i in range(n)]


# --- request validation ------------------------------------------------------------------


def validate(request: pb.GenerateRequest) -> SamplingParams:
    """The router's checks of a client request, in the router's order."""
    check_prompt(
        list(request.prompt_token_ids),
        CFG,
        max_len=MAX_LEN,
        max_new_tokens=request.max_new_tokens,
    )
    sampling = sampling_from_proto(request.temperature, request.top_p, request.top_k, request.seed)
    check_request_id(request.request_id)
    return sampling


def assert_usable(sampling: SamplingParams) -> None:
    """An accepted SamplingParams is in range and reaches the device without an error."""
    assert math.isfinite(sampling.temperature) and sampling.temperature >= 0
    assert math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1
    assert 0 <= sampling.top_k <= INT32_MAX and 0 <= sampling.seed < 2**64
    temperature, top_k, top_p = sampling_knobs(sampling)
    assert top_k[0] == sampling.top_k and 0 < top_p[0] <= 1 and temperature[0] >= 0
    request_key(sampling.seed)


token_ids = st.one_of(st.integers(0, VOCAB - 1), INT32)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
request_ids = st.one_of(
    st.text(max_size=8),
    st.text(st.characters(codec="utf-8"), max_size=300),
    st.sampled_from(["ok", "a\nb", "tab\there", "\x00", "\u200b", "é" * 256, "x" * 257]),
)


@FAST
@given(
    tokens=st.lists(token_ids, max_size=MAX_LEN + 4),
    max_new_tokens=st.one_of(st.integers(-2, MAX_LEN + 2), INT32),
    temperature=floats32,
    top_p=floats32,
    top_k=INT32,
    seed=st.integers(0, 2**64 - 1),
    request_id=request_ids,
)
def test_generate_request_validation(
    tokens, max_new_tokens, temperature, top_p, top_k, seed, request_id
):
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
    )
    request = pb.GenerateRequest.FromString(request.SerializeToString())  # as the router sees it
    try:
        sampling = validate(request)
    except UserError as err:
        assert str(err)  # refused with a message
        return
    assert tokens and all(0 <= t < VOCAB for t in tokens)
    assert max_new_tokens >= 1 and len(tokens) + max_new_tokens - 1 <= MAX_LEN
    assert len(request_id) <= MAX_REQUEST_ID_LEN and request_id.isprintable()
    assert_usable(sampling)
    assert request.ByteSize() <= router_max_request_bytes(MAX_LEN)


@pytest.fixture(scope="module")
def in_process_router(tmp_path_factory):
    """The router itself over fake workers (PrfaaS prefill, PD prefill, PD decode), in process,
    with the `max_len` the validation above is fuzzed for."""
    path = tmp_path_factory.mktemp("router-fuzz") / "cluster.toml"
    config = load_cluster_config(fake_config(path, engine={"max_len": MAX_LEN}))
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(CFG)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(CFG)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=MAX_LEN)),
    }
    with serve_in_process(config, engines) as cluster:
        yield cluster.router


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # Each field valid more often than not, so both outcomes are drawn often.
    tokens=st.one_of(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_LEN - 8),
        st.lists(token_ids, max_size=MAX_LEN + 4),
    ),
    max_new_tokens=st.one_of(st.integers(1, 6), st.integers(-2, MAX_LEN + 2), INT32),
    temperature=st.one_of(st.sampled_from([0.0, 0.8]), floats32),
    top_p=st.one_of(st.just(1.0), floats32),
    top_k=st.one_of(st.integers(0, 8), INT32),
    request_id=st.one_of(st.just(""), request_ids),
)
def test_router_generate_accepts_exactly_the_valid_requests(
    in_process_router, tokens, max_new_tokens, temperature, top_p, top_k, request_id
):
    """`Router.Generate` itself, not the helpers: a request the checks above refuse ends
    INVALID_ARGUMENT with a message, one they accept streams the right tokens; nothing else."""
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    try:
        validate(pb.GenerateRequest.FromString(request.SerializeToString()))
        valid = True
    except UserError:
        valid = False
    event(f"valid={valid}")
    try:
        messages = list(in_process_router.Generate(request, timeout=30))
    except grpc.RpcError as err:
        assert not valid, (err.code(), err.details())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details(), err
        return
    assert valid
    # No seed was sent: the router drew one and reports it; the fake engines sample with it.
    seed = messages[-1].report.seed
    sampling = sampling_from_proto(request.temperature, request.top_p, request.top_k, seed)
    streamed = [t for m in messages for t in m.token_ids]
    assert streamed == fake_tokens(tokens, max_new_tokens, VOCAB, sampling)


@FAST
@given(
    temperature=st.one_of(st.floats(), st.integers()),
    top_p=st.one_of(st.floats(), st.integers()),
    top_k=st.integers(),
    seed=st.integers(),
    first_index=st.integers(),
)
def test_sampling_params_accept_or_refuse(temperature, top_p, top_k, seed, first_index):
    """Python values beyond what the proto carries (a handoff's JSON holds any number)."""
    try:
        sampling = SamplingParams(temperature, top_k, top_p, seed, first_index)
    except UserError:
        return
    assert_usable(sampling)
    assert 0 <= sampling.first_index < INT32_MAX


@FAST
@given(request_id=st.text(st.characters(), max_size=MAX_REQUEST_ID_LEN + 2))
def test_request_id_rules(request_id):
    try:
        check_request_id(request_id)
    except UserError as err:
        assert len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable(), err
        return
    assert len(request_id) <= MAX_REQUEST_ID_LEN and request_id.isprintable()


@pytest.mark.parametrize(
    ("tokens", "max_new_tokens", "sampling", "request_id", "message"),
    [
        ([], 4, {}, "", "empty"),
        ([1, VOCAB], 4, {}, "", "outside the vocabulary"),
        ([1, -1], 4, {}, "", "outside the vocabulary"),
        ([1] * (MAX_LEN + 1), 1, {}, "", f"max_len {MAX_LEN}"),
        ([1] * MAX_LEN, 2, {}, "", f"max_len {MAX_LEN}"),
        ([1], 0, {}, "", "max_new_tokens"),
        ([1], -5, {}, "", "max_new_tokens"),
        ([1], INT32_MAX, {}, "", f"max_len {MAX_LEN}"),
        ([1], 2, {"temperature": math.nan}, "", "temperature"),
        ([1], 2, {"temperature": math.inf}, "", "temperature"),
        ([1], 2, {"temperature": -0.5}, "", "temperature"),
        ([1], 2, {"top_p": math.nan}, "", "top_p"),
        ([1], 2, {"top_p": -math.inf}, "", "top_p"),
        ([1], 2, {"top_p": 1.5}, "", "top_p"),
        ([1], 2, {"top_k": -1}, "", "top_k"),
        ([1], 2, {}, "line\nbreak", "non-printable"),
        ([1], 2, {}, "nul\x00", "non-printable"),
        ([1], 2, {}, "x" * (MAX_REQUEST_ID_LEN + 1), f"more than {MAX_REQUEST_ID_LEN}"),
    ],
)
def test_each_malformed_request_class(tokens, max_new_tokens, sampling, request_id, message):
    request = pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=tokens, max_new_tokens=max_new_tokens, **sampling
    )
    with pytest.raises(UserError, match=message):
        validate(request)


def test_top_k_beyond_the_vocabulary_is_off():
    assert validate(pb.GenerateRequest(prompt_token_ids=[1], max_new_tokens=2, top_k=10**6))


def test_largest_valid_request_fits_the_router_limit():
    request = pb.GenerateRequest(
        request_id="\U0001f600" * MAX_REQUEST_ID_LEN,  # 4 UTF-8 bytes each
        prompt_token_ids=[VOCAB - 1] * MAX_LEN,
        max_new_tokens=1,
        temperature=1e30,
        top_p=1.0,
        top_k=INT32_MAX,
        seed=2**64 - 1,
    )
    validate(request)
    # The bound holds for any vocabulary an int32 token id can index.
    request.prompt_token_ids[:] = [INT32_MAX] * MAX_LEN
    assert request.ByteSize() <= router_max_request_bytes(MAX_LEN)


# --- workers in-process --------------------------------------------------------------------


@dataclasses.dataclass
class Workers:
    address: str
    decode: DecodeService
    prefill_stub: pb_grpc.PrefillWorkerStub
    decode_stub: pb_grpc.DecodeWorkerStub


@pytest.fixture(scope="module")
def workers():
    prefill = PrefillService(
        engine=lambda: FakePrefillEngine(CFG),
        cfg=CFG,
        max_len=MAX_LEN,
        frame_bytes=FRAME_BYTES,
        shaper=None,
        admit=lambda context: None,
        push_timeout_s=10.0,
    )
    decode = DecodeService(
        engine=lambda: FakeDecodeEngine(CFG, max_slots=4, max_len=MAX_LEN),
        cfg=CFG,
        max_len=MAX_LEN,
        admit=lambda context: None,
        state_timeout_s=10.0,
        data_path=DataListener(),
    )
    server = serve_workers(prefill, decode, max_workers=16)
    channel = grpc.insecure_channel(server.address)
    yield Workers(
        server.address,
        decode,
        pb_grpc.PrefillWorkerStub(channel),
        pb_grpc.DecodeWorkerStub(channel),
    )
    channel.close()
    decode.stop()
    server.stop(grace_s=0.5)
    decode.data_path.close()


def fresh_id() -> str:
    return uuid.uuid4().hex


def stream_for(prompt: list[int], first_token: int | None = None) -> list[bytes]:
    """A PushState stream (codec frames + handoff) of the fake engine's state; valid unless
    `first_token` overrides prefill's."""
    result = FakePrefillEngine(CFG).prefill(prompt)
    frames = list(codec.encode(result.state, CFG, max_frame_bytes=FRAME_BYTES))
    first = result.first_token if first_token is None else first_token
    handoff = Handoff(first, SamplingParams())
    return [*frames, pack_handoff(handoff, frames[0])]


def push_status(
    w: Workers, request_id: str, frames: list[bytes], via: str = "stream"
) -> tuple[grpc.StatusCode, str]:
    """The decode worker's answer to `frames` pushed as messages of the stream (`via`
    "stream"), or on a data connection beside it ("data": serving/transfer/data_path.py)."""
    first = pb.StateChunk(request_id=request_id)
    if via == "data":
        sender = DataSender.connect("127.0.0.1", w.decode.data_path.port)
        chunks = push_messages(first, ((f, False) for f in frames), sender)
    else:
        chunks = iter([first, *(pb.StateChunk(frame=f) for f in frames)])
    try:
        w.decode_stub.PushState(chunks, timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def push(w: Workers, request_id: str, frames: list[bytes], via: str = "stream") -> grpc.StatusCode:
    return push_status(w, request_id, frames, via)[0]


def decode_tokens(w: Workers, request_id: str, prompt_len: int, n: int) -> list[int]:
    request = pb.DecodeRequest(request_id=request_id, prompt_len=prompt_len, max_new_tokens=n)
    return [t for m in w.decode_stub.Generate(request, timeout=10) for t in m.token_ids]


def assert_serves(w: Workers, n: int = 5) -> None:
    prompt, rid = prompt_of(11, offset=5), fresh_id()
    assert push(w, rid, stream_for(prompt)) is grpc.StatusCode.OK
    assert decode_tokens(w, rid, len(prompt), n) == fake_tokens(prompt, n, VOCAB)


def assert_discarded(w: Workers, request_id: str) -> None:
    """Nothing of the request stays on the worker (a failed stream cleans up as it ends)."""
    deadline = time.monotonic() + 5
    while True:
        with w.decode._cv:
            if request_id not in w.decode._requests:
                return
        assert time.monotonic() < deadline, f"{request_id} is still held"
        time.sleep(0.005)


def forged_header(header: StateHeader, draw: st.DrawFn) -> bytes:
    """`header` re-packed with other values: its CRC is valid, its claims are not."""
    length = draw(st.one_of(st.integers(0, 2 * MAX_LEN), st.integers(0, 2**64 - 1)))
    tensors = list(header.tensors)
    if tensors and draw(st.booleans()):
        tid = draw(st.integers(0, len(tensors) - 1))
        entry = tensors[tid]
        shape = tuple(draw(st.integers(0, 2**48)) for _ in entry.spec.shape)
        spec = dataclasses.replace(entry.spec, shape=shape)
        tensors[tid] = TensorEntry(spec, draw(st.integers(0, 2**33)))
    if draw(st.booleans()):
        tensors = tensors[: draw(st.integers(0, len(tensors)))]
    return pack_header(dataclasses.replace(header, length=length, tensors=tuple(tensors)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.one_of(
        st.lists(inner, max_size=8), st.dictionaries(st.text(max_size=8), inner)
    ),
    max_leaves=30,
).map(json.dumps)


def header_with_table(header: StateHeader, table: bytes, draw: st.DrawFn) -> bytes:
    """A frame of `header` with `table` as its tensor table (and maybe another tensor count)."""
    count = draw(st.one_of(st.just(len(header.tensors)), st.integers(0, 2**32 - 1)))
    fixed = struct.pack(
        "<8sHHQQI32sI",
        HEADER_MAGIC,
        FORMAT_VERSION,
        0,
        header.stream_id,
        header.length,
        count,
        bytes.fromhex(header.fingerprint),
        len(table),
    )
    body = fixed + table
    return body + struct.pack("<I", zlib.crc32(body))


@st.composite
def mutated_streams(draw: st.DrawFn) -> tuple[list[int], list[bytes], list[str]]:
    prompt = prompt_of(draw(st.integers(1, MAX_LEN - 8)), offset=draw(st.integers(0, VOCAB)))
    frames = stream_for(prompt)
    header_frame = frames[0]
    header = codec.inspect(frames)
    stream_id = header.stream_id
    applied = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                [
                    "flip",
                    "truncate",
                    "drop",
                    "duplicate",
                    "swap",
                    "foreign",
                    "random",
                    "append",
                    "forge_header",
                    "forge_data",
                    "forge_trailer",
                    "forge_table",
                    "bad_first_token",
                ]
            )
        )
        applied.append(kind)
        if not frames and kind not in ("random", "append"):
            continue
        at = draw(st.integers(0, max(len(frames) - 1, 0)))
        if kind == "flip":
            frame = bytearray(frames[at])
            if frame:
                pos = draw(st.integers(0, len(frame) - 1))
                frame[pos] ^= draw(st.integers(1, 255))
            frames[at] = bytes(frame)
        elif kind == "truncate":
            frames[at] = frames[at][: draw(st.integers(0, max(len(frames[at]) - 1, 0)))]
        elif kind == "drop":
            del frames[at]
        elif kind == "duplicate":
            frames.insert(draw(st.integers(0, len(frames))), frames[at])
        elif kind == "swap":
            other = draw(st.integers(0, len(frames) - 1))
            frames[at], frames[other] = frames[other], frames[at]
        elif kind == "foreign":  # a frame of another stream (same prompt or not)
            same = draw(st.booleans())
            other = stream_for(prompt if same else prompt_of(len(prompt), offset=1))
            frames[at] = other[min(at, len(other) - 1)]
        elif kind == "random":
            frames.insert(draw(st.integers(0, len(frames))), draw(st.binary(max_size=300)))
        elif kind == "append":
            frames.append(draw(st.binary(max_size=64)))
        elif kind == "forge_header":
            frames[0] = forged_header(header, draw)
        elif kind == "forge_data":  # valid CRC, absurd tensor id / offset / size
            frames.insert(
                draw(st.integers(1, len(frames))),
                pack_data(
                    stream_id if draw(st.booleans()) else draw(st.integers(0, 2**64 - 1)),
                    draw(st.integers(0, 2**32 - 1)),
                    draw(st.integers(0, 2**64 - 1)),
                    draw(st.binary(max_size=64)),
                ),
            )
        elif kind == "forge_trailer":  # valid CRC, arbitrary tensor CRCs and count
            crcs = draw(st.lists(st.integers(0, 2**32 - 1), max_size=12))
            sid = stream_id if draw(st.booleans()) else draw(st.integers(0, 2**64 - 1))
            frames.insert(at, pack_trailer(StateTrailer(sid, tuple(crcs))))
        elif kind == "forge_table":  # a header whose tensor table is any JSON, CRC valid
            frames[0] = header_with_table(header, draw(json_values).encode(), draw)
        elif kind == "bad_first_token":
            token = draw(st.one_of(st.integers(VOCAB, 2**40), st.integers(-(2**40), -1)))
            handoff = pack_handoff(Handoff(token, SamplingParams()), header_frame)
            frames = [*frames[:-1], handoff]
    return prompt, frames, applied


@pytest.mark.parametrize("via", ["stream", "data"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated_streams())
def test_mutated_state_streams(workers, via, case):
    """Every way a stream can be damaged, as messages of the stream or on the data path: the
    same checks refuse it either way."""
    prompt, frames, applied = case
    rid = fresh_id()
    code, details = push_status(workers, rid, frames, via)
    event(code.name)  # `--hypothesis-show-statistics` shows how many streams got through
    if code is grpc.StatusCode.OK:
        # Only harmless mutations pass (e.g. data frames reordered): the state is then intact.
        n = 4
        assert decode_tokens(workers, rid, len(prompt), n) == fake_tokens(prompt, n, VOCAB)
    else:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (applied, code, details)
        assert_discarded(workers, rid)


@pytest.mark.parametrize("via", ["stream", "data"])
def test_worker_serves_after_every_kind_of_bad_stream(workers, via):
    good = stream_for(prompt_of(20))
    bad = {
        "empty": [],
        "only the header": good[:1],
        "garbage": [b"not a frame", good[-1]],
        "truncated": [good[0], good[1][:-3], *good[2:]],
        "duplicate": [*good[:2], good[1], *good[2:]],
        "no trailer": [*good[:-2], good[-1]],
        "no handoff": good[:-1],
        "another stream's handoff": [*good[:-1], stream_for(prompt_of(20))[-1]],
        "first token outside the vocabulary": stream_for(prompt_of(20), first_token=VOCAB),
        "garbage after the handoff": [*good, b"x"],
    }
    for name, frames in bad.items():
        rid = fresh_id()
        assert push(workers, rid, frames, via) is grpc.StatusCode.INVALID_ARGUMENT, name
        assert_discarded(workers, rid)
    rid = fresh_id()
    assert push(workers, rid, good, via) is grpc.StatusCode.OK
    assert push(workers, rid, good, via) is grpc.StatusCode.ALREADY_EXISTS
    assert decode_tokens(workers, rid, 20, 3) == fake_tokens(prompt_of(20), 3, VOCAB)
    assert_serves(workers)


def test_forged_headers_are_refused_before_allocating(workers):
    """Valid CRCs, absurd claims: refused with StateDecodeError, not a MemoryError."""
    good = stream_for(prompt_of(12))
    header = parse_header(memoryview(good[0]))
    huge = pack_header(dataclasses.replace(header, length=2**62))
    with pytest.raises(codec.StateDecodeError, match="more than max_len"):
        codec.decode([huge, *good[1:-1]], CFG, max_len=MAX_LEN)
    with pytest.raises(codec.StateDecodeError, match="more than the model's max_len"):
        codec.decode([huge, *good[1:-1]], CFG)
    entry = header.tensors[0]
    spec = dataclasses.replace(entry.spec, shape=(2**40, 2**8))
    wide = pack_header(
        dataclasses.replace(header, tensors=(dataclasses.replace(entry, spec=spec),)),
    )
    with pytest.raises(codec.StateDecodeError, match="tensors"):
        codec.decode([wide, *good[1:-1]], CFG, max_len=MAX_LEN)
    long_trailer = pack_trailer(StateTrailer(header.stream_id, (0,) * 100_000))
    with pytest.raises(codec.StateDecodeError, match="tensor CRCs"):
        codec.decode([*good[:-2], long_trailer], CFG, max_len=MAX_LEN)
    for frames in ([huge, *good[1:]], [wide, *good[1:]], [*good[:-2], long_trailer, good[-1]]):
        rid = fresh_id()
        assert push(workers, rid, frames) is grpc.StatusCode.INVALID_ARGUMENT
        assert_discarded(workers, rid)
    assert_serves(workers)


@pytest.mark.parametrize("generate_first", [True, False])
def test_state_of_another_length_than_announced(workers, generate_first):
    prompt, rid = prompt_of(15), fresh_id()
    frames = stream_for(prompt)
    request = pb.DecodeRequest(request_id=rid, prompt_len=len(prompt) + 1, max_new_tokens=3)
    if generate_first:
        call = workers.decode_stub.Generate(request, timeout=10)
        deadline = time.monotonic() + 5
        while rid not in workers.decode._requests:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert push(workers, rid, frames) is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    else:
        assert push(workers, rid, frames) is grpc.StatusCode.OK
        with pytest.raises(grpc.RpcError) as err:
            list(workers.decode_stub.Generate(request, timeout=10))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "15" in err.value.details() and "16" in err.value.details()
    assert_discarded(workers, rid)
    assert_serves(workers)


def test_waiting_generate_fails_at_once_when_its_state_is_rejected(workers):
    prompt, rid = prompt_of(9), fresh_id()
    request = pb.DecodeRequest(request_id=rid, prompt_len=len(prompt), max_new_tokens=3)
    call = workers.decode_stub.Generate(request, timeout=10)
    deadline = time.monotonic() + 5
    while rid not in workers.decode._requests:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    frames = stream_for(prompt)
    assert push(workers, rid, [*frames[:1], *frames[2:]]) is grpc.StatusCode.INVALID_ARGUMENT
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "rejected" in err.value.details()
    assert time.monotonic() - start < 5  # not the state timeout
    assert_discarded(workers, rid)
    assert_serves(workers)


@pytest.mark.parametrize(
    ("prompt_len", "max_new_tokens"),
    [(0, 3), (5, 0), (5, -1), (5, INT32_MAX), (INT32_MAX, INT32_MAX), (MAX_LEN + 1, 1)],
)
def test_decode_request_validation(workers, prompt_len, max_new_tokens):
    request = pb.DecodeRequest(
        request_id=fresh_id(), prompt_len=prompt_len, max_new_tokens=max_new_tokens
    )
    with pytest.raises(grpc.RpcError) as err:
        list(workers.decode_stub.Generate(request, timeout=10))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert_discarded(workers, request.request_id)


# --- the prefill worker ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"request_id": "", "prompt_token_ids": [1]}, "request_id"),
        ({"prompt_token_ids": [1], "decode_address": ""}, "decode_address"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, VOCAB]}, "outside the vocabulary"),
        ({"prompt_token_ids": [-3]}, "outside the vocabulary"),
        ({"prompt_token_ids": [1] * (MAX_LEN + 1)}, f"max_len {MAX_LEN}"),
        ({"prompt_token_ids": [1], "sampling": {"temperature": math.nan}}, "temperature"),
        ({"prompt_token_ids": [1], "sampling": {"top_p": math.inf}}, "top_p"),
        ({"prompt_token_ids": [1], "sampling": {"top_k": -2}}, "top_k"),
        ({"prompt_token_ids": [1], "sampling": {"first_index": 2**32 - 1}}, "first_index"),
    ],
)
def test_prefill_request_validation(workers, fields, message):
    fields = {"request_id": fresh_id(), "decode_address": workers.address, **fields}
    sampling = pb.SamplingParams(**fields.pop("sampling", {}))
    with pytest.raises(grpc.RpcError) as err:
        workers.prefill_stub.Prefill(pb.PrefillRequest(sampling=sampling, **fields), timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_prefill_worker_serves_after_bad_requests(workers):
    prompt, rid = prompt_of(17, offset=3), fresh_id()
    request = pb.DecodeRequest(request_id=rid, prompt_len=len(prompt), max_new_tokens=4)
    tokens = workers.decode_stub.Generate(request, timeout=10)
    reply = workers.prefill_stub.Prefill(
        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, decode_address=workers.address),
        timeout=10,
    )
    assert reply.first_token == fake_tokens(prompt, 1, VOCAB)[0]
    assert [t for m in tokens for t in m.token_ids] == fake_tokens(prompt, 4, VOCAB)


# --- message size limit ------------------------------------------------------------------


class _EchoRouter(pb_grpc.RouterServicer):
    def Generate(self, request, context):  # noqa: N802
        yield pb.GenerateResponse(token_ids=request.prompt_token_ids[:1], finished=True)


def test_oversized_message_is_resource_exhausted():
    limit = router_max_request_bytes(MAX_LEN)
    server = ServingServer(
        [(pb_grpc.add_RouterServicer_to_server, _EchoRouter(), full_service_name("Router"))],
        max_workers=2,
        max_receive_bytes=limit,
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.RouterStub(channel)
            big = pb.GenerateRequest(prompt_token_ids=[1] * (limit + 1), max_new_tokens=1)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(big, timeout=10))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            small = pb.GenerateRequest(prompt_token_ids=[7] * MAX_LEN, max_new_tokens=1)
            assert [t for m in stub.Generate(small, timeout=10) for t in m.token_ids] == [7]
    finally:
        server.stop(grace_s=0.5)
