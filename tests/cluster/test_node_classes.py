"""Node classes by cgroups (serving/cluster/cgroups.py, real processes): a process started in a
class's cgroup runs on the class's cores at the class's quota, the launcher puts each instance
in a cgroup of its own, and no cgroup outlives its launcher — after a clean stop, after a kill
(the next start removes it), with stragglers killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prfaas_jax.cli import main as prfaas
from prfaas_jax.serving.cluster.cgroups import CGROUP_ROOT, NodeCgroups, sweep_stale
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster_sections import NodeClassSection
from prfaas_jax.toml_config import dumps

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (CGROUP_ROOT / "cpu" / "cgroup.procs").exists(),
    reason="node classes need root and the cgroup v1 cpu and cpuset controllers",
)

# CPU seconds a busy loop gets in `wall` seconds of wall time, and its allowed cores.
_BUSY = (
    "import os, time\n"
    "wall = float(os.environ['WALL']); start = time.monotonic(); cpu = time.process_time()\n"
    "while time.monotonic() - start < wall: pass\n"
    "print(time.process_time() - cpu, ','.join(map(str, sorted(os.sched_getaffinity(0)))))\n"
)


def _ours(pid: int) -> list[str]:
    return [
        f"{controller}/{p.name}"
        for controller in ("cpu", "cpuset")
        for p in (CGROUP_ROOT / controller).iterdir()
        if p.name.startswith(f"prfaas-{pid}-")
    ]


def test_a_process_in_a_class_runs_at_its_quota_on_its_cores():
    cgroups = NodeCgroups()
    try:
        node = NodeClassSection(cpus="0", cpu_quota=0.25, period_ms=10.0)
        prefix = cgroups.enter("busy", "slow", node)
        out = subprocess.run(
            [*prefix, sys.executable, "-c", _BUSY],
            env={**os.environ, "WALL": "2.0"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        cpu_s, cores = float(out[0]), out[1]
        assert cores == "0"
        # 0.25 core for 2 s = 0.5 CPU s; the start-up before the loop adds a little.
        assert 0.35 < cpu_s < 0.65
        stats = cgroups.throttling()["busy"]
        assert stats["throttled_periods"] > 0.5 * stats["periods"]
        assert cgroups.classes == {"busy": "slow"}
        cpu_dir = CGROUP_ROOT / "cpu" / f"prfaas-{os.getpid()}-busy"
        assert (cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "2500"
        assert (cpu_dir / "cpu.cfs_period_us").read_text().strip() == "10000"
    finally:
        cgroups.close()
    assert _ours(os.getpid()) == []


def test_close_kills_stragglers_and_a_stale_owners_cgroups_are_swept():
    cgroups = NodeCgroups()
    prefix = cgroups.enter("sleeper", "slow", NodeClassSection(cpus="0", cpu_quota=0.5))
    sleeper = subprocess.Popen([*prefix, "sleep", "600"])
    time.sleep(0.3)  # the shell moves itself in, then becomes sleep
    cgroups.close()
    assert sleeper.wait(timeout=5) == -signal.SIGKILL
    assert _ours(os.getpid()) == []

    # A launcher that died without closing: a pid that no longer runs, a straggler inside.
    dead = subprocess.Popen(["true"])
    dead.wait()
    paths = [CGROUP_ROOT / c / f"prfaas-{dead.pid}-pd-0" for c in ("cpu", "cpuset")]
    for path in paths:
        path.mkdir()
    (paths[1] / "cpuset.mems").write_text((CGROUP_ROOT / "cpuset" / "cpuset.mems").read_text())
    (paths[1] / "cpuset.cpus").write_text("0")
    straggler = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {paths[0]}/cgroup.procs; exec sleep 600"],
    )
    time.sleep(0.3)
    removed = sweep_stale()
    assert sorted(removed) == [f"cpu/prfaas-{dead.pid}-pd-0", f"cpuset/prfaas-{dead.pid}-pd-0"]
    assert straggler.wait(timeout=5) == -signal.SIGKILL
    assert not any(path.exists() for path in paths)


def _config(root: Path) -> Path:
    path = root / "cluster.toml"
    path.write_text(
        dumps(
            {
                "model": {"preset": "tiny", "engine": "fake"},
                "engine": {"max_len": 512, "max_slots": 4, "compile_cache": False},
                "fake": {"decode_step_s": 0.01},
                "instances": {"prfaas_class": "fast", "pd_class": "slow"},
                "router": {"threshold": 64},
                "controller": {"enabled": False},
                "node_classes": {
                    "fast": {"cpus": "0", "cpu_quota": 0.8},
                    "slow": {"cpus": "1" if os.cpu_count() > 1 else "0", "cpu_quota": 0.3},
                },
            }
        )
    )
    return path


def test_each_instance_runs_in_its_class_and_nothing_is_left(tmp_path):
    config = _config(tmp_path)
    with ClusterProcesses(config) as cluster:
        ready = cluster.start()
        assert ready["node_classes"] == {"prfaas-0": "fast", "pd-0": "slow", "pd-1": "slow"}
        for name, worker in ready["workers"].items():
            cgroup = Path(f"/proc/{worker['pid']}/cgroup").read_text()
            assert f"cpu:/prfaas-{os.getpid()}-{name}\n" in cgroup
            want = {0} if name == "prfaas-0" else {1 if os.cpu_count() > 1 else 0}
            assert os.sched_getaffinity(worker["pid"]) == want
        router = Path(f"/proc/{ready['router_pid']}/cgroup").read_text()
        assert f"cpu:/prfaas-{os.getpid()}-router\n" in router  # the weight, no quota
        quota = CGROUP_ROOT / "cpu" / f"prfaas-{os.getpid()}-router" / "cpu.cfs_quota_us"
        assert quota.read_text().strip() == "-1"
    assert _ours(os.getpid()) == []


def test_a_killed_launchers_cgroups_go_at_the_next_start(tmp_path):
    config = _config(tmp_path)
    ready_file = tmp_path / "ready.json"
    serve = subprocess.Popen(
        [sys.executable, "-m", "prfaas_jax.cli", "serve", "--config", str(config),
         "--ready-file", str(ready_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready_file.exists():
            assert serve.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert len(_ours(serve.pid)) == 8  # three instances and the router, two controllers
    finally:
        serve.send_signal(signal.SIGKILL)
        serve.wait()
    NodeCgroups().close()  # what any next start does first
    assert _ours(serve.pid) == []


def test_profile_refuses_a_class_without_its_config(capsys):
    assert prfaas(["profile", "--node-class", "slow", "--out", "x.toml"]) == 2
    assert "--node-class needs --config" in capsys.readouterr().err
