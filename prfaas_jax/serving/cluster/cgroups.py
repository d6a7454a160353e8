"""Node classes made by the kernel: `NodeCgroups` gives each instance of a node class
(`[node_classes.NAME]`: `cpu_quota` cores on the cores `cpus`) a cgroup of its own in the v1
`cpu` and `cpuset` hierarchies, and the command prefix that starts a process inside it;
`require_cgroups` says in one line what is missing.

The quota is the CFS bandwidth limit (`cpu.cfs_quota_us` over `cpu.cfs_period_us`): whatever the
process's threads do, they run at most `cpu_quota` cores' worth of time per period, the way a
slower chip gets less done per second; the cpuset pins them to `cpus`, so a fast class and a
slow one do not share cores; a large weight (`cpu.shares`) gets a node its quota even when
processes outside any node compete for its cores. Two instances of one class get two cgroups,
each with the whole quota: nodes never take each other's time. A process started in the cgroup
(the prefix is a shell that moves itself in and then execs the command) carries every thread and
child it makes.

Names carry the launcher's pid, `prfaas-<pid>-<instance>`, in both hierarchies. `close` kills
what is left inside and removes them; a start first removes the cgroups of launchers that no
longer run (a run that was killed: its children died with it, PR_SET_PDEATHSIG, so those
cgroups are empty or hold stragglers that are killed). Needs root and the v1 controllers
mounted at `/sys/fs/cgroup/cpu` and `/sys/fs/cgroup/cpuset`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster.processes import pid_alive
from prfaas_jax.serving.cluster_sections import NodeClassSection

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuset")
NODE_SHARES = 65536  # 64 × a plain process's weight (1024)
_NAME = re.compile(r"^prfaas-(\d+)-[A-Za-z0-9._-]+$")
# The shell that moves itself into the two cgroups given as $1 and $2, then becomes the command.
_ENTER = 'echo $$ > "$1" && echo $$ > "$2" && shift 2 && exec "$@"'


def _root(controller: str) -> Path:
    return CGROUP_ROOT / controller


def require_cgroups() -> None:
    """A one-line `UserError` unless this process can make cgroups with CPU limits."""
    if os.geteuid() != 0:
        raise UserError("node classes ([node_classes]) need root to create cgroups")
    for controller in CONTROLLERS:
        root = _root(controller)
        if not (root / "cgroup.procs").exists():
            raise UserError(
                f"node classes need the cgroup v1 {controller!r} controller mounted at {root}"
            )
        if not os.access(root, os.W_OK):
            raise UserError(f"node classes need write access to {root}")


def machine_cpus() -> tuple[int, ...]:
    """The cores the root cpuset holds."""
    text = (_root("cpuset") / "cpuset.cpus").read_text().strip()
    return NodeClassSection(cpus=text, cpu_quota=1.0).cpu_list


def _remove(path: Path, timeout_s: float = 5.0) -> None:
    """Kill what is left in the cgroup at ``path`` and remove it (a cgroup with tasks cannot be
    removed; a killed task leaves it a moment later)."""
    deadline = time.monotonic() + timeout_s
    while path.exists():
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def sweep_stale() -> list[str]:
    """Remove the cgroups of launchers that no longer run; their names."""
    removed = []
    for controller in CONTROLLERS:
        root = _root(controller)
        if not root.is_dir():
            continue
        for path in root.iterdir():
            match = _NAME.match(path.name)
            if match and path.is_dir() and not pid_alive(int(match.group(1))):
                _remove(path)
                removed.append(f"{controller}/{path.name}")
    return removed


class NodeCgroups:
    """The cgroups of one launcher's instances (module docstring)."""

    def __init__(self) -> None:
        require_cgroups()
        sweep_stale()
        self.owner = os.getpid()
        self._cpus = machine_cpus()
        self._made: dict[str, tuple[Path, Path]] = {}
        self.classes: dict[str, str] = {}  # instance → class name
        self._adopted = ""  # the cgroup this process moved into (`adopt_self`)

    def _paths(self, instance: str) -> tuple[Path, Path]:
        name = f"prfaas-{self.owner}-{instance}"
        return _root("cpu") / name, _root("cpuset") / name

    def enter(
        self, instance: str, class_name: str = "", node: NodeClassSection | None = None
    ) -> list[str]:
        """Make (or reuse, for a restarted instance) ``instance``'s cgroups with ``node``'s
        limits; the argv prefix that runs a command inside them. Without ``node``: the weight
        alone, every core, no quota (the router of a cluster with node classes: a process
        that must not starve, whose speed is not the experiment's)."""
        cpus = node.cpus if node is not None else ",".join(map(str, self._cpus))
        if node is not None and (missing := sorted(set(node.cpu_list) - set(self._cpus))):
            have = ",".join(map(str, self._cpus))
            raise UserError(
                f"node class {class_name!r} asks for cpus {node.cpus} ({missing} missing); "
                f"this machine has {have}"
            )
        cpu, cpuset = self._paths(instance)
        if instance not in self._made:
            cpu.mkdir(exist_ok=True)
            cpuset.mkdir(exist_ok=True)
            self._made[instance] = (cpu, cpuset)
            if node is not None:
                period_us = round(node.period_ms * 1e3)
                quota_us = max(round(node.cpu_quota * period_us), 1000)
                (cpu / "cpu.cfs_period_us").write_text(str(period_us))
                (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))
                self.classes[instance] = class_name
            # The quota caps a node; the weight makes sure it gets that much when the
            # machine's other processes (outside any node) want the same cores.
            (cpu / "cpu.shares").write_text(str(NODE_SHARES))
            mems = (_root("cpuset") / "cpuset.mems").read_text().strip()
            (cpuset / "cpuset.mems").write_text(mems)  # a cpuset takes no task without both
            (cpuset / "cpuset.cpus").write_text(cpus)
        return ["sh", "-c", _ENTER, "sh", str(cpu / "cgroup.procs"), str(cpuset / "cgroup.procs")]

    def adopt_self(self, name: str) -> None:
        """Move this process (every thread) into a cgroup of its own with the weight alone,
        until `close`: a load generator that must not starve beside the nodes it drives."""
        self.enter(name)
        for path in self._made[name]:
            (path / "cgroup.procs").write_text(str(os.getpid()))
        self._adopted = name

    def throttling(self) -> dict[str, dict[str, float]]:
        """Per instance, what its quota cost it so far: periods it ran in, periods it was
        throttled in, seconds throttled (`cpu.stat`)."""
        out = {}
        for instance, (cpu, _) in self._made.items():
            with contextlib.suppress(OSError):
                stat = dict(
                    line.split() for line in (cpu / "cpu.stat").read_text().splitlines() if line
                )
                out[instance] = {
                    "periods": int(stat.get("nr_periods", 0)),
                    "throttled_periods": int(stat.get("nr_throttled", 0)),
                    "throttled_s": int(stat.get("throttled_time", 0)) / 1e9,
                }
        return out

    def close(self) -> None:
        """Kill what is left in this launcher's cgroups and remove them (this process, if it
        moved into one, moves back to the root first)."""
        if self._adopted:
            for controller in CONTROLLERS:
                (_root(controller) / "cgroup.procs").write_text(str(os.getpid()))
            self._adopted = ""
        for paths in self._made.values():
            for path in paths:
                _remove(path)
        self._made.clear()
