"""Start and stop a toy cluster of real processes: `ClusterProcesses` (`prfaas serve`'s loop
around it is serving/cluster/serve.py; which parts run on which machine, machines.py; the record
of a child, processes.py; the helpers the children share, serving/transport/lifecycle.py).

On loopback by default, or where `[hosts]` puts each server; with `netns` the PrfaaS and PD
clusters each run in a network namespace of their own, joined by a kernel-shaped veth
(serving/cluster/netns.py), and the ready info gains `"netns"`: the namespaces, host addresses,
link device and rate. The workers there bind addresses beyond loopback, so the launcher makes a CA
and a node certificate for them at start (`_secure_netns`, serving/cluster/netns_credentials.py)
and every worker port and channel between the processes uses mutual TLS; elsewhere `check_binds`
refuses, before anything starts, a config whose servers would listen beyond loopback in plaintext.
An instance whose cluster has a node class (`[instances] prfaas_class`, `pd_class`) runs in cgroups
of its own with that class's CPU quota and cores (serving/cluster/cgroups.py; the router and the
delay line then get cgroups with the nodes' weight and no quota), and the ready info gains
`"node_classes"`. With `only` a launcher runs part of the cluster (the router, the PrfaaS or the PD
instances) and another machine's launcher the rest, each finding the other's instances at their
`[hosts]` address. A PrfaaS instance of several JAX processes (`[instances] prfaas_processes`,
engine/spmd.py) is started, watched and restarted as one: its leader is the child the others are
attached to.

`ClusterProcesses.start` launches one worker process per instance (serving/worker/main.py), waits
until each listens and reports SERVING on its health service, then launches the router
(serving/router/main.py) with the workers' addresses and waits for it too; it returns the ready
info that `prfaas serve --ready-file` writes:

    {"router": "127.0.0.1:P", "metrics": "127.0.0.1:M", "model": preset, "seed": s,
     "workers": {name: {"address": …, "pid": …, "role": "prfaas_prefill" | "pd_prefill" |
     "pd_decode"}}, "pid": launcher pid, "router_pid": …, "log_dir": …,
     "interpreted_kernels": true when impl = "pallas" runs interpreted (no GPU or TPU)}

Each child runs in its own process group (session) and asks to die with its parent
(`die_with_parent`: PR_SET_PDEATHSIG on Linux, should the launcher itself be killed); `stop` sends
SIGTERM to every group, waits, then SIGKILLs what is left, so no process outlives the cluster.
Children are spawned from the calling thread, which must outlive them (the death signal follows the
thread that forked). With the compile cache on, the first worker of each engine kind warms up alone
and the others start once it serves, so they load its executables instead of compiling them again.

The module is over 500 lines long because one object owns every child's whole life — start order and
waits, restarts, the link's schedule, stop — and the namespaces and cgroups they run in.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path

from prfaas_jax.engine.compile_cache import default_compile_cache_dir
from prfaas_jax.errors import UserError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster.cgroups import NodeCgroups
from prfaas_jax.serving.cluster.machines import PARTS, remote_instances, wait_remote
from prfaas_jax.serving.cluster.netns import LINK_DEVICE, NetnsTopology, require_netns
from prfaas_jax.serving.cluster.netns_credentials import SECURITY_FILE, netns_credentials
from prfaas_jax.serving.cluster.processes import ChildProcess, ClusterError, free_port
from prfaas_jax.serving.cluster.wan import applied_path
from prfaas_jax.serving.cluster_config import (
    check_binds,
    instance_roles,
    load_cluster_config,
    load_security_file,
    local_devices,
)
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.transport.lifecycle import write_json
from prfaas_jax.serving.transport.server import health_status

WAN_ROLE = "wan"  # the delay line's child: neither a worker nor the router
WORKER_ROLES = frozenset(role.value for role in Role)


class ClusterProcesses:
    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        log_dir: str | os.PathLike[str] | None = None,
        compile_cache: str | os.PathLike[str] | None = None,
        ready_timeout_s: float = 600.0,
        stop_event: threading.Event | None = None,
        restart_workers: bool = False,
        netns: bool = False,
        only: Collection[str] = PARTS,
    ) -> None:
        """`restart_workers`: replace a worker process that dies (same name and role, a new
        port unless `[hosts]` fixes it) from a supervisor thread, and tell the router through
        the workers file. `netns`: run each cluster in its own network namespace, the link
        between them shaped by the kernel (serving/cluster/netns.py); the router stays in this
        namespace. `only`: the parts this machine runs (`PARTS`: the router, the PrfaaS and the
        PD cluster); another machine runs the rest, at the `[hosts]` addresses."""
        self.config = load_cluster_config(config_path)
        self.only = frozenset(only)
        self.remote = remote_instances(self.config, self.only)
        if netns and self.remote:
            raise UserError(
                "--netns runs both clusters on this machine: it does not go with --only"
            )
        security = self.config.security
        if netns:
            require_netns(wan=self.config.link.in_packets)
            if security.tls:
                raise UserError(
                    "--netns makes its own certificates for its namespaces' addresses: leave "
                    "[security] ca_cert, cert and key out of a --netns cluster's config"
                )
        # Under --netns the router and its metrics stay on this namespace's loopback and the
        # workers bind their namespaces' addresses, known at start (`_secure_netns`).
        for warning in [] if netns else check_binds(self.config, self.only):
            print(f"prfaas serve: {warning}", file=sys.stderr, flush=True)
        self.netns = netns
        # What the workers' ports and every channel between the processes use: the config's
        # [security], or under --netns certificates made at start for the namespaces'
        # addresses (`_secure_netns`), in `_credentials_dir`, removed at stop.
        self.peer_security: SecuritySection = security
        self._credentials_dir: Path | None = None
        self.topology: NetnsTopology | None = None
        # Node classes ([node_classes]): a cgroup per instance that has one, made at start.
        self.cgroups: NodeCgroups | None = None
        self.config_path = str(self.config.path)
        # A temporary log dir is removed after a clean run and kept when something failed.
        self._temporary_logs = log_dir is None
        self.failed = False
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="prfaas-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cache = compile_cache or (
            default_compile_cache_dir() if self.config.engine.compile_cache else None
        )
        self.compile_cache = str(cache) if cache else None
        self.ready_timeout_s = ready_timeout_s
        self._stop = stop_event or threading.Event()
        self.children: list[ChildProcess] = []
        self.ready: dict | None = None
        self.restart_workers = restart_workers
        self.restarts = 0
        self._children_lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._link_schedule: threading.Thread | None = None
        self._schedule_start: tuple[float, float] | None = None
        self._workers_file = self.log_dir / "workers.json"
        # A `WanControl` written here changes the delay line's model while it runs
        # (serving/cluster/wan.py; `prfaas soak --netns` injects its link faults so).
        self.wan_control_file = self.log_dir / "wan-control.json"

    def __enter__(self) -> ClusterProcesses:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.stop()
        if self._temporary_logs and exc_type is None and not self.failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _child(
        self,
        name: str,
        role: str,
        module: str,
        extra: list[str],
        log_name: str = "",
        prefix: list[str] | None = None,
    ) -> ChildProcess:
        argv = [*(prefix or []), sys.executable, "-m", module, "--config", self.config_path]
        argv += ["--parent-pid", str(os.getpid())]
        log_path = self.log_dir / f"{log_name or name}.log"
        return ChildProcess(
            name,
            role,
            [*argv, *extra, "--address-file", str(log_path.with_suffix(".json"))],
            log_path,
        )

    def _spawn(self, *args, **kwargs) -> ChildProcess:
        child = self._child(*args, **kwargs)
        with self._children_lock:
            self.children.append(child)
        return child

    def _spawn_worker(self, name: str, role: Role, log_name: str = "") -> ChildProcess:
        """One instance: a worker process, or for a multi-process PrfaaS instance its leader
        (process 0, which serves) with the followers attached to it (engine/spmd.py)."""
        extra = ["--name", name, "--role", role.value, *self._security_flags()]
        if self.compile_cache:
            extra += ["--compile-cache", self.compile_cache]
        devices = local_devices(self.config, role)
        if devices > 1:
            extra += ["--local-devices", str(devices)]
        prfaas = role is Role.PRFAAS_PREFILL
        endpoint, prefix = self.config.hosts.endpoint(name), None
        host = endpoint.host
        if self.topology is not None:
            topology = self.topology
            host = topology.prfaas_host if prfaas else topology.pd_host
            if prfaas:
                extra += ["--kernel-link", LINK_DEVICE]
            prefix = topology.exec_prefix(prfaas)
        if (node := self.config.node_class(role)) is not None and self.cgroups is not None:
            # The cgroup first: `ip netns exec` mounts a sysfs of its own, without cgroups.
            prefix = [*self.cgroups.enter(name, *node), *(prefix or [])]
        extra += ["--host", host]
        if endpoint.port:
            extra += ["--port", str(endpoint.port)]
        module = "prfaas_jax.serving.worker.main"
        processes = self.config.instances.prfaas_processes if prfaas else 1
        if processes == 1:
            return self._spawn(name, role.value, module, extra, log_name, prefix)
        # The coordination service carries every prefill's call in the clear: on this
        # machine's (or namespace's) loopback only, where all the instance's processes run.
        coordinator = f"127.0.0.1:{free_port()}"
        extra += ["--coordinator", coordinator, "--num-processes", str(processes)]
        log_name = log_name or name
        followers = [
            self._child(
                name,
                role.value,
                module,
                [*extra, "--process-id", str(i)],
                f"{log_name}.p{i}",
                prefix,
            )
            for i in range(1, processes)
        ]
        leader = self._spawn(
            name, role.value, module, [*extra, "--process-id", "0"], log_name, prefix
        )
        leader.followers = followers
        return leader

    def _wait_serving(
        self, children: list[ChildProcess], deadline: float, stop: threading.Event | None = None
    ) -> None:
        waiting = list(children)
        while waiting:
            if self._stop.is_set() or (stop is not None and stop.is_set()):
                raise ClusterError("interrupted while the cluster was starting")
            for child in list(waiting):
                if (exited := child.exited()) is not None:
                    process, code = exited
                    raise ClusterError(
                        f"{child.name} exited with status {code} while starting; its log "
                        f"({process.log_path}) ends with:\n{process.log_tail()}"
                    )
                if not child.info and child.address_file.exists():
                    child.info = json.loads(child.address_file.read_text())
                # With certificates, the probe presents the node's: workers require mTLS.
                router = child.role == "router"
                security = self.config.security if router else self.peer_security
                if (
                    child.info
                    and health_status(child.info["address"], security_section=security) == "SERVING"
                ):
                    waiting.remove(child)
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting)
                raise ClusterError(f"{names} not SERVING after {self.ready_timeout_s:.0f} s")
            if waiting:
                time.sleep(0.1)

    def start(self) -> dict:
        """Start every process of this machine's parts and wait until all are SERVING (and,
        with the router here, the other machines' instances too); returns the ready info."""
        deadline = time.monotonic() + self.ready_timeout_s
        roles = {n: r for n, r in instance_roles(self.config).items() if n not in self.remote}
        router = None
        try:
            if any(self.config.node_class(role) for role in roles.values()):
                self.cgroups = NodeCgroups()
            if self.netns:
                link = self.config.link
                self.topology = NetnsTopology.create(
                    link.bandwidth_bytes_per_s, wan=link.in_packets
                )
                if self.topology.wan:
                    self._start_wan(deadline)
                self._secure_netns()
            pending = list(roles.items())
            if self.compile_cache:
                # One worker per engine kind first: the others then hit the compile cache.
                firsts: dict[bool, tuple[str, Role]] = {}
                for name, role in pending:
                    firsts.setdefault(role.is_prefill, (name, role))
                wave = [self._spawn_worker(n, r) for n, r in firsts.values()]
                self._wait_serving(wave, deadline)
                pending = [item for item in pending if item not in firsts.values()]
            rest = [self._spawn_worker(n, r) for n, r in pending]
            self._wait_serving(rest, deadline)
            workers = self._write_workers()
            if "router" in self.only:
                wait_remote(self.config, self.remote, deadline, self._stop, self.ready_timeout_s)
                extra = ["--workers", str(self._workers_file), *self._security_flags()]
                endpoint = self.config.hosts.router
                if self.topology is None:  # under --netns the router stays on loopback
                    extra += ["--host", endpoint.host, "--port", str(endpoint.port)]
                # Beside nodes of a class, the router gets their weight (no quota): it must
                # not starve while they run, or it would be the cluster's bottleneck.
                prefix = self.cgroups.enter("router") if self.cgroups is not None else None
                router = self._spawn(
                    "router", "router", "prfaas_jax.serving.router.main", extra, prefix=prefix
                )
                self._wait_serving([router], deadline)
            if self.restart_workers:
                self._supervisor = threading.Thread(
                    target=self._supervise, name="cluster-supervisor", daemon=True
                )
                self._supervisor.start()
            if self.topology is not None and self.config.link.schedule:
                # t = 0 of the schedule, on both clocks: the ready info gives the wall time.
                self._schedule_start = (time.monotonic(), time.time())
                self._link_schedule = threading.Thread(
                    target=self.topology.follow_schedule,
                    args=(self.config.link, self._schedule_start[0], self._stopping),
                    name="link-schedule",
                    daemon=True,
                )
                self._link_schedule.start()
        except BaseException:
            self.stop()
            raise
        self.ready = {
            "router": router.info["address"] if router else None,
            "metrics": router.info["metrics"] if router else None,
            "model": self.config.model.preset,
            "seed": self.config.model.seed,
            "workers": {name: workers[name] for name in instance_roles(self.config)},
            "pid": os.getpid(),
            "router_pid": router.info["pid"] if router else None,
            "log_dir": str(self.log_dir),
            # impl = "pallas" on a machine without an accelerator: correct, and slow.
            "interpreted_kernels": any(
                c.info.get("interpreted_kernels", False) for c in self.children
            ),
        }
        if self.cgroups is not None:
            self.ready["node_classes"] = dict(self.cgroups.classes)
        if self.topology is not None:
            self.ready["netns"] = self.topology.describe()
            # Whether the namespaces' ports want the certificates made for this run.
            self.ready["netns"]["mutual_tls"] = self.peer_security.tls
            if self._schedule_start is not None:
                self.ready["netns"]["schedule_start_unix_s"] = self._schedule_start[1]
        return self.ready

    def _secure_netns(self) -> None:
        """The rule beyond loopback for the namespaces' workers (`netns_credentials`)."""
        assert self.topology is not None
        hosts = {"PrfaaS": self.topology.prfaas_host, "PD": self.topology.pd_host}
        self._credentials_dir = netns_credentials(self.config.security, hosts)
        if self._credentials_dir is not None:
            self.peer_security = load_security_file(self._credentials_dir / SECURITY_FILE)

    def _security_flags(self) -> list[str]:
        """A child's flag for the certificates `_secure_netns` made (none without them)."""
        if self._credentials_dir is None:
            return []
        return ["--cluster-security", str(self._credentials_dir / SECURITY_FILE)]

    def _start_wan(self, deadline: float) -> None:
        """The delay line of the WAN namespace (serving/cluster/wan.py), served once its address
        file names it."""
        topology = self.topology
        assert topology is not None
        # A reused log dir's control (and its acknowledgement) is not this run's.
        self.wan_control_file.unlink(missing_ok=True)
        applied_path(self.wan_control_file).unlink(missing_ok=True)
        child = self._spawn(
            "wan",
            WAN_ROLE,
            "prfaas_jax.serving.cluster.wan",
            [
                *topology.wan_argv(),
                *("--stats-file", str(self.log_dir / "wan-stats.json")),
                *("--control-file", str(self.wan_control_file)),
            ],
            prefix=[
                *(self.cgroups.enter("wan") if self.cgroups is not None else []),
                *topology.wan_exec_prefix(),
            ],
        )
        while not child.address_file.exists():
            if (exited := child.exited()) is not None:
                raise ClusterError(
                    f"the delay line exited with status {exited[1]} while starting; its log "
                    f"({child.log_path}) ends with:\n{child.log_tail()}"
                )
            if time.monotonic() > deadline or self._stop.is_set():
                raise ClusterError("the delay line of the WAN namespace did not start")
            time.sleep(0.05)
        child.info = json.loads(child.address_file.read_text())

    def _write_workers(self) -> dict:
        """The workers listing the router reads (and re-reads after a restart), atomically;
        another machine's instances at their `[hosts]` address, with no pid."""
        workers = {
            name: {"address": str(self.config.hosts.endpoint(name)), "pid": None, "role": r.value}
            for name, r in self.remote.items()
        }
        with self._children_lock:
            workers |= {
                c.name: {"address": c.info["address"], "pid": c.info["pid"], "role": c.role}
                for c in self.children
                if c.role in WORKER_ROLES
            }
        write_json(self._workers_file, workers)
        return workers

    def worker_pid(self, name: str) -> int | None:
        """The pid of the process that is instance `name` now (None: none is running); of a
        multi-process instance, its leader's."""
        pids = self.instance_pids(name)
        return pids[0] if pids else None

    def instance_pids(self, name: str) -> list[int]:
        """The pids of instance `name`'s running processes, its leader first."""
        with self._children_lock:
            for child in self.children:
                if child.name == name and child.popen.poll() is None:
                    return [c.popen.pid for c in child.group() if c.popen.poll() is None]
        return []

    def _supervise(self) -> None:
        """Replace dead workers until the cluster stops. Runs on its own thread, which then
        also forks the replacements (their parent-death signal follows this thread, which lives
        as long as the cluster)."""
        while not self._stopping.wait(0.1):
            with self._children_lock:
                workers = [c for c in self.children if c.role in WORKER_ROLES]
                dead = [c for c in workers if c.exited() is not None]
            for child in dead:
                if self._stopping.is_set():
                    return
                self._replace(child)

    def _replace(self, dead: ChildProcess) -> None:
        process, code = dead.exited() or (dead, dead.popen.poll())
        what = (
            f"{dead.name} exited with status {code}; restarting it"
            if process is dead
            else f"process {process.log_path.stem} of {dead.name} exited with status {code}; "
            f"restarting {dead.name}"
        )
        print(f"prfaas serve: {what}", file=sys.stderr, flush=True)
        # An instance lives and dies whole: its other processes would wait on the lost one.
        for child in dead.group():
            child.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=5)  # reaped: no zombie keeps its pid
        self.failed = True  # keep the logs: they hold the dead process's last words
        with self._children_lock:
            self.children.remove(dead)
        attempt = self.restarts + 1
        child = self._spawn_worker(dead.name, Role(dead.role), f"{dead.name}.restart-{attempt}")
        try:
            self._wait_serving([child], time.monotonic() + self.ready_timeout_s, self._stopping)
        except ClusterError as err:
            # Left in the list dead: the next pass replaces it again.
            print(f"prfaas serve: restarting {dead.name} failed: {err}", file=sys.stderr)
            return
        workers = self._write_workers()
        if self.ready is not None:
            self.ready["workers"][dead.name] = workers[dead.name]
        self.restarts += 1  # last: a reader that sees the count sees the new address too

    def dead_child(self) -> str | None:
        """The name of a process that exited on its own, if any (with `restart_workers`, only
        the router counts: a worker is replaced)."""
        with self._children_lock:
            children = list(self.children)
        for child in children:
            if self.restart_workers and child.role in WORKER_ROLES:
                continue
            if child.popen.poll() is not None:
                return child.name
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, wait up to `grace_s`, SIGKILL the rest."""
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=self.ready_timeout_s)
        if self._link_schedule is not None:
            self._link_schedule.join(timeout=15)
        processes = [p for child in reversed(self.children) for p in child.group()]
        for child in processes:  # the router first: it stops taking requests
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for child in processes:
            # Also catches anything a child left in its group.
            child.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=5)
        self.children = []
        if self.cgroups is not None:
            self.cgroups.close()
            self.cgroups = None
        if self.topology is not None:
            self.topology.close()
            self.topology = None
        if self._credentials_dir is not None:
            shutil.rmtree(self._credentials_dir, ignore_errors=True)
            self._credentials_dir = None
