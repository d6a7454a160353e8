"""The inter-cluster link shaped by the kernel: `KernelLink` (a `tbf` qdisc on a veth) and the
`tc` / `ip` helpers around it.

Under `prfaas serve --netns` (serving/cluster/netns.py) the PrfaaS cluster's traffic to the PD
cluster leaves through one veth whose root qdisc is a token bucket filter: the kernel, not the
sender, holds the rate, and the bytes are real TCP segments that the veth counts. The kernel of
the machines this runs on has no `netem`, so propagation delay stays in user space (the
sender's `LinkShaper`, with an unlimited rate and the configured latency).

`tbf` needs a bucket at least as large as the biggest packet it is handed: a veth passes GSO
segments of up to 64 KiB, so `tbf_burst_bytes` never goes below that (a smaller bucket stalls
the connection, the classic loopback-MTU pitfall), and grows with the rate to about 4 ms of it.

`tcp_segments` reads the namespace's TCP counters: retransmissions are the link's congestion
signal (serving/router/control.py feeds them to the threshold controller).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

GSO_MAX_BYTES = 64 * 1024


class KernelLinkError(RuntimeError):
    """An `ip` or `tc` command failed; the message quotes it and what it printed."""


def run_ip(*argv: str, namespace: str | None = None) -> str:
    """Run ``ip``/``tc`` ``argv`` (in ``namespace`` if given); its stdout, or `KernelLinkError`."""
    command = list(argv)
    if namespace is not None:
        command = [command[0], "-n", namespace, *command[1:]]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelLinkError(f"{' '.join(command)}: {err}") from None
    if done.returncode != 0:
        raise KernelLinkError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def tbf_burst_bytes(rate_bytes_per_s: float) -> int:
    return max(GSO_MAX_BYTES * 2, int(rate_bytes_per_s * 0.004))


def set_tbf(device: str, rate_bytes_per_s: float, *, namespace: str | None, add: bool) -> None:
    """Make (``add``) or change ``device``'s root qdisc a `tbf` at ``rate_bytes_per_s``."""
    if not rate_bytes_per_s > 0:
        raise ValueError(f"a link rate must be positive, got {rate_bytes_per_s}")
    rate_bit = max(int(rate_bytes_per_s * 8), 8)
    burst = tbf_burst_bytes(rate_bytes_per_s)
    verb = "add" if add else "change"
    # latency: how long a packet may wait in the bucket's queue before it is dropped; TCP backs
    # off long before a second of queue builds up.
    run_ip(
        "tc", "qdisc", verb, "dev", device, "root", "tbf",
        "rate", f"{rate_bit}bit", "burst", str(burst), "latency", "1s",
        namespace=namespace,
    )  # fmt: skip


def tbf_rate_bytes_per_s(device: str, *, namespace: str | None) -> float:
    """The rate of ``device``'s root `tbf`, from ``tc -j``."""
    for qdisc in json.loads(
        run_ip("tc", "-j", "qdisc", "show", "dev", device, namespace=namespace)
    ):
        if qdisc.get("kind") == "tbf" and qdisc.get("root"):
            return float(qdisc["options"]["rate"])
    raise KernelLinkError(f"{device} has no root tbf qdisc")


def device_bytes(device: str, *, namespace: str | None) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` the kernel counted on ``device``."""
    [link] = json.loads(
        run_ip("ip", "-j", "-s", "link", "show", "dev", device, namespace=namespace)
    )
    stats = link["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def tcp_segments(snmp: str = "/proc/net/snmp") -> tuple[int, int]:
    """``(OutSegs, RetransSegs)``: TCP segments this process's network namespace has sent and
    retransmitted, from the kernel's counters (``/proc/net/snmp`` is per namespace, so in a
    PrfaaS namespace of its own they count the link's traffic only). `KernelLinkError` when
    the file cannot be read or parsed."""
    try:
        with open(snmp) as fh:
            names, values = [line.split() for line in fh if line.startswith("Tcp:")]
        counters = dict(zip(names[1:], values[1:], strict=True))
        return int(counters["OutSegs"]), int(counters["RetransSegs"])
    except (OSError, ValueError, KeyError) as err:
        raise KernelLinkError(f"cannot read the TCP counters in {snmp}: {err}") from None


class KernelLink:
    """One PrfaaS worker's view of the kernel-shaped link: its share of the `tbf` rate (read
    back at most every `cache_s`, so a change made by anyone shows), and `set_rate`."""

    def __init__(self, device: str, share: int, *, cache_s: float = 0.5) -> None:
        self.device, self.share, self.cache_s = device, max(share, 1), cache_s
        self._lock = threading.Lock()
        self._rate, self._read_at = 0.0, -float("inf")

    def rate(self) -> float:
        """This worker's share of the link rate, bytes/s (0.0 if the qdisc cannot be read)."""
        with self._lock:
            now = time.monotonic()
            if now - self._read_at > self.cache_s:
                try:
                    self._rate = tbf_rate_bytes_per_s(self.device, namespace=None)
                except KernelLinkError:
                    self._rate = 0.0
                self._read_at = now
            return self._rate / self.share

    def set_rate(self, share_bytes_per_s: float) -> None:
        """Shape the whole link to ``share × share_bytes_per_s`` (a worker's share, as `SetLink`
        gives it for the in-process shaper)."""
        with self._lock:
            set_tbf(self.device, share_bytes_per_s * self.share, namespace=None, add=False)
            self._read_at = -float("inf")
