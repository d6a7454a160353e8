"""The data path (serving/transfer/data_path.py): a push's frames on a TCP connection of their
own, checked byte for byte against what was sent, on loopback, plaintext and mutual TLS.

Proven here, at the connection level: frames (and their `queued` flags) arrive exactly as sent,
in order, followed by one `last` chunk at the `end` record; a connection that closes before
`end` — between frames or inside one — is a cut transfer (`TransferCutError`), never a short
push; a record the receiver cannot read is `DataPathError`; a hello that is not one, or a TLS
peer without a CA-signed certificate, never reaches a push, and a connection no push claims is
closed. Through `DecodeService` (tests/serving/test_fuzz.py runs every malformed stream both
ways) and through a whole in-process cluster (tokens equal with and without the data path).
"""

from __future__ import annotations

import logging
import pathlib
import socket
import threading

import grpc
import numpy as np
import pytest
from serving_support import fake_config, generate, serve_in_process, serve_workers, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer import channels as channels_module
from prfaas_jax.serving.transfer import data_path
from prfaas_jax.serving.transfer.channels import DecodeChannels
from prfaas_jax.serving.transfer.data_path import (
    DataListener,
    DataPathError,
    DataSender,
    TransferCutError,
    push_messages,
)
from prfaas_jax.serving.transport.certs import make_ca, make_node_cert
from prfaas_jax.serving.transport.link import LinkShaper
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.main import link_profile


def _frames(seed: int = 0) -> list[tuple[bytes, bool]]:
    """Frames of awkward sizes (empty, one byte, larger than a socket buffer), random bytes."""
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 7, 4096, 3 * 2**20 + 5, 65_537]
    return [(rng.bytes(n), bool(i % 2)) for i, n in enumerate(sizes)]


def _received(listener: DataListener, sender: DataSender) -> list:
    receiver = listener.claim(sender.ticket)
    try:
        return [(bytes(c.frame), c.queued, c.last) for c in receiver.chunks()]
    finally:
        receiver.close()


def _send_all(sender: DataSender, frames: list[tuple[bytes, bool]], *, end: bool = True) -> None:
    for frame, queued in frames:
        sender.send(frame, queued)
    if end:
        sender.end()
    else:
        sender.close()


@pytest.fixture
def listener():
    out = DataListener(claim_timeout_s=2.0, hello_timeout_s=2.0)
    yield out
    out.close()


def test_frames_arrive_as_sent_then_one_last_chunk(listener):
    frames = _frames()
    sender = DataSender.connect("127.0.0.1", listener.port)
    thread = threading.Thread(target=_send_all, args=(sender, frames))
    thread.start()  # the receiver reads while the sender writes: > a socket buffer in flight
    got = _received(listener, sender)
    thread.join()
    assert got == [(f, q, False) for f, q in frames] + [(b"", False, True)]
    assert listener.claimed == 1


def test_each_push_claims_its_own_connection(listener):
    a = DataSender.connect("127.0.0.1", listener.port)
    b = DataSender.connect("127.0.0.1", listener.port)
    assert a.ticket != b.ticket and len(a.ticket) == data_path.TICKET_BYTES
    _send_all(b, [(b"bee", False)])
    _send_all(a, [(b"ay", True)])
    assert _received(listener, b)[0] == (b"bee", False, False)
    assert _received(listener, a)[0] == (b"ay", True, False)


@pytest.mark.parametrize("where", ["between frames", "inside a frame", "before any frame"])
def test_a_connection_closed_before_its_end_is_a_cut_transfer(listener, where):
    sender = DataSender.connect("127.0.0.1", listener.port)
    if where == "between frames":
        _send_all(sender, [(b"x" * 100, False)], end=False)
    elif where == "inside a frame":  # a record head that promises more than comes
        sender._conn.sendall(data_path.RECORD.pack(100, 0) + b"x" * 40)
        sender.close()
    else:
        sender.abort()
    receiver = listener.claim(sender.ticket)
    with pytest.raises(TransferCutError, match="closed"):
        list(receiver.chunks())
    receiver.close()


@pytest.mark.parametrize(
    ("record", "words"),
    [
        (data_path.RECORD.pack(0, 4), "unknown flags 0x04"),
        (data_path.RECORD.pack(3, data_path.END) + b"abc", "carries no frame"),
        (data_path.RECORD.pack(0, data_path.END | data_path.QUEUED), "carries no frame"),
        (data_path.RECORD.pack(2**20 + 1, 0), "over its 1048576-byte limit"),
    ],
)
def test_a_record_that_cannot_be_read_is_malformed(listener, record, words):
    sender = DataSender.connect("127.0.0.1", listener.port)
    sender._conn.sendall(record)
    receiver = listener.claim(sender.ticket)
    with pytest.raises(DataPathError, match=words):
        list(receiver.chunks(max_frame_bytes=2**20))
    receiver.close()
    sender.close()


def _raw_hello(port: int, hello: bytes) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(hello)
    return conn


@pytest.mark.parametrize(
    "hello",
    [
        data_path.HELLO.pack(b"HTTP", data_path.VERSION, b"t" * 16),
        data_path.HELLO.pack(data_path.MAGIC, data_path.VERSION + 1, b"t" * 16),
        data_path.MAGIC + b"\x01short",  # then silence: the hello times out
    ],
)
def test_a_bad_hello_never_reaches_a_push(hello):
    listener = DataListener(claim_timeout_s=0.5, hello_timeout_s=0.3)
    try:
        stranger = _raw_hello(listener.port, hello)
        with pytest.raises(TransferCutError, match="no data connection"):
            listener.claim(b"t" * 16)
        assert stranger.recv(1) == b""  # the listener closed it
        stranger.close()
    finally:
        listener.close()


def test_a_connection_no_push_claims_is_closed():
    listener = DataListener(claim_timeout_s=0.2)
    try:
        orphan = DataSender.connect("127.0.0.1", listener.port)
        threading.Event().wait(0.4)
        DataSender.connect("127.0.0.1", listener.port).close()  # the next arrival sweeps
        orphan._conn.settimeout(5)
        assert orphan._conn.recv(1) == b""
        with pytest.raises(TransferCutError):
            listener.claim(orphan.ticket)
    finally:
        listener.close()


def test_a_ticket_said_twice_keeps_the_first_connection(listener):
    first = DataSender.connect("127.0.0.1", listener.port)
    assert wait_for(lambda: listener.waiting == 1)  # its hello is in
    twin = _raw_hello(listener.port, data_path.HELLO.pack(data_path.MAGIC, 1, first.ticket))
    twin.settimeout(5)
    assert twin.recv(1) == b""  # refused
    _send_all(first, [(b"mine", False)])
    assert _received(listener, first)[0] == (b"mine", False, False)


def test_push_messages_puts_only_control_on_the_stream(listener):
    sender = DataSender.connect("127.0.0.1", listener.port)
    first = pb.StateChunk(request_id="r", stripe=1, stripes=2)
    frames = [(b"one", False), (b"two", True)]
    messages = list(push_messages(first, iter(frames), sender))
    assert [m.data_ticket for m in messages] == [sender.ticket]  # the first message only
    end = (b"", False, True)
    assert _received(listener, sender) == [(b"one", False, False), (b"two", True, False), end]
    # Without a data connection the frames are the stream's messages; a secondary ends `last`.
    on_stream = list(push_messages(pb.StateChunk(stripe=1), iter(frames), None))
    assert [bytes(m.frame) for m in on_stream[1:3]] == [b"one", b"two"]
    assert on_stream[2].queued and on_stream[-1].last and len(on_stream) == 4


def test_a_push_given_up_leaves_without_its_end(listener):
    sender = DataSender.connect("127.0.0.1", listener.port)
    first = pb.StateChunk(request_id="r")
    list(push_messages(first, iter([(b"a", False)]), sender, stopped=lambda: True))
    receiver = listener.claim(sender.ticket)
    with pytest.raises(TransferCutError):
        list(receiver.chunks())
    receiver.close()


def test_an_interrupted_read_returns_as_a_cut(listener):
    sender = DataSender.connect("127.0.0.1", listener.port)
    receiver = listener.claim(sender.ticket)
    out: list[BaseException] = []

    def read() -> None:
        try:
            list(receiver.chunks())
        except TransferCutError as err:
            out.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    receiver.interrupt()  # what a cancelled PushState does
    reader.join(5)
    assert not reader.is_alive() and len(out) == 1
    receiver.close()
    sender.close()


# --- mutual TLS ------------------------------------------------------------------------------


def _section(root: pathlib.Path, name: str, ca, node) -> SecuritySection:
    (root / f"{name}-ca.pem").write_bytes(ca.cert_pem)
    (root / f"{name}.pem").write_bytes(node.cert_pem)
    (root / f"{name}-key.pem").write_bytes(node.key_pem)
    return SecuritySection(
        str(root / f"{name}-ca.pem"), str(root / f"{name}.pem"), str(root / f"{name}-key.pem")
    )


def test_mutual_tls_carries_the_frames_and_refuses_a_foreign_certificate(tmp_path):
    ca, other = make_ca(), make_ca("another CA")
    ours = _section(tmp_path, "node", ca, make_node_cert(ca))
    listener = DataListener(security=ours, claim_timeout_s=1.0, hello_timeout_s=2.0)
    try:
        frames = _frames(1)
        sender = DataSender.connect("127.0.0.1", listener.port, ours)
        thread = threading.Thread(target=_send_all, args=(sender, frames))
        thread.start()
        assert _received(listener, sender)[:-1] == [(f, q, False) for f, q in frames]
        thread.join()
        # A client whose certificate another CA signed: the handshake fails on one side or
        # the other, and no push ever sees the connection.
        foreign = _section(tmp_path, "foreign", other, make_node_cert(other))
        foreign = SecuritySection(ours.ca_cert, foreign.cert, foreign.key)
        try:
            stranger = DataSender.connect("127.0.0.1", listener.port, foreign, timeout_s=2)
        except OSError:
            pass
        else:
            with pytest.raises(TransferCutError):
                listener.claim(stranger.ticket)
            stranger.close()
        # A plaintext client: never a push either.
        plain = DataSender.connect("127.0.0.1", listener.port, timeout_s=2)
        with pytest.raises(TransferCutError):
            listener.claim(plain.ticket)
        plain.close()
    finally:
        listener.close()


def test_a_decode_service_without_a_data_path_refuses_a_ticket():
    cfg = load_model_config("tiny")
    service = DecodeService(engine=lambda: None, cfg=cfg, max_len=48, admit=lambda c: None)
    assert service.DataPath(pb.DataPathRequest(), None).port == 0

    class AbortedError(Exception):
        pass

    class Context:
        def abort(self, code, details):
            self.code, self.details = code, details
            raise AbortedError

    context = Context()
    first = pb.StateChunk(request_id="r", data_ticket=b"t" * 16)
    with pytest.raises(AbortedError):
        service.PushState(iter([first]), context)
    assert context.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "no data path" in context.details


# --- a whole cluster -------------------------------------------------------------------------


@pytest.mark.parametrize("on", [True, False])
def test_a_cluster_serves_the_same_tokens_with_and_without_the_data_path(tmp_path, on):
    """`[link] data_path` on (the default): every push, PD and PrfaaS, striped over two
    streams, takes the decode worker's data port; off: none does. The tokens are the same."""
    link = {"data_path": on, "streams": 2, "bandwidth_mbps": 800.0, "latency_ms": 0.0}
    path = fake_config(tmp_path / "cluster.toml", link=link, engine={"frame_bytes": 1024})
    config = load_cluster_config(path)
    cfg = load_model_config("tiny")
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(cfg)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(cfg)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(cfg, max_slots=4, max_len=512)),
    }
    shaper = LinkShaper(link_profile(config))
    with serve_in_process(config, engines, shapers={"prfaas-0": shaper}) as cluster:
        prompts = [[(n + 13 * i) % cfg.vocab_size for i in range(n)] for n in (9, 120, 40, 200)]
        for tokens in prompts:
            reply = generate(cluster.router, tokens, 4)
            assert reply.tokens == fake_tokens(tokens, 4, cfg.vocab_size)
            assert reply.report.route == ("prfaas" if len(tokens) > 64 else "pd")
        listener = cluster.decode["pd-1"].data_path
        # Two PrfaaS pushes of two stripes each, two PD pushes on one connection each.
        assert (listener.claimed if on else listener) == (6 if on else None)


def test_an_unreachable_data_port_sends_the_frames_on_the_stream(monkeypatch, caplog):
    """A decode worker whose data port refuses connections still gets its pushes, on their
    streams; the port is left alone for `DATA_RETRY_S`, then asked for again."""
    cfg = load_model_config("tiny")
    listener = DataListener()
    decode = DecodeService(
        engine=lambda: FakeDecodeEngine(cfg, max_slots=2, max_len=64),
        cfg=cfg,
        max_len=64,
        admit=lambda context: None,
        data_path=listener,
    )
    server = serve_workers(decode=decode)
    channels = DecodeChannels()
    try:
        assert channels.data_sender(server.address) is not None  # the port answers
        listener.close()  # it stops taking connections; DataPath still names its port
        clock = [1000.0]
        monkeypatch.setattr(channels_module.time, "monotonic", lambda: clock[0])
        asks = []
        real = channels._data_port
        monkeypatch.setattr(channels, "_data_port", lambda a: asks.append(a) or real(a))
        with caplog.at_level(logging.WARNING, logger="prfaas.prefill"):
            assert channels.data_sender(server.address) is None
        assert "frames go on the stream" in caplog.text and len(asks) == 1
        clock[0] += channels_module.DATA_RETRY_S - 1
        assert channels.data_sender(server.address) is None and len(asks) == 1  # not tried
        clock[0] += 2
        assert channels.data_sender(server.address) is None and len(asks) == 2  # asked again
        # The push itself: its frames as the stream's messages, decoded as ever.
        prompt = [(5 + 7 * i) % cfg.vocab_size for i in range(20)]
        result = FakePrefillEngine(cfg).prefill(prompt)
        frames = list(codec.encode(result.state, cfg, max_frame_bytes=1024))
        frames.append(pack_handoff(Handoff(result.first_token, SamplingParams()), frames[0]))
        first = pb.StateChunk(request_id="r")
        sender = channels.data_sender(server.address)
        messages = push_messages(first, ((f, False) for f in frames), sender)
        reply = channels.stub(server.address).PushState(messages, timeout=10)
        assert reply.frames == len(frames) and listener.claimed == 0
    finally:
        server.stop(grace_s=0.5)
        decode.stop()
        listener.close()
