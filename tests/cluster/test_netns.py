"""Clusters in network namespaces (`--netns`, fake engines, real processes): the states cross a
veth the kernel shapes, its byte counter matches the router's egress, the link runs at the rate
it is shaped to and can be reshaped while serving without losing a request, every port a
namespace exposes wants the certificates the run made, and no namespace, veth, certificate or
process outlives the cluster."""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest
from cryptography import x509
from serving_support import assert_data_port_refuses, fake_config, generate

from prfaas_jax.cli import main as prfaas
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster.netns import (
    NetnsTopology,
    owned_namespaces,
    remove_stale,
    root_devices,
)
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.loadgen.demo import TLS_BYTES_PER_TRANSFER
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer.data_path import DataSender
from prfaas_jax.serving.transport import security
from prfaas_jax.serving.transport.kernel_link import run_ip, tbf_rate_bytes_per_s
from prfaas_jax.serving.transport.server import health_status

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="--netns needs root and iproute2 (ip, tc)",
)

RATE = 2_000_000.0  # bytes/s (16 Mbit/s); a 480-token toy state is ~100 KB
PROMPT_LEN = 480


def _config(root: pathlib.Path) -> pathlib.Path:
    return fake_config(
        root / "cluster.toml",
        fake={"prefill_s_per_token": 1e-5, "decode_step_s": 0.001},
        link={"bandwidth_mbps": RATE * 8 / 1e6, "latency_ms": 0.0},
        engine={"max_len": 512, "max_slots": 8},
        router={"prfaas_max_queue": 256, "max_in_flight": 64},
    )


def _devices_left(index: int) -> list[str]:
    return [d for d in root_devices(index) if pathlib.Path(f"/sys/class/net/{d}").exists()]


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("netns-cluster")
    cluster = ClusterProcesses(_config(root), log_dir=root / "logs", netns=True)
    with cluster:
        ready = cluster.start()
        index, pids = cluster.topology.index, [w["pid"] for w in ready["workers"].values()]
        credentials = pathlib.Path(cluster.peer_security.cert).parent
        yield cluster, ready
    # Nothing outlives the cluster: its namespaces, the root ends of its veths, its processes,
    # the certificates it made.
    assert owned_namespaces(os.getpid()) == []
    assert _devices_left(index) == []
    assert not credentials.exists()
    for pid in [*pids, ready["router_pid"]]:
        assert not pathlib.Path(f"/proc/{pid}").exists() or _is_zombie(pid), pid


def _is_zombie(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


class LinkSampler:
    """The PrfaaS end's `tbf` qdisc — bytes it sent and bytes queued in it — sampled every
    20 ms on a thread."""

    def __init__(self, topology: NetnsTopology) -> None:
        self.topology, self.samples = topology, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            command = ("tc", "-s", "-j", "qdisc", "show", "dev", "link0")
            [qdisc] = json.loads(run_ip(*command, namespace=self.topology.prfaas_ns))
            self.samples.append((time.monotonic(), qdisc["bytes"], qdisc["backlog"]))
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def rate(self, start: float, end: float) -> float:
        """Bytes/s the link sent while it had a backlog, in ``[start, end]``: over runs of
        samples with bytes queued at both ends, so time the senders left the link idle (a
        loaded machine) does not count against it. At least 0.5 s of such runs."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        sent = seconds = 0.0
        for (t0, b0, q0), (t1, b1, q1) in itertools.pairwise(inside):
            if q0 > 0 and q1 > 0:
                sent, seconds = sent + b1 - b0, seconds + t1 - t0
        assert seconds >= 0.5, f"the link had a backlog for only {seconds:.2f} s"
        return sent / seconds


def _burst(stub, count: int, errors: list[str]) -> None:
    def one(i: int) -> None:
        try:
            generate(stub, [(i + j) % 200 + 1 for j in range(PROMPT_LEN)], 1)
        except grpc.RpcError as err:
            errors.append(err.code().name)

    with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
        list(pool.map(one, range(count)))


def test_states_cross_the_shaped_veth(netns_cluster):
    cluster, ready = netns_cluster
    assert ready["netns"]["link_rate_bytes_per_s"] == RATE
    assert ready["workers"]["prfaas-0"]["address"].startswith(ready["netns"]["prfaas_host"] + ":")
    assert ready["workers"]["pd-1"]["address"].startswith(ready["netns"]["pd_host"] + ":")
    with grpc.insecure_channel(ready["router"]) as channel:
        stub = pb_grpc.RouterStub(channel)
        before_router = stub.GetStats(pb.GetStatsRequest()).egress_bytes
        before_kernel = cluster.topology.link_tx_bytes()
        replies = [generate(stub, [7] * n, 2) for n in (32, 200, 480)]
        assert [r.report.route for r in replies] == ["pd", "prfaas", "prfaas"]
        time.sleep(1.0)  # the router polls the egress counters once per control period
        shipped = stub.GetStats(pb.GetStatsRequest()).egress_bytes - before_router
    sent = cluster.topology.link_tx_bytes() - before_kernel
    states = sum(r.report.state_bytes for r in replies if r.report.route == "prfaas")
    assert states <= shipped <= 1.02 * states  # the codec's frames: the state and its headers
    # Every shipped byte crossed the veth, plus headers (66 B per ≤ 1,448-B segment), framing
    # and each transfer's TLS handshakes (the demo's allowance).
    transfers = sum(r.report.route == "prfaas" for r in replies)
    assert shipped <= sent <= 1.08 * shipped + TLS_BYTES_PER_TRANSFER * transfers, (sent, shipped)


def test_every_cross_namespace_port_wants_the_runs_certificates(netns_cluster):
    """The workers bind their namespaces' addresses, not loopback: with no [security] in the
    config the run makes a CA and a node certificate for them, and each worker port and data
    port refuses a caller without one (plaintext, or TLS with no client certificate: the
    handshake fails) and serves one with it. The router stays on loopback, as configured."""
    cluster, ready = netns_cluster
    peer = cluster.peer_security
    assert peer.tls and cluster.config.security == SecuritySection()
    assert ready["netns"]["mutual_tls"] is True
    cert = x509.load_pem_x509_certificate(pathlib.Path(peer.cert).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    hosts = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert {ready["netns"]["prfaas_host"], ready["netns"]["pd_host"]} <= hosts
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime < datetime.timedelta(days=8)
    no_certificate = SecuritySection(ca_cert=peer.ca_cert)
    for name, worker in ready["workers"].items():
        address = worker["address"]
        assert health_status(address) == "UNAVAILABLE", name  # plaintext
        assert health_status(address, security_section=no_certificate) == "UNAVAILABLE", name
        with security.channel(address, peer) as channel:
            stats = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
            assert stats.name == name
            if worker["role"] != "pd_decode":
                continue
            stub = pb_grpc.DecodeWorkerStub(channel)
            port = stub.DataPath(pb.DataPathRequest(), timeout=10).port
        host = address.rsplit(":", 1)[0]
        for client in (None, no_certificate):
            assert_data_port_refuses(host, port, client)
        DataSender.connect(host, port, peer, timeout_s=5).close()
    assert health_status(ready["router"]) == "SERVING"


def test_bench_reports_the_veths_bytes_next_to_the_routers(netns_cluster, tmp_path, capsys):
    """`prfaas bench --ready-file` finds the router and, under --netns, the link's veth: its
    kernel count sits next to the router's egress, above it by the headers only."""
    cluster, ready = netns_cluster
    ready_file = tmp_path / "ready.json"
    ready_file.write_text(json.dumps(ready))
    argv = ["bench", "--ready-file", str(ready_file), "--num-prompts", "12"]
    argv += ["--input-dist", "fixed", "--input-len", "300", "--output-len", "2", "--json"]
    before = cluster.topology.link_tx_bytes()
    code = prfaas(argv)
    sent = cluster.topology.link_tx_bytes() - before
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    assert summary["completed"] == 12 and summary["offload_fraction"] == 1.0
    egress, kernel = summary["egress_bytes"], summary["link_kernel_bytes"]
    assert egress > 12 * 50_000  # twelve 300-token states
    assert egress <= kernel <= 1.08 * egress + TLS_BYTES_PER_TRANSFER * 12, (kernel, egress)
    assert kernel <= sent  # the bench's window lies inside this test's
    argv[argv.index("--json")] = "--seed"
    argv.append("1")
    assert prfaas(argv) == 0
    text = capsys.readouterr().out
    assert "Egress on the link device (bytes)" in text and "over the router's count" in text


def test_the_link_runs_at_its_shaped_rate_and_reshapes_without_loss(netns_cluster):
    cluster, ready = netns_cluster
    errors: list[str] = []
    sampler = LinkSampler(cluster.topology)
    try:
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            # The workers take only callers with the run's certificates (mutual TLS).
            control = pb_grpc.WorkerControlStub(
                security.channel(ready["workers"]["prfaas-0"]["address"], cluster.peer_security)
            )
            start = time.monotonic()
            # ~6 MB queued at once, 3 s of the link: it stays busy long enough to time even
            # when a loaded machine starves the sender now and then.
            _burst(stub, 60, errors)
            full = sampler.rate(start + 0.3, time.monotonic() - 0.3)
            # Halve the rate through the worker, as the router or an operator would, while a
            # second burst is in flight.
            second = threading.Thread(target=_burst, args=(stub, 30, errors))
            second.start()
            time.sleep(0.2)
            state = control.SetLink(pb.SetLinkRequest(bandwidth_bytes_per_s=RATE / 2))
            changed = time.monotonic()
            second.join()
            half = sampler.rate(changed + 0.3, time.monotonic() - 0.3)
    finally:
        sampler.stop()
    print(
        f"measured {full:,.0f} B/s shaped to {RATE:,.0f}; {half:,.0f} B/s shaped to {RATE / 2:,.0f}"
    )
    assert errors == []  # no request lost to the change
    assert full == pytest.approx(RATE, rel=0.15)
    assert half == pytest.approx(RATE / 2, rel=0.15)
    assert state.bandwidth_bytes_per_s == pytest.approx(RATE / 2, rel=1e-3)  # one PrfaaS worker
    assert tbf_rate_bytes_per_s("link0", namespace=cluster.topology.prfaas_ns) == pytest.approx(
        RATE / 2, rel=1e-3
    )
    cluster.topology.set_rate(RATE)  # as it was, for whatever runs next


def test_a_killed_launchers_namespaces_go_at_the_next_start():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    topology = NetnsTopology(255, dead.pid, RATE)
    try:
        topology._build()
        assert set(owned_namespaces(dead.pid)) == {topology.prfaas_ns, topology.pd_ns}
        removed = remove_stale()
        assert {topology.prfaas_ns, topology.pd_ns} <= set(removed)
        assert owned_namespaces(dead.pid) == [] and _devices_left(255) == []
    finally:
        topology.close()


def test_netns_refuses_certificates_of_the_configs_own(tmp_path):
    from prfaas_jax.errors import UserError

    assert prfaas(["certs", "--out", str(tmp_path / "creds"), "--days", "1"]) == 0
    paths = {"ca_cert": "ca.pem", "cert": "node.pem", "key": "node-key.pem"}
    config = fake_config(
        tmp_path / "cluster.toml", security={k: f"creds/{v}" for k, v in paths.items()}
    )
    before = owned_namespaces(os.getpid())
    with pytest.raises(UserError, match="--netns makes its own certificates"):
        ClusterProcesses(config, netns=True)
    assert owned_namespaces(os.getpid()) == before  # refused before any was made


def test_netns_is_refused_in_one_line_without_root(tmp_path, monkeypatch):
    from prfaas_jax.errors import UserError

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="needs root"):
        ClusterProcesses(_config(tmp_path), netns=True)
