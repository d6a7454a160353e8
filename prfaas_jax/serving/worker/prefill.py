"""The `PrefillWorker` service: prefill a prompt, stream its state to the chosen decode worker.

`PrefillService.Prefill` checks the request, waits for the engine (one prefill at a time: a
prefill instance is compute-bound), then streams the state to the decode worker's `PushState`
*while* the node's `PrefillEngine` computes it (codec v2, docs/wire-format.md; frames of at most
`frame_bytes`): the header goes out as prefill starts, each chunk's `on_chunk` hands the MLA /
GQA cache rows it made final to the stream (`StreamEncoder.ready_frames`); in the last chunk an
engine with `[engine] layer_groups > 1` hands over each group of layers as soon as its states
are final (`on_layers`, `StreamEncoder.layer_frames`: recurrent states, conv tails, SWA windows,
the last cache rows), so they travel while the later layers compute; whatever is left goes
after the last chunk, then the trailer and the handoff frame (first token and sampling,
engine/codec/handoff.py).

Two threads share the work through an `_Outbox`: the engine thread (this RPC's) makes frames,
gRPC's request-stream thread sends them, so copying rows to the host is all a chunk waits for.
A PrfaaS worker sends through its `LinkShaper` (the inter-cluster link; each frame takes its
place on the link when it is made); a PD worker sends unshaped. Each frame says whether it was
made before the previous one left (`StateChunk.queued`); the decode worker times those frames'
arrivals and replies with the link's time for them, from which a PrfaaS worker learns its link's
capacity (`link_meter`, policy/link_capacity.py). The engine is released after
the last chunk, so the next prompt prefills while this state's tail is on the wire. The push's
deadline (`push_timeout_s`) therefore covers prefill and transfer.

When the router says the decode worker already holds the KV of the prompt's first K positions
(`decode_cached_len`, from `DecodeWorker.ReserveKv`), the stream is an increment: those rows
stay out of it (the header's base; docs/wire-format.md).

Every prefill goes through the node's prefix cache (`prefixes`, serving/worker/prefix.py): only
the part of the prompt no cached prefix covers is computed, checkpoints are saved from the same
`on_chunk` calls, and a prefix the router says sits on another instance (`prefix_source`) is
fetched before the engine is awaited. The reply's `cached_len` is what was reused.

The queue is bounded: with `max_queue` requests already waiting for or on the engine (a prefix
fetch counts), the next is refused at once with RESOURCE_EXHAUSTED, before any work.

A call the router cancels (its client left, or it gave up on the attempt) stops at once: a
request still waiting for the engine never takes it, one on the engine stops at its next chunk,
no further frame goes on the link, and the push is cancelled.

A failed push fails the RPC with the push's status (the router then retries), and stops the
prefill at its next chunk, so a lost transfer does not hold the engine: a stream the
decode worker rejected keeps its code (INVALID_ARGUMENT for bad frames), an unreachable or dead
decode worker is UNAVAILABLE, and so is a link cut midway (a cancelled push). With `[chaos]` on,
`faults` (serving/worker/faults.py) corrupts a frame or cuts the link of some transfers on purpose.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.api import OnChunk, OnLayers, PrefillEngineLike, PrefillOutput
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import ModelState, state_nbytes
from prfaas_jax.policy.link_capacity import CapacityMeter
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport import security as transport
from prfaas_jax.serving.transport.link import LinkShaper
from prfaas_jax.serving.transport.messages import check_prompt, sampling_from_proto
from prfaas_jax.serving.transport.server import CHANNEL_OPTIONS, abort_for
from prfaas_jax.serving.worker.faults import FaultInjector, TransferFaults
from prfaas_jax.serving.worker.prefix import PrefixService


class DecodeChannels:
    """One channel per decode address, shared by every request of the process (mutual TLS when
    `security` has certificates)."""

    def __init__(self, security: SecuritySection | None = None) -> None:
        self.security = security
        self._stubs: dict[str, pb_grpc.DecodeWorkerStub] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> pb_grpc.DecodeWorkerStub:
        with self._lock:
            if address not in self._stubs:
                channel = transport.channel(address, self.security, CHANNEL_OPTIONS)
                self._stubs[address] = pb_grpc.DecodeWorkerStub(channel)
            return self._stubs[address]


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        *,
        engine: Callable[[], PrefillEngineLike],
        cfg: ModelConfig,
        max_len: int,
        frame_bytes: int,
        shaper: LinkShaper | None,
        admit: Callable[[grpc.ServicerContext], None],
        push_timeout_s: float = 120.0,
        prefixes: PrefixService | None = None,
        security: SecuritySection | None = None,
        faults: FaultInjector | None = None,
        max_queue: int = 64,
    ) -> None:
        """`engine()` returns the node's prefill engine; `admit(context)` aborts the RPC unless
        the node currently has a prefill role; `prefixes` is the node's prefix cache, which
        every prefill goes through (none: every prompt is computed in full); `security` is how
        pushes reach decode workers (None: plaintext); `faults` injects transfer faults
        (`[chaos]`; None: none); `max_queue` bounds the requests waiting for or on the engine
        (more are RESOURCE_EXHAUSTED at once)."""
        self._engine, self.cfg, self.max_len = engine, cfg, max_len
        self.frame_bytes, self.shaper, self._admit = frame_bytes, shaper, admit
        self.push_timeout_s, self.prefixes = push_timeout_s, prefixes
        self._channels = DecodeChannels(security)
        self.faults, self.max_queue = faults, max_queue
        # A PrfaaS worker learns its link's rate from its own transfers (never from the shaper).
        self.link_meter = CapacityMeter() if shaper is not None else None
        self._engine_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.queued = 0  # waiting for or running on the engine
        self.transferring = 0
        self.completed = 0

    def _count(self, name: str, delta: int) -> None:
        with self._count_lock:
            setattr(self, name, getattr(self, name) + delta)

    def learned_link(self) -> tuple[float, int]:
        """``(bytes/s, transfers)``: the link's capacity and how many transfers taught it;
        0.0 bytes/s without a link, before the first timed transfer, or when none was timed
        for the meter's `stale_s`."""
        with self._count_lock:
            meter = self.link_meter
            if meter is None:
                return 0.0, 0
            return meter.estimate(time.monotonic()), meter.samples

    @property
    def busy(self) -> bool:
        with self._count_lock:
            return bool(self.queued or self.transferring)

    def _enter_queue(self, context: grpc.ServicerContext) -> None:
        """Count the request into the queue, or refuse it when the queue is full."""
        with self._count_lock:
            full = self.queued >= self.max_queue
            if not full:
                self.queued += 1
        if full:
            message = f"prefill queue full ({self.max_queue} requests)"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

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
            if not 0 <= request.decode_cached_len < len(tokens):
                raise UserError(
                    f"decode_cached_len {request.decode_cached_len} is outside [0, "
                    f"{len(tokens)}): the last prompt position is always sent"
                )
            s = request.sampling
            sampling = sampling_from_proto(s.temperature, s.top_p, s.top_k, s.seed, s.first_index)
        except UserError as err:
            abort_for(context, err)
        arrived = time.perf_counter()
        self._enter_queue(context)
        outbox = _Outbox(self.shaper, context)
        # The call ends early when the router cancels it (its client left, or it gave up on the
        # attempt): stop at once — no more frames on the link, the push cancelled.
        context.add_callback(lambda: outbox.cancel(outbox.push))
        push: grpc.Future | None = None
        try:
            prefix = None
            if request.prefix_source and self.prefixes is not None:
                # Fetched before waiting for the engine, so the transfer overlaps the queue.
                prefix = self.prefixes.fetch(
                    request.prefix_source, tokens, cross_cluster=request.prefix_cross_cluster
                )
            with self._engine_lock:
                if outbox.stopped:  # cancelled while it waited: the engine goes to the next
                    raise _AbandonedError
                started = time.perf_counter()
                # The decode worker holds the KV of the first decode_cached_len positions: an
                # increment leaves them out.
                encoder = codec.StreamEncoder(
                    self.cfg,
                    len(tokens),
                    max_frame_bytes=self.frame_bytes,
                    base=request.decode_cached_len,
                )
                if self.faults is not None:
                    outbox.faults = self.faults.plan(
                        encoder.state_header, 1, f"{request.request_id} → {request.decode_address}"
                    )
                push = self._start_push(request, outbox)
                outbox.put(encoder.header())

                def shipped(state: ModelState) -> ModelState:
                    return state if outbox.faults is None else outbox.faults.state(state)

                def on_chunk(state: ModelState, done: int) -> None:
                    if outbox.stopped:  # the push failed or the router gave up: stop computing
                        raise _AbandonedError
                    outbox.put_all(encoder.ready_frames(shipped(state), done))

                def on_layers(state: ModelState, done: int, layers: range) -> None:
                    if outbox.stopped:
                        raise _AbandonedError
                    outbox.put_all(encoder.layer_frames(shipped(state), layers))

                result = self._prefill(
                    tokens, prefix, sampling=sampling, on_chunk=on_chunk, on_layers=on_layers
                )
                # Reads the state; frames are built as they are sent.
                tail = encoder.finish(shipped(result.state))
        except _AbandonedError:
            result = None
        except Exception as err:  # the engine's own checks, or a bug: report, don't hang
            outbox.cancel(push)
            abort_for(context, err)
        finally:
            self._count("queued", -1)
        prefilled = time.perf_counter()
        if result is None:
            if push is None or not push.done() or not context.is_active():  # cancelled
                outbox.cancel(push)
                context.abort(grpc.StatusCode.CANCELLED, "the request was cancelled")
        else:
            outbox.put_all(tail)
            outbox.put(pack_handoff(Handoff(result.first_token, sampling), encoder.header()))
            outbox.close()
        try:
            pushed = push.result()
        except grpc.FutureCancelledError:  # the link was cut under the stream
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"pushing the state to {request.decode_address}: {outbox.cut_reason()}",
            )
        except grpc.RpcError as err:
            context.abort(
                err.code(), f"pushing the state to {request.decode_address}: {err.details()}"
            )
        if result is None:  # stopped although the push went through: cannot happen, but say so
            context.abort(grpc.StatusCode.INTERNAL, "the prefill stopped before its state was sent")
        self._count("completed", 1)
        if self.link_meter is not None:
            with self._count_lock:
                self.link_meter.add(pushed.backlog_bytes, pushed.backlog_s, time.monotonic())
        return pb.PrefillReply(
            first_token=result.first_token,
            state_bytes=encoder.state_header.payload_nbytes,
            wire_bytes=outbox.wire_bytes,
            frames=outbox.frames,
            queue_s=started - arrived,
            prefill_s=prefilled - started,
            transfer_s=time.perf_counter() - prefilled,  # the part of the transfer after prefill
            shaped=self.shaper is not None,
            cached_len=result.prefix_len,
            prefix_bytes=0 if prefix is None else state_nbytes(self.cfg, int(prefix.lengths[0])),
        )

    def _prefill(
        self,
        tokens: list[int],
        prefix: ModelState | None,
        *,
        sampling: SamplingParams,
        on_chunk: OnChunk,
        on_layers: OnLayers,
    ) -> PrefillOutput:
        """Prefill through the node's prefix cache (engine/cached_prefill.py): only the part no
        cached (or fetched) prefix covers is computed; `on_chunk` still sees every chunk, and
        an engine that streams by layers calls `on_layers` in the last."""
        engine, max_len = self._engine(), self.max_len
        options = {"sampling": sampling, "max_len": max_len}
        options |= {"on_chunk": on_chunk, "on_layers": on_layers}
        if self.prefixes is None:
            return engine.prefill(tokens, **options)
        return self.prefixes.reuse.prefill(engine, tokens, prefix=prefix, **options)

    def _start_push(self, request: pb.PrefillRequest, outbox: _Outbox) -> grpc.Future:
        """Open the decode worker's `PushState`; it sends what `outbox` is given, as it comes."""

        def chunks() -> Iterator[pb.StateChunk]:
            yield pb.StateChunk(request_id=request.request_id)
            for frame, queued in outbox.frames_to_send():
                yield pb.StateChunk(frame=frame, queued=queued)

        stub = self._channels.stub(request.decode_address)
        self._count("transferring", 1)
        push = stub.PushState.future(chunks(), timeout=self.push_timeout_s)
        outbox.push = push  # before the first frame is put, so before the sender can need it

        def done(_: grpc.Future) -> None:
            outbox.stop()  # a failed push takes no more frames (nor link capacity)
            self._count("transferring", -1)

        push.add_done_callback(done)
        return push


_CLOSED = None
_CANCEL_WAIT_S = 5.0  # bounds the wait for gRPC to act on a cancel (it takes milliseconds)


class _AbandonedError(Exception):
    """The transfer ended before the state was complete: computing the rest would be waste."""


class _Outbox:
    """Frames between the engine thread (`put`) and gRPC's request-stream thread
    (`frames_to_send`), shaped by the link when there is one."""

    def __init__(self, shaper: LinkShaper | None, context: grpc.ServicerContext) -> None:
        self._shaper, self._context = shaper, context
        self._queue: queue.Queue[tuple[bytes, float] | None] = queue.Queue()
        self._stopped = threading.Event()  # the sender gave up: drop what is still made
        self.frames = self.wire_bytes = 0
        self.push: grpc.Future | None = None
        self.faults: TransferFaults | None = None  # `[chaos]`: this transfer's planned faults

    def put(self, frame: bytes) -> None:
        if self._stopped.is_set():
            return
        if self.faults is not None:
            frame = self.faults.corrupt(frame)
        # The frame joins the link's queue when it is made, not when the sender gets to it.
        arrival = self._shaper.admit(len(frame)) if self._shaper is not None else 0.0
        self.frames += 1
        self.wire_bytes += len(frame)
        self._queue.put((frame, arrival))

    def put_all(self, frames: Iterable[bytes]) -> None:
        for frame in frames:
            self.put(frame)

    def close(self) -> None:
        self._queue.put(_CLOSED)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        self._stopped.set()

    def cancel(self, push: grpc.Future | None) -> None:
        """Abandon the transfer: the decode worker sees a cancelled stream, not a short one."""
        self.stop()
        if push is not None:
            push.cancel()
        self.close()  # wakes the sending thread if it waits for a frame

    def cut_reason(self) -> str:
        faults = self.faults
        if faults is not None and faults.dropped:
            where = "inter-cluster link" if self._shaper is not None else "link"
            return f"{where} dropped after {faults.cut_after} of {faults.num_frames} frames"
        return "the transfer was cancelled"

    def _abandon(self) -> None:
        """End the push without a clean end: cancel it, and return from the request stream
        only once gRPC has seen the cancel. Returning first would half-close the stream, which
        the decode worker could read as a complete state that is short (INVALID_ARGUMENT and a
        refused state in its log) instead of a cut transfer."""
        self.stop()
        push = self.push
        if push is None:
            return
        cancelled = threading.Event()
        push.add_done_callback(lambda _: cancelled.set())
        push.cancel()
        cancelled.wait(_CANCEL_WAIT_S)

    def frames_to_send(self) -> Iterator[tuple[bytes, bool]]:
        """``(frame, queued)`` as they may go: ``queued`` when the frame was made before the
        previous one left, so it follows it onto the wire back to back (the receiver times
        the link on such frames: policy/link_capacity.py)."""
        sent = 0
        while True:
            try:
                item, queued = self._queue.get_nowait(), sent > 0
            except queue.Empty:
                item, queued = self._queue.get(), False
            if item is _CLOSED:
                return
            if self._stopped.is_set() or not self._context.is_active():
                self._abandon()  # the router gave up on this request: stop using the link
                return
            if self.faults is not None and self.faults.cut(sent):
                self._abandon()  # a dead link: the receiver sees no clean end
                return
            frame, arrival = item
            yield (
                (self._shaper.deliver(frame, arrival) if self._shaper is not None else frame),
                queued,
            )
            sent += 1
