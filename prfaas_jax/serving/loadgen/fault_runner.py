"""Injecting a fault schedule (serving/loadgen/fault_schedule.py) into a running `--netns`
cluster: `FaultRunner`, a thread that applies each `Fault` at its time and keeps an `Injection`
record of it — whom it hit, whether it was detected, whether the cluster recovered.

What each kind does, how it is detected, and what counts as recovered:

- link faults change the delay line's model through its control file (`WanControl`,
  serving/cluster/wan.py: ``loss_burst``, ``blackhole``, ``rtt_spike``; injected once the delay
  line acknowledges it) or the kernel's tbf rate (``bandwidth_drop``) for the fault's hold,
  then restore it. Detected on the path: the delay
  line's loss or blackhole counter grew over the fault, a TCP connect across the link (from the
  PrfaaS namespace to a PD worker) took at least 0.8 × the spiked round trip, the kernel reads the
  dropped rate back. Recovered is judged from the requests after the run
  (serving/loadgen/netns_soak_report.py): a PrfaaS-route request sent after the restore completed
  right.
- ``sigkill:<role>``: a random instance of the role (a decode kill: the one with the most
  requests mid-stream); ``sigterm:prfaas_prefill``: the PrfaaS prefill worker while it holds
  requests (the soak sends long prompts first: `load`), its exit status kept. Detected: the
  launcher saw the process exit; recovered: its replacement serves (the launcher's restart).
- ``sigstop:<role>``: SIGSTOP, the hold, SIGCONT. Detected: its health check went unanswered
  while stopped; recovered: it answers SERVING again after SIGCONT.
- ``sigterm:frontdoor``: the HTTP front door while requests stream through it (`load` sends
  them). Detected: the process exited, its status kept; recovered: a new front door serves.

A process the injector stopped is always continued, also when the run is interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster.netns import LINK_DEVICE
from prfaas_jax.serving.cluster.processes import ChildProcess
from prfaas_jax.serving.cluster.wan import WanControl, applied_path
from prfaas_jax.serving.loadgen.fault_schedule import Fault
from prfaas_jax.serving.transport.kernel_link import KernelLinkError, tbf_rate_bytes_per_s
from prfaas_jax.serving.transport.lifecycle import write_json
from prfaas_jax.serving.transport.server import health_status

LOSS_BURST = WanControl(loss=0.2, loss_burst=8.0)
BLACKHOLE = WanControl(blackhole=True)
RTT_FACTOR = 10.0
RATE_FACTOR = 0.1
APPLY_WAIT_S = 5.0  # how long a link fault waits for the delay line to apply it
BUSY_WAIT_S = 3.0  # how long a kill or stop waits for its target to hold requests
RECOVER_WAIT_S = 90.0  # a replacement on a busy machine can take this long to serve
CONNECT = """
import socket, sys, time
start = time.perf_counter()
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30).close()
print(time.perf_counter() - start)
"""


class FrontDoorHandle(Protocol):
    """The HTTP front door as the injector sees it (serving/loadgen/soak_frontdoor.py): its
    pid, how many have started, its exit, and whether a later one serves."""

    starts: int

    @property
    def pid(self) -> int | None: ...

    def wait_exit(self, timeout_s: float) -> int | None: ...

    def wait_serving(self, after_starts: int, timeout_s: float) -> bool: ...


@dataclasses.dataclass
class Injection:
    kind: str
    at_s: float  # when it was applied, from the start of arrivals
    end_s: float = 0.0  # when it was undone (a kill: when the process was gone)
    target: str = ""
    pid: int | None = None
    injected: bool = False
    detected: bool = False
    recovered: bool | None = None  # None: judged from the requests after the run
    recovered_s: float | None = None  # since end_s
    detail: dict = dataclasses.field(default_factory=dict)


class FaultRunner(threading.Thread):
    """Apply `faults` in time order from `start` (monotonic) until done or `stop`. `busy()`
    gives each worker's requests in hand (the router's stats); `load(kind)` sends requests that
    a fault of that kind will catch in flight."""

    def __init__(
        self,
        cluster: ClusterProcesses,
        faults: list[Fault],
        *,
        seed: int,
        frontdoor: FrontDoorHandle,
        busy: Callable[[], dict[str, int]],
        load: Callable[[str], None],
    ) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.cluster, self.faults, self.rng = cluster, faults, random.Random(seed + 2)
        self.frontdoor, self.busy, self.load = frontdoor, busy, load
        self.stop = threading.Event()
        self.injections: list[Injection] = []
        self.start_time = 0.0
        self._stopped: list[int] = []  # pids SIGSTOPped and not yet continued
        self._child: ChildProcess | None = None  # the process last signalled
        assert cluster.ready is not None and cluster.topology is not None
        self.topology = cluster.topology
        self.link = cluster.config.link

    def now(self) -> float:
        return time.monotonic() - self.start_time

    def run(self) -> None:
        try:
            for fault in self.faults:
                if self.stop.wait(max(self.start_time + fault.at_s - time.monotonic(), 0.0)):
                    return
                injection = Injection(fault.kind, round(self.now(), 2))
                self.injections.append(injection)
                action, _, role = fault.kind.partition(":")
                handler = getattr(self, f"_{action}")
                handler(injection, fault, *([role] if role else []))
        finally:
            self.undo()

    def _hold(self, injection: Injection, fault: Fault) -> None:
        """Until the fault has held for its time since it was applied (or `stop`)."""
        self.stop.wait(max(self.start_time + injection.at_s + fault.hold_s - time.monotonic(), 0))

    def undo(self) -> None:
        """Continue what is stopped, restore the link (also after an interruption)."""
        for pid in self._stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped.clear()
        self._control(WanControl())
        with contextlib.suppress(KernelLinkError):  # the namespaces are going away
            self.topology.set_rate(self.link.bandwidth_bytes_per_s)

    # ---- the link ----

    def _control(self, control: WanControl) -> bool:
        """Hand the delay line ``control``; whether it applied it within APPLY_WAIT_S (it
        re-reads its control file five times a second)."""
        fields = {k: v for k, v in dataclasses.asdict(control).items() if v not in (None, False)}
        write_json(self.cluster.wan_control_file, fields)
        applied = applied_path(self.cluster.wan_control_file)
        deadline = time.monotonic() + APPLY_WAIT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(applied.read_text()) == fields:
                    return True
            time.sleep(0.02)
        return False

    def _wan_counter(self, name: str) -> int:
        try:
            stats = json.loads((self.cluster.log_dir / "wan-stats.json").read_text())
        except (OSError, ValueError):
            return 0
        return sum(stats[way].get(name, 0) for way in ("forward", "backward"))

    def _hold_link(self, injection: Injection, fault: Fault, control: WanControl, counter: str):
        before = self._wan_counter(counter)
        injection.injected = self._control(control)
        self._hold(injection, fault)
        self._control(WanControl())
        injection.end_s = round(self.now(), 2)
        self.stop.wait(1.5)  # the delay line writes its counters once a second
        injection.detail[counter] = self._wan_counter(counter) - before
        injection.detected = injection.detail[counter] > 0

    def _loss_burst(self, injection: Injection, fault: Fault) -> None:
        self._hold_link(injection, fault, LOSS_BURST, "lost")

    def _blackhole(self, injection: Injection, fault: Fault) -> None:
        self._hold_link(injection, fault, BLACKHOLE, "blackholed")

    def _rtt_spike(self, injection: Injection, fault: Fault) -> None:
        spiked = RTT_FACTOR * self.link.one_way_delay_s
        injection.injected = self._control(WanControl(delay_s=spiked))
        rtt = self._connect_s()
        self._hold(injection, fault)
        self._control(WanControl())
        injection.end_s = round(self.now(), 2)
        injection.detail = {"rtt_s": rtt, "spiked_rtt_s": 2 * spiked}
        injection.detected = rtt is not None and rtt >= 0.8 * 2 * spiked

    def _connect_s(self) -> float | None:
        """One TCP connect from the PrfaaS namespace to a PD worker's port, timed."""
        ready = self.cluster.ready
        assert ready is not None
        address = next(w["address"] for w in ready["workers"].values() if w["role"] == "pd_decode")
        host, port = address.rsplit(":", 1)
        argv = [*self.topology.exec_prefix(True), sys.executable, "-c", CONNECT, host, port]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
            return float(out.stdout)
        except (subprocess.SubprocessError, ValueError):
            return None

    def _bandwidth_drop(self, injection: Injection, fault: Fault) -> None:
        rate = self.link.bandwidth_bytes_per_s
        self.topology.set_rate(RATE_FACTOR * rate)
        injection.injected = True
        namespace = self.topology.prfaas_ns
        read = tbf_rate_bytes_per_s(LINK_DEVICE, namespace=namespace)
        self._hold(injection, fault)
        self.topology.set_rate(rate)
        injection.end_s = round(self.now(), 2)
        injection.detail = {"rate_read_bytes_per_s": read}
        injection.detected = abs(read - RATE_FACTOR * rate) <= 0.02 * RATE_FACTOR * rate

    # ---- the processes ----

    def _pick(self, role: str) -> tuple[str, int] | None:
        """An instance of ``role`` that is up (not being replaced) and its pid: the one with
        the most requests in hand, waiting up to BUSY_WAIT_S for one that has any."""
        ready = self.cluster.ready
        assert ready is not None
        names = [n for n, w in ready["workers"].items() if w["role"] == role]
        self.rng.shuffle(names)
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            held = self.busy()
            if any(held.get(n, 0) for n in names) or time.monotonic() > deadline:
                break
            if self.stop.wait(0.1):
                break
        for name in sorted(names, key=lambda n: -held.get(n, 0)):
            pid = self.cluster.worker_pid(name)
            if pid is not None and pid == ready["workers"][name]["pid"]:
                return name, pid
        return None

    def _signal_worker(self, injection: Injection, role: str, sig: signal.Signals) -> bool:
        picked = self._pick(role)
        if picked is None:
            injection.detail["skipped"] = "no instance of the role serving"
            return False
        injection.target, injection.pid = picked
        injection.detail["requests_in_hand"] = self.busy().get(injection.target, 0)
        children = list(self.cluster.children)
        self._child = next((c for c in children if c.popen.pid == injection.pid), None)
        try:
            os.kill(injection.pid, sig)
        except ProcessLookupError:
            return False
        injection.injected = True
        return True

    def _replaced(self, injection: Injection) -> None:
        """Detected: the launcher saw the process exit; recovered: its replacement serves."""
        ready, name, pid = self.cluster.ready, injection.target, injection.pid
        assert ready is not None
        deadline = time.monotonic() + RECOVER_WAIT_S
        while pid in self.cluster.instance_pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        injection.end_s = round(self.now(), 2)
        injection.detected = pid not in self.cluster.instance_pids(name)
        while ready["workers"][name]["pid"] == pid and time.monotonic() < deadline:
            if self.stop.wait(0.1):
                break
        if ready["workers"][name]["pid"] != pid:
            injection.recovered = True
            injection.recovered_s = round(self.now() - injection.end_s, 2)
        else:
            injection.recovered = False

    def _sigkill(self, injection: Injection, fault: Fault, role: str) -> None:
        if self._signal_worker(injection, role, signal.SIGKILL):
            self._replaced(injection)

    def _sigterm(self, injection: Injection, fault: Fault, role: str) -> None:
        if role == "frontdoor":
            self._sigterm_frontdoor(injection)
            return
        self.load(fault.kind)
        if self._signal_worker(injection, role, signal.SIGTERM):
            self._replaced(injection)
            if self._child is not None:
                injection.detail["exit_status"] = self._child.popen.returncode

    def _sigstop(self, injection: Injection, fault: Fault, role: str) -> None:
        if not self._signal_worker(injection, role, signal.SIGSTOP):
            return
        self._stopped.append(injection.pid)
        ready = self.cluster.ready
        assert ready is not None
        address = ready["workers"][injection.target]["address"]
        security = self.cluster.peer_security
        self.stop.wait(1.0)
        seen = health_status(address, 1.0, security_section=security)
        injection.detected = seen != "SERVING"
        injection.detail["health_while_stopped"] = seen
        self._hold(injection, fault)
        os.kill(injection.pid, signal.SIGCONT)
        self._stopped.remove(injection.pid)
        injection.end_s = round(self.now(), 2)
        deadline = time.monotonic() + RECOVER_WAIT_S
        while time.monotonic() < deadline and not self.stop.is_set():
            if health_status(address, 2.0, security_section=security) == "SERVING":
                injection.recovered = True
                injection.recovered_s = round(self.now() - injection.end_s, 2)
                return
            time.sleep(0.2)
        injection.recovered = False

    def _sigterm_frontdoor(self, injection: Injection) -> None:
        self.load("sigterm:frontdoor")
        self.stop.wait(0.5)  # the requests reach the front door and start streaming
        pid, starts = self.frontdoor.pid, self.frontdoor.starts
        if pid is None:
            injection.detail["skipped"] = "no front door running"
            return
        injection.target, injection.pid = "frontdoor", pid
        os.kill(pid, signal.SIGTERM)
        injection.injected = True
        status = self.frontdoor.wait_exit(30.0)
        injection.end_s = round(self.now(), 2)
        injection.detected = status is not None
        injection.detail["exit_status"] = status
        injection.recovered = self.frontdoor.wait_serving(starts, RECOVER_WAIT_S)
        if injection.recovered:
            injection.recovered_s = round(self.now() - injection.end_s, 2)
