"""The rule beyond loopback: a server that would listen on an address other machines can reach
refuses to start in plaintext, with one line naming the fix, unless `[security]
allow_plaintext = true` (then a warning at every start). Checked over a whole config
(`check_binds`, which `prfaas serve` applies before starting anything) and again at each
server's bind (gRPC servers, the data port, the metrics endpoint, the OpenAI front door); with
certificates the HTTP ports speak TLS and want the token (401 without) or a client
certificate. Loopback stays plaintext. The rule's own cases are written out by hand here."""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import urllib.error
import urllib.request

import pytest
from serving_support import fake_config

from prfaas_jax.cli import main as prfaas
from prfaas_jax.errors import ConfigError
from prfaas_jax.serving.bind_rule import bind_refusal, is_loopback
from prfaas_jax.serving.cluster_config import check_binds, load_cluster_config
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.frontdoor.app import FrontDoor, FrontDoorServer
from prfaas_jax.serving.frontdoor.metrics import FrontDoorMetrics
from prfaas_jax.serving.router.metrics import Histogram, MetricsServer, RouterSnapshot
from prfaas_jax.serving.transfer.data_path import DataListener
from prfaas_jax.serving.transport.security import http_client_context, read_token
from prfaas_jax.serving.transport.server import ServingServer

ALLOWED = SecuritySection(allow_plaintext=True)
WIDE = "0.0.0.0"  # every address of this machine: bindable here, and not loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.3", True),  # all of 127/8 is this machine
        ("::1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("198.18.0.2", False),
        ("node-a.example", False),  # a name may resolve anywhere
        ("localhost.example", False),
    ],
)
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback
    refusal = bind_refusal(host, "worker pd-0", tls=False)
    assert (refusal is None) is loopback
    assert bind_refusal(host, "worker pd-0", tls=True) is None


def test_a_refusal_is_one_line_naming_the_fix_and_allow_plaintext_turns_it_into_a_warning():
    with pytest.raises(ConfigError) as err:
        SecuritySection().check_bind("10.0.0.1", "worker pd-0")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("worker pd-0 would listen on 10.0.0.1 in plaintext")
    for fix in ("prfaas certs --config", "ca_cert, cert, key and token_file", "allow_plaintext"):
        assert fix in message
    warning = ALLOWED.check_bind("10.0.0.1", "worker pd-0")
    assert warning is not None and warning.startswith("warning: worker pd-0 would listen")
    assert SecuritySection(cert="node.pem").check_bind("10.0.0.1", "worker pd-0") is None
    assert SecuritySection().check_bind("127.0.0.1", "worker pd-0") is None


def _hosts_config(tmp_path, hosts, **security):
    return fake_config(tmp_path / "cluster.toml", hosts=hosts, security=security)


def test_check_binds_covers_every_server_of_the_parts_a_machine_runs(tmp_path):
    hosts = {"router": "10.0.0.2:50050", "prfaas": "10.0.0.1:50100", "pd": "127.0.0.1"}
    config = load_cluster_config(_hosts_config(tmp_path, hosts))
    with pytest.raises(ConfigError) as err:
        check_binds(config)
    assert str(err.value).startswith(f"{tmp_path / 'cluster.toml'}: the router's client port")
    with pytest.raises(ConfigError, match=r"worker prfaas-0 would listen on 10\.0\.0\.1"):
        check_binds(config, {"prfaas", "pd"})
    assert check_binds(config, {"pd"}) == []  # the PD instances stay on loopback
    allowed = load_cluster_config(_hosts_config(tmp_path, hosts, allow_plaintext=True))
    warnings = check_binds(allowed)
    assert [w.split(" would")[0] for w in warnings] == [
        "warning: the router's client port",
        "warning: the router's metrics endpoint",
        "warning: worker prfaas-0",
    ]
    # Loopback aliases (how tests stand in for machines) are loopback: plaintext, as before.
    alias = {"router": "127.0.0.3:50050", "prfaas": "127.0.0.2:50100"}
    (tmp_path / "alias").mkdir()
    assert check_binds(load_cluster_config(_hosts_config(tmp_path / "alias", alias))) == []


def test_prfaas_serve_refuses_a_plaintext_cluster_beyond_loopback(tmp_path, capsys):
    hosts = {"router": "10.0.0.2:50050", "prfaas": "10.0.0.1:50100", "pd": "10.0.0.2:50200"}
    config = _hosts_config(tmp_path, hosts)
    assert prfaas(["serve", "--config", str(config), "--only", "prfaas"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("prfaas serve: error: ") and "worker prfaas-0" in err
    assert "prfaas certs --config" in err and "allow_plaintext = true" in err


def test_each_server_refuses_plaintext_at_its_bind(caplog):
    snapshot = _idle
    door = FrontDoor("127.0.0.1:1", model="tiny", vocab_size=256, max_len=64)
    starts = {
        "a gRPC server": lambda s: ServingServer([], host=WIDE, security_section=s),
        "the router's metrics endpoint": lambda s: MetricsServer(snapshot, host=WIDE, security=s),
        "a decode worker's data port": lambda s: DataListener(WIDE, s),
        "the OpenAI front door": lambda s: FrontDoorServer(door, WIDE, security=s),
    }
    for what, start in starts.items():
        refused = "^" + re.escape(f"{what} would listen on {WIDE} in plaintext")
        with pytest.raises(ConfigError, match=refused):
            start(None)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="prfaas.security"):
            server = start(ALLOWED)
        assert [r.getMessage().split(" would")[0] for r in caplog.records] == [f"warning: {what}"]
        if isinstance(server, ServingServer):
            server.stop(0)
        elif isinstance(server, DataListener):
            server.close()
        elif isinstance(server, FrontDoorServer):
            server._socket.close()  # never started
        else:
            server.stop()


def _idle() -> RouterSnapshot:
    return RouterSnapshot(
        requests={},
        in_flight=0,
        threshold=64,
        threshold_changes={},
        egress_bytes=0,
        egress_bytes_per_s=0.0,
        link_capacity_bytes_per_s=0.0,
        queue_depth={},
        decode_assigned={},
        instances={},
        role_changes=0,
        ttft=Histogram(),
    )


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    root = tmp_path_factory.mktemp("creds")
    assert prfaas(["certs", "--out", str(root), "--days", "1"]) == 0
    return root


def _get(url: str, context: ssl.SSLContext | None = None, token: str | None = None) -> int:
    """The HTTP status of GET `url` (an error in the handshake: -1)."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, ConnectionError, ssl.SSLError):
        return -1


def _client(creds, *, certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(creds / "ca.pem"))
    if certificate:
        context.load_cert_chain(str(creds / "node.pem"), str(creds / "node-key.pem"))
    return context


def test_the_metrics_endpoint_wants_the_token_or_a_certificate(creds):
    token = (creds / "router.token").read_text().strip()
    paths = {"ca_cert": "ca.pem", "cert": "node.pem", "key": "node-key.pem"}
    with_token = SecuritySection(
        **{k: str(creds / v) for k, v in paths.items()}, token_file=str(creds / "router.token")
    )
    server = MetricsServer(_idle, security=with_token)
    try:
        url = f"https://{server.address}/metrics"
        assert _get(f"http://{server.address}/metrics", token=token) == -1  # TLS only
        assert _get(url, _client(creds, certificate=False)) == 401
        assert _get(url, _client(creds, certificate=False), token="wrong") == 401
        assert _get(url, _client(creds, certificate=False), token=token) == 200
    finally:
        server.stop()
    # Without a token, a client certificate signed by the CA is the credential.
    server = MetricsServer(
        _idle, security=SecuritySection(**{**with_token.paths, "token_file": ""})
    )
    try:
        url = f"https://{server.address}/metrics"
        assert _get(url, _client(creds, certificate=False)) == -1
        assert _get(url, _client(creds, certificate=True)) == 200
    finally:
        server.stop()


def test_the_front_door_serves_https_and_wants_the_token(creds):
    token = (creds / "router.token").read_text().strip()
    section = SecuritySection(
        ca_cert=str(creds / "ca.pem"),
        cert=str(creds / "node.pem"),
        key=str(creds / "node-key.pem"),
        token_file=str(creds / "router.token"),
    )
    door = FrontDoor("127.0.0.1:1", model="tiny", vocab_size=256, max_len=64, token=token)
    with FrontDoorServer(door, security=section) as server:
        assert server.base_url.startswith("https://")
        url = f"{server.base_url}/models"
        assert _get(url, _client(creds, certificate=False)) == 401
        assert _get(url, _client(creds, certificate=False), token=token) == 200


@pytest.mark.parametrize("token_file", ["router.token", ""])
def test_the_front_door_reads_a_secured_routers_metrics(creds, token_file):
    """With [security] the router's endpoint wants HTTPS and the token (or, without one, the
    node certificate): the front door's /metrics reads it with both."""
    section = SecuritySection(
        ca_cert=str(creds / "ca.pem"),
        cert=str(creds / "node.pem"),
        key=str(creds / "node-key.pem"),
        token_file=str(creds / token_file) if token_file else "",
    )
    server = MetricsServer(_idle, security=section)
    try:
        plain = FrontDoorMetrics(server.address)  # the scrape before [security] reached it
        secured = FrontDoorMetrics(
            server.address, tls=http_client_context(section), token=read_token(section)
        )
        assert b"prfaas_frontdoor_router_metrics_up 0.0" in asyncio.run(plain.render())
        text = asyncio.run(secured.render())
        assert b"prfaas_frontdoor_router_metrics_up 1.0" in text
        assert b"# TYPE prfaas_ttft_seconds histogram" in text  # the router's own series
    finally:
        server.stop()
