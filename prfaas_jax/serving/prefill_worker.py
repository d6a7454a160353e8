"""The `PrefillWorker` service: prefill a prompt, push its state to the chosen decode worker.

`PrefillService.Prefill` checks the request, waits for the engine (one prefill at a time: a
prefill instance is compute-bound), prefills with the node's `PrefillEngine`, encodes the state
with the codec (frames of at most `frame_bytes`) followed by the handoff frame (first token and
sampling, engine/decode.py), and streams them to the decode worker's `PushState`. A PrfaaS
worker sends through its `LinkShaper` (the inter-cluster link); a PD worker sends unshaped. The
engine is released before the transfer starts, so the next prompt prefills while this state is
on the wire.

Chunk-level overlap: the codec's v1 data frames carry a stream tag derived from the final header
(which holds whole-tensor CRCs), so no frame can be built before the last chunk is done; the
transfer therefore starts right after prefill, and overlaps the *next* request's prefill.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.decode import Handoff, pack_handoff
from prfaas_jax.errors import UserError
from prfaas_jax.serving.grpc_server import CHANNEL_OPTIONS, abort_for
from prfaas_jax.serving.link import LinkShaper
from prfaas_jax.serving.messages import check_prompt, sampling_from_proto
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc


class DecodeChannels:
    """One channel per decode address, shared by every request of the process."""

    def __init__(self) -> None:
        self._stubs: dict[str, pb_grpc.DecodeWorkerStub] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> pb_grpc.DecodeWorkerStub:
        with self._lock:
            if address not in self._stubs:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._stubs[address] = pb_grpc.DecodeWorkerStub(channel)
            return self._stubs[address]


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        *,
        engine: Callable[[], Any],
        cfg: ModelConfig,
        max_len: int,
        frame_bytes: int,
        shaper: LinkShaper | None,
        admit: Callable[[grpc.ServicerContext], None],
        push_timeout_s: float = 120.0,
    ) -> None:
        """`engine()` returns the node's prefill engine; `admit(context)` aborts the RPC unless
        the node currently has a prefill role."""
        self._engine, self.cfg, self.max_len = engine, cfg, max_len
        self.frame_bytes, self.shaper, self._admit = frame_bytes, shaper, admit
        self.push_timeout_s = push_timeout_s
        self._channels = DecodeChannels()
        self._engine_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.queued = 0  # waiting for or running on the engine
        self.transferring = 0
        self.completed = 0

    def _count(self, name: str, delta: int) -> None:
        with self._count_lock:
            setattr(self, name, getattr(self, name) + delta)

    @property
    def busy(self) -> bool:
        with self._count_lock:
            return bool(self.queued or self.transferring)

    def Prefill(  # noqa: N802
        self, request: pb.PrefillRequest, context: grpc.ServicerContext
    ) -> pb.PrefillReply:
        self._admit(context)
        tokens = list(request.prompt_token_ids)
        try:
            if not request.request_id:
                raise UserError("request_id is empty")
            if not request.decode_address:
                raise UserError("decode_address is empty")
            check_prompt(tokens, self.cfg, max_len=self.max_len, max_new_tokens=1)
            s = request.sampling
            sampling = sampling_from_proto(s.temperature, s.top_p, s.top_k, s.seed)
        except UserError as err:
            abort_for(context, err)
        arrived = time.perf_counter()
        self._count("queued", 1)
        try:
            with self._engine_lock:
                started = time.perf_counter()
                result = self._engine().prefill(tokens, sampling=sampling, max_len=self.max_len)
                frames = list(
                    codec.encode(result.state, self.cfg, max_frame_bytes=self.frame_bytes)
                )
        except Exception as err:  # the engine's own checks, or a bug: report, don't hang
            abort_for(context, err)
        finally:
            self._count("queued", -1)
        prefilled = time.perf_counter()
        frames.append(pack_handoff(Handoff(result.first_token, sampling), frames[0]))
        state_bytes = codec.inspect(frames).payload_nbytes
        self._count("transferring", 1)
        try:
            self._push(request, frames, context)
        finally:
            self._count("transferring", -1)
        self._count("completed", 1)
        return pb.PrefillReply(
            first_token=result.first_token,
            state_bytes=state_bytes,
            wire_bytes=sum(len(f) for f in frames),
            frames=len(frames),
            queue_s=started - arrived,
            prefill_s=prefilled - started,
            transfer_s=time.perf_counter() - prefilled,
            shaped=self.shaper is not None,
        )

    def _push(
        self, request: pb.PrefillRequest, frames: list[bytes], context: grpc.ServicerContext
    ) -> None:
        def chunks() -> Iterator[pb.StateChunk]:
            yield pb.StateChunk(request_id=request.request_id)
            sent = self.shaper.send(frames) if self.shaper is not None else frames
            for frame in sent:
                if not context.is_active():
                    return  # the router gave up on this request: stop using the link
                yield pb.StateChunk(frame=frame)

        stub = self._channels.stub(request.decode_address)
        try:
            stub.PushState(chunks(), timeout=self.push_timeout_s)
        except grpc.RpcError as err:
            context.abort(
                err.code(), f"pushing the state to {request.decode_address}: {err.details()}"
            )
