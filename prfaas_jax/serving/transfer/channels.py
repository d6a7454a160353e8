"""`DecodeChannels`: how a prefill worker reaches decode workers — one gRPC channel per decode
address (and per stripe), shared by every request of the process, and a data connection per
push where the decode worker has a data port (serving/transfer/data_path.py).

A port that cannot be reached is left alone for `DATA_RETRY_S` (its pushes send their frames
on their streams), then asked for again: the worker may have restarted on another.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.data_path import DataSender
from prfaas_jax.serving.transfer.state_chunks import DecodeWorkerStub
from prfaas_jax.serving.transport import security as transport
from prfaas_jax.serving.transport.server import CHANNEL_OPTIONS

log = logging.getLogger("prfaas.prefill")
DATA_CONNECT_S = 5.0  # how long a push waits for its data connection before using its stream
DATA_RETRY_S = 30.0  # how long an unreachable data port is left alone


class DecodeChannels:
    """One channel per decode address, shared by every request of the process (mutual TLS when
    `security` has certificates), and the data connections of its pushes (`data_sender`;
    `data_path` False: none)."""

    def __init__(self, security: SecuritySection | None = None, *, data_path: bool = True) -> None:
        self.security, self.data_path = security, data_path
        self._stubs: dict[str, DecodeWorkerStub] = {}
        self._data_ports: dict[str, int] = {}  # by decode address; 0: it has no data path
        self._unreachable: dict[str, float] = {}  # address → until when its port is not tried
        self._lock = threading.Lock()

    def data_sender(self, address: str) -> DataSender | None:
        """A new connection to the data port of the decode worker at ``address`` (one per
        push: serving/transfer/data_path.py), or None — no data path here or there, or it
        cannot be reached — and the push carries its frames on its stream. A port that could
        not be reached is not tried for `DATA_RETRY_S`, then asked for again (the worker may
        have restarted on another)."""
        with self._lock:
            if time.monotonic() < self._unreachable.get(address, 0.0):
                return None
        port = self._data_port(address) if self.data_path else 0
        if not port:
            return None
        host = address.rsplit(":", 1)[0].strip("[]")
        try:
            return DataSender.connect(host, port, self.security, timeout_s=DATA_CONNECT_S)
        except OSError as err:
            with self._lock:
                self._data_ports.pop(address, None)
                self._unreachable[address] = time.monotonic() + DATA_RETRY_S
            log.warning("data path of %s (:%d): %s; frames go on the stream", address, port, err)
            return None

    def _data_port(self, address: str) -> int:
        with self._lock:
            if address in self._data_ports:
                return self._data_ports[address]
        try:
            port = self.stub(address).DataPath(pb.DataPathRequest(), timeout=10).port
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.UNIMPLEMENTED:
                return 0  # not known yet: this push goes on the stream, the next one asks
            port = 0
        with self._lock:
            self._data_ports[address] = port
        return port

    def stub(self, address: str, lane: int = 0) -> DecodeWorkerStub:
        """The stub of ``address``; each ``lane`` > 0 (a stripe of a striped push) has a
        channel, hence a TCP connection, of its own."""
        key = f"{address}#{lane}"
        with self._lock:
            if key not in self._stubs:
                # Channels to one address share a connection unless their pools differ.
                options = (
                    (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))
                    if lane
                    else (CHANNEL_OPTIONS)
                )
                channel = transport.channel(address, self.security, options)
                self._stubs[key] = DecodeWorkerStub(channel)
            return self._stubs[key]
