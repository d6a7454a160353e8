"""`[hosts]` and `prfaas serve --only`: one cluster config, two launchers as two machines would
run it (fake engines, real processes). The PrfaaS cluster's launcher (`--only prfaas`) binds
127.0.0.2, the other (`--only router,pd`) binds 127.0.0.3 and finds the PrfaaS instance at its
configured address, whichever starts first; requests flow through both, with the fake engines'
hand-computable tokens. Loopback aliases stand in for two machines' addresses: every server
listens on exactly the address `[hosts]` gives it."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from serving_support import fake_config, generate

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster.processes import free_port
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

MACHINE_A, MACHINE_B = "127.0.0.2", "127.0.0.3"


def listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts")
    hosts = {
        "router": f"{MACHINE_B}:{free_port(MACHINE_B)}",
        "prfaas": f"{MACHINE_A}:{free_port(MACHINE_A)}",
        "pd": MACHINE_B,  # the router's own machine: free ports, read from address files
    }
    return fake_config(root / "cluster.toml", hosts=hosts), root, hosts


def test_two_launchers_serve_one_cluster_at_the_configured_addresses(config):
    path, root, hosts = config
    cfg = load_model_config("tiny")
    pd_side = ClusterProcesses(path, log_dir=root / "b", only={"router", "pd"}, ready_timeout_s=120)
    prfaas_side = ClusterProcesses(path, log_dir=root / "a", only={"prfaas"})
    ready_a: dict = {}
    done = threading.Event()

    def machine_a() -> None:
        # A child's parent-death signal follows the thread that forked it: this thread lives
        # as long as the test's cluster.
        time.sleep(1.0)  # the router's machine starts first, and waits
        ready_a.update(prfaas_side.start())
        done.wait()

    with pd_side, prfaas_side:
        thread = threading.Thread(target=machine_a)
        thread.start()
        try:
            ready_b = pd_side.start()
            _check(ready_a, ready_b, hosts, cfg)
        finally:
            prfaas_side.stop()  # before its thread ends, which would take its children along
            done.set()
            thread.join()


def _check(ready_a: dict, ready_b: dict, hosts: dict, cfg) -> None:
    assert ready_a["router"] is None and ready_a["router_pid"] is None
    assert ready_a["workers"]["prfaas-0"]["address"] == hosts["prfaas"]
    assert ready_a["workers"]["pd-0"]["pid"] is None  # the other machine's
    assert ready_b["router"] == hosts["router"]
    assert ready_b["metrics"].startswith(MACHINE_B + ":")
    assert ready_b["workers"]["prfaas-0"] == {
        "address": hosts["prfaas"],
        "pid": None,
        "role": "prfaas_prefill",
    }
    for name in ("pd-0", "pd-1"):
        assert ready_b["workers"][name]["address"].startswith(MACHINE_B + ":")
    # Each server listens where [hosts] says and nowhere else.
    port = int(hosts["prfaas"].rpartition(":")[2])
    assert listening(MACHINE_A, port) and not listening(MACHINE_B, port)
    with grpc.insecure_channel(ready_b["router"]) as channel:
        stub = pb_grpc.RouterStub(channel)
        for length in (30, 200):
            prompt = [(3 * i) % 97 + 1 for i in range(length)]
            reply = generate(stub, prompt, 5)
            assert reply.tokens == fake_tokens(prompt, 5, cfg.vocab_size)
            route = "prfaas" if length > 64 else "pd"
            assert reply.report.route == route
            if route == "prfaas":
                assert reply.report.prefill_instance == "prfaas-0"


def test_a_remote_instance_needs_a_fixed_port(tmp_path):
    path = fake_config(tmp_path / "cluster.toml", hosts={"prfaas": MACHINE_A})
    with pytest.raises(UserError, match=r'prfaas-0 runs on another machine .*"HOST:PORT"'):
        ClusterProcesses(path, log_dir=tmp_path, only={"router", "pd"})
    ClusterProcesses(path, log_dir=tmp_path, only={"prfaas"})  # no router: nothing to find
    with pytest.raises(UserError, match="--only takes some of router, prfaas, pd"):
        ClusterProcesses(path, log_dir=tmp_path, only={"decode"})
