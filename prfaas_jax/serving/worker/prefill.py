"""The `PrefillWorker` service: prefill a prompt, stream its state to the chosen decode worker.

`PrefillService.Prefill` checks the request, waits for the engine (one engine call at a time: a
prefill instance is compute-bound; short prompts waiting together share one, below), then
streams the state to the decode worker's `PushState` *while* the node's `PrefillEngine` computes
it (codec v2, docs/wire-format.md; frames of at most `frame_bytes`): the header goes out as
prefill starts, each chunk's `on_chunk` hands the MLA / GQA cache rows it made final to the
stream (`StreamEncoder.ready_frames`); in the last chunk an engine with
`[engine] layer_groups > 1` hands over each group of layers as soon as its states are final
(`on_layers`, `StreamEncoder.layer_frames`: recurrent states, conv tails, SWA windows, the last
cache rows), so they travel while the later layers compute; whatever is left goes after the last
chunk, then the trailer and the handoff frame (first token and sampling,
engine/codec/handoff.py).

The state travels as one transfer (`StatePush`, serving/transfer/sender.py): the engine thread
(this RPC's) makes frames, gRPC's request-stream threads send them, so copying rows to the host
is all a chunk waits for. A PrfaaS worker's transfer goes through its `LinkShaper` (the
inter-cluster link), striped over `[link] streams` pushes when that is more than 1; a PD worker's
goes unshaped, on one stream. The decode worker times the frames that queued behind each other
and replies with the link's time for them, from which a PrfaaS worker learns its link's capacity
(`link_meter`, policy/link_capacity.py). The engine is released after the last chunk, so the
next prompt prefills while this state's tail is on the wire. The push's deadline
(`push_timeout_s`) therefore covers prefill and transfer.

A request that asks for log-probabilities (`logprobs`) has its context and first token scored
once the state is sealed, while its tail is on the wire (`score`: a second prefill that keeps
every position's logits), and the reply carries them; other requests never pay for it.

When the router says the decode worker already holds the KV of the prompt's first K positions
(`decode_cached_len`, from `DecodeWorker.ReserveKv`), the stream is an increment: those rows
stay out of it (the header's base; docs/wire-format.md).

The state's encoding is the worker's `[link] precision` unless the request names one
(`wire_precision`: the router's `[wire]` choice for this request, serving/router/wire_rule.py);
the header declares each tensor's, so the decode worker reads any.

Every prefill goes through the node's prefix cache (`prefixes`, serving/worker/prefix.py): only
the part of the prompt no cached prefix covers is computed, checkpoints are saved from the same
`on_chunk` calls, and a prefix the router says sits on another instance (`prefix_source`) is
fetched before the engine is awaited (a prefix in this worker's disk tier is read back then too,
`PrefixService.prefetch`). The reply's `cached_len` is what was reused, its `cache_tier` where
that came from (host memory, the disk tier, or a fetched prefix).

Short prompts waiting together share one engine call (`[engine] prefill_batch_rows`,
`prefill_batch_tokens`; serving/worker/prefill_queue.py): each keeps its own push, report,
errors and cancellation, and its row is what it would be alone.

The queue is bounded: with `max_queue` requests already waiting for or on the engine (a prefix
fetch counts), the next is refused at once with RESOURCE_EXHAUSTED, before any work.

A call the router cancels (its client left, or it gave up on the attempt) stops at once: a
request still waiting for the engine leaves the queue and never takes it, one on the engine
stops at its next chunk, no further frame goes on the link, and the push is cancelled.

A request this worker refuses — its checks, or a prompt past the engine's limit — is
INVALID_ARGUMENT marked final (serving/transport/messages.py `abort_final`): the router does
not retry it. A failed push fails the RPC with the status its `TransferError` carries (the
router then retries: a damaged state may be the link's fault), and stops the prefill at its
next chunk, so a lost transfer does not hold the engine: a stream the decode worker rejected
keeps its code (INVALID_ARGUMENT for bad frames), an unreachable or dead decode worker is
UNAVAILABLE, and so is a link cut midway (a cancelled push). With `[faults]` on, `faults`
(serving/transfer/faults.py) corrupts a frame or cuts the link of some transfers on purpose.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import grpc

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.api import OnChunk, OnLayers, PrefillEngineLike, PrefillOutput
from prfaas_jax.engine.cached_prefill import IMPORTED, NOT_REUSED
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import ModelState, state_nbytes
from prfaas_jax.policy.link_capacity import CapacityMeter
from prfaas_jax.policy.link_rtt import RttMeter
from prfaas_jax.prefix_events import DISK, HOST
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer.api import TransferError, TransferLedger
from prfaas_jax.serving.transfer.channels import DecodeChannels
from prfaas_jax.serving.transfer.faults import FaultInjector
from prfaas_jax.serving.transfer.sender import StatePush
from prfaas_jax.serving.transport.link import LinkShaper
from prfaas_jax.serving.transport.messages import (
    abort_final,
    check_prompt,
    check_top_logprobs,
    logprobs_to_proto,
    sampling_from_proto,
)
from prfaas_jax.serving.transport.server import abort_for
from prfaas_jax.serving.worker.prefill_queue import PrefillQueue, QueuedPrefill, WithdrawnError
from prfaas_jax.serving.worker.prefix import PrefixService
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision

# `PrefillReply.cache_tier` of each source `CachedPrefill` reports (engine/cached_prefill.py).
CACHE_TIERS = {
    NOT_REUSED: pb.CACHE_TIER_NONE,
    HOST: pb.CACHE_TIER_HOST,
    DISK: pb.CACHE_TIER_DISK,
    IMPORTED: pb.CACHE_TIER_PEER,
}


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
        streams: int = 1,
        name: str = "",
        precision: WirePrecision = WIRE_NATIVE,
        data_path: bool = True,
        batch_rows: int = 1,
        batch_tokens: int = 4096,
        batch_ready: Callable[[Sequence[int]], bool] | None = None,
    ) -> None:
        """`engine()` returns the node's prefill engine; `admit(context)` aborts the RPC unless
        the node currently has a prefill role; `prefixes` is the node's prefix cache, which
        every prefill goes through (none: every prompt is computed in full); `security` is how
        pushes reach decode workers (None: plaintext); `faults` injects transfer faults
        (`[faults]`; None: none); `max_queue` bounds the requests waiting for or on the engine
        (more are RESOURCE_EXHAUSTED at once); `streams`: the pushes a state crossing the
        link is striped over (serving/transfer/stripes.py); `name`: this worker's, which its
        pushes carry (the decode worker times the link per sender); `precision`: how its
        pushes encode a state (`[link] precision` for a PrfaaS worker, else native) unless
        the request names one (the router's `[wire]` choice);
        `data_path`: whether pushes send their frames on a data connection where the decode
        worker has a data port (`[link] data_path`, serving/transfer/data_path.py);
        `batch_rows`, `batch_tokens`: at most this many waiting short prompts, of at most this
        many tokens together, share one engine call (serving/worker/prefill_queue.py; 1: each
        prompt alone), once `batch_ready(lengths)` says its calls are compiled (None: at once)."""
        self._engine, self.cfg, self.max_len = engine, cfg, max_len
        self.frame_bytes, self.shaper, self._admit = frame_bytes, shaper, admit
        self.push_timeout_s, self.prefixes = push_timeout_s, prefixes
        self._channels = DecodeChannels(security, data_path=data_path)
        self.transfers = TransferLedger()  # how this worker's transfers ended
        self.faults, self.max_queue, self.streams = faults, max_queue, streams
        self.name, self.precision = name, precision
        # A PrfaaS worker learns its link's rate from its own transfers (never from the shaper).
        self.link_meter = CapacityMeter() if shaper is not None else None
        # And its round trip, as TCP measured it on the pushes' data connections.
        self.rtt_meter = RttMeter() if shaper is not None else None
        self._queue = PrefillQueue(
            max_rows=batch_rows, max_tokens=batch_tokens, max_len=max_len, ready=batch_ready
        )
        self._count_lock = threading.Lock()
        self.retransmits = 0  # segments TCP resent on the data connections of delivered pushes
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

    def measured_rtt(self) -> tuple[float, int]:
        """``(seconds, transfers)``: the link's round trip as TCP measured it (`RttMeter`)."""
        with self._count_lock:
            meter = self.rtt_meter
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
            top = check_top_logprobs(request.logprobs) if request.HasField("logprobs") else None
            precision = self._precision(request.wire_precision)
        except UserError as err:  # the request itself: another attempt would meet the same
            abort_final(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        arrived = time.perf_counter()
        self._enter_queue(context)
        push = StatePush(
            request.request_id,
            request.decode_address,
            channels=self._channels,
            context=context,
            shaper=self.shaper,
            lanes=self.streams if self.shaper else 1,
            sender_name=self.name,
            timeout_s=self.push_timeout_s,
            ledger=self.transfers,
        )
        # The call ends early when the router cancels it (its client left, or it gave up on the
        # attempt): stop at once — no more frames on the link, the push cancelled.
        context.add_callback(lambda: (push.cancel(), self._queue.wake()))
        try:
            prefix = None
            if request.prefix_source and self.prefixes is not None:
                # Fetched before waiting for the engine, so the transfer overlaps the queue.
                prefix = self.prefixes.fetch(
                    request.prefix_source, tokens, cross_cluster=request.prefix_cross_cluster
                )
            elif self.prefixes is not None:
                # A prefix in the disk tier is read back while the request waits, likewise.
                self.prefixes.prefetch(tokens)
            # The decode worker holds the KV of the first decode_cached_len positions: an
            # increment leaves them out.
            encoder = codec.StreamEncoder(
                self.cfg,
                len(tokens),
                max_frame_bytes=self.frame_bytes,
                base=request.decode_cached_len,
                precision=precision,
            )
            faults = None
            started = arrived
            reused_from = NOT_REUSED  # a batched row reuses nothing

            def on_reuse(source: str) -> None:
                nonlocal reused_from
                reused_from = source

            def start() -> None:  # the engine is this request's
                nonlocal faults, started
                if push.stopped:  # cancelled while it waited: the engine goes to the next
                    raise _AbandonedError
                started = time.perf_counter()
                if self.faults is not None:
                    faults = self.faults.plan(
                        encoder.state_header, 1, f"{request.request_id} → {request.decode_address}"
                    )
                self._count("transferring", 1)
                push.open(faults, on_answered=lambda: self._count("transferring", -1))
                push.put_all([encoder.header()])

            def shipped(state: ModelState) -> ModelState:
                return state if faults is None else faults.state(state)

            def on_chunk(state: ModelState, done: int) -> None:
                if push.stopped:  # the push failed or the router gave up: stop computing
                    raise _AbandonedError
                push.put_all(encoder.ready_frames(shipped(state), done))

            def on_layers(state: ModelState, done: int, layers: range) -> None:
                if push.stopped:
                    raise _AbandonedError
                push.put_all(encoder.layer_frames(shipped(state), layers))

            def row_done(output: PrefillOutput) -> None:  # a row of a batched call
                on_chunk(output.state, len(tokens))
                if self.prefixes is not None:
                    self.prefixes.reuse.computed(tokens, output.state)

            queued = QueuedPrefill(
                tokens,
                sampling,
                start=start,
                alone=lambda: self._prefill(
                    tokens,
                    prefix,
                    sampling=sampling,
                    on_chunk=on_chunk,
                    on_layers=on_layers,
                    on_reuse=on_reuse,
                ),
                row_done=row_done,
                batchable=lambda: prefix is None and self._batchable(tokens),
                stopped=lambda: push.stopped,
            )
            result = self._queue.run(queued, self._engine())
            # The cache has kept this prompt: an index that has seen this event knows it.
            cache_seq = self.prefixes.cache_seq() if self.prefixes is not None else 0
            # Views of the state's buffers (FrameParts): a data connection sends them as
            # they lie, a stream joins each frame once.
            tail = encoder.finish(shipped(result.state), views=True)
        except (_AbandonedError, WithdrawnError):
            result = None
        except Exception as err:  # the engine's own checks, or a bug: report, don't hang
            push.cancel()
            abort_for(context, err)
        finally:
            self._count("queued", -1)
        prefilled = time.perf_counter()
        if result is None:
            if not push.answered or not context.is_active():  # cancelled
                push.cancel()
                context.abort(grpc.StatusCode.CANCELLED, "the request was cancelled")
        else:
            handoff = pack_handoff(Handoff(result.first_token, sampling), encoder.header())
            push.seal([*tail, handoff])
        scored = []
        if result is not None and top is not None:  # while the state's tail is on the wire
            try:
                with self._queue.exclusive():
                    scored = self._engine().score([*tokens, result.first_token], top)
            except Exception as err:
                push.cancel()
                abort_for(context, err)
        try:
            delivery = push.wait()
        except TransferError as err:
            context.abort(err.status, f"pushing the state to {request.decode_address}: {err}")
        assert result is not None  # a push that delivered was sealed, so prefill finished
        self._count("completed", 1)
        if self.link_meter is not None and self.rtt_meter is not None:
            with self._count_lock:
                now = time.monotonic()
                self.link_meter.add(delivery.backlog_bytes, delivery.backlog_s, now)
                self.rtt_meter.add(delivery.rtt_s, now)
                self.retransmits += delivery.retransmits
        return pb.PrefillReply(
            first_token=result.first_token,
            state_bytes=encoder.state_header.payload_nbytes,
            wire_bytes=push.wire_bytes,
            frames=push.frames,
            queue_s=started - arrived,
            prefill_s=prefilled - started,
            transfer_s=time.perf_counter() - prefilled,  # the part of the transfer after prefill
            shaped=self.shaper is not None,
            cached_len=result.prefix_len,
            cache_tier=CACHE_TIERS[reused_from],
            cache_seq=cache_seq,
            prefix_bytes=0 if prefix is None else state_nbytes(self.cfg, int(prefix.lengths[0])),
            logprobs=[logprobs_to_proto(x) for x in scored],
        )

    def _precision(self, asked: str) -> WirePrecision:
        """How this push encodes its state: the router's choice (`PrefillRequest.
        wire_precision`, `[wire]`), else this worker's own; `UserError` on a name the codec
        does not know."""
        if not asked:
            return self.precision
        try:
            return WirePrecision.parse(asked)
        except ValueError as err:
            raise UserError(f"wire_precision: {err}") from None

    @property
    def waiting(self) -> int:
        """Requests waiting for the engine (past their checks and any prefix fetch)."""
        return self._queue.waiting

    @property
    def batch_calls(self) -> dict[int, int]:
        """Engine calls so far by the prompts each held (1: a prompt alone)."""
        return dict(self._queue.calls)

    def _batchable(self, tokens: list[int]) -> bool:
        """Whether a prompt no fetched prefix covers may share a batched call: one chunk, no
        cached prefix, an engine on one device (serving/worker/prefill_queue.py)."""
        engine = self._engine()
        chunk_len = getattr(engine, "chunk_len", 0)
        if getattr(engine, "mesh", None) is not None or len(tokens) > (chunk_len or len(tokens)):
            return False
        return self.prefixes is None or self.prefixes.reuse.cached_len(tokens) == 0

    def _prefill(
        self,
        tokens: list[int],
        prefix: ModelState | None,
        *,
        sampling: SamplingParams,
        on_chunk: OnChunk,
        on_layers: OnLayers,
        on_reuse: Callable[[str], None],
    ) -> PrefillOutput:
        """Prefill through the node's prefix cache (engine/cached_prefill.py): only the part no
        cached (or fetched) prefix covers is computed; `on_chunk` still sees every chunk, and
        an engine that streams by layers calls `on_layers` in the last; `on_reuse` is told
        where the reused prefix came from."""
        engine, max_len = self._engine(), self.max_len
        options = {"sampling": sampling, "max_len": max_len}
        options |= {"on_chunk": on_chunk, "on_layers": on_layers}
        if self.prefixes is None:
            return engine.prefill(tokens, **options)
        reuse = self.prefixes.reuse
        return reuse.prefill(engine, tokens, prefix=prefix, on_reuse=on_reuse, **options)


class _AbandonedError(Exception):
    """The transfer ended before the state was complete: computing the rest would be waste."""
