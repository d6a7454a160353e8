"""Two datacenters on one box: `NetnsTopology` puts the PrfaaS cluster and the PD cluster in
network namespaces of their own, joined by a veth pair that the kernel shapes.

    root namespace (launcher, router, clients)
      ├── veth pf<k>p ── <prefix>-pf: PrfaaS workers, host 198.18.k.2
      ├── veth pf<k>d ── <prefix>-pd:  PD workers,     host 198.18.k.3
      └── (routes to both hosts)
    <prefix>-pf  link0 ═══ tbf ═══▶ link0  <prefix>-pd       (198.19.k.9/30 ↔ .10/30)

Each cluster namespace has one host address (a /32 on its loopback) that every server in it
binds, the way a machine has one address; routes send PrfaaS → PD traffic over the `link0`
pair, whose PrfaaS end has a `tbf` root qdisc at the configured rate
(serving/transport/kernel_link.py), and the router's traffic over the unshaped pairs to the
root namespace. Addresses come from the 198.18.0.0/15 benchmarking range (RFC 2544), one /24 of
each half per cluster (`k`, 0-255, the lowest free). Names carry the launcher's pid:
`prfaas-<pid>-<k>-pf|pd`; a start first deletes the namespaces of launchers that no longer run
(a run that was killed), and `close` deletes its own (their veths go with them). Everything
here needs root (CAP_NET_ADMIN) and the `ip` and `tc` tools: `require_netns` says in one line
what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from prfaas_jax.errors import UserError
from prfaas_jax.serving.transport.kernel_link import (
    KernelLinkError,
    device_bytes,
    run_ip,
    set_tbf,
)

PREFIX = "prfaas-"
LINK_DEVICE = "link0"  # the shaped veth, the same name in both cluster namespaces
_NAME = re.compile(r"^prfaas-(\d+)-(\d+)-(pf|pd)$")
_LOCK = Path("/run/lock/prfaas-netns.lock") if Path("/run/lock").is_dir() else None


def require_netns() -> None:
    """A one-line `UserError` unless this process can build namespaces."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"--netns needs the {' and '.join(missing)} command(s) (iproute2)")
    if os.geteuid() != 0:
        raise UserError("--netns needs root (CAP_NET_ADMIN) to create network namespaces")


def _namespaces() -> list[str]:
    out = run_ip("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def remove_stale() -> list[str]:
    """Delete the namespaces (and veths) of launchers that are gone; returns their names."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not _alive(int(match[1])):
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

    @property
    def prfaas_ns(self) -> str:
        return f"{PREFIX}{self.owner_pid}-{self.index}-pf"

    @property
    def pd_ns(self) -> str:
        return f"{PREFIX}{self.owner_pid}-{self.index}-pd"

    @property
    def prfaas_host(self) -> str:
        return f"198.18.{self.index}.2"

    @property
    def pd_host(self) -> str:
        return f"198.18.{self.index}.3"

    def _link(self, suffix: int) -> str:
        return f"198.19.{self.index}.{suffix}"

    @classmethod
    def create(cls, link_rate_bytes_per_s: float) -> NetnsTopology:
        """Clean up after dead launchers, pick a free index and build the topology."""
        require_netns()
        with _allocation_lock():
            remove_stale()
            used = {int(m[2]) for n in _namespaces() if (m := _NAME.match(n))}
            used |= {k for k in range(256) if Path(f"/sys/class/net/{root_devices(k)[0]}").exists()}
            free = [k for k in range(256) if k not in used]
            if not free:
                raise UserError("--netns: 256 clusters already run on this machine")
            topology = cls(free[0], os.getpid(), link_rate_bytes_per_s)
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
        # The inter-cluster pair, made in both namespaces at once.
        run_ip(
            "ip", "link", "add", LINK_DEVICE, "netns", pf, "type", "veth",
            "peer", LINK_DEVICE, "netns", pd,
        )  # fmt: skip
        for ns, suffix in ((pf, 9), (pd, 10)):
            run_ip(
                "ip", "addr", "add", f"{self._link(suffix)}/30", "dev", LINK_DEVICE, namespace=ns
            )
            run_ip("ip", "link", "set", LINK_DEVICE, "up", namespace=ns)
        # Host routes: cluster ↔ cluster over link0, cluster → root namespace over up0, each
        # leaving from the namespace's host address.
        routes = (
            (pf, self.pd_host, self._link(10), self.prfaas_host),
            (pd, self.prfaas_host, self._link(9), self.pd_host),
        )
        for ns, dest, via, src in routes:
            run_ip("ip", "route", "add", f"{dest}/32", "via", via, "src", src, namespace=ns)
        set_tbf(LINK_DEVICE, self.link_rate_bytes_per_s, namespace=pf, add=True)

    def exec_prefix(self, prfaas: bool) -> list[str]:
        """The argv prefix that runs a command inside the PrfaaS (or PD) namespace."""
        return ["ip", "netns", "exec", self.prfaas_ns if prfaas else self.pd_ns]

    def set_rate(self, rate_bytes_per_s: float) -> None:
        """Reshape the inter-cluster link while the cluster runs."""
        set_tbf(LINK_DEVICE, rate_bytes_per_s, namespace=self.prfaas_ns, add=False)

    def link_tx_bytes(self) -> int:
        """Bytes the kernel sent from the PrfaaS end of the inter-cluster link."""
        return device_bytes(LINK_DEVICE, namespace=self.prfaas_ns)[0]

    def describe(self) -> dict:
        return {
            "prfaas_namespace": self.prfaas_ns,
            "pd_namespace": self.pd_ns,
            "prfaas_host": self.prfaas_host,
            "pd_host": self.pd_host,
            "link_device": LINK_DEVICE,
            "link_rate_bytes_per_s": self.link_rate_bytes_per_s,
        }

    def close(self) -> None:
        """Delete both namespaces (their veths, and the root routes through them, go too)."""
        _delete(self.index, [self.prfaas_ns, self.pd_ns])


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
