"""A PrfaaS instance made of 2 JAX processes (`[instances] prfaas_processes = 2`, 2 CPU devices
each, one `tensor=4` mesh over gloo), the local PD cluster single-process on one device each:
the states the 4-device instance ships decode there to exactly the tokens of single-process
greedy generation (the model's `prefill` + `decode_step`, computed here), and the instance's
coordination service listens on loopback only. Then one of the
instance's processes is SIGKILLed while a state is on the link: the launcher takes the whole
instance down, every request completes with the same tokens (retried elsewhere), the instance
comes back as two new processes and serves again, and after the cluster stops no process of
either incarnation is alive."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import os
import pathlib
import signal
import time

import grpc
import numpy as np
import pytest
from serving_support import REAL_ENGINE, generate, real_cluster

from prfaas_jax.config import load_model_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

NEW = 6
SECTIONS = {
    "model": {"preset": "tiny", "seed": 0},
    # The PD side's engines are the other real-model tests': their executables come from the
    # session's compile cache.
    "engine": {**REAL_ENGINE, "prfaas_mesh": "tensor=4"},
    "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1, "prfaas_processes": 2},
    # 100 KB/s: a 200-token state (~38 KB) is on the link for about 0.4 s.
    "link": {"bandwidth_mbps": 0.8, "latency_ms": 2.0},
    "router": {"threshold": 64, "control_period_s": 0.25, "retry_wait_s": 300.0},
    "controller": {"enabled": False},
}
# Two prompt lengths: the single-process reference compiles one prefill per length.
LENGTHS = {"long": [200] * 5, "short": [40]}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = load_model_config("tiny")
    rng = np.random.default_rng(5)
    prompts = {
        kind: [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
        for kind, lengths in LENGTHS.items()
    }
    root = tmp_path_factory.mktemp("multiprocess")
    new = dict.fromkeys(prompts, NEW)
    with real_cluster(root, SECTIONS, prompts, new) as (cluster, ready, stub, expected):
        yield cluster, ready, stub, prompts, expected


@pytest.mark.slow
def test_a_two_process_instance_ships_states_that_decode_to_greedy_tokens(setup):
    cluster, ready, stub, prompts, expected = setup
    pids = cluster.instance_pids("prfaas-0")
    assert len(pids) == 2 and pids[0] == ready["workers"]["prfaas-0"]["pid"]
    long = [generate(stub, p, NEW) for p in prompts["long"][:2]]
    short = [generate(stub, p, NEW) for p in prompts["short"]]
    assert [r.tokens for r in long] == expected["long"][:2]
    assert [r.tokens for r in short] == expected["short"]
    assert [(r.report.route, r.report.prefill_instance) for r in long] == [
        ("prfaas", "prfaas-0")
    ] * 2
    assert [r.report.decode_instance for r in long] == ["pd-1"] * 2
    assert all(r.report.attempts == 1 for r in [*long, *short])
    # The coordination service, which carries every prefill's call in the clear, listens on
    # loopback only (JAX's default is every interface).
    argv = pathlib.Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
    port = int(argv[argv.index(b"--coordinator") + 1].rsplit(b":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}


def listening_addresses(port: int) -> set[str]:
    """The local addresses of this machine's TCP sockets listening on ``port`` (/proc/net)."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in pathlib.Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if table == "tcp":
                    found.add(str(ipaddress.IPv4Address(raw[::-1])))
                else:  # four 32-bit words, each in host (little-endian) order
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    ip = ipaddress.IPv6Address(words)
                    found.add(str(ip.ipv4_mapped or ip))  # ::ffff:127.0.0.1 is 127.0.0.1
    return found


@pytest.mark.slow
def test_a_killed_process_fails_the_instance_cleanly_and_it_is_restarted(setup):
    cluster, ready, stub, prompts, expected = setup
    old = cluster.instance_pids("prfaas-0")
    control = pb_grpc.WorkerControlStub(
        grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"])
    )
    sent = control.GetStats(pb.GetStatsRequest(), timeout=5).egress_bytes
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(generate, stub, p, NEW) for p in prompts["long"][2:4]]
        deadline = time.monotonic() + 120
        while control.GetStats(pb.GetStatsRequest(), timeout=5).egress_bytes == sent:
            assert time.monotonic() < deadline, "no state went on the link"
            time.sleep(0.01)
        os.kill(old[1], signal.SIGKILL)  # the follower: the leader is still up and shipping
        replies = [f.result(timeout=300) for f in futures]
    assert [r.tokens for r in replies] == expected["long"][2:4]
    assert any(r.report.attempts > 1 for r in replies)
    deadline = time.monotonic() + 300
    while cluster.restarts < 1:
        assert time.monotonic() < deadline, "the instance was not restarted"
        time.sleep(0.2)
    new = cluster.instance_pids("prfaas-0")
    assert len(new) == 2 and not set(new) & set(old)
    assert not any(alive(pid) for pid in old), "the leader outlived its follower"
    # The router finds the new address at its next control period; until then a long prompt
    # may go to the local cluster. Each reply is checked either way.
    deadline = time.monotonic() + 30
    while True:
        reply = generate(stub, prompts["long"][4], NEW)
        assert reply.tokens == expected["long"][4] and reply.report.attempts == 1
        if reply.report.prefill_instance == "prfaas-0":
            break
        assert time.monotonic() < deadline, "the restarted instance was never routed to"
        time.sleep(0.25)
    everyone = [*old, *new, *(w["pid"] for w in ready["workers"].values()), ready["router_pid"]]
    cluster.stop()
    assert not [pid for pid in everyone if alive(pid)]
