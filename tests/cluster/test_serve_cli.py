"""`prfaas serve`: the ready file appears once every server is SERVING; SIGTERM and SIGINT stop
every process and remove it; config mistakes, a `[engine] max_len` past a model's trained limit
among them, are one line and status 2."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest
from serving_support import fake_config, generate

from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.server import health_status
from prfaas_jax.toml_config import resolve


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def start_serve(tmp_path, out=subprocess.PIPE) -> tuple[subprocess.Popen, pathlib.Path, dict]:
    """`prfaas serve` on a fake-engine cluster, logs in tmp_path/logs: the process, its ready
    file and the ready info once the file appears."""
    config = fake_config(tmp_path / "cluster.toml")
    ready_file = tmp_path / "ready.json"
    command = [sys.executable, "-m", "prfaas_jax.cli", "serve", "--config", str(config)]
    command += ["--ready-file", str(ready_file), "--log-dir", str(tmp_path / "logs")]
    server = subprocess.Popen(command, stdout=out, stderr=out)
    deadline = time.monotonic() + 120
    while not ready_file.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            stderr = server.communicate()[1]
            pytest.fail(f"no ready file: {stderr.decode()[-2000:] if stderr else ''}")
        time.sleep(0.1)
    return server, ready_file, json.loads(ready_file.read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_ready_file_and_clean_shutdown(tmp_path, sig):
    server, ready_file, ready = start_serve(tmp_path)
    try:
        assert (ready["model"], ready["seed"]) == ("tiny", 0)
        roles = {name: w["role"] for name, w in ready["workers"].items()}
        assert roles == {"prfaas-0": "prfaas_prefill", "pd-0": "pd_prefill", "pd-1": "pd_decode"}
        addresses = [ready["router"], *(w["address"] for w in ready["workers"].values())]
        assert all(health_status(a) == "SERVING" for a in addresses)
        with grpc.insecure_channel(ready["router"]) as channel:
            assert len(generate(pb_grpc.RouterStub(channel), [1, 2, 3], 3).tokens) == 3
        pids = [ready["router_pid"], *(w["pid"] for w in ready["workers"].values())]
        assert all(alive(pid) for pid in pids)
        server.send_signal(sig)
        assert server.wait(timeout=60) == 0
        assert b"Ctrl-C stops" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "orphan processes"
    assert not ready_file.exists()


def test_serve_restarts_a_dead_worker(tmp_path):
    """A worker SIGKILLed under `prfaas serve` is restarted (a new pid and port in the ready
    file), the router routes to it, and the logs of the crash are kept."""
    server, ready_file, before = start_serve(tmp_path)
    logs = tmp_path / "logs"
    try:
        deadline = time.monotonic() + 120
        os.kill(before["workers"]["pd-1"]["pid"], signal.SIGKILL)
        while True:
            now = json.loads(ready_file.read_text())
            if now["workers"]["pd-1"]["pid"] != before["workers"]["pd-1"]["pid"]:
                break
            assert server.poll() is None and time.monotonic() < deadline, "no restart"
            time.sleep(0.1)
        assert now["workers"]["pd-1"]["role"] == "pd_decode"
        assert health_status(now["workers"]["pd-1"]["address"]) == "SERVING"
        with grpc.insecure_channel(now["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            while True:  # new requests fail fast until the router adopts the replacement
                try:
                    assert generate(stub, [4, 5], 3).report.decode_instance == "pd-1"
                    break
                except grpc.RpcError as err:
                    assert err.code() is grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "the router never adopted the restart"
                    time.sleep(0.1)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        err = server.stderr.read().decode()
        assert "pd-1 exited with status -9; restarting it" in err
        assert (logs / "pd-1.log").exists() and (logs / "pd-1.restart-1.log").exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_launcher_death_takes_the_cluster_down(tmp_path):
    """If the launcher itself is killed (SIGKILL: no cleanup runs), its children still exit."""
    server, _, ready = start_serve(tmp_path, out=subprocess.DEVNULL)
    try:
        pids = [ready["router_pid"], *(w["pid"] for w in ready["workers"].values())]
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "orphan processes"


def refused_at_start(config: pathlib.Path) -> str:
    """`prfaas serve --config CONFIG`'s one line on stderr, once it exited with status 2."""
    result = subprocess.run(
        [sys.executable, "-m", "prfaas_jax.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    return result.stderr


def test_config_mistakes_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npreset = "tiny"\n[router]\nthreshhold = 1\n')
    assert "router.threshhold: unknown key" in refused_at_start(bad)


def test_a_max_len_past_a_trained_limit_is_refused_at_start(tmp_path):
    """`[engine] max_len` past a model's fixed limit (`max_len_fixed`: the positional range an
    imported checkpoint's weights were trained for) is one line and status 2; a max_len within
    it loads."""
    model = tmp_path / "fixed.toml"
    model.write_text(
        resolve("models", "tiny")
        .read_text()
        .replace("\nmax_len = 4096\n", "\nmax_len = 4096\nmax_len_fixed = true\n")
    )
    config = fake_config(tmp_path / "cluster.toml", model={"preset": str(model)})
    config.write_text(config.read_text().replace("max_len = 512", "max_len = 8192"))
    error = refused_at_start(config)
    assert "engine.max_len: 8192 tokens exceed tiny's max_len 4096" in error
    assert "trained for" in error
    config.write_text(config.read_text().replace("max_len = 8192", "max_len = 4096"))
    assert load_cluster_config(config).engine.max_len == 4096
