"""A bandwidth drop on the real link, against the simulator's run of the same scenario.

1. Starts a fake-engine toy cluster (the states are real codec streams of the ``tiny`` layout,
   the compute a sleep of ``--prefill-s-per-token``) whose ``[link] schedule`` drops the link to
   ``--drop`` of its rate ``--drop-at`` seconds in, for ``--drop-for`` seconds. With ``--netns``
   (root) the link is real TCP between two network namespaces, its rate held by the kernel's
   ``tbf`` and reshaped along the schedule (serving/cluster/netns.py); without it the sender's
   token bucket follows the same schedule. The threshold controller is on.
2. Sends a steady Poisson load (``prfaas bench``'s workload: ``--rate`` requests/s, prompts
   uniform around ``--input-len``) from the start of the schedule, while it polls the router's
   stats every half second: the threshold t, the egress counter, the capacity the router learned
   from the transfers, and the requests finished per route.
3. Replays the same requests, arrival times and lengths through the simulator with the same
   schedule and controller (profiles fitted to the run: bench/sim_inputs.py).
4. Prints, per phase (before, during, after the drop), t, the egress rate against the link's
   capacity, and the share of requests offloaded to PrfaaS, measured and simulated; how long the
   measured egress stayed above the dropped capacity after the drop (the controller's reaction);
   and, with ``--plot FILE``, both traces in one figure (matplotlib).

    python bench/bandwidth_drop.py [--netns] [--rate 8] [--input-len 500] [--drop 0.3]
                                   [--drop-at 40] [--drop-for 60] [--after 50] [--plot FILE]
                                   [--json] [--fixed-t] [--adaptive-wire | --recall]

``--fixed-t`` turns the threshold controller off. ``--adaptive-wire`` runs steps 1–2 twice
instead, every state native and then with the router's ``[wire]`` policy narrowing offloaded
states while the link runs hot, and compares throughput, TTFT P90 and the share narrowed;
``--recall`` does so on the recall model's JAX engines and checks every answer
(bench/wire_comparison.py).

The router's egress counter is what the PrfaaS workers handed to their sockets, so right after
the drop it can run ahead of the link by what the sockets' buffers take in; the kernel then
drains it at the dropped rate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import grpc
from sim_inputs import plan_and_trace, toml_text
from wire_comparison import compare, table

from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.loadgen.bench import BenchOptions, InputDist, run_bench
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.sim.config import load_sim_config
from prfaas_jax.sim.simulator import Simulator

POLL_S = 0.5
WINDOW_S = 4.0  # the controller's utilization window (cluster_config's [controller])
CONTROL_PERIOD_S = 0.5


def cluster_config(root: Path, args: argparse.Namespace, extra: dict | None = None) -> Path:
    """The toy cluster's config under ``root``; ``extra``: sections (name → keys) merged in."""
    schedule = [[args.drop_at, args.drop], [args.drop_at + args.drop_for, 1.0]]
    sections = {
        "model": {"preset": "tiny", "engine": "fake"},
        "engine": {"max_len": 4096, "max_slots": 16, "compile_cache": False},
        "fake": {"prefill_s_per_token": args.prefill_s_per_token, "decode_step_s": 0.005},
        "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1},
        "link": {
            "bandwidth_mbps": args.bandwidth_mbps,
            "latency_ms": 0.0,
            "rtt_ms": args.rtt_ms,
            "schedule": schedule,
        },
        "router": {"threshold": 64.0, "prfaas_max_queue": 64, "control_period_s": CONTROL_PERIOD_S},
        "controller": {
            "enabled": not args.fixed_t,
            "threshold_step": 32,
            "utilization_window_s": WINDOW_S,
        },
        "prefix_cache": {"enabled": False},
    }
    for name, keys in (extra or {}).items():
        sections.setdefault(name, {}).update(keys)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "cluster.toml"
    path.write_text(toml_text(sections))
    return path


class StatsPoller:
    """The router's stats every `POLL_S` on a thread: (seconds since `start`, RouterStats)."""

    def __init__(self, router: str, start: float) -> None:
        self.rows: list[tuple[float, pb.RouterStats]] = []
        self._channel = grpc.insecure_channel(router)
        self._stub = pb_grpc.RouterStub(self._channel)
        self._start, self._stop = start, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            stats = self._stub.GetStats(pb.GetStatsRequest(), timeout=10)
            self.rows.append((time.monotonic() - self._start, stats))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()


def measure(
    root: Path,
    args: argparse.Namespace,
    extra: dict | None = None,
    prompts: list[list[int]] | None = None,
    output_len: int = 4,
    tag: str = "",
    failures: bool = False,
) -> tuple[list, list[dict], dict]:
    """One run: the cluster (``extra`` sections merged into its config) under the schedule, the
    load (``prompts``, one per request, when given) and the router's stats as they went; its
    logs in ``--log-dir``/``tag``. A failed request ends the bench unless ``failures``: then
    its record carries the error."""
    config = cluster_config(root, args, extra)
    logs = Path(args.log_dir) / tag if args.log_dir else root / "logs"
    with ClusterProcesses(config, log_dir=logs, netns=args.netns) as cluster:
        ready = cluster.start()
        # t = 0 of the schedule: the kernel link's is in the ready info; the sender's token
        # bucket starts with its worker, moments before.
        start_unix = ready.get("netns", {}).get("schedule_start_unix_s", time.time())
        start = time.monotonic() - (time.time() - start_unix)
        poller = StatsPoller(ready["router"], start)
        options = BenchOptions(
            router=ready["router"],
            num_prompts=requests(args),
            request_rate=args.rate,
            input_dist=InputDist.UNIFORM,
            input_len=args.input_len,
            range_ratio=0.9,
            output_len=output_len,
            seed=args.seed,
        )
        records, _ = run_bench(options, prompts=prompts)
        poller.stop()
    failed = [r.error for r in records if r.error]
    if failed and not failures:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0]}")
    sent0 = min(r.sent for r in records) - start  # the load's first request on the schedule
    trace = []
    for (t0, a), (t1, b) in zip(poller.rows, poller.rows[1:], strict=False):
        trace.append(
            {
                "time_s": t1,
                "threshold": b.threshold,
                "egress_bytes_per_s": (b.egress_bytes - a.egress_bytes) / (t1 - t0),
                "capacity_bytes_per_s": b.link_capacity_bytes_per_s,
                "prfaas_done": b.requests_prfaas - a.requests_prfaas,
                "pd_done": b.requests_pd - a.requests_pd,
                "rtt_s": b.link_rtt_s,
            }
        )
    return records, trace, {"toy": tomllib.loads(config.read_text()), "sent0": sent0}


def requests(args: argparse.Namespace) -> int:
    """How many requests a run sends: the rate over the whole schedule."""
    return max(int(args.rate * (args.drop_at + args.drop_for + args.after)), 1)


def simulate(root: Path, records: list, toy: dict, sent0: float, args: argparse.Namespace) -> list:
    """The same requests through the simulator: its trace on the schedule's clock."""
    fitted = plan_and_trace(root, records, toy, "drop")
    gbps = args.bandwidth_mbps / 1e3
    sim = {
        "workload": {"arrivals": "trace", "path": str(fitted["trace"])},
        "link": {
            # The trace starts at the first request, `sent0` into the schedule.
            "schedule": [
                [0, gbps],
                [max(args.drop_at - sent0, 0.0), gbps * args.drop],
                [args.drop_at + args.drop_for - sent0, gbps],
            ],
            "rtt_ms": args.rtt_ms,
            "handoff_s": fitted["handoff_s"],
        },
        "router": {"prfaas_max_queue": 64, "control_period_s": CONTROL_PERIOD_S},
        "controller": {"threshold_step": 32, "utilization_window_s": WINDOW_S},
        "report": {"bin_s": POLL_S},
        "deployments.toy": {"prfaas": 1, "pd_prefill": 1, "pd_decode": 1, "threshold": 64.0},
    }
    path = root / "sim-drop.toml"
    path.write_text('plan = "plan-drop.toml"\n' + toml_text(sim))
    config = load_sim_config(path)
    result = Simulator(config, config.deployments[0]).run()
    series = result.series
    rows = []
    for i in range(1, len(series["time_s"])):
        dt = series["time_s"][i] - series["time_s"][i - 1]
        if dt <= 0:
            continue
        rows.append(
            {
                "time_s": series["time_s"][i] + sent0,
                "threshold": series["threshold"][i],
                "egress_bytes_per_s": (series["sent_bytes"][i] - series["sent_bytes"][i - 1]) / dt,
                "capacity_bytes_per_s": series["capacity_gbps"][i] * 1e9 / 8,
            }
        )
    offloaded = [
        (float(result.arrival[k]) + sent0, bool(result.offloaded[k]))
        for k in range(len(result.arrival))
    ]
    return rows, offloaded


def phases(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    end = args.drop_at + args.drop_for
    return [
        ("before", 10.0, args.drop_at),
        ("drop", args.drop_at, end),
        ("after", end, end + args.after),
    ]


def summary(args, trace, sim_trace, records, sim_offloaded, start_offset) -> list[dict]:
    rate = args.bandwidth_mbps * 1e6 / 8
    out = []
    for name, a, b in phases(args):
        capacity = rate * (args.drop if name == "drop" else 1.0)
        measured = [row for row in trace if a <= row["time_s"] < b]
        simulated = [row for row in sim_trace if a <= row["time_s"] < b]
        sent = [r for r in records if a <= r.sent - start_offset < b]
        sim_sent = [off for at, off in sim_offloaded if a <= at < b]
        out.append(
            {
                "phase": name,
                "from_s": a,
                "to_s": b,
                "link_bytes_per_s": capacity,
                "measured_threshold_mean": _mean(r["threshold"] for r in measured),
                "simulated_threshold_mean": _mean(r["threshold"] for r in simulated),
                "measured_egress_bytes_per_s": _mean(r["egress_bytes_per_s"] for r in measured),
                "simulated_egress_bytes_per_s": _mean(r["egress_bytes_per_s"] for r in simulated),
                "measured_prfaas_share": _mean(r.route == "prfaas" for r in sent),
                "simulated_prfaas_share": _mean(sim_sent),
            }
        )
    return out


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def reaction(args: argparse.Namespace, trace: list[dict]) -> dict[str, float]:
    """How the controller met the drop: ``first_rise_s``, from the drop until t first rose;
    ``over_s``, for how long during the drop the egress, averaged over the controller's own
    utilization window (a half-second poll alone swings with the sockets' buffers), was above
    the dropped capacity; ``last_over_s``, from the drop until the end of the last such
    window (0.0: never)."""
    limit = args.bandwidth_mbps * 1e6 / 8 * args.drop
    end = args.drop_at + args.drop_for
    during = [row for row in trace if args.drop_at <= row["time_s"] < end]
    before = [row["threshold"] for row in trace if row["time_s"] < args.drop_at]
    start_t = before[-1] if before else 0.0
    rises = [row["time_s"] for row in during if row["threshold"] > start_t]
    over = []
    for row in during:
        t = row["time_s"]
        window = [r["egress_bytes_per_s"] for r in trace if t - WINDOW_S < r["time_s"] <= t]
        if statistics.fmean(window) > limit:
            over.append(t)
    return {
        "first_rise_s": (rises[0] - args.drop_at) if rises else float("nan"),
        "over_s": len(over) * POLL_S,
        "last_over_s": (over[-1] - args.drop_at) if over else 0.0,
    }


def plot(path: Path, args, trace, sim_trace, records, sim_offloaded, start_offset) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    mt = [r["time_s"] for r in trace]
    st = [r["time_s"] for r in sim_trace]
    top.plot(mt, [r["threshold"] for r in trace], label="cluster")
    top.plot(st, [r["threshold"] for r in sim_trace], "--", label="simulator")
    top.set_ylabel("threshold t (tokens)")
    top.legend(loc="upper left")
    mid.plot(mt, [r["egress_bytes_per_s"] / 1e6 for r in trace], label="cluster egress")
    mid.plot(st, [r["egress_bytes_per_s"] / 1e6 for r in sim_trace], "--", label="sim egress")
    mid.plot(mt, [r["capacity_bytes_per_s"] / 1e6 for r in trace], ":", label="learned capacity")
    rate = args.bandwidth_mbps / 8
    end = args.drop_at + args.drop_for
    mid.step(
        [0, args.drop_at, end, end + args.after],
        [rate, rate * args.drop, rate, rate],
        where="post",
        color="black",
        linewidth=0.8,
        label="link rate",
    )
    mid.set_ylabel("MB/s")
    mid.legend(loc="upper right", fontsize=8)
    bins = [10.0 * k for k in range(int((end + args.after) / 10) + 1)]
    for label, points, style in (
        ("cluster", [(r.sent - start_offset, r.route == "prfaas") for r in records], "-"),
        ("simulator", sim_offloaded, "--"),
    ):
        shares = []
        for a, b in itertools.pairwise(bins):
            inside = [off for at, off in points if a <= at < b]
            shares.append(statistics.fmean(inside) if inside else float("nan"))
        low.step(bins[1:], shares, style, where="pre", label=label)
    low.set_ylabel("offloaded to PrfaaS")
    low.set_xlabel("seconds into the schedule")
    low.legend(loc="lower left")
    for axis in (top, mid, low):
        axis.axvspan(args.drop_at, end, color="grey", alpha=0.12)
    fig.suptitle(
        f"link {args.bandwidth_mbps:g} Mbit/s → {args.drop:.0%} for {args.drop_for:g} s "
        f"under {args.rate:g} req/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", action="store_true", help="the link in the kernel (root)")
    parser.add_argument("--bandwidth-mbps", type=float, default=16.0, help="the link (Mbit/s)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="the link's round trip")
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson)")
    parser.add_argument("--input-len", type=int, default=500, help="mean prompt length")
    parser.add_argument("--prefill-s-per-token", type=float, default=1e-4)
    parser.add_argument("--drop", type=float, default=0.3, help="the link's share in the drop")
    parser.add_argument("--drop-at", type=float, default=40.0, help="seconds into the schedule")
    parser.add_argument("--drop-for", type=float, default=60.0, help="seconds")
    parser.add_argument("--after", type=float, default=50.0, help="seconds after the recovery")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write the figure here (PNG)")
    parser.add_argument("--log-dir", help="keep the cluster's logs here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--adaptive-wire",
        action="store_true",
        help="run twice, states native and with [wire] narrowing them, and compare",
    )
    parser.add_argument(
        "--recall",
        action="store_true",
        help="--adaptive-wire on the recall model's JAX engines: recall through the cluster",
    )
    parser.add_argument("--fixed-t", action="store_true", help="the threshold controller off")
    args = parser.parse_args()
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root")
    if not (0 < args.drop < 1 and args.drop_at > 10 and args.drop_for > 0 and args.after > 0):
        parser.error("need 0 < --drop < 1, --drop-at > 10, --drop-for > 0, --after > 0")
    if args.adaptive_wire or args.recall:
        return wire_main(args)
    with tempfile.TemporaryDirectory(prefix="prfaas-bandwidth-drop-") as tmp:
        root = Path(tmp)
        records, trace, context = measure(root, args)
        start_offset = min(r.sent for r in records) - context["sent0"]
        sim_trace, sim_offloaded = simulate(root, records, context["toy"], context["sent0"], args)
    phase_rows = summary(args, trace, sim_trace, records, sim_offloaded, start_offset)
    report = {
        "command": " ".join(["python bench/bandwidth_drop.py", *sys.argv[1:]]),
        "link": "kernel tbf (--netns)" if args.netns else "in-process token bucket",
        "phases": phase_rows,
        "reaction": reaction(args, trace),
        "controller": {"control_period_s": CONTROL_PERIOD_S, "utilization_window_s": WINDOW_S},
        "trace": trace,
        "simulated_trace": sim_trace,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
    }
    if args.plot:
        plot(Path(args.plot), args, trace, sim_trace, records, sim_offloaded, start_offset)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        "| phase | link (MB/s) | t: cluster / sim | egress MB/s: cluster / sim | "
        "offloaded: cluster / sim |"
    )
    print("|---|---|---|---|---|")
    for r in phase_rows:
        print(
            f"| {r['phase']} ({r['from_s']:g}–{r['to_s']:g} s) | "
            f"{r['link_bytes_per_s'] / 1e6:.2f} | "
            f"{r['measured_threshold_mean']:.0f} / {r['simulated_threshold_mean']:.0f} | "
            f"{r['measured_egress_bytes_per_s'] / 1e6:.2f} / "
            f"{r['simulated_egress_bytes_per_s'] / 1e6:.2f} | "
            f"{r['measured_prfaas_share']:.0%} / {r['simulated_prfaas_share']:.0%} |"
        )
    r = report["reaction"]
    print(
        f"\nt first rose {r['first_rise_s']:.1f} s after the drop; the egress (mean over the "
        f"controller's {WINDOW_S:g} s window) was above the dropped capacity for "
        f"{r['over_s']:.1f} s of the drop, the last time {r['last_over_s']:.1f} s into it"
    )
    print(json.dumps({k: v for k, v in report.items() if "trace" not in k}))
    return 0


def wire_main(args: argparse.Namespace) -> int:
    """``--adaptive-wire`` / ``--recall``: the two runs of bench/wire_comparison.py."""
    with tempfile.TemporaryDirectory(prefix="prfaas-bandwidth-drop-") as tmp:
        result = compare(Path(tmp), args, measure, requests(args), WINDOW_S)
    result["command"] = " ".join(["python bench/bandwidth_drop.py", *sys.argv[1:]])
    result["link"] = "kernel tbf (--netns)" if args.netns else "in-process token bucket"
    result["controller"] = "off (fixed t)" if args.fixed_t else "on"
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table(result))
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
