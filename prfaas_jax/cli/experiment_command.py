"""`prfaas experiment`: the case study on real processes (serving/loadgen/experiment.py) — three
deployments of one node budget, predicted, simulated and measured — printed as one table, with
``--json`` and ``--plot``."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from prfaas_jax.cli.flags import add_json_flag, print_json
from prfaas_jax.cli.progress import progress


def add_experiment(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "experiment",
        help="the case study on real processes: three deployments planned, simulated, measured",
        description="Profile the config's node classes (CPU quota and cores, by cgroups), take "
        "the planner's threshold, split and Λ_max for PrfaaS-PD, homogeneous PD and naive "
        "heterogeneous with one node budget, simulate them, then start each as real processes "
        "(network namespaces, the shaped link) and measure its saturation throughput "
        "(closed loop) and TTFT at a common rate; every output is checked against "
        "single-process greedy generation. Needs root. See docs/serving.md, 'The case study on "
        "real processes'.",
        epilog="example: sudo prfaas experiment --config toy-case-study --quick --plot case.png",
    )
    p.add_argument(
        "--config",
        default="toy-case-study",
        help="an experiment config: a name under configs/experiments/ or a TOML path "
        "(default: toy-case-study)",
    )
    p.add_argument("--quick", action="store_true", help="the config's [quick] settings (shorter)")
    p.add_argument("--plot", metavar="PNG", help="draw Λ_max by source and throughput by level")
    p.add_argument(
        "--no-netns",
        dest="netns",
        action="store_false",
        help="run the clusters on loopback (the link shaped by the sender) instead of in network "
        "namespaces",
    )
    p.add_argument(
        "--out-dir",
        metavar="DIR",
        help="keep the profiles, generated configs, logs and experiment.json here (default: a "
        "temporary folder, removed after the run)",
    )
    add_json_flag(p)
    p.set_defaults(run=_run_experiment)


def _run_experiment(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.cluster.cgroups import require_cgroups
    from prfaas_jax.serving.cluster.netns import require_netns
    from prfaas_jax.serving.loadgen.experiment import experiment_json, run_experiment
    from prfaas_jax.serving.loadgen.experiment_config import load_experiment_config
    from prfaas_jax.serving.loadgen.experiment_report import draw_experiment, format_experiment

    config = load_experiment_config(args.config, quick=args.quick)
    require_cgroups()
    if args.netns:
        require_netns(wan=config.cluster.link.in_packets)
    started = time.perf_counter()
    with progress("experiment", quiet=args.json) as shown:

        def say(message: str) -> None:
            shown.update(description=f"experiment: {message}")
            print(
                f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True
            )

        if args.out_dir:
            experiment = run_experiment(config, Path(args.out_dir), netns=args.netns, say=say)
        else:
            with tempfile.TemporaryDirectory(prefix="prfaas-experiment-") as root:
                experiment = run_experiment(config, Path(root), netns=args.netns, say=say)
    if args.plot:
        draw_experiment(experiment, args.plot)
    if args.json:
        print_json(experiment_json(experiment))
    else:
        print(format_experiment(experiment))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if experiment.outputs_ok else 1
