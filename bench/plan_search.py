"""Times the `prfaas plan` search on the paper's case study: every threshold × every split.

Runs `prfaas_jax.policy.search.search` (the 2-D sweep plus both baselines) --runs times on
configs/plans/case-study-1t.toml and reports the best wall-clock time, with the number of
thresholds and splits searched. The target is ≥ 500 thresholds × every split in < 2 s.

    python bench/plan_search.py [--json] [--runs N] [--threshold-step TOKENS] [--config FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from prfaas_jax.planning.plan_config import load_plan_config
from prfaas_jax.policy.search import search, threshold_grid

CASE_STUDY = Path(__file__).resolve().parents[1] / "configs" / "plans" / "case-study-1t.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CASE_STUDY), help="plan TOML (default: case study)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the best is kept")
    parser.add_argument(
        "--threshold-step", type=int, help="override [search] threshold_step (tokens)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)

    config = load_plan_config(args.config)
    if args.threshold_step is not None:
        thresholds = threshold_grid(config.model.lengths, args.threshold_step)
        config = dataclasses.replace(config, thresholds=thresholds)
    seconds = []
    for _ in range(max(args.runs, 1)):
        start = time.perf_counter()
        plan = search(config.model, config.baseline, thresholds=config.thresholds)
        seconds.append(time.perf_counter() - start)

    result = {
        "config": str(args.config),
        "thresholds": len(plan.grid),
        "splits": len(plan.grid[0]),
        "runs": len(seconds),
        "best_seconds": min(seconds),
        "median_seconds": sorted(seconds)[len(seconds) // 2],
        "python": sys.version.split()[0],
    }
    if not args.json:
        print(f"{'config':<16}{result['config']}")
        for key in ("thresholds", "splits", "runs"):
            print(f"{key:<16}{result[key]:,}")
        print(f"{'best of runs':<16}{result['best_seconds']:.3f} s")
        print(f"{'median':<16}{result['median_seconds']:.3f} s")
        print()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
