"""A state that does not match its tokens fails its request: workers in process on loopback.

The fake engines check every bit of a state they are handed against the state its tokens make
(engine/fake.py). Through the workers: a decode worker handed a state damaged before it was
encoded (so every checksum holds) — one bit of a KDA recurrent state, of a conv tail, of a
later layer, of MLA k_rope or c_kv — fails the request with INVALID_ARGUMENT naming the
tensor (at most prefill's first token gets out first, also when that is the only token asked
for and nothing is decoded), and goes on serving. A prefill worker
whose prefix hit has the right KV blocks but another prefix's linear checkpoint, from its own
cache or fetched from another instance's, fails the prefill the same way; a fetched prefix the
engine refuses is not kept in the importer's cache.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.codec.layout import canonical_arrays, state_from_arrays
from prfaas_jax.engine.fake import (
    STATE_MISMATCH,
    FakeDecodeEngine,
    FakePrefillEngine,
    fake_tokens,
)
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.server import ServingServer, full_service_name
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService
from prfaas_jax.serving.worker.prefix import PrefixService

CFG = load_model_config("tiny")  # layers: KDA, KDA, KDA, MLA
VOCAB = CFG.vocab_size
MAX_LEN = 64
FRAME_BYTES = 1024


@dataclasses.dataclass
class Node:
    """One worker: prefill (through its prefix cache) and decode on one loopback server."""

    prefixes: PrefixService
    decode: DecodeService
    server: ServingServer

    @property
    def address(self) -> str:
        return self.server.address


@pytest.fixture
def nodes() -> Iterator[Callable[[], Node]]:
    """Starts nodes on demand; stops them after the test."""
    started: list[Node] = []

    def start() -> Node:
        cache = PrefixCache(CFG, capacity_bytes=1 << 20, block_size=4)
        prefixes = PrefixService(
            cfg=CFG, cache=cache, max_len=MAX_LEN, frame_bytes=FRAME_BYTES, shaper=None
        )
        prefill = PrefillService(
            engine=lambda: FakePrefillEngine(CFG),
            cfg=CFG,
            max_len=MAX_LEN,
            frame_bytes=FRAME_BYTES,
            shaper=None,
            admit=lambda context: None,
            push_timeout_s=10.0,
            prefixes=prefixes,
        )
        decode = DecodeService(
            engine=lambda: FakeDecodeEngine(CFG, max_slots=4, max_len=MAX_LEN),
            cfg=CFG,
            max_len=MAX_LEN,
            admit=lambda context: None,
            state_timeout_s=10.0,
        )
        services = [
            (pb_grpc.add_PrefillWorkerServicer_to_server, prefill, "PrefillWorker"),
            (pb_grpc.add_DecodeWorkerServicer_to_server, decode, "DecodeWorker"),
            (pb_grpc.add_PrefixCacheServicer_to_server, prefixes, "PrefixCache"),
        ]
        server = ServingServer([(add, s, full_service_name(name)) for add, s, name in services])
        started.append(Node(prefixes, decode, server))
        return started[-1]

    yield start
    for node in started:
        node.decode.stop()
        node.server.stop(grace_s=0.5)


def serve(node: Node, prompt: list[int], n: int, source: Node | None = None) -> pb.PrefillReply:
    """Prefill on `node` (reusing `source`'s prefix when given), decode there; checks that the
    `n` tokens are the fake engines'."""
    request_id = uuid.uuid4().hex
    with grpc.insecure_channel(node.address) as channel:
        tokens = pb_grpc.DecodeWorkerStub(channel).Generate(
            pb.DecodeRequest(request_id=request_id, prompt_len=len(prompt), max_new_tokens=n),
            timeout=10,
        )
        try:
            reply = pb_grpc.PrefillWorkerStub(channel).Prefill(
                pb.PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    decode_address=node.address,
                    prefix_source=source.address if source else "",
                ),
                timeout=10,
            )
        except grpc.RpcError:
            tokens.cancel()  # its state will never come
            raise
        assert [t for m in tokens for t in m.token_ids] == fake_tokens(prompt, n, VOCAB)
    return reply


def prompt_of(n: int) -> list[int]:
    return [(3 * i + 1) % VOCAB for i in range(n)]


@pytest.mark.parametrize("max_new_tokens", [4, 1])  # 1: no decoding, the state is still checked
@pytest.mark.parametrize(
    ("layer", "name"),
    [(0, "recurrent"), (1, "recurrent"), (2, "conv"), (3, "k_rope"), (3, "c_kv")],
)
def test_a_state_damaged_before_encoding_fails_its_request(nodes, layer, name, max_new_tokens):
    node = nodes()
    prompt = prompt_of(20)
    result = FakePrefillEngine(CFG).prefill(prompt, max_len=MAX_LEN)
    length, arrays = canonical_arrays(result.state, CFG, 0)
    arrays = [(spec, np.array(array)) for spec, array in arrays]
    spec, array = next((s, a) for s, a in arrays if (s.layer, s.name) == (layer, name))
    array.view(f"u{spec.itemsize}").reshape(-1)[array.size // 2 + 1] ^= 1  # one bit, mid-tensor
    damaged = state_from_arrays(CFG, length, arrays, MAX_LEN)
    frames = list(codec.encode(damaged, CFG, max_frame_bytes=FRAME_BYTES))
    handoff = pack_handoff(Handoff(result.first_token, SamplingParams()), frames[0])
    request_id = uuid.uuid4().hex
    with grpc.insecure_channel(node.address) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        chunks = [pb.StateChunk(request_id=request_id)]
        chunks += [pb.StateChunk(frame=frame) for frame in [*frames, handoff]]
        stub.PushState(iter(chunks), timeout=10)  # every checksum holds: accepted
        request = pb.DecodeRequest(
            request_id=request_id, prompt_len=len(prompt), max_new_tokens=max_new_tokens
        )
        got = []
        with pytest.raises(grpc.RpcError) as err:
            for message in stub.Generate(request, timeout=10):
                got += message.token_ids
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"the state {STATE_MISMATCH}: {spec} differs" in err.value.details()
    assert got == fake_tokens(prompt, len(got), VOCAB)  # at most prefill's first token
    serve(node, prompt, max_new_tokens)  # the worker goes on serving, the intact state exactly


@pytest.mark.parametrize("where", ["own cache", "fetched"])
def test_a_prefix_hit_with_another_prefix_checkpoint_fails_the_prefill(nodes, where):
    """The holder's checkpoint at 16 tokens is replaced by that of a prompt that differs only
    in its last token: same KV blocks for 15 positions, other recurrent states and conv tails."""
    holder = nodes()
    prompt = prompt_of(16)
    follow_up = [*prompt, 9, 9, 9]
    serve(holder, prompt, 2)
    assert serve(holder, follow_up, 2).cached_len == 16  # the intact hit, reused exactly

    donor = FakePrefillEngine(CFG).prefill([*prompt[:-1], prompt[-1] + 1]).state
    fixed = [a for spec, a in canonical_arrays(donor, CFG, 0)[1] if not spec.token_axis]
    hit = holder.prefixes.cache.match(follow_up, record=False)
    assert hit is not None and hit.length == 16
    for stored, array in zip(hit.checkpoint.fixed, fixed, strict=True):
        np.copyto(stored, array)

    target, source = (holder, None) if where == "own cache" else (nodes(), holder)
    with pytest.raises(grpc.RpcError) as err:
        serve(target, follow_up, 2, source=source)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prefix state {STATE_MISMATCH}: layer 0 kda recurrent" in err.value.details()
    assert target.prefixes.imports == (where == "fetched")


def test_a_refused_fetched_prefix_is_not_kept(nodes):
    """A fetched prefix enters the importer's cache only once its engine has accepted it: after
    the refusal above, the same prompt on the importer hits nothing and is computed whole."""
    holder, importer = nodes(), nodes()
    prompt = prompt_of(16)
    follow_up = [*prompt, 9, 9, 9]
    serve(holder, prompt, 2)
    donor = FakePrefillEngine(CFG).prefill([*prompt[:-1], prompt[-1] + 1]).state
    fixed = [a for spec, a in canonical_arrays(donor, CFG, 0)[1] if not spec.token_axis]
    hit = holder.prefixes.cache.match(follow_up, record=False)
    for stored, array in zip(hit.checkpoint.fixed, fixed, strict=True):
        np.copyto(stored, array)

    with pytest.raises(grpc.RpcError) as err:
        serve(importer, follow_up, 2, source=holder)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prefix state {STATE_MISMATCH}" in err.value.details()
    assert importer.prefixes.imports == 1  # fetched and decoded: the codec had nothing to refuse

    assert importer.prefixes.cache.match(follow_up, record=False) is None
    assert serve(importer, follow_up, 2).cached_len == 0  # computed whole, and right
    assert serve(importer, [*follow_up, 5], 2).cached_len == len(follow_up)  # its own state
