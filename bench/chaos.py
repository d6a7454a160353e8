"""A bounded soak of a fake-engine cluster under worker kills, corrupted frames and dropped links.

Reports requests accepted, completed, failed fast, lost, duplicated and wrong, and the latency
cost of the faults.

Starts the cluster of --config (default configs/clusters/chaos.toml: 1 PrfaaS prefill, 2 PD
prefill, 2 PD decode, 3 % of transfers corrupted and 3 % dropped) with worker restarts on, sends
Poisson arrivals at --rate for --duration seconds while SIGKILLing a worker every --kill-every
seconds, waits for every request, and prints a table, then JSON (serving/loadgen/soak_report.py defines
every count). Exit status 1 when a request was lost, duplicated or wrong.

    python bench/chaos.py [--duration 180] [--rate 2] [--kill-every 20] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prfaas_jax.serving.loadgen.soak import SoakOptions, run_soak

CHAOS = Path(__file__).resolve().parents[1] / "configs" / "clusters" / "chaos.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CHAOS), help="cluster TOML (fake engines)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds; 0: no kills")
    parser.add_argument("--seed", type=int, default=0, help="workload and kill choices")
    parser.add_argument("--deadline", type=float, default=150.0, help="s before a request is lost")
    parser.add_argument("--log-dir", help="keep the cluster's logs here")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)

    options = SoakOptions(
        duration_s=args.duration,
        rate=args.rate,
        kill_every_s=args.kill_every,
        seed=args.seed,
        deadline_s=args.deadline,
    )
    report = run_soak(args.config, options, log_dir=args.log_dir)
    if not args.json:
        print(report.format_table())
        print()
    print(json.dumps(report.to_dict()))
    counts = report.counts()
    return 1 if counts["lost"] or counts["duplicated"] or counts["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
