"""`prfaas soak --netns` (serving/loadgen/netns_soak.py) as a user runs it, over the emulated WAN
(configs/clusters/soak-wan.toml, fake engines, real processes): a 40 s soak whose schedule
fits a blackhole, a decode worker stopped for 8 s and a PD prefill worker stopped, then killed,
reports each injected, detected and recovered, nothing lost, duplicated or wrong; and nothing it
made — namespaces, the root ends of their veths, certificates, cgroups, processes (the
workers, the router, the delay line, the front door) — outlives it: after its end, after
Ctrl-C, and after a SIGKILL of the soak while a worker is stopped, once the next start has
cleaned up (`remove_stale`, which a rerun calls first)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from prfaas_jax.serving.cluster.cgroups import CGROUP_ROOT, CONTROLLERS
from prfaas_jax.serving.cluster.netns import namespace_pids, owned_namespaces, remove_stale
from prfaas_jax.serving.cluster.netns_credentials import (
    credentials_folders,
    remove_stale_credentials,
)

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0
        or shutil.which("ip") is None
        or shutil.which("tc") is None
        or not os.access("/dev/net/tun", os.R_OK | os.W_OK),
        reason="the soak over the WAN needs root, iproute2 (ip, tc) and /dev/net/tun",
    ),
    pytest.mark.slow,
]


def _soak(log_dir: pathlib.Path, duration: float) -> subprocess.Popen:
    argv = [sys.executable, "-m", "prfaas_jax.cli", "soak", "--netns", "--json"]
    argv += ["--duration", str(duration), "--rate", "2", "--seed", "0"]
    argv += ["--log-dir", str(log_dir)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _processes_of(log_dir: pathlib.Path) -> list[str]:
    """Processes whose command line names the run's log dir: every child of the cluster and
    the front door (`--address-file`, `--ready-file` there)."""
    found = subprocess.run(["pgrep", "-af", str(log_dir)], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def _left_behind(pid: int, log_dir: pathlib.Path) -> dict[str, list]:
    cgroups = [
        path.name
        for controller in CONTROLLERS
        if (CGROUP_ROOT / controller).is_dir()
        for path in (CGROUP_ROOT / controller).iterdir()
        if path.name.startswith(f"prfaas-{pid}-")
    ]
    return {
        "namespaces": owned_namespaces(pid),
        "credentials": credentials_folders(pid),
        "cgroups": cgroups,
        "processes": _processes_of(log_dir),
    }


NOTHING = {"namespaces": [], "credentials": [], "cgroups": [], "processes": []}


def _wait_gone(pid: int, log_dir: pathlib.Path, timeout_s: float = 15.0) -> dict[str, list]:
    """What the run left, once its children had a moment to act on their death signal."""
    deadline = time.monotonic() + timeout_s
    while (left := _left_behind(pid, log_dir)) != NOTHING and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _wait_arrivals(soak: subprocess.Popen, log_dir: pathlib.Path) -> None:
    """Until the cluster and its front door are up (the front door's address file)."""
    deadline = time.monotonic() + 240
    while not (log_dir / "frontdoor-1.json").exists():
        assert soak.poll() is None, soak.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_short_soak_over_the_wan_reports_every_fault_and_leaves_nothing(tmp_path):
    log_dir = tmp_path / "logs"
    soak = _soak(log_dir, 40)
    out, err = soak.communicate(timeout=400)
    assert soak.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    counts = report["counts"]
    assert counts["lost"] == counts["duplicated"] == counts["wrong"] == 0
    assert counts["sent"] >= 40 and counts["completed"] >= 0.9 * counts["accepted"]
    assert report["mix"]["sampled"] > 0 and report["mix"]["frontdoor"] > 0
    # Every wire precision crossed the link, the lossy ones taken by the fake decode engines.
    assert set(report["mix"]["prfaas_by_precision"]) == {"native", "bf16", "int8", "fp8_e4m3"}
    kinds = report["by_kind"]
    # Seed 0's first round, as far as 40 s of arrivals hold it (tests/serving/
    # test_fault_schedule.py checks the schedule itself).
    scheduled = {kind for kind, row in kinds.items() if row["scheduled"]}
    assert scheduled == {
        "blackhole",
        "sigstop:pd_decode",
        "sigstop:pd_prefill",
        "sigkill:pd_prefill",
    }
    for kind in scheduled:
        row = kinds[kind]
        assert row["injected"] == row["detected"] == row["recovered"] == 1, (kind, row)
        assert row["in_flight"] >= 1
    assert report["missing_kinds"] == [] and report["passed"]
    stopped = next(i for i in report["injections"] if i["kind"] == "sigstop:pd_decode")
    assert stopped["detail"]["health_while_stopped"] != "SERVING"
    rss = report["rss"]
    assert {"soak", "router", "wan", "frontdoor-1", "prfaas-0", "pd-0"} <= set(rss)
    assert all(row["samples"] >= 2 for name, row in rss.items() if "restart" not in name)
    # 40 s is too short for the memory rule (serving/loadgen/soak_memory.py) to judge anyone.
    assert {v["verdict"] for v in report["memory"].values()} == {"too short"}
    assert report["restarts"] == 1  # the killed PD prefill worker
    assert _wait_gone(soak.pid, log_dir) == NOTHING


def test_ctrl_c_and_a_killed_soak_leave_nothing(tmp_path):
    # Ctrl-C a few seconds into the arrivals: the soak stops everything on its way out.
    log_dir = tmp_path / "interrupted"
    soak = _soak(log_dir, 30)
    _wait_arrivals(soak, log_dir)
    time.sleep(3)
    soak.send_signal(signal.SIGINT)
    soak.communicate(timeout=120)
    assert _wait_gone(soak.pid, log_dir) == NOTHING
    # SIGKILL while a decode worker is stopped (seed 0's second fault, 10 s in): its children
    # die with it, but the stopped one cannot until someone kills it; the next start does.
    log_dir = tmp_path / "killed"
    soak = _soak(log_dir, 30)
    _wait_arrivals(soak, log_dir)
    deadline = time.monotonic() + 60
    stopped = []
    while not stopped:
        assert soak.poll() is None and time.monotonic() < deadline, "no worker was stopped"
        pids = [p for ns in owned_namespaces(soak.pid) for p in namespace_pids(ns)]
        stopped = [p for p in pids if _state(p) == "T"]
        time.sleep(0.2)
    soak.send_signal(signal.SIGKILL)
    soak.communicate(timeout=30)
    time.sleep(2)  # the death signals reach the children
    assert _state(stopped[0]) == "T"  # what only the clean-up at the next start removes
    remove_stale()
    remove_stale_credentials()
    assert _wait_gone(soak.pid, log_dir) == NOTHING


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
