"""The data path: a push's frames on a TCP connection of their own, beside `PushState`.

gRPC Python copies each message it receives out of its buffers into a new `bytes` object and
each one it sends into its own, so one gRPC stream carries about half of what the socket under
it can (bench/codec.py). A push therefore sends its frames on a plain TCP connection — TLS with
the node certificate, both ways checked, when `[security]` has certificates, as on the worker
port — and keeps `PushState` for the control: its first message names the request and the
connection's ticket, its reply is the decode worker's answer as before. Every frame is checked
by the same decoder, whichever way it came.

On the wire (docs/wire-format.md, "The data path"), after the TLS handshake if any:

    hello    b"PRFT" · version u8 = 1 · ticket (16 random bytes)       once, from the sender
    record   length u32 LE · flags u8 · `length` bytes of one frame    flags: 1 queued, 2 end

The `end` record (length 0) closes a push that ended on purpose; a connection that closes
before it is a cut transfer (`TransferCutError`), never a short state. A record the receiver
cannot read — unknown flag bits, an `end` that carries bytes, a frame over `MAX_FRAME_BYTES` —
is malformed input (`DataPathError`, INVALID_ARGUMENT).

- `DataListener` (decode worker): accepts connections, reads each hello on a thread of its own
  and holds the connection for the push that names its ticket (`claim`); a connection no push
  claims within `claim_timeout_s` is closed.
- `DataReceiver`: a claimed connection; `chunks` yields its frames as `FrameChunk`s, ending
  with a `last` chunk. A data frame's payload is received straight into the state being
  decoded where the decoder can say from the frame's prefix where it goes (`place`:
  `StreamDecoder.target`), every other frame into a buffer of its own: the kernel's copy is
  the only one either way.
- `DataSender` (prefill worker): `connect`s and says hello; `send` writes a frame without
  copying it (`sendmsg` of the record head and the frame, or of a data frame's prefix and its
  payload where it lies in the state: `FrameParts`), `end` or `abort` closes.
- `push_messages`: `PushState`'s request stream for a push whose frames take the data path.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from prfaas_jax.engine.codec.decoder import PlacedFrame
from prfaas_jax.engine.codec.format import DATA_PREFIX_SIZE, FrameParts
from prfaas_jax.errors import ConfigError, UserError
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.api import TransferCutError
from prfaas_jax.serving.transfer.state_chunks import FrameChunk
from prfaas_jax.serving.transport.security import check_listen

# Below this many bytes a frame's payload is copied once more, to leave in one TLS record.
TLS_JOIN_BYTES = 64 * 1024
MAGIC = b"PRFT"
VERSION = 1
TICKET_BYTES = 16
HELLO = struct.Struct(f"<4sB{TICKET_BYTES}s")
RECORD = struct.Struct("<IB")
QUEUED, END = 1, 2
MAX_FRAME_BYTES = 64 * 2**20  # the largest message a worker's gRPC port takes
log = logging.getLogger("prfaas.data_path")
# Where a data frame's payload may be received: (its first bytes, its length) → a PlacedFrame.
Place = Callable[[memoryview, int], PlacedFrame | None]


class DataPathError(UserError, ValueError):
    """A data connection sent something that is not a hello or a record."""


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tls_context(section: SecuritySection | None, *, server: bool) -> ssl.SSLContext | None:
    """Mutual TLS as on the worker port: the node certificate on both ends, both checked
    against the CA (the client also checks the host it dialled); None without certificates."""
    if section is None or not section.tls:
        return None
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    try:
        context = ssl.create_default_context(purpose, cafile=section.ca_cert)
        context.load_cert_chain(section.cert, section.key)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"the data path's TLS credentials: {err}") from None
    if server:
        context.verify_mode = ssl.CERT_REQUIRED
        # Nothing flows back to a sender, not even session tickets: a sender that closes with
        # unread bytes would reset the connection, and the receiver could lose its last frames.
        context.num_tickets = 0
    return context


def _read_into(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False when the connection ends (or breaks) first."""
    flags = 0 if isinstance(conn, ssl.SSLSocket) else socket.MSG_WAITALL
    got, size = 0, len(view)
    try:
        while got < size:
            n = conn.recv_into(view[got:], size - got, flags)
            if not n:
                return False
            got += n
    except OSError:  # reset, or shut down under us (the push was cancelled)
        return False
    return True


class DataReceiver:
    """A data connection claimed by its push (module docstring)."""

    def __init__(self, conn: socket.socket, ticket: bytes) -> None:
        self._conn, self.ticket = conn, ticket

    def chunks(
        self, max_frame_bytes: int = MAX_FRAME_BYTES, place: Place | None = None
    ) -> Iterator[FrameChunk]:
        """The push's frames as they arrive, then a `last` chunk at its `end` record;
        `TransferCutError` if the connection closes before it, `DataPathError` on a record
        that cannot be read. With ``place`` (`PushDecoder.place`), a frame whose first
        `DATA_PREFIX_SIZE` bytes it accepts is received straight into the buffer it gives: the
        chunk then carries that `PlacedFrame` instead of the frame."""
        head = bytearray(RECORD.size)
        while True:
            if not _read_into(self._conn, memoryview(head)):
                raise TransferCutError("the data connection closed before the push's end")
            length, flags = RECORD.unpack(head)
            if flags & ~(QUEUED | END):
                raise DataPathError(f"a data record with unknown flags {flags:#04x}")
            if flags & END:
                if length or flags & QUEUED:
                    raise DataPathError("the end record of a push carries no frame and no flag")
                yield FrameChunk(b"", last=True)
                return
            if length > max_frame_bytes:
                raise DataPathError(
                    f"a {length}-byte frame on the data path, over its {max_frame_bytes}-byte limit"
                )
            queued, prefix = bool(flags & QUEUED), memoryview(b"")
            if place is not None and length > DATA_PREFIX_SIZE:
                prefix = memoryview(bytearray(DATA_PREFIX_SIZE))
                if not _read_into(self._conn, prefix):
                    raise TransferCutError("the data connection closed inside a frame")
                placement = place(prefix, length)
                if placement is not None:
                    if not _read_into(self._conn, memoryview(placement.payload)):
                        raise TransferCutError("the data connection closed inside a frame")
                    yield FrameChunk(placement, queued)
                    continue
            view = memoryview(np.empty(length, np.uint8))  # not zeroed: every byte is written
            view[: len(prefix)] = prefix
            if not _read_into(self._conn, view[len(prefix) :]):
                raise TransferCutError("the data connection closed inside a frame")
            yield FrameChunk(view.toreadonly(), queued)

    def interrupt(self) -> None:
        """Unblock a read in progress (from another thread): the push was cancelled."""
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.interrupt()
        self._conn.close()


class DataListener:
    """A decode worker's data port (module docstring): binds ``host`` on ``port`` (0: a free
    one), TLS with ``security``'s certificates."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        security: SecuritySection | None = None,
        *,
        port: int = 0,
        claim_timeout_s: float = 10.0,
        hello_timeout_s: float = 10.0,
    ) -> None:
        self._tls = tls_context(security, server=True)
        check_listen(security, host, "a decode worker's data port", tls=self._tls is not None)
        self.claim_timeout_s, self.hello_timeout_s = claim_timeout_s, hello_timeout_s
        self._server = socket.create_server((host, port), family=_family(host), backlog=128)
        self.host, self.port = host, self._server.getsockname()[1]
        self._cv = threading.Condition()
        self._arrived: dict[bytes, tuple[socket.socket, float]] = {}
        self._closed = False
        self.claimed = 0  # pushes that took their frames from here
        threading.Thread(target=self._accept, name="data-path", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._hello, args=(conn,), daemon=True).start()

    def _hello(self, conn: socket.socket) -> None:
        """The connection's TLS handshake and hello, then it waits for its push."""
        try:
            conn.settimeout(self.hello_timeout_s)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            hello = bytearray(HELLO.size)
            if not _read_into(conn, memoryview(hello)):
                raise DataPathError("the connection closed inside its hello")
            magic, version, ticket = HELLO.unpack(hello)
            if magic != MAGIC or version != VERSION:
                raise DataPathError(f"not a version-{VERSION} hello: {bytes(hello[:5])!r}")
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, DataPathError) as err:  # a stranger, a bad certificate, a slow peer
            log.warning("data connection refused: %s", err)
            conn.close()
            return
        with self._cv:
            self._drop_stale(time.monotonic())
            if self._closed or ticket in self._arrived:
                conn.close()
                return
            self._arrived[ticket] = (conn, time.monotonic())
            self._cv.notify_all()

    def _drop_stale(self, now: float) -> None:
        """Close the connections no push claimed in time (caller holds the lock)."""
        for ticket, (conn, at) in list(self._arrived.items()):
            if now - at > self.claim_timeout_s:
                del self._arrived[ticket]
                conn.close()

    @property
    def waiting(self) -> int:
        """Connections that said hello and wait for their push."""
        with self._cv:
            return len(self._arrived)

    def claim(self, ticket: bytes) -> DataReceiver:
        """The connection that said hello with ``ticket``, once it has (at most
        `claim_timeout_s`); `TransferCutError` if none does."""
        deadline = time.monotonic() + self.claim_timeout_s
        with self._cv:
            self._drop_stale(time.monotonic())
            while ticket not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    waited = f"{self.claim_timeout_s:g} s"
                    raise TransferCutError(f"no data connection with the push's ticket in {waited}")
                self._cv.wait(left)
            conn, _ = self._arrived.pop(ticket)
            self.claimed += 1
        return DataReceiver(conn, ticket)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for conn, _ in self._arrived.values():
                conn.close()
            self._arrived.clear()
            self._cv.notify_all()
        with contextlib.suppress(OSError):  # wakes the accept thread: the port closes now
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


class DataSender:
    """A push's frames on the data path (module docstring); `connect` makes one."""

    def __init__(self, conn: socket.socket, ticket: bytes) -> None:
        self._conn, self.ticket = conn, ticket
        self._tls = isinstance(conn, ssl.SSLSocket)
        self._lock = threading.Lock()
        self._open = True
        # What the kernel measured on this connection, read as it closes (`tcp_info`).
        self.rtt_s, self.retransmits = 0.0, 0

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        security: SecuritySection | None = None,
        *,
        timeout_s: float = 10.0,
    ) -> DataSender:
        """A connection to the data port ``host:port`` that said hello with a new ticket
        (OSError, or ssl.SSLError, when it cannot be made)."""
        context = tls_context(security, server=False)
        conn = socket.create_connection((host, port), timeout=timeout_s)
        try:
            if context is not None:
                conn = context.wrap_socket(conn, server_hostname=host)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ticket = new_ticket()
            conn.sendall(HELLO.pack(MAGIC, VERSION, ticket))
            conn.settimeout(None)
        except BaseException:
            conn.close()
            raise
        return cls(conn, ticket)

    def send(self, frame: bytes | memoryview | FrameParts, queued: bool = False) -> None:
        """One frame (OSError once the connection is closed or broken); `FrameParts` are
        written as they lie, the payload from the state's own memory."""
        head = RECORD.pack(len(frame), QUEUED if queued else 0)
        if isinstance(frame, FrameParts):
            pieces = [head, frame.prefix, frame.payload]
        else:
            pieces = [head, frame]
        if self._tls:
            # The SSLSocket, not an SSLObject over MemoryBIOs batching MiBs per `sendall`: the
            # BIOs' two extra copies cost the sender more CPU than the syscalls they save, and
            # the receiver no less (bench/tls_data_path.py; docs/performance.md, "TLS").
            # Each write is a TLS record of its own (and a send): the record head and the
            # frame's prefix go with the payload when it is small (the cluster's 16 KiB
            # frames), ahead of it otherwise, so a frame costs one or two records, not three.
            *heads, payload = pieces
            if memoryview(payload).nbytes <= TLS_JOIN_BYTES:
                self._conn.sendall(b"".join([*heads, payload]))
            else:
                self._conn.sendall(b"".join(heads))
                self._conn.sendall(payload)
            return
        parts = [memoryview(piece).cast("B") for piece in pieces]
        while parts:  # sendmsg writes what the socket takes: go on from where it stopped
            sent = self._conn.sendmsg(parts)
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][sent:]

    def end(self, *, close: bool = True) -> None:
        """The push ended on purpose: the `end` record, then close (``close`` False: the caller
        closes it once the receiver answered, so `tcp_info` counts every retransmission)."""
        try:
            self._conn.sendall(RECORD.pack(0, END))
        except BaseException:
            self.close()
            raise
        if close:
            self.close()

    def abort(self) -> None:
        """Close without the `end` record (from any thread): the receiver sees a cut transfer,
        and a `send` blocked on a full socket returns with an error."""
        with self._lock:
            if self._open:
                with contextlib.suppress(OSError):
                    self._conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            if self._open:
                self.rtt_s, self.retransmits = tcp_info(self._conn)
        self.abort()
        with self._lock:
            self._open = False
            self._conn.close()


# struct tcp_info (linux/tcp.h): eight one-byte fields, then 32-bit ones; tcpi_rtt (the smoothed
# round trip, µs) is the 16th of those and tcpi_total_retrans the 24th.
_TCP_INFO = struct.Struct("<8B24I")
_RTT, _TOTAL_RETRANS = 8 + 15, 8 + 23


def tcp_info(conn: socket.socket) -> tuple[float, int]:
    """``(smoothed round trip in seconds, segments retransmitted)`` the kernel measured on
    ``conn``; (0.0, 0) where it cannot say (not Linux, not TCP, closed)."""
    try:
        raw = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except (OSError, AttributeError):
        return 0.0, 0
    if len(raw) < _TCP_INFO.size:
        return 0.0, 0
    fields = _TCP_INFO.unpack(raw)
    return fields[_RTT] / 1e6, fields[_TOTAL_RETRANS]


def push_messages(
    first: pb.StateChunk,
    frames: Iterable[tuple[bytes | memoryview, bool]],
    sender: DataSender | None,
    *,
    stopped: Callable[[], bool] = lambda: False,
    keep_open: bool = False,
) -> Iterator[pb.StateChunk | FrameChunk]:
    """`PushState`'s request stream: ``first`` (with the data connection's ticket), then the
    ``(frame, queued)`` pairs — on ``sender``'s connection, which ends with its `end` record
    unless ``stopped()`` says the push was given up, or (``sender`` None) as messages of the
    stream, a secondary stripe's with its `last` message. A broken data connection ends the
    stream quietly: the decode worker's reply says what happened. ``keep_open``: a connection
    that ended cleanly is left for the caller to close (after the reply)."""
    if sender is None:
        yield first
        for frame, queued in frames:
            yield FrameChunk(frame, queued)
        if first.stripe and not stopped():
            yield pb.StateChunk(last=True)  # a secondary stripe's clean end
        return
    first.data_ticket = sender.ticket
    ended = False
    try:
        yield first
        for frame, queued in frames:
            sender.send(frame, queued)
        if not stopped():
            sender.end(close=not keep_open)
            ended = True
    except OSError:
        pass
    finally:
        if not (ended and keep_open):
            sender.close()
