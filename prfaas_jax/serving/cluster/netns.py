"""Two datacenters on one box: `NetnsTopology` puts the PrfaaS cluster and the PD cluster in
network namespaces of their own, joined by a link that the kernel shapes.

    root namespace (launcher, router, clients)
      ├── veth pf<k>p ── <prefix>-pf: PrfaaS workers, host 198.18.k.2
      ├── veth pf<k>d ── <prefix>-pd:  PD workers,     host 198.18.k.3
      └── (routes to both hosts)
    <prefix>-pf  link0 ═══ tbf ═══▶ link0  <prefix>-pd                 (198.19.k.9/30 ↔ .10/30)

or, when the link is asked for a round trip, jitter or loss (`[link] rtt_ms`, `jitter_ms`,
`loss_percent`: `LinkSection.in_packets`), through a third namespace whose delay line holds
every packet that crosses (serving/cluster/wan.py):

    <prefix>-pf  link0 ═══ tbf ═══▶ wpf  <prefix>-wan  wpd ══▶ link0  <prefix>-pd
                                          └── wtun ⇄ delay line ──┘
                                 (198.19.k.9/30 ↔ .10/30, 198.19.k.14/30 ↔ .13/30)

Each cluster namespace has one host address (a /32 on its loopback) that every server in it
binds, the way a machine has one address; routes send PrfaaS → PD traffic over `link0`, whose
PrfaaS end has a `tbf` root qdisc at the configured rate (serving/transport/kernel_link.py), and
the router's traffic over the unshaped pairs to the root namespace. In the WAN namespace two
policy rules send whatever arrives from either cluster to the TUN device `wtun`; the delay line
reads it there and writes it back when its time comes, and the main table forwards it on — so
the rate stays in the kernel, before the delay, and TCP sees both. Addresses come from the
198.18.0.0/15 benchmarking range (RFC 2544), one /24 of each half per cluster (`k`, 0-255, the
lowest free). Names carry the launcher's pid: `prfaas-<pid>-<k>-pf|pd|wan`; a start first deletes
the namespaces of launchers that no longer run (a run that was killed) and kills what still runs
in them, and `close` deletes its own (their veths and the TUN device go with them). Everything
here needs root (CAP_NET_ADMIN) and the `ip` and `tc` tools, and the WAN a TUN device
(`/dev/net/tun`): `require_netns` says in one line what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster.processes import pid_alive
from prfaas_jax.serving.cluster_sections import LinkSection
from prfaas_jax.serving.transport.kernel_link import (
    KernelLinkError,
    device_bytes,
    run_ip,
    set_tbf,
)
from prfaas_jax.serving.transport.link import schedule_factor

log = logging.getLogger("prfaas.netns")
PREFIX = "prfaas-"
LINK_DEVICE = "link0"  # the shaped veth, the same name in both cluster namespaces
WAN_TUN = "wtun"  # the delay line's TUN device, in the WAN namespace
_NAME = re.compile(r"^prfaas-(\d+)-(\d+)-(pf|pd|wan)$")
# The delay line's queue into user space: deep enough for a burst at the link's rate; the
# default 500 packets drops segments at a few hundred Mbit/s before the delay line sees them.
_TUN_QUEUE = 10_000
_LOCK = Path("/run/lock/prfaas-netns.lock") if Path("/run/lock").is_dir() else None


def require_netns(*, wan: bool = False) -> None:
    """A one-line `UserError` unless this process can build namespaces (and, with ``wan``, the
    delay line's TUN device)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"--netns needs the {' and '.join(missing)} command(s) (iproute2)")
    if os.geteuid() != 0:
        raise UserError("--netns needs root (CAP_NET_ADMIN) to create network namespaces")
    if wan and not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        raise UserError(
            "--netns with [link] rtt_ms, jitter_ms or loss_percent needs TUN devices "
            "(/dev/net/tun) for its delay line"
        )


def _namespaces() -> list[str]:
    out = run_ip("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def root_devices(index: int) -> tuple[str, str]:
    """The root-namespace ends of cluster ``index``'s veths (to the PrfaaS and the PD side)."""
    return f"pf{index}p", f"pf{index}d"


def _delete(index: int, namespaces: list[str]) -> None:
    # The root ends first: deleting a device removes its pair at once, while a deleted
    # namespace releases its devices asynchronously.
    for device in root_devices(index):
        with contextlib.suppress(KernelLinkError):
            run_ip("ip", "link", "del", device)
    for name in namespaces:
        with contextlib.suppress(KernelLinkError):
            run_ip("ip", "netns", "del", name)


def namespace_pids(name: str) -> list[int]:
    """The processes that run in namespace ``name``."""
    try:
        return [int(pid) for pid in run_ip("ip", "netns", "pids", name).split()]
    except KernelLinkError:
        return []


def remove_stale() -> list[str]:
    """Delete the namespaces (and veths) of launchers that are gone, with any process still in
    them (one stopped with SIGSTOP when its launcher was killed never acts on the death signal
    it was sent); returns their names."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not pid_alive(int(match[1])):
            for pid in namespace_pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _delete(int(match[2]), [name])
            removed.append(name)
    return removed


def owned_namespaces(pid: int) -> list[str]:
    """The namespaces launcher ``pid`` made (tests check that none outlive their cluster)."""
    return [n for n in _namespaces() if (m := _NAME.match(n)) and int(m[1]) == pid]


@dataclass(frozen=True)
class NetnsTopology:
    index: int
    owner_pid: int
    link_rate_bytes_per_s: float
    wan: bool = False  # a WAN namespace with a delay line sits between the clusters

    @property
    def prfaas_ns(self) -> str:
        return f"{PREFIX}{self.owner_pid}-{self.index}-pf"

    @property
    def pd_ns(self) -> str:
        return f"{PREFIX}{self.owner_pid}-{self.index}-pd"

    @property
    def wan_ns(self) -> str:
        return f"{PREFIX}{self.owner_pid}-{self.index}-wan"

    @property
    def prfaas_host(self) -> str:
        return f"198.18.{self.index}.2"

    @property
    def pd_host(self) -> str:
        return f"198.18.{self.index}.3"

    def _link(self, suffix: int) -> str:
        return f"198.19.{self.index}.{suffix}"

    @classmethod
    def create(cls, link_rate_bytes_per_s: float, *, wan: bool = False) -> NetnsTopology:
        """Clean up after dead launchers, pick a free index and build the topology (``wan``:
        with the WAN namespace between the clusters)."""
        require_netns(wan=wan)
        with _allocation_lock():
            remove_stale()
            used = {int(m[2]) for n in _namespaces() if (m := _NAME.match(n))}
            used |= {k for k in range(256) if Path(f"/sys/class/net/{root_devices(k)[0]}").exists()}
            free = [k for k in range(256) if k not in used]
            if not free:
                raise UserError("--netns: 256 clusters already run on this machine")
            topology = cls(free[0], os.getpid(), link_rate_bytes_per_s, wan)
            try:
                topology._build()
            except KernelLinkError as err:
                topology.close()
                raise UserError(f"--netns: cannot build the namespaces: {err}") from None
        return topology

    def _build(self) -> None:
        pf, pd = self.prfaas_ns, self.pd_ns
        for ns, host in ((pf, self.prfaas_host), (pd, self.pd_host)):
            run_ip("ip", "netns", "add", ns)
            run_ip("ip", "link", "set", "lo", "up", namespace=ns)
            run_ip("ip", "addr", "add", f"{host}/32", "dev", "lo", namespace=ns)
        # Root namespace ↔ each cluster (unshaped): root end .1/.5, cluster end .2/.6.
        to_pf, to_pd = root_devices(self.index)
        for ns, root_dev, base in ((pf, to_pf, 0), (pd, to_pd, 4)):
            run_ip("ip", "link", "add", root_dev, "type", "veth", "peer", "up0", "netns", ns)
            run_ip("ip", "addr", "add", f"{self._link(base + 1)}/30", "dev", root_dev)
            run_ip("ip", "link", "set", root_dev, "up")
            run_ip("ip", "addr", "add", f"{self._link(base + 2)}/30", "dev", "up0", namespace=ns)
            run_ip("ip", "link", "set", "up0", "up", namespace=ns)
        run_ip("ip", "route", "add", f"{self.prfaas_host}/32", "via", self._link(2))
        run_ip("ip", "route", "add", f"{self.pd_host}/32", "via", self._link(6))
        if self.wan:
            self._build_wan()
        else:
            # The inter-cluster pair, made in both namespaces at once.
            run_ip(
                "ip", "link", "add", LINK_DEVICE, "netns", pf, "type", "veth",
                "peer", LINK_DEVICE, "netns", pd,
            )  # fmt: skip
            for ns, suffix in ((pf, 9), (pd, 10)):
                run_ip(
                    "ip", "addr", "add", f"{self._link(suffix)}/30", "dev", LINK_DEVICE,
                    namespace=ns,
                )  # fmt: skip
                run_ip("ip", "link", "set", LINK_DEVICE, "up", namespace=ns)
            # Host routes: cluster ↔ cluster over link0, cluster → root namespace over up0,
            # each leaving from the namespace's host address.
            routes = (
                (pf, self.pd_host, self._link(10), self.prfaas_host),
                (pd, self.prfaas_host, self._link(9), self.pd_host),
            )
            for ns, dest, via, src in routes:
                run_ip("ip", "route", "add", f"{dest}/32", "via", via, "src", src, namespace=ns)
        set_tbf(LINK_DEVICE, self.link_rate_bytes_per_s, namespace=pf, add=True)

    def _build_wan(self) -> None:
        """The clusters' link0 ends to the WAN namespace, and its policy routes through the
        delay line's TUN device (module docstring)."""
        pf, pd, wan = self.prfaas_ns, self.pd_ns, self.wan_ns
        run_ip("ip", "netns", "add", wan)
        run_ip("ip", "link", "set", "lo", "up", namespace=wan)
        # link0 (cluster) ↔ wpf / wpd (WAN): 198.19.k.9 ↔ .10 and .13 ↔ .14.
        for ns, wan_dev, here, there in ((pf, "wpf", 9, 10), (pd, "wpd", 13, 14)):
            run_ip(
                "ip", "link", "add", LINK_DEVICE, "netns", ns, "type", "veth",
                "peer", wan_dev, "netns", wan,
            )  # fmt: skip
            run_ip("ip", "addr", "add", f"{self._link(here)}/30", "dev", LINK_DEVICE, namespace=ns)
            run_ip("ip", "link", "set", LINK_DEVICE, "up", namespace=ns)
            run_ip("ip", "addr", "add", f"{self._link(there)}/30", "dev", wan_dev, namespace=wan)
            run_ip("ip", "link", "set", wan_dev, "up", namespace=wan)
        routes = (
            (pf, self.pd_host, self._link(10), self.prfaas_host),
            (pd, self.prfaas_host, self._link(14), self.pd_host),
        )
        for ns, dest, via, src in routes:
            run_ip("ip", "route", "add", f"{dest}/32", "via", via, "src", src, namespace=ns)
        run_ip("ip", "route", "add", f"{self.pd_host}/32", "via", self._link(13), namespace=wan)
        run_ip("ip", "route", "add", f"{self.prfaas_host}/32", "via", self._link(9), namespace=wan)
        run_ip("ip", "tuntap", "add", "dev", WAN_TUN, "mode", "tun", namespace=wan)
        run_ip("ip", "link", "set", WAN_TUN, "txqueuelen", str(_TUN_QUEUE), "up", namespace=wan)
        # Whatever comes in from a cluster goes to the delay line; what it writes back comes in
        # on wtun and follows the main table on to the other cluster.
        run_ip("ip", "route", "add", "default", "dev", WAN_TUN, "table", "100", namespace=wan)
        for pref, device in ((100, "wpf"), (101, "wpd")):
            run_ip(
                "ip", "rule", "add", "iif", device, "lookup", "100", "pref", str(pref),
                namespace=wan,
            )  # fmt: skip
        # Forward between the veths and the TUN device; reverse-path filtering would drop the
        # packets the delay line writes back (they come in on wtun, their source is elsewhere).
        for key, value in (
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
            (f"net.ipv4.conf.{WAN_TUN}.rp_filter", "0"),
        ):
            run_ip("ip", "netns", "exec", wan, "sysctl", "-qw", f"{key}={value}")

    def wan_argv(self) -> list[str]:
        """The delay line's own arguments (serving/cluster/wan.py): its device and which way
        is forward."""
        return ["--tun", WAN_TUN, "--forward-dest", self.pd_host]

    def exec_prefix(self, prfaas: bool) -> list[str]:
        """The argv prefix that runs a command inside the PrfaaS (or PD) namespace."""
        return ["ip", "netns", "exec", self.prfaas_ns if prfaas else self.pd_ns]

    def set_rate(self, rate_bytes_per_s: float) -> None:
        """Reshape the inter-cluster link while the cluster runs."""
        set_tbf(LINK_DEVICE, rate_bytes_per_s, namespace=self.prfaas_ns, add=False)

    def follow_schedule(self, link: LinkSection, start: float, stop: threading.Event) -> None:
        """Reshape the link along ``link.schedule`` (bandwidth × factor(t), t in seconds from
        the monotonic time ``start``; the in-process `LinkShaper` and the simulator read the same
        schedule) until ``stop``; a rate set meanwhile by `SetLink` holds until the next step.
        Runs on a thread of the launcher's."""
        while not stop.is_set():
            factor, next_offset = schedule_factor(
                link.schedule, link.repeat_s, time.monotonic() - start
            )
            try:
                self.set_rate(link.bandwidth_bytes_per_s * factor)
            except KernelLinkError as err:
                if stop.is_set():
                    return  # the namespaces are going away
                log.warning("link schedule: %s", err)
            if math.isinf(next_offset):
                return
            stop.wait(max(start + next_offset - time.monotonic(), 0.0))

    def link_tx_bytes(self) -> int:
        """Bytes the kernel sent from the PrfaaS end of the inter-cluster link."""
        return device_bytes(LINK_DEVICE, namespace=self.prfaas_ns)[0]

    def wan_exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.wan_ns]

    def describe(self) -> dict:
        return {
            "prfaas_namespace": self.prfaas_ns,
            "pd_namespace": self.pd_ns,
            "wan_namespace": self.wan_ns if self.wan else None,
            "prfaas_host": self.prfaas_host,
            "pd_host": self.pd_host,
            "link_device": LINK_DEVICE,
            "link_rate_bytes_per_s": self.link_rate_bytes_per_s,
        }

    def close(self) -> None:
        """Delete the namespaces (their veths, the TUN device and the root routes through them
        go too)."""
        _delete(self.index, [self.prfaas_ns, self.pd_ns, *([self.wan_ns] if self.wan else [])])


@contextlib.contextmanager
def _allocation_lock():
    """Serialise index allocation between launchers starting at the same time."""
    if _LOCK is None:
        yield
        return
    with _LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
