"""Transport security: mutual TLS between the cluster's processes, TLS and a bearer token at the
router (the `[security]` config section is tests/serving/test_security_config.py).

One fake-engine cluster of real processes runs with the certificates and token that `prfaas
certs` writes (its config names them by relative paths). A client with the CA and the token is
served; without the token, with a wrong one, or in plaintext it is refused; a worker refuses
any peer that lacks a certificate from the cluster's CA. The cluster's own traffic (router →
workers, PrfaaS prefill → decode `PushState`, a prefix fetched across clusters with `Export`,
the launcher's health checks) all runs over mutual TLS, and the token appears in no log. A
second cluster, without a token, wants a client certificate at the router instead.
"""

from __future__ import annotations

import json
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_support import assert_data_port_refuses, fake_config, generate

from prfaas_jax.cli import main as prfaas
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport import security
from prfaas_jax.serving.transport.certs import make_ca, make_node_cert
from prfaas_jax.serving.transport.server import health_status

CFG = load_model_config("tiny")
REFUSED = grpc.StatusCode.UNAVAILABLE  # a failed TLS handshake: the call never starts


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i + 3) % CFG.vocab_size for i in range(n)]


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    """`prfaas certs` output (ca.pem, node.pem, node-key.pem, router.token) in <root>/creds,
    plus a certificate from another CA in <root>/other."""
    root = tmp_path_factory.mktemp("security")
    assert prfaas(["certs", "--out", str(root / "creds"), "--days", "2"]) == 0
    other = make_ca("another CA")
    stranger = make_node_cert(other)
    (root / "other").mkdir()
    (root / "other" / "node.pem").write_bytes(stranger.cert_pem)
    (root / "other" / "node-key.pem").write_bytes(stranger.key_pem)
    return root


@pytest.fixture(scope="module")
def cluster(creds):
    """A fake-engine cluster with [security] certificates and token_file (relative paths),
    prefix caching and the bandwidth-abundant rule (so a prefix moves between workers)."""
    config = fake_config(
        creds / "cluster.toml",
        security={
            "ca_cert": "creds/ca.pem",
            "cert": "creds/node.pem",
            "key": "creds/node-key.pem",
            "token_file": "creds/router.token",
        },
        prefix_cache={"enabled": True, "capacity_mib": 4.0, "block_size": 8},
        router={"cache_rule": "abundant"},
    )
    with ClusterProcesses(config, log_dir=creds / "logs") as processes:
        yield processes.start()


def section(creds, *, client: str | None = None, token: bool = False) -> SecuritySection:
    """What a client holds: always the cluster's CA; a certificate from `client` ("creds", the
    cluster's own, or "other", another CA's); the router token if `token`."""
    cert = key = ""
    if client is not None:
        cert, key = str(creds / client / "node.pem"), str(creds / client / "node-key.pem")
    token_file = str(creds / "creds" / "router.token") if token else ""
    return SecuritySection(str(creds / "creds" / "ca.pem"), cert, key, token_file)


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    """The status code `call(*args, **kwargs)` fails with."""
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)
    return err.value.code()


def test_certs_command_writes_private_key_and_token(creds):
    out = creds / "creds"
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.pem",
        "node-key.pem",
        "node.pem",
        "router.token",
    ]
    for name in ("node-key.pem", "router.token"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    assert len((out / "router.token").read_text().strip()) >= 32


def test_tls_and_token_are_served(cluster, creds):
    with security.router_channel(cluster["router"], section(creds, token=True)) as channel:
        router = pb_grpc.RouterStub(channel)
        for n in (20, 100):  # PD, then PrfaaS: its state reaches the decode worker over mTLS
            reply = generate(router, prompt(n, n), 5)
            assert reply.tokens == fake_tokens(prompt(n, n), 5, CFG.vocab_size)
            assert reply.report.route == ("prfaas" if n > 64 else "pd")
        # The next turn's prefix sits on prfaas-0 and moves to pd-0 (an `Export` over mTLS).
        second = [*prompt(100, 100), *reply.tokens, *prompt(12, 5)]
        report = generate(router, second, 5).report
        assert (report.route, report.prefill_instance, report.cached_len) == ("pd", "pd-0", 100)
        assert router.GetStats(pb.GetStatsRequest(), timeout=10).prefix_moves == 1
    pd_0 = cluster["workers"]["pd-0"]["address"]
    with security.channel(pd_0, section(creds, client="creds")) as channel:
        stats = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    assert (stats.prefix_cache.imports, stats.prefix_cache.import_failures) == (1, 0)
    # Both states' frames came on pd-1's data port, over mutual TLS as its gRPC port.
    pd_1 = cluster["workers"]["pd-1"]["address"]
    with security.channel(pd_1, section(creds, client="creds")) as channel:
        stats = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.data_path_pushes >= 3


def test_missing_or_wrong_token_is_unauthenticated(cluster, creds):
    with security.channel(cluster["router"], section(creds)) as channel:
        router = pb_grpc.RouterStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=2)
        for metadata in ((), security.client_metadata("not-the-token")):
            with pytest.raises(grpc.RpcError) as err:
                list(router.Generate(request, metadata=metadata, timeout=10))
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert err.value.details() == "missing or invalid bearer token"
            code = code_of(router.GetStats, pb.GetStatsRequest(), metadata=metadata)
            assert code is grpc.StatusCode.UNAUTHENTICATED
    # A client certificate is no substitute for the token at a port that wants one.
    with security.channel(cluster["router"], section(creds, client="creds")) as channel:
        code = code_of(pb_grpc.RouterStub(channel).GetStats, pb.GetStatsRequest())
        assert code is grpc.StatusCode.UNAUTHENTICATED
    # Health stays open (a probe needs no secret), over TLS.
    assert health_status(cluster["router"], security_section=section(creds)) == "SERVING"


def test_plaintext_client_is_refused(cluster, creds):
    token = (creds / "creds" / "router.token").read_text().strip()
    with grpc.insecure_channel(cluster["router"]) as channel:
        router = pb_grpc.RouterStub(channel)
        metadata = security.client_metadata(token)
        assert code_of(router.GetStats, pb.GetStatsRequest(), metadata=metadata) is REFUSED
    assert health_status(cluster["router"]) == REFUSED.name


def test_workers_require_a_certificate_from_the_cluster_ca(cluster, creds):
    address = cluster["workers"]["pd-1"]["address"]

    def stats(client: SecuritySection | None) -> pb.WorkerStats:
        with security.channel(address, client) as channel:
            return pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)

    assert code_of(stats, None) is REFUSED  # plaintext
    assert code_of(stats, section(creds)) is REFUSED  # TLS, no client certificate
    assert code_of(stats, section(creds, client="other")) is REFUSED  # another CA
    assert stats(section(creds, client="creds")).name == "pd-1"
    # The decode worker's PushState, which prefill workers call, is behind the same door.
    with security.channel(address, section(creds)) as channel:
        chunks = iter([pb.StateChunk(request_id="intruder")])
        assert code_of(pb_grpc.DecodeWorkerStub(channel).PushState, chunks) is REFUSED
    with security.channel(address, section(creds, client="creds")) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    # So is its data port: a connection without a certificate from the CA is dropped
    # before any push can claim it.
    with security.channel(address, section(creds, client="creds")) as channel:
        port = pb_grpc.DecodeWorkerStub(channel).DataPath(pb.DataPathRequest(), timeout=10).port
    host = address.rsplit(":", 1)[0]
    for client in (None, section(creds), section(creds, client="other")):
        assert_data_port_refuses(host, port, client)


def test_no_secret_in_logs_or_ready_info(cluster, creds):
    # Refused calls too: the failures must not echo what was presented.
    with security.channel(cluster["router"], section(creds)) as channel:
        metadata = security.client_metadata("wrong-" + "x" * 20)
        code_of(pb_grpc.RouterStub(channel).GetStats, pb.GetStatsRequest(), metadata=metadata)
    token = (creds / "creds" / "router.token").read_text().strip()
    key_lines = (creds / "creds" / "node-key.pem").read_text().splitlines()[1:-1]
    assert token not in json.dumps(cluster)
    logs = list((creds / "logs").iterdir())
    assert any(p.name == "router.log" for p in logs)
    for path in logs:
        text = path.read_text(errors="replace")
        assert token not in text and "x" * 20 not in text, path.name
        assert not any(line in text for line in key_lines), path.name
    router_log = (creds / "logs" / "router.log").read_text()
    assert "client port: TLS, bearer token required for prfaas.v1.Router" in router_log


def test_without_a_token_the_router_wants_a_client_certificate(creds, tmp_path):
    config = fake_config(
        creds / "no-token.toml",
        security={"ca_cert": "creds/ca.pem", "cert": "creds/node.pem", "key": "creds/node-key.pem"},
    )
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as processes:
        address = processes.start()["router"]
        with security.router_channel(address, section(creds)) as channel:
            assert code_of(pb_grpc.RouterStub(channel).GetStats, pb.GetStatsRequest()) is REFUSED
        with security.router_channel(address, section(creds, client="creds")) as channel:
            reply = generate(pb_grpc.RouterStub(channel), prompt(90), 3)
        assert reply.tokens == fake_tokens(prompt(90), 3, CFG.vocab_size)
    log = (tmp_path / "logs" / "router.log").read_text()
    assert "client port: TLS, client certificate signed by the CA required" in log
