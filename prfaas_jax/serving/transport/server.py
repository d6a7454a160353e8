"""gRPC plumbing shared by every server: `ServingServer` (health + reflection) and status mapping.

`ServingServer` binds `host` (127.0.0.1 unless the cluster config's `[hosts]` or `--netns` says
otherwise) on a free port (or the one given), registers the project's
servicers, the standard `grpc.health.v1.Health` service and server reflection, and starts
NOT_SERVING; `set_serving` flips every registered service (and the overall "" entry) to
SERVING once the process is ready (engines built and warmed). `abort_for` maps the project's
exceptions to gRPC status codes, so a bad request is INVALID_ARGUMENT and not UNKNOWN.
Given TLS `credentials` (serving/transport/security.py) the port is TLS; `interceptors` run before
every servicer (the router's bearer-token check).

`stop` is how a process ends on SIGTERM or SIGINT: the port closes at once (a new call, the
health check included, fails UNAVAILABLE), the calls in flight get `STOP_GRACE_S` to finish, and
any still running then is cancelled (its caller gets UNAVAILABLE).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prfaas_jax.errors import LengthLimitError, UserError
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2
from prfaas_jax.serving.transport import security
from prfaas_jax.serving.transport.messages import abort_final

MAX_MESSAGE_BYTES = 64 * 2**20
STOP_GRACE_S = 2.0  # what `stop` leaves the calls in flight to finish
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


class ServingServer:
    """A started gRPC server with health and reflection, on ``host`` (loopback by default)."""

    def __init__(
        self,
        registrations: Sequence[tuple[Callable[[object, grpc.Server], None], object, str]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 64,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        security_section: SecuritySection | None = None,
        what: str = "a gRPC server",
    ) -> None:
        """`registrations`: (add_XServicer_to_server, servicer, full service name) triples;
        `max_receive_bytes`: the largest message the server parses (gRPC refuses a larger one
        with RESOURCE_EXHAUSTED before any servicer sees it). Beyond loopback the server needs
        `credentials` unless `security_section` allows plaintext (`security.check_listen`; `what`
        names it in the error)."""
        if max_receive_bytes < 1:
            raise ValueError(f"max_receive_bytes must be ≥ 1, got {max_receive_bytes}")
        security.check_listen(security_section, host, what, tls=credentials is not None)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers)
        options = (
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
        )
        self.server = grpc.server(self._pool, options=options, interceptors=interceptors)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = [name for _, _, name in registrations]
        for add, servicer, _ in registrations:
            add(servicer, self.server)
        names = (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.host = host
        bind = f"{host}:{port}"
        if credentials is None:
            self.port = self.server.add_insecure_port(bind)
        else:
            self.port = self.server.add_secure_port(bind, credentials)
        if self.port == 0:
            raise OSError(f"cannot bind {bind}")
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _set(self, status: int) -> None:
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def set_serving(self) -> None:
        self._set(health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Refuse new calls now, cancel those still running after `grace_s`; returns then."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        self._pool.shutdown(wait=False, cancel_futures=True)


def full_service_name(service: str) -> str:
    """The full name of a service of prfaas.proto: "Router" → "prfaas.v1.Router"."""
    return prfaas_pb2.DESCRIPTOR.services_by_name[service].full_name


def abort_for(context: grpc.ServicerContext, err: Exception) -> NoReturn:
    """Abort the RPC with the status code that fits `err` (user errors: INVALID_ARGUMENT; a
    request past the engine's limit, `LengthLimitError`, final: see messages.abort_final)."""
    if isinstance(err, LengthLimitError):
        abort_final(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
    if isinstance(err, UserError | ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    if isinstance(err, TimeoutError):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err) or "timed out")
    context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
    raise AssertionError("context.abort returned")


def health_status(
    address: str, timeout_s: float = 1.0, *, security_section: SecuritySection | None = None
) -> str:
    """The overall health of the server at `address` ("SERVING", "NOT_SERVING", or the error),
    asked over TLS with the node certificate when `security_section` has one."""
    with security.channel(address, security_section) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
