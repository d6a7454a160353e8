"""The state transfer's contract (serving/transfer/api.py): the phase table, the errors and the
statuses they carry, and both ends of real transfers between a `PrefillService` and a
`DecodeService` (fake engines, one loopback gRPC server in process) ending where the table says:
delivered, refused (a corrupted frame), cut (a dropped link) and abandoned (the caller left).

The legal moves and the error table are written out here by hand, from the module's docstring:
the oracle is the documented contract, not the code's own tables.
"""

from __future__ import annotations

import itertools
import threading

import grpc
import pytest
from serving_support import serve_workers, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine
from prfaas_jax.serving.cluster_sections import FaultsSection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer import api
from prfaas_jax.serving.transfer.api import Transfer, TransferLedger, TransferPhase
from prfaas_jax.serving.transfer.channels import DecodeChannels
from prfaas_jax.serving.transfer.data_path import DataListener
from prfaas_jax.serving.transfer.faults import FaultInjector
from prfaas_jax.serving.transfer.receiver import IncomingPush, PushIntake
from prfaas_jax.serving.transfer.sender import StatePush
from prfaas_jax.serving.transport.link import LinkProfile, LinkShaper
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService

P = TransferPhase
CFG = load_model_config("tiny")
PROMPT = [(7 * i + 3) % CFG.vocab_size for i in range(90)]
ENDS = {P.CUT, P.REFUSED, P.ABANDONED}
LEGAL = {  # the diagram: OPENED → STREAMING → SEALED → DELIVERED, each of the three may end
    P.OPENED: {P.STREAMING} | ENDS,
    P.STREAMING: {P.SEALED} | ENDS,
    P.SEALED: {P.DELIVERED} | ENDS,
    P.DELIVERED: set(),
    P.CUT: set(),
    P.REFUSED: set(),
    P.ABANDONED: set(),
}


def at(phase: TransferPhase, ledger: TransferLedger | None = None) -> Transfer:
    """A transfer walked to ``phase`` along the main line (or straight to an end)."""
    transfer = Transfer("r", ledger)
    path = [P.STREAMING, P.SEALED, P.DELIVERED]
    for step in path[: path.index(phase) + 1] if phase in path else [phase]:
        transfer.move(step)
    return transfer


@pytest.mark.parametrize(("start", "to"), list(itertools.product(P, P)))
def test_every_move_is_legal_exactly_when_the_table_says(start, to):
    transfer = at(start) if start is not P.OPENED else Transfer("r")
    if to in LEGAL[start]:
        transfer.move(to)
        assert transfer.phase is to and transfer.ended == (to in api.FINAL_PHASES)
    else:
        with pytest.raises(api.TransferPhaseError, match=f"{start.value} → {to.value}"):
            transfer.move(to)
        assert transfer.phase is start


def test_the_first_verdict_wins_and_is_counted_once():
    ledger = TransferLedger()
    transfer = at(P.STREAMING, ledger)
    transfer.advance(P.STREAMING)  # every frame advances it: idempotent
    assert transfer.end(P.CUT) and transfer.phase is P.CUT
    assert not transfer.end(P.ABANDONED) and transfer.phase is P.CUT
    transfer.advance(P.SEALED)  # a late frame of an ended transfer changes nothing
    assert transfer.phase is P.CUT
    assert ledger.counts() == {P.CUT: 1}
    with pytest.raises(api.TransferPhaseError):  # delivered needs sealed
        at(P.STREAMING).end(P.DELIVERED)
    with pytest.raises(api.TransferPhaseError, match="not a final phase"):
        at(P.STREAMING).end(P.SEALED)


@pytest.mark.parametrize(
    ("error", "ends_in", "status", "fails_waiting"),
    [
        (api.InvalidPushError, P.REFUSED, grpc.StatusCode.INVALID_ARGUMENT, False),
        (api.RejectedStateError, P.REFUSED, grpc.StatusCode.INVALID_ARGUMENT, True),
        (api.TransferCutError, P.CUT, grpc.StatusCode.UNAVAILABLE, False),
        (api.SenderCancelledError, P.CUT, grpc.StatusCode.CANCELLED, False),
        (api.StripeError, P.REFUSED, grpc.StatusCode.ABORTED, False),
    ],
)
def test_each_error_carries_the_documented_status(error, ends_in, status, fails_waiting):
    err = error("x")
    assert isinstance(err, api.TransferError)
    assert (err.ends_in, err.status, err.fails_waiting) == (ends_in, status, fails_waiting)


@pytest.mark.parametrize(
    ("status", "ends_in"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, P.REFUSED),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, P.REFUSED),
        (grpc.StatusCode.UNAVAILABLE, P.CUT),
        (grpc.StatusCode.CANCELLED, P.CUT),
    ],
)
def test_a_failed_push_keeps_the_decode_workers_status(status, ends_in):
    err = api.PushFailedError("details", status)
    assert (err.status, err.ends_in, str(err)) == (status, ends_in, "details")


def test_the_two_ends_satisfy_their_protocols():
    push = StatePush("r", "127.0.0.1:1", channels=DecodeChannels(), context=None)
    assert isinstance(push, api.StateSender) and push.transfer.phase is P.OPENED
    incoming = IncomingPush(PushIntake(CFG, 64), pb.StateChunk(request_id="r"), iter(()), None)
    assert isinstance(incoming, api.StateReceiver) and incoming.transfer.phase is P.OPENED
    assert not isinstance(object(), api.StateSender)


# --- both ends of real transfers ------------------------------------------------------------


@pytest.fixture(params=["stream", "data"])
def start(request):
    """`start(faults, bandwidth)`: a prefill worker (shaped at ``bandwidth`` bytes/s when given)
    and a decode worker on one server; "data": pushes take the data path."""
    started = []

    def start_workers(faults: FaultsSection | None = None, bandwidth: float | None = None):
        shaper = None
        if bandwidth is not None:
            shaper = LinkShaper(LinkProfile(bandwidth_bytes_per_s=bandwidth, latency_s=0.0))
        prefill = PrefillService(
            engine=lambda: FakePrefillEngine(CFG),
            cfg=CFG,
            max_len=512,
            frame_bytes=1024,
            shaper=shaper,
            admit=lambda context: None,
            faults=FaultInjector.build(faults or FaultsSection(), "w"),
        )
        decode = DecodeService(
            engine=lambda: FakeDecodeEngine(CFG, max_slots=4, max_len=512),
            cfg=CFG,
            max_len=512,
            admit=lambda context: None,
            data_path=DataListener() if request.param == "data" else None,
        )
        server = serve_workers(prefill, decode)
        started.append((server, decode))
        return server.address, prefill, decode

    yield start_workers
    for server, decode in started:
        decode.stop()
        server.stop(grace_s=0.5)
        if decode.data_path is not None:
            decode.data_path.close()


def prefill_call(address: str, request_id: str, timeout: float = 30) -> pb.PrefillReply:
    with grpc.insecure_channel(address) as channel:
        request = pb.PrefillRequest(
            request_id=request_id, prompt_token_ids=PROMPT, decode_address=address
        )
        return pb_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=timeout)


def test_a_delivered_transfer_ends_delivered_at_both_ends(start):
    address, prefill, decode = start()
    reply = prefill_call(address, "ok")
    assert reply.state_bytes > 0 and reply.frames > 3
    assert prefill.transfers.counts() == {P.DELIVERED: 1}
    assert wait_for(lambda: decode.intake.ledger.counts() == {P.DELIVERED: 1})


@pytest.mark.parametrize(
    ("faults", "code", "ends_in"),
    [
        (FaultsSection(corrupt_frame_prob=1.0), grpc.StatusCode.INVALID_ARGUMENT, P.REFUSED),
        (FaultsSection(drop_transfer_prob=1.0), grpc.StatusCode.UNAVAILABLE, P.CUT),
    ],
)
def test_a_failed_transfer_ends_where_its_error_says(start, faults, code, ends_in):
    address, prefill, decode = start(faults)
    with pytest.raises(grpc.RpcError) as err:
        prefill_call(address, "bad")
    assert err.value.code() == code
    assert prefill.transfers.counts() == {ends_in: 1}
    if ends_in is P.CUT:
        # The sender cancels after k ≥ 1 frames left it, but a busy machine's cancel can
        # overtake them: a call cancelled before the receiver's handler starts leaves no
        # transfer there. One the receiver saw ends CUT, never in another phase.
        wait_for(lambda: decode.intake.ledger.counts() == {P.CUT: 1}, timeout_s=3.0)
        assert decode.intake.ledger.counts() in ({P.CUT: 1}, {})
    else:
        assert wait_for(lambda: decode.intake.ledger.counts() == {ends_in: 1})
    assert decode.stats()["state_bytes_received"] == 0


def test_a_transfer_its_caller_leaves_is_abandoned(start):
    """The router cancels the prefill while the state is on a slow link: the sender abandons
    the transfer, and the receiver sees it cut."""
    address, prefill, decode = start(bandwidth=20e3)  # ~2 s for the state on this link
    with grpc.insecure_channel(address) as channel:
        request = pb.PrefillRequest(
            request_id="gone", prompt_token_ids=PROMPT, decode_address=address
        )
        call = pb_grpc.PrefillWorkerStub(channel).Prefill.future(request, timeout=30)
        assert wait_for(lambda: prefill.transferring == 1)
        threading.Timer(0.2, call.cancel).start()
        with pytest.raises(grpc.FutureCancelledError):
            call.result()
    assert wait_for(lambda: prefill.transfers.counts() == {P.ABANDONED: 1})
    assert wait_for(lambda: decode.intake.ledger.counts() == {P.CUT: 1})
