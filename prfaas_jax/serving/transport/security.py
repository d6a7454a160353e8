"""Transport security of the serving plane: `server_credentials`, `channel` (internal) and
`router_channel` (clients), `TokenAuth` (the router's token check), `read_token`,
`client_metadata`, `client_section` (client flags) and `client_port_summary`; for the HTTP ports
(the metrics endpoint, the OpenAI front door) `http_ssl_context` and `bearer_matches`; and
`check_listen`, the rule every server applies where it binds. All driven by the `[security]`
section of the cluster config.

The rule (docs/serving.md, "Security"):

- With `ca_cert`, `cert` and `key` set, every server speaks TLS with that certificate. Worker
  ports (the inter-cluster and internal plane: `Prefill`, `PushState`, prefix `Export`,
  `WorkerControl`) require a client certificate signed by the CA — mutual TLS — and every
  internal channel (router → workers, prefill → decode, prefix fetches, the launcher's health
  checks) presents the node certificate.
- The router's client port uses TLS with the same certificate; clients verify it
  against the CA. Its clients authenticate with the bearer token when `token_file` is set, and
  with a CA-signed client certificate otherwise: one credential per port, never none.
- The HTTP ports (the router's metrics endpoint, the OpenAI front door) use TLS with the same
  certificate and want the bearer token when `token_file` is set, a CA-signed client
  certificate otherwise.
- Without certificates every port is plaintext, as before; `token_file` alone still guards the
  router's RPCs, but the token then crosses the wire in the clear. So no server listens
  beyond loopback without certificates (`check_listen`; the launcher checks the whole config
  first, serving/cluster_config.py `check_binds`) unless `allow_plaintext` says so.

`TokenAuth` guards only the services it is given (the router's `prfaas.v1.Router`): the health
service stays open so a probe needs no secret and says nothing but SERVING, and reflection
describes only the public proto. The token and key material never reach a log line, an error
message, the stats or the ready file: errors name the file, never its contents.
"""

from __future__ import annotations

import collections
import hmac
import logging
import ssl
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc

from prfaas_jax.errors import ConfigError
from prfaas_jax.serving.cluster_sections import SecuritySection

log = logging.getLogger("prfaas.security")
AUTHORIZATION = "authorization"
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read the {what} {path}: {err.strerror}") from None


def client_section(
    *, ca_cert: str = "", cert: str = "", key: str = "", token_file: str = ""
) -> SecuritySection | None:
    """A client's credentials from command-line paths (None when none is given): `ca_cert`
    verifies the router, `cert` and `key` (together, and only with `ca_cert`) prove the
    client where the router wants a certificate, `token_file` where it wants a token."""
    paths = {"ca-cert": ca_cert, "cert": cert, "key": key, "token-file": token_file}
    if not any(paths.values()):
        return None
    if bool(cert) != bool(key):
        raise ConfigError("--cert and --key go together")
    if cert and not ca_cert:
        raise ConfigError("--cert needs --ca-cert (the CA that signed the router's certificate)")
    for flag, path in paths.items():
        if path and not Path(path).is_file():
            raise ConfigError(f"--{flag}: no such file {path}")
    return SecuritySection(ca_cert=ca_cert, cert=cert, key=key, token_file=token_file)


def read_token(section: SecuritySection | None) -> str | None:
    """The router's bearer token from `token_file` (surrounding whitespace dropped), or None
    when the section sets none."""
    if section is None or not section.token_file:
        return None
    token = _read(section.token_file, "token file").decode("utf-8", errors="replace").strip()
    if not token:
        raise ConfigError(f"the token file {section.token_file} is empty")
    return token


def server_credentials(
    section: SecuritySection, *, require_client_auth: bool
) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (None without certificates: plaintext). With
    `require_client_auth`, a client must present a certificate signed by `ca_cert`."""
    if not section.tls:
        return None
    return grpc.ssl_server_credentials(
        [(_read(section.key, "private key"), _read(section.cert, "certificate"))],
        root_certificates=_read(section.ca_cert, "CA certificate"),
        require_client_auth=require_client_auth,
    )


def channel_credentials(
    section: SecuritySection | None, *, client_cert: bool = True
) -> grpc.ChannelCredentials | None:
    """TLS credentials that verify the server against `ca_cert` and (with `client_cert`)
    present the node certificate; None without certificates."""
    if section is None or not section.ca_cert:
        return None
    root = _read(section.ca_cert, "CA certificate")
    if not (client_cert and section.cert):
        return grpc.ssl_channel_credentials(root)
    key, cert = _read(section.key, "private key"), _read(section.cert, "certificate")
    return grpc.ssl_channel_credentials(root, key, cert)


def channel(
    address: str,
    security: SecuritySection | None,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.Channel:
    """A channel to `address`: TLS presenting the node certificate when `security` has one,
    plaintext otherwise (or when `security` is None)."""
    credentials = channel_credentials(security)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel, so callers keep
    their plain stub calls."""

    def __init__(self, token: str) -> None:
        self._metadata = client_metadata(token)

    def __repr__(self) -> str:  # never the token
        return "_BearerToken()"

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def _forward(
        self,
        continuation: Callable[..., object],
        details: grpc.ClientCallDetails,
        request: object,
    ) -> object:
        return continuation(self._details(details), request)

    intercept_unary_unary = intercept_unary_stream = _forward
    intercept_stream_unary = intercept_stream_stream = _forward


def router_channel(
    address: str,
    security: SecuritySection | None,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.Channel:
    """A client's channel to the router's client port: TLS verified against `ca_cert` (with
    the certificate, when the section has one, for a port that wants it) and the bearer token
    from `token_file` on every call, as the section sets them."""
    base = channel(address, security, options)
    token = read_token(security)
    return base if token is None else grpc.intercept_channel(base, _BearerToken(token))


def client_port_summary(section: SecuritySection) -> str:
    """How the router's client port authenticates clients, for its log (names no secret)."""
    transport_name = "TLS" if section.tls else "plaintext"
    if section.token_file:
        return f"{transport_name}, bearer token required for prfaas.v1.Router"
    if section.tls:
        return "TLS, client certificate signed by the CA required"
    return "plaintext, no client authentication"


def client_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` as `authorization: Bearer <token>` (nothing for None)."""
    return () if token is None else ((AUTHORIZATION, f"Bearer {token}"),)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""

    def deny(request: object, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    factory: Callable[..., grpc.RpcMethodHandler] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(deny)


class TokenAuth(grpc.ServerInterceptor):
    """Refuse every call to `services` (full names, e.g. "prfaas.v1.Router") whose metadata
    lacks `authorization: Bearer <token>`, UNAUTHENTICATED; other services pass through. The
    comparison takes the same time wherever a wrong token differs (`hmac.compare_digest`)."""

    def __init__(self, token: str, services: Iterable[str]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._prefixes = tuple(f"/{name}/" for name in services)

    def __repr__(self) -> str:  # never the token
        return f"TokenAuth(services={self._prefixes})"

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == AUTHORIZATION:
                given = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(given, self._expected)
        return False

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _denying(handler)


def check_listen(section: SecuritySection | None, host: str, what: str, *, tls: bool) -> None:
    """The rule at a server's bind, beside the launcher's check of the whole config (defence in
    depth): a `ConfigError` when `what` would listen on `host`, not loopback, without TLS
    (`tls`); the warning logged at this start when `[security] allow_plaintext` lets it."""
    warning = (section or SecuritySection()).check_bind(host, what, tls=tls)
    if warning is not None:
        log.warning("%s", warning)


def http_ssl_context(section: SecuritySection | None) -> ssl.SSLContext | None:
    """The TLS context of an HTTP server (None without certificates): the node certificate,
    and with no `token_file` a client certificate signed by `ca_cert` required, since the
    client then has no other way to prove itself."""
    if section is None or not section.tls:
        return None
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=section.ca_cert)
        context.load_cert_chain(section.cert, section.key)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"the HTTP port's TLS credentials: {err}") from None
    context.verify_mode = ssl.CERT_NONE if section.token_file else ssl.CERT_REQUIRED
    return context


def http_client_context(section: SecuritySection | None) -> ssl.SSLContext | None:
    """The TLS context of an HTTP client of the cluster's own servers (None without
    certificates): it checks the server against `ca_cert` and shows the node certificate, so
    a server that wants a client certificate gets one."""
    if section is None or not section.tls:
        return None
    try:
        context = ssl.create_default_context(cafile=section.ca_cert)
        context.load_cert_chain(section.cert, section.key)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"the HTTP client's TLS credentials: {err}") from None
    return context


def bearer_matches(header: str | None, token: str | None) -> bool:
    """Whether an HTTP `Authorization` header carries `token` (always, for no token), compared
    in constant time."""
    if token is None:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())
