"""The cross-datacenter link in packets under `--netns` (serving/cluster/wan.py, netns.py; fake
engines, real processes): TCP between the clusters sees the configured round trip and loses
segments, requests still come back right, the schedule reshapes the kernel's rate, the default
link has no delay line, and nothing — namespaces, the TUN device, the delay line's process —
outlives the cluster or a killed launcher.

The round trip is measured as a TCP connect (one SYN, one SYN-ACK) from inside the PrfaaS
namespace to a PD worker's port; retransmissions from the PrfaaS namespace's own TCP counters
(/proc/net/snmp read inside it), around a bulk transfer to a listener in the PD namespace."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest
from serving_support import fake_config, generate

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster.netns import NetnsTopology, owned_namespaces, remove_stale
from prfaas_jax.serving.cluster.netns_credentials import (
    credentials_folders,
    remove_stale_credentials,
)
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.kernel_link import tbf_rate_bytes_per_s

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("ip") is None
    or shutil.which("tc") is None
    or not os.access("/dev/net/tun", os.R_OK | os.W_OK),
    reason="the link in packets needs root, iproute2 (ip, tc) and /dev/net/tun",
)

CFG = load_model_config("tiny")
RTT_MS, LOSS_PERCENT = 40.0, 0.5
RATE = 2_000_000.0  # bytes/s (16 Mbit/s)

CONNECT = """
import socket, statistics, sys, time
host, port = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(7):
    sock = socket.socket()
    start = time.perf_counter()
    sock.connect((host, port))
    times.append(time.perf_counter() - start)
    sock.close()
print(statistics.median(times))
"""
SINK = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while conn.recv(1 << 20):
    pass
conn.sendall(b"k")
"""
BULK = """
import socket, sys
def retransmitted():
    rows = [l.split() for l in open("/proc/net/snmp") if l.startswith("Tcp:")]
    return int(dict(zip(rows[0][1:], rows[1][1:]))["RetransSegs"])
before = retransmitted()
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
sock.sendall(b"x" * int(sys.argv[3]))
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
print(retransmitted() - before)
"""


def _in(namespace: str, script: str, *args: str, **popen) -> subprocess.Popen:
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", script, *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)


def _connect_s(namespace: str, address: str) -> float:
    host, port = address.rsplit(":", 1)
    out, _ = _in(namespace, CONNECT, host, port).communicate(timeout=60)
    return float(out)


def _config(root: pathlib.Path, **link) -> pathlib.Path:
    return fake_config(
        root / "cluster.toml",
        fake={"prefill_s_per_token": 1e-5, "decode_step_s": 0.001},
        link={"bandwidth_mbps": RATE * 8 / 1e6, **link},
        engine={"max_len": 512, "max_slots": 8},
    )


@pytest.fixture(scope="module")
def wan_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-cluster")
    config = _config(root, rtt_ms=RTT_MS, loss_percent=LOSS_PERCENT)
    cluster = ClusterProcesses(config, log_dir=root / "logs", netns=True)
    with cluster:
        ready = cluster.start()
        wan = next(c for c in cluster.children if c.role == "wan")
        yield cluster, ready
        wan_pid = wan.popen.pid
    # The delay line, its namespace and TUN device go with the cluster.
    assert owned_namespaces(os.getpid()) == []
    assert not pathlib.Path(f"/proc/{wan_pid}").exists() or _state(wan_pid) == "Z"


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return "Z"


def _address(ready: dict, role: str) -> str:
    return next(w["address"] for w in ready["workers"].values() if w["role"] == role)


def test_tcp_sees_the_round_trip(wan_cluster):
    _, ready = wan_cluster
    netns = ready["netns"]
    assert netns["wan_namespace"] is not None
    rtt = _connect_s(netns["prfaas_namespace"], _address(ready, "pd_decode"))
    assert 0.8 * RTT_MS / 1e3 < rtt < 1.2 * RTT_MS / 1e3, rtt


def test_a_bulk_transfer_across_the_link_is_retransmitted(wan_cluster):
    _, ready = wan_cluster
    netns = ready["netns"]
    sink = _in(netns["pd_namespace"], SINK, netns["pd_host"])
    try:
        port = sink.stdout.readline().strip()
        # 1 MiB at 2 MB/s: ~750 segments, each direction losing 0.5 %.
        sender = _in(netns["prfaas_namespace"], BULK, netns["pd_host"], port, 2**20)
        out, _ = sender.communicate(timeout=120)
    finally:
        sink.kill()
        sink.wait()
    assert int(out) > 0


def test_requests_come_back_right_and_the_router_measures_the_round_trip(wan_cluster):
    """The router's round trip is what TCP measured on the transfers' data connections (the
    queue in the shaper adds to it; never less than the path's own)."""
    _, ready = wan_cluster
    with grpc.insecure_channel(ready["router"]) as channel:
        stub = pb_grpc.RouterStub(channel)
        for i in range(6):
            prompt = [(11 * j + i) % CFG.vocab_size for j in range(300)]
            reply = generate(stub, prompt, 6)
            assert reply.tokens == fake_tokens(prompt, 6, CFG.vocab_size)
            assert reply.report.route == "prfaas" and reply.report.state_bytes > 0
        deadline = time.monotonic() + 10
        while (stats := stub.GetStats(pb.GetStatsRequest())).link_rtt_s == 0:
            assert time.monotonic() < deadline, "no round trip measured"
            time.sleep(0.2)
    assert 0.8 * RTT_MS / 1e3 < stats.link_rtt_s < 4 * RTT_MS / 1e3, stats.link_rtt_s
    prfaas = next(w for w in stats.workers if w.name.startswith("prfaas"))
    assert prfaas.link.rtt_samples >= 1


def test_the_default_link_has_no_delay_line(tmp_path):
    with ClusterProcesses(_config(tmp_path, latency_ms=0.0), netns=True) as cluster:
        ready = cluster.start()
        assert ready["netns"]["wan_namespace"] is None
        assert not any(c.role == "wan" for c in cluster.children)
        rtt = _connect_s(ready["netns"]["prfaas_namespace"], _address(ready, "pd_decode"))
        assert rtt < 0.005


def test_the_schedule_reshapes_the_kernel_link(tmp_path):
    config = _config(tmp_path, rtt_ms=10.0, schedule=[[1.0, 0.3], [2.5, 1.0]])
    with ClusterProcesses(config, netns=True) as cluster:
        ready = cluster.start()
        start = ready["netns"]["schedule_start_unix_s"]
        namespace = ready["netns"]["prfaas_namespace"]

        def rate_at(t: float) -> float:
            time.sleep(max(start + t - time.time(), 0.0))
            return tbf_rate_bytes_per_s("link0", namespace=namespace)

        # tbf stores its rate in whole bytes per second: within 1 %.
        assert rate_at(0.5) == pytest.approx(RATE, rel=0.01)
        assert rate_at(1.7) == pytest.approx(0.3 * RATE, rel=0.01)
        assert rate_at(3.2) == pytest.approx(RATE, rel=0.01)


def test_a_killed_launchers_delay_line_and_namespaces_go(tmp_path):
    """`prfaas serve --netns` killed with SIGKILL: its children die with it (the delay line
    too), and the next start removes the namespaces and the certificates it left."""
    config = _config(tmp_path, rtt_ms=10.0)
    ready_file = tmp_path / "ready.json"
    serve = subprocess.Popen(
        [sys.executable, "-m", "prfaas_jax.cli", "serve", "--config", str(config), "--netns",
         "--ready-file", str(ready_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ready_file.exists():
            assert serve.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        left = owned_namespaces(serve.pid)
        assert len(left) == 3 and any(name.endswith("-wan") for name in left)
        assert len(credentials_folders(serve.pid)) == 1  # the certificates it made
    finally:
        serve.send_signal(signal.SIGKILL)
        serve.wait()
    wan_processes = subprocess.run(
        ["pgrep", "-f", f"serving.cluster.wan.*--parent-pid {serve.pid}"],
        capture_output=True,
        text=True,
    )
    deadline = time.monotonic() + 10
    while wan_processes.stdout.strip() and time.monotonic() < deadline:  # PDEATHSIG: moments
        time.sleep(0.2)
        wan_processes = subprocess.run(
            ["pgrep", "-f", f"serving.cluster.wan.*--parent-pid {serve.pid}"],
            capture_output=True,
            text=True,
        )
    assert wan_processes.stdout.strip() == ""
    # The next start's clean-up (another test's cluster may have started first and done it).
    remove_stale()
    remove_stale_credentials()
    assert owned_namespaces(serve.pid) == []
    assert credentials_folders(serve.pid) == []


def test_the_wan_topology_builds_and_closes_whole():
    topology = NetnsTopology(254, os.getpid(), RATE, wan=True)
    try:
        topology._build()
        names = set(owned_namespaces(os.getpid()))
        assert {topology.prfaas_ns, topology.pd_ns, topology.wan_ns} <= names
    finally:
        topology.close()
    assert not {topology.prfaas_ns, topology.pd_ns, topology.wan_ns} & set(
        owned_namespaces(os.getpid())
    )
