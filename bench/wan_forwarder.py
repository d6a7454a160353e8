"""The delay line's own cost: packets per second and CPU per Gbit/s of serving/cluster/wan.py.

Builds the `--netns` topology with its WAN namespace (root; serving/cluster/netns.py), starts the
delay line with ``--rtt-ms`` and ``--loss-percent``, and sends ``--mib`` MiB of bulk TCP from the
PrfaaS namespace to a listener in the PD namespace, once per ``--rates`` entry (Mbit/s of the
kernel's ``tbf``; 0: no ``tbf``, as fast as the delay line goes). Per run it prints the goodput,
the packets the delay line moved (both directions), its CPU time (user + system, from
/proc/<pid>/stat), the CPU-seconds per Gbit of payload and per million packets, and the TCP
retransmissions the sender counted; then the same as JSON.

    sudo python bench/wan_forwarder.py [--rates 0,100] [--rtt-ms 40] [--loss-percent 0]
                                       [--mib 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prfaas_jax.serving.cluster.netns import LINK_DEVICE, NetnsTopology
from prfaas_jax.serving.transport.kernel_link import set_tbf

SINK = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    while conn.recv(1 << 20):
        pass
    conn.sendall(b"k")
    conn.close()
"""
BULK = """
import socket, sys, time
def retransmitted():
    rows = [l.split() for l in open("/proc/net/snmp") if l.startswith("Tcp:")]
    return int(dict(zip(rows[0][1:], rows[1][1:]))["RetransSegs"])
before = retransmitted()
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk, left = b"x" * (1 << 20), int(sys.argv[3])
start = time.perf_counter()
while left > 0:
    sock.sendall(chunk[:left])
    left -= len(chunk)
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
print(time.perf_counter() - start, retransmitted() - before)
"""
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def in_ns(namespace: str, script: str, *args: object, **popen) -> subprocess.Popen:
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", script, *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)


def run(topology: NetnsTopology, port: str, rate_mbps: float, args, stats: Path) -> dict:
    # The run's own root qdisc: none (the default), or a tbf at the rate.
    subprocess.run(
        ["tc", "-n", topology.prfaas_ns, "qdisc", "del", "dev", LINK_DEVICE, "root"],
        check=False,
        capture_output=True,
    )
    if rate_mbps:
        set_tbf(LINK_DEVICE, rate_mbps * 1e6 / 8, namespace=topology.prfaas_ns, add=True)
    line = subprocess.Popen(
        [
            *topology.wan_exec_prefix(), sys.executable, "-m", "prfaas_jax.serving.cluster.wan",
            *topology.wan_argv(), "--delay-ms", str(args.rtt_ms / 2),
            "--loss-percent", str(args.loss_percent), "--stats-file", str(stats),
        ]
    )  # fmt: skip
    try:
        time.sleep(1.0)
        before = cpu_s(line.pid)
        sender = in_ns(topology.prfaas_ns, BULK, topology.pd_host, port, args.mib * 2**20)
        out, _ = sender.communicate(timeout=600)
        elapsed, retransmitted = out.split()
        used = cpu_s(line.pid) - before
    finally:
        line.terminate()
        line.wait()
    counts = json.loads(stats.read_text())
    packets = counts["forward"]["packets"] + counts["backward"]["packets"]
    gbit = args.mib * 2**20 * 8 / 1e9
    return {
        "tbf_mbps": rate_mbps,
        "goodput_mbps": gbit * 1e3 / float(elapsed),
        "packets": packets,
        "packets_per_s": packets / float(elapsed),
        "cpu_s": used,
        "cpu_s_per_gbit": used / gbit,
        "cpu_s_per_million_packets": used / packets * 1e6,
        "lost": counts["forward"]["lost"] + counts["backward"]["lost"],
        "retransmitted": int(retransmitted),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0,100", help="tbf rates (Mbit/s; 0: none)")
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--loss-percent", type=float, default=0.0)
    parser.add_argument("--mib", type=int, default=32, help="MiB per transfer")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces)")
    try:
        rates = [float(x) for x in args.rates.split(",")]
    except ValueError as err:
        parser.error(f"--rates: {err}")
    topology = NetnsTopology.create(100e6 / 8, wan=True)
    rows, sink = [], None
    try:
        sink = in_ns(topology.pd_ns, SINK, topology.pd_host)
        port = sink.stdout.readline().strip()
        with tempfile.TemporaryDirectory() as tmp:
            rows = [
                run(topology, port, r, args, Path(tmp) / f"{i}.json") for i, r in enumerate(rates)
            ]
    finally:
        if sink is not None:
            sink.kill()
            sink.wait()
        topology.close()
    report = {
        "rtt_ms": args.rtt_ms,
        "loss_percent": args.loss_percent,
        "mib": args.mib,
        "rows": rows,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
    }
    if not args.json:
        print(
            "| tbf (Mbit/s) | goodput (Mbit/s) | packets/s | delay-line CPU (s) | "
            "CPU-s per Gbit | CPU-s per 10⁶ packets | lost | retransmitted |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['tbf_mbps'] or 'none'} | {r['goodput_mbps']:.0f} | "
                f"{r['packets_per_s']:,.0f} | {r['cpu_s']:.2f} | {r['cpu_s_per_gbit']:.2f} | "
                f"{r['cpu_s_per_million_packets']:.1f} | {r['lost']} | {r['retransmitted']} |"
            )
        print()
    print(json.dumps(report, indent=2 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
