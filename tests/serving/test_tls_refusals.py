"""TLS refusals the cluster's doors must make: certificates out of their validity period, and
servers the client cannot authenticate (serving/transport/security.py, certs.py).

In process, on loopback: ports set up exactly as the two mains set theirs up — a worker's
(mutual TLS: `server_credentials(section, require_client_auth=True)`) and the router's client port
(TLS, bearer token: `require_client_auth=False` and `TokenAuth`) — each serving a stand-in whose
only job is to count the calls that reach it. Clients use the project's own channels
(`security.channel`, `security.router_channel`). The cluster test over real processes is
tests/cluster/test_security.py (plaintext, missing-certificate and foreign-CA *clients*).

Proven, each time next to a positive control (the same client, or the same server, with valid
credentials is served right after, so the refusal is about the certificate and not a dead port):

- a server whose certificate has expired, or is not valid yet, is refused by a client that
  trusts its CA: the handshake fails with UNAVAILABLE and the details say why ("certificate has
  expired", "certificate is not yet valid"); a client certificate that has expired is refused by
  a worker;
- server authentication: a client that trusts another CA cannot reach the router or a worker
  ("unable to get local issuer certificate"); a server with another CA's certificate, or one
  naming another host, is refused by the cluster's own client, and no call (so no bearer token)
  reaches it.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import pathlib
from collections.abc import Iterator

import grpc
import pytest

from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport import security
from prfaas_jax.serving.transport.certs import Issued, make_ca, make_node_cert
from prfaas_jax.serving.transport.server import ServingServer, full_service_name

NOW = datetime.datetime.now(datetime.UTC)
EXPIRED = {"valid_from": NOW - datetime.timedelta(days=10), "days": 2}  # ended 8 days ago
NOT_YET = {"valid_from": NOW + datetime.timedelta(days=3), "days": 30}  # starts in 3 days
TOKEN = "a-bearer-token-for-these-tests"
_names = itertools.count()


@dataclasses.dataclass
class Credentials:
    """PEM files on disk: the CA a party trusts and the certificate it presents."""

    ca: Issued
    other_ca: Issued
    root: pathlib.Path

    def section(self, node: Issued | None, *, trust: Issued | None = None, token=False):
        """What one party holds: trust in `trust` (default: the cluster CA), `node` as its
        certificate, the bearer token if `token`."""
        out = self.root / f"party-{next(_names)}"
        out.mkdir()
        (out / "ca.pem").write_bytes((trust or self.ca).cert_pem)
        cert = key = token_file = ""
        if node is not None:
            (out / "node.pem").write_bytes(node.cert_pem)
            (out / "node-key.pem").write_bytes(node.key_pem)
            cert, key = str(out / "node.pem"), str(out / "node-key.pem")
        if token:
            (out / "token").write_text(TOKEN + "\n")
            token_file = str(out / "token")
        return SecuritySection(str(out / "ca.pem"), cert, key, token_file)


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Credentials:
    return Credentials(make_ca(), make_ca("another CA"), tmp_path_factory.mktemp("tls"))


class Counting(pb_grpc.WorkerControlServicer, pb_grpc.RouterServicer):
    """Stands in for a worker's control service or the router: counts the calls that reach it
    and the bearer tokens they carried."""

    def __init__(self, reply: type[pb.WorkerStats] | type[pb.RouterStats]) -> None:
        self.reply, self.calls, self.tokens = reply, 0, []

    def GetStats(self, request, context):  # noqa: N802
        self.calls += 1
        metadata = dict(context.invocation_metadata())
        self.tokens.append(metadata.get(security.AUTHORIZATION, ""))
        return self.reply()


@pytest.fixture
def serve() -> Iterator:
    """`serve(kind, section)`: a port set up as `kind` ("worker" or "router") with the
    certificate of `section`; returns (address, the servicer behind it)."""
    servers: list[ServingServer] = []

    def start(kind: str, section: SecuritySection) -> tuple[str, Counting]:
        servicer = Counting(pb.WorkerStats if kind == "worker" else pb.RouterStats)
        if kind == "worker":  # serving/worker/main.py
            add, name, interceptors = (
                pb_grpc.add_WorkerControlServicer_to_server,
                "WorkerControl",
                [],
            )
            credentials = security.server_credentials(section, require_client_auth=True)
        else:  # serving/router/main.py, with a token
            add, name = pb_grpc.add_RouterServicer_to_server, "Router"
            interceptors = [security.TokenAuth(TOKEN, [full_service_name("Router")])]
            credentials = security.server_credentials(section, require_client_auth=False)
        server = ServingServer(
            [(add, servicer, full_service_name(name))],
            credentials=credentials,
            interceptors=interceptors,
        )
        servers.append(server)
        return server.address, servicer

    yield start
    for server in servers:
        server.stop(grace_s=0)


def call(kind: str, address: str, client: SecuritySection) -> str:
    """`GetStats` on the port as `client`: "OK", or the one-line refusal "CODE: details"."""
    opener = security.channel if kind == "worker" else security.router_channel
    with opener(address, client) as channel:
        stub = (
            pb_grpc.WorkerControlStub(channel) if kind == "worker" else pb_grpc.RouterStub(channel)
        )
        try:
            stub.GetStats(pb.GetStatsRequest(), timeout=10)
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
    return "OK"


def client_of(creds: Credentials, kind: str, **options) -> SecuritySection:
    """The cluster's client of a `kind` port: a node certificate for a worker, the token for
    the router; `options` go to `Credentials.section`."""
    if kind == "worker":
        return creds.section(options.pop("node", make_node_cert(creds.ca)), **options)
    return creds.section(None, token=True, **options)


KINDS = ["worker", "router"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("validity", "reason"),
    [(EXPIRED, "certificate has expired"), (NOT_YET, "certificate is not yet valid")],
    ids=["expired", "not-yet-valid"],
)
def test_a_server_certificate_out_of_its_validity_is_refused(creds, serve, kind, validity, reason):
    client = client_of(creds, kind)
    address, servicer = serve(kind, creds.section(make_node_cert(creds.ca, **validity)))
    refusal = call(kind, address, client)
    assert refusal.startswith("UNAVAILABLE: ") and reason in refusal, refusal
    assert servicer.calls == 0
    good_address, _ = serve(kind, creds.section(make_node_cert(creds.ca)))
    assert call(kind, good_address, client) == "OK"


def test_an_expired_client_certificate_is_refused_by_a_worker(creds, serve):
    address, servicer = serve("worker", creds.section(make_node_cert(creds.ca)))
    expired = client_of(creds, "worker", node=make_node_cert(creds.ca, **EXPIRED))
    refusal = call("worker", address, expired)
    # The worker ends the handshake; the client is told only that the connection closed.
    assert refusal.startswith("UNAVAILABLE: "), refusal
    assert servicer.calls == 0
    assert call("worker", address, client_of(creds, "worker")) == "OK"
    assert servicer.calls == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_that_trusts_another_ca_cannot_connect(creds, serve, kind):
    address, servicer = serve(kind, creds.section(make_node_cert(creds.ca)))
    # Its own certificate is the cluster's: only its trust is wrong.
    stranger = client_of(creds, kind, trust=creds.other_ca)
    refusal = call(kind, address, stranger)
    assert refusal.startswith("UNAVAILABLE: "), refusal
    assert "unable to get local issuer certificate" in refusal, refusal
    assert servicer.calls == 0
    assert call(kind, address, client_of(creds, kind)) == "OK"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("impostor", "reason"),
    [
        (lambda creds: make_node_cert(creds.other_ca), "unable to get local issuer certificate"),
        (
            lambda creds: make_node_cert(
                creds.ca, dns_names=("elsewhere.example",), ip_addresses=("10.1.2.3",)
            ),
            "Hostname Verification Check failed",
        ),
    ],
    ids=["another-ca", "another-host"],
)
def test_the_cluster_client_refuses_a_server_it_cannot_authenticate(
    creds, serve, kind, impostor, reason
):
    # The impostor trusts the cluster CA, so only the client's check can stop the call.
    address, servicer = serve(kind, creds.section(impostor(creds)))
    client = client_of(creds, kind)
    refusal = call(kind, address, client)
    assert refusal.startswith("UNAVAILABLE: ") and reason in refusal, refusal
    assert servicer.calls == 0 and servicer.tokens == []  # the token never left the client
    genuine, servicer = serve(kind, creds.section(make_node_cert(creds.ca)))
    assert call(kind, genuine, client) == "OK"
    if kind == "router":
        assert servicer.tokens == [f"Bearer {TOKEN}"]
