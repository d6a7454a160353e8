"""Where a TLS push's CPU goes: CPU seconds per GB on each side of one loopback connection, by
how the bytes reach the socket.

Each side runs on a thread of its own and is charged its own user and system time
(``getrusage(RUSAGE_THREAD)``); 4 MiB frames, as a push's data frames, into one reused
destination (as a push's payload lands in the state). The modes:

- ``plaintext``: the data path without TLS: one ``sendall`` per frame, one
  ``recv_into(MSG_WAITALL)`` straight into the destination;
- ``SSLSocket``: the data path with TLS (serving/transfer/data_path.py, its contexts:
  TLS 1.3, both certificates checked): ``sendall`` per frame, which OpenSSL writes as one
  ``write`` per 16 KiB record, and ``recv_into`` record by record (two ``read``\\ s of the
  socket per record, then a copy out of OpenSSL's buffer);
- ``MemoryBIO``: the same TLS over ``ssl.SSLObject`` and a ``MemoryBIO`` each way: the sender
  encrypts ``--batch-kib`` at a time into the outgoing BIO and sends it with one ``sendall``;
  the receiver ``recv_into``\\ s up to ``--batch-kib`` into a reused buffer, feeds the incoming
  BIO and ``SSLObject.read(n, view)`` decrypts straight into the destination;
- ``in memory``: the ``SSLObject`` pair with no socket between them: OpenSSL's record layer
  alone, the least a TLS side can cost (encrypt and take the records out of the BIO; put them
  into the other BIO and decrypt).

Prints a table (the lowest of ``--repeat`` runs for each side, the modes taken in turn), then
the same as JSON with ``--json``.

    python bench/tls_data_path.py [--gb 0.5] [--batch-kib 1024] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.transfer.data_path import tls_context
from prfaas_jax.serving.transport.certs import write_cluster_credentials

FRAME = 4 * 2**20
GB = 1e9
MODES = ("plaintext", "SSLSocket", "MemoryBIO", "in memory")


def _cpu() -> tuple[float, float]:
    """This thread's (user, system) CPU seconds so far."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


def _since(start: tuple[float, float]) -> tuple[float, float]:
    user, system = _cpu()
    return user - start[0], system - start[1]


def _handshake(sock: socket.socket, tls: ssl.SSLObject, incoming, outgoing) -> None:
    """The TLS handshake of ``tls`` over ``sock``, its records carried by the two BIOs."""
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if outgoing.pending:
                sock.sendall(outgoing.read())
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the peer closed the connection in the handshake") from None
            incoming.write(data)
    if outgoing.pending:
        sock.sendall(outgoing.read())


def _bio(sock: socket.socket, context: ssl.SSLContext, server: bool) -> tuple:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hostname = None if server else "127.0.0.1"
    tls = context.wrap_bio(incoming, outgoing, server_side=server, server_hostname=hostname)
    _handshake(sock, tls, incoming, outgoing)
    return tls, incoming, outgoing


def _sender(mode: str, sock: socket.socket, context: ssl.SSLContext, batch: int) -> Callable:
    """What sends one frame in ``mode``."""
    if mode == "plaintext":
        return sock.sendall
    if mode == "SSLSocket":
        return context.wrap_socket(sock, server_hostname="127.0.0.1").sendall
    tls, _, outgoing = _bio(sock, context, server=False)

    def send(frame: np.ndarray) -> None:
        view = memoryview(frame).cast("B")
        for start in range(0, len(view), batch):
            tls.write(view[start : start + batch])
            sock.sendall(outgoing.read())

    return send


def _receiver(mode: str, sock: socket.socket, context: ssl.SSLContext, batch: int) -> Callable:
    """What fills one destination in ``mode``."""
    if mode == "plaintext" or mode == "SSLSocket":
        flags = socket.MSG_WAITALL if mode == "plaintext" else 0
        if mode == "SSLSocket":
            sock = context.wrap_socket(sock, server_side=True)

        def fill(view: memoryview) -> None:
            got = 0
            while got < len(view):
                n = sock.recv_into(view[got:], len(view) - got, flags)
                if not n:
                    raise ConnectionError("the sender closed the connection")
                got += n

        return fill
    tls, incoming, _ = _bio(sock, context, server=True)
    buffer = memoryview(bytearray(batch))

    def fill_from_bio(view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                got += tls.read(len(view) - got, view[got:])
            except ssl.SSLWantReadError:
                n = sock.recv_into(buffer)
                if not n:
                    raise ConnectionError("the sender closed the connection") from None
                incoming.write(buffer[:n])

    return fill_from_bio


def over_loopback(mode: str, contexts: tuple, frames: int, batch: int) -> dict:
    """One run of ``frames`` frames in ``mode``: CPU-s per GB of each side, and GB/s."""
    server_context, client_context = contexts
    payload = np.random.default_rng(0).integers(0, 256, FRAME, np.uint8)
    listener = socket.create_server(("127.0.0.1", 0))
    out: dict = {}

    def receive() -> None:
        conn, _ = listener.accept()
        fill = _receiver(mode, conn, server_context, batch)
        dest = np.zeros(FRAME, np.uint8)
        view = memoryview(dest)
        fill(view[:1])  # the sender's first byte: both ends are up
        start, wall = _cpu(), time.perf_counter()
        for _ in range(frames):
            fill(view)
        out["recv"], out["wall"] = _since(start), time.perf_counter() - wall
        out["equal"] = bool(np.array_equal(dest, payload))
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    conn = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send = _sender(mode, conn, client_context, batch)
    send(payload[:1])
    start = _cpu()
    for _ in range(frames):
        send(payload)
    out["send"] = _since(start)
    thread.join()
    conn.close()
    listener.close()
    if not out["equal"]:
        raise AssertionError(f"{mode}: the bytes received differ from those sent")
    gb = frames * FRAME / GB
    return {
        "send": [t / gb for t in out["send"]],
        "recv": [t / gb for t in out["recv"]],
        "gb_per_s": gb / out["wall"],
    }


def in_memory(contexts: tuple, frames: int, batch: int) -> dict:
    """The same bytes through an SSLObject pair joined by their BIOs, no socket, ``batch`` at a
    time (the MemoryBIO mode's work without its socket)."""
    server_context, client_context = contexts
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_out, client_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(to_client, client_out, server_hostname="127.0.0.1")
    server = server_context.wrap_bio(to_server, server_out, server_side=True)
    while not (client.version() and server.version()):
        for side in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):  # until the peer's records are in
                side.do_handshake()
        to_server.write(client_out.read())
        to_client.write(server_out.read())
    payload = np.random.default_rng(0).integers(0, 256, FRAME, np.uint8)
    dest = np.zeros(FRAME, np.uint8)
    view, source = memoryview(dest), memoryview(payload)
    send, recv = [0.0, 0.0], [0.0, 0.0]
    for _ in range(frames):
        for at in range(0, FRAME, batch):
            end = min(at + batch, FRAME)
            start = _cpu()
            client.write(source[at:end])
            records = client_out.read()
            spent = _since(start)
            send = [a + b for a, b in zip(send, spent, strict=True)]
            start = _cpu()
            to_server.write(records)
            while at < end:
                at += server.read(end - at, view[at:])
            spent = _since(start)
            recv = [a + b for a, b in zip(recv, spent, strict=True)]
    if not np.array_equal(dest, payload):
        raise AssertionError("in memory: the bytes decrypted differ from those encrypted")
    gb = frames * FRAME / GB
    return {"send": [t / gb for t in send], "recv": [t / gb for t in recv], "gb_per_s": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=0.5, help="bytes per run, in GB")
    parser.add_argument("--batch-kib", type=int, default=1024, help="MemoryBIO batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    frames = max(1, round(args.gb * GB / FRAME))
    with tempfile.TemporaryDirectory() as folder:
        paths = write_cluster_credentials(folder, days=1)
        section = SecuritySection(str(paths["ca_cert"]), str(paths["cert"]), str(paths["key"]))
        contexts = (tls_context(section, server=True), tls_context(section, server=False))
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.repeat):
        for mode in MODES:
            if mode == "in memory":
                runs[mode].append(in_memory(contexts, frames, args.batch_kib * 1024))
            else:
                runs[mode].append(over_loopback(mode, contexts, frames, args.batch_kib * 1024))
    rows = {}
    for mode, done in runs.items():
        send = min((r["send"] for r in done), key=sum)
        recv = min((r["recv"] for r in done), key=sum)
        rates = [r["gb_per_s"] for r in done if r["gb_per_s"] is not None]
        rows[mode] = {"send": send, "recv": recv, "gb_per_s": max(rates) if rates else None}
    print(f"{args.gb:g} GB per run in {FRAME // 2**20} MiB frames, best of {args.repeat};")
    print("CPU-s per GB, user + system:")
    print(f"{'mode':<11}{'sender':>22}{'receiver':>22}{'GB/s':>7}")
    for mode, row in rows.items():
        sides = [f"{sum(t):.2f} ({t[0]:.2f} + {t[1]:.2f})" for t in (row["send"], row["recv"])]
        rate = "" if row["gb_per_s"] is None else f"{row['gb_per_s']:.2f}"
        print(f"{mode:<11}{sides[0]:>22}{sides[1]:>22}{rate:>7}")
    if args.json:
        print(json.dumps({"gb": args.gb, "batch_kib": args.batch_kib, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
