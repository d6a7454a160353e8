"""`StatePush`: the prefill side of one state transfer (`api.StateSender`).

The prefill worker makes one per request as the request arrives (`api.Transfer` OPENED), and
opens its `PushState` calls to the decode worker once the engine is free (`open`): one call per
lane of a striped transfer (`[link] streams`, stripes.py), each on a connection of its own, and
each sending its frames on a data connection beside the call where the decode worker has a data
port (data_path.py, via `DecodeChannels`), else as the call's messages. The engine thread puts
frames as prefill makes them (STREAMING), the last ones seal the transfer (SEALED), and `wait`
gives the verdict: DELIVERED with the link's timing (`api.Delivery`), or the `TransferError`
the prefill RPC answers with — `TransferCutError` when a push was cancelled under the stream
(a cut link), `PushFailedError` with the decode worker's status otherwise (DEADLINE_EXCEEDED,
naming the push's deadline, when no answer came in time). `cancel` abandons it
(ABANDONED): the router gave up, or prefill failed. Frames go through an `Outbox` (outbox.py),
which shapes them on the inter-cluster link and spreads them over the lanes.

A push that fails stops the transfer (`stopped`), so prefill stops computing a state no one will
receive; a data connection whose push failed is aborted, so a send blocked on a dead link
returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import grpc

from prfaas_jax.engine.codec.format import FrameParts
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.api import (
    Delivery,
    PushFailedError,
    Transfer,
    TransferCutError,
    TransferError,
    TransferLedger,
    TransferPhase,
)
from prfaas_jax.serving.transfer.channels import DecodeChannels
from prfaas_jax.serving.transfer.data_path import DataSender, push_messages
from prfaas_jax.serving.transfer.faults import TransferFaults
from prfaas_jax.serving.transfer.outbox import Outbox, striped_sample
from prfaas_jax.serving.transfer.state_chunks import FrameChunk
from prfaas_jax.serving.transport.link import LinkShaper


class StatePush:
    """One state's transfer to one decode worker (module docstring)."""

    def __init__(
        self,
        request_id: str,
        decode_address: str,
        *,
        channels: DecodeChannels,
        context: grpc.ServicerContext,
        shaper: LinkShaper | None = None,
        lanes: int = 1,
        sender_name: str = "",
        timeout_s: float = 120.0,
        ledger: TransferLedger | None = None,
    ) -> None:
        """`context`: the prefill RPC's (a transfer whose RPC ended stops); `shaper`: the
        inter-cluster link's token bucket (None: an unshaped, intra-cluster push); `lanes`:
        the pushes it is striped over; `sender_name`: the worker's, which its pushes carry
        (the decode worker times the link per sender); `timeout_s`: each push's deadline;
        `ledger`: where its final phase is counted."""
        self.request_id, self.decode_address = request_id, decode_address
        self.transfer = Transfer(request_id, ledger)
        self._channels, self._name, self._timeout_s = channels, sender_name, timeout_s
        self._outbox = Outbox(shaper, context, lanes=lanes)
        self._senders: list[DataSender] = []

    @property
    def stopped(self) -> bool:
        return self._outbox.stopped

    @property
    def opened(self) -> bool:
        return bool(self._outbox.pushes)

    @property
    def answered(self) -> bool:
        """Whether the primary push (stream 0, which ends with the trailer) has ended."""
        return self.opened and self._outbox.pushes[0].done()

    @property
    def frames(self) -> int:
        return self._outbox.frames

    @property
    def wire_bytes(self) -> int:
        return self._outbox.wire_bytes

    def open(
        self,
        faults: TransferFaults | None = None,
        on_answered: Callable[[], None] | None = None,
    ) -> None:
        """Open the decode worker's `PushState` calls, which send what `put_all` is given as it
        comes; ``faults``: the faults planned for this transfer (`[faults]`); ``on_answered``
        runs when the primary push ends, however."""
        outbox, lanes = self._outbox, self._outbox.lanes
        outbox.faults = faults
        for lane in range(lanes):
            stub = self._channels.stub(self.decode_address, lane)
            # Registered before the first frame is put, so before a sender can need it.
            outbox.pushes.append(stub.PushState.future(self._chunks(lane), timeout=self._timeout_s))
        primary = outbox.pushes[0]

        def done(call: grpc.Future) -> None:
            failed = call.cancelled() or call.exception() is not None
            if failed:
                for sender in list(self._senders):  # a send blocked on a dead link returns
                    sender.abort()
            if call is primary or failed:
                outbox.stop()  # a failed push takes no more frames (nor link capacity)
            if call is primary and on_answered is not None:
                on_answered()

        for push in outbox.pushes:
            push.add_done_callback(done)

    def _chunks(self, lane: int) -> Iterator[pb.StateChunk | FrameChunk]:
        """Lane ``lane``'s request stream: its first message, then its frames as they come."""
        # Connected here, on gRPC's thread of this push, while prefill starts.
        sender = self._channels.data_sender(self.decode_address)
        if sender is not None:
            self._senders.append(sender)
        lanes = self._outbox.lanes
        first = pb.StateChunk(
            request_id=self.request_id,
            stripe=lane,
            stripes=lanes if lanes > 1 else 0,
            sender=self._name,
        )
        frames = self._outbox.frames_to_send(lane)
        yield from push_messages(
            first, frames, sender, stopped=lambda: self._outbox.stopped, keep_open=True
        )

    def put_all(self, frames: Iterable[bytes | FrameParts]) -> None:
        for frame in frames:
            if self._outbox.stopped:
                return
            self.transfer.advance(TransferPhase.STREAMING)
            self._outbox.put(frame)

    def seal(self, frames: Iterable[bytes | FrameParts]) -> None:
        self.put_all(frames)
        self._outbox.close()
        if not self._outbox.stopped:
            self.transfer.advance(TransferPhase.SEALED)

    def wait(self) -> Delivery:
        try:
            replies = [push.result() for push in self._outbox.pushes]
        except grpc.FutureCancelledError:  # the link was cut under the stream
            error: TransferError = TransferCutError(self._outbox.cut_reason())
        except grpc.RpcError as err:
            message = err.details() or ""
            if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # say which deadline ran out
                message = f"no answer within the push deadline of {self._timeout_s:g} s"
            error = PushFailedError(message, err.code())
        else:
            # The receiver has every byte: TCP's counts of the connections are final now.
            senders = self._close_senders()
            if self.transfer.phase is TransferPhase.SEALED:
                self.transfer.end(TransferPhase.DELIVERED)
                backlog_bytes, backlog_s = striped_sample(replies)
                return Delivery(
                    backlog_bytes,
                    backlog_s,
                    frames=replies[0].frames,
                    rtt_s=max((sender.rtt_s for sender in senders), default=0.0),
                    retransmits=sum(sender.retransmits for sender in senders),
                )
            # Stopped although every push went through: cannot happen, but say so.
            error = TransferError("the prefill stopped before its state was sent")
            error.ends_in = TransferPhase.ABANDONED
        self._close_senders()
        self.transfer.end(error.ends_in)
        raise error

    def cancel(self) -> None:
        self.transfer.end(TransferPhase.ABANDONED)
        self._outbox.cancel()
        self._close_senders()

    def _close_senders(self) -> list[DataSender]:
        """Close the data connections (each reads its `tcp_info` as it closes)."""
        senders = list(self._senders)
        for sender in senders:
            sender.close()
        return senders
