"""The model–system co-design command: `add_codesign` (``prfaas codesign``).

codesign reads a sweep (planning/codesign_config.py), hands planning/codesign.py the two
measurements it needs — state sizes by abstract evaluation (engine/kvsize.py) and recall by
training (train/recall_probe.py) — and prints the table, ``--json``, ``--csv`` and ``--plot``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prfaas_jax.cli.flags import (
    add_compile_cache_flag,
    add_json_flag,
    print_json,
    use_compile_cache,
)
from prfaas_jax.cli.progress import progress
from prfaas_jax.errors import UserError


def add_codesign(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "codesign",
        help="sweep hybrid layouts: state bytes on the wire, cluster throughput and recall",
        description="For every point of a sweep (linear:full ratio, mixers, MLA rank, heads × "
        "head dim, state dtype): S_kv from the state the real prefill returns at full size, "
        "T_prefill and Φ_kv from the deployment's profiles, the planner's optimum (t*, split, "
        "Λ_max, speed-ups, egress) for the sweep's PrfaaS deployment, and held-out recall of the "
        "same layout trained at toy size. See docs/codesign.md.",
        epilog="example: prfaas codesign --config configs/codesign/kimi-ratio.toml --quick "
        "--seeds 3 --budget 60 --plot codesign.png",
    )
    p.add_argument("--config", required=True, help="sweep TOML (see configs/codesign/)")
    p.add_argument(
        "--toy",
        choices=("default", "quick", "large"),
        default="default",
        help="the toy setting: [toy], [toy.quick] (minutes on CPU) or [toy.large] (more blocks, "
        "longer sequences; for users with time)",
    )
    p.add_argument("--quick", action="store_true", help="the same as --toy quick")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="training runs per toy layout, seeds seed … seed+N−1, at the learning rate chosen on "
        "the validation split; recall is their mean with a 95%% Student-t interval (N ≥ 2)",
    )
    p.add_argument(
        "--budget",
        type=float,
        metavar="MINUTES",
        help="cap the training time: the plan is printed first, and after the first run the "
        "seeds are trimmed to fit (at least 2) or the sweep is refused",
    )
    p.add_argument(
        "--no-recall",
        action="store_true",
        help="skip the toy-size training (wire and cluster only)",
    )
    p.add_argument("--csv", metavar="FILE", help="also write one CSV line per point")
    p.add_argument(
        "--plot", metavar="PNG", help="recall against Λ_max gain, sized by bytes (matplotlib)"
    )
    p.add_argument(
        "--layouts",
        metavar="DIR",
        help="also write each point's full-size model TOML here (for prfaas kv / plan --model)",
    )
    add_compile_cache_flag(p)
    add_json_flag(p)
    p.set_defaults(run=_run_codesign)


def _run_codesign(args: argparse.Namespace) -> int:
    from prfaas_jax.config import load_model_config
    from prfaas_jax.engine.kvsize import state_sizes
    from prfaas_jax.model.checkpoint import config_to_toml
    from prfaas_jax.model.weights import load_config
    from prfaas_jax.planning import codesign_report
    from prfaas_jax.planning.codesign import run_codesign
    from prfaas_jax.planning.codesign_config import load_sweep
    from prfaas_jax.toml_config import resolve
    from prfaas_jax.train.loop import TrainConfig
    from prfaas_jax.train.recall_probe import measure_recall, shipped_recall
    from prfaas_jax.train.tasks import TaskSpec

    use_compile_cache(args)
    sweep = load_sweep(args.config)
    base_name = sweep.model.base
    if not Path(base_name).is_absolute() and (sweep.path.parent / base_name).exists():
        base_name = str(sweep.path.parent / base_name)
    base = load_config(base_name)
    toy = sweep.toy_setting("quick" if args.quick else args.toy)
    toy_base = None if args.no_recall else load_model_config(resolve("models", toy.base))

    def measure(cfg, lengths, trace):
        return state_sizes(cfg, lengths, measure=trace, only_mixers=True)

    with progress("codesign", quiet=args.json) as shown:

        def task_and_config(spec_toy):
            spec = TaskSpec(
                task=spec_toy.task,
                vocab_size=spec_toy.vocab_size,
                seq_len=spec_toy.seq_len,
                num_pairs=spec_toy.num_pairs,
                num_queries=spec_toy.num_queries,
            )
            config = TrainConfig(
                steps=spec_toy.steps,
                batch_size=spec_toy.batch_size,
                lr=spec_toy.lr,
                warmup_steps=spec_toy.warmup_steps,
                seed=spec_toy.seed,
                eval_examples=spec_toy.eval_examples,
            )
            return spec, config

        def recall(cfg, spec_toy):
            spec, config = task_and_config(spec_toy)
            shown.update(completed=0, total=config.steps)

            def on_step(report):
                shown.update(completed=report.step)

            return measure_recall(cfg, spec, config, spec_toy.eval_lengths, on_step=on_step)

        def shipped(cfg, spec_toy, trained, precision):
            spec, config = task_and_config(spec_toy)
            return shipped_recall(cfg, spec, config, trained, spec_toy.eval_lengths, precision)

        def emission(cfg, length):
            from prfaas_jax.engine.emission_timing import layer_seconds
            from prfaas_jax.model.seeded_weights import seeded_params

            return layer_seconds(cfg, seeded_params(cfg, toy.seed), length)

        def say(message: str) -> None:
            shown.update(description=f"codesign {message}")

        def tell(message: str) -> None:
            print(f"codesign {message}", file=sys.stderr)

        rows = run_codesign(
            sweep,
            base,
            measure=measure,
            recall=None if args.no_recall else recall,
            shipped=None if args.no_recall else shipped,
            toy_base=toy_base,
            toy=toy,
            say=say,
            seeds=args.seeds,
            budget_min=args.budget,
            tell=tell,
            emission=emission if sweep.axes.placement and not args.no_recall else None,
        )
    toy_shown = None if args.no_recall else toy
    if args.layouts:
        folder = Path(args.layouts)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for row in rows:
                (folder / f"{row.layout.name}.toml").write_text(config_to_toml(row.layout))
        except OSError as err:
            raise UserError(f"--layouts: cannot write {folder}: {err.strerror}") from None
    if args.csv:
        codesign_report.write_csv(rows, args.csv)
    if args.plot:
        codesign_report.draw_codesign(rows, args.plot)
    if args.json:
        print_json(codesign_report.codesign_json(sweep, rows, toy_shown))
    else:
        print(codesign_report.format_codesign(sweep, rows, toy_shown))
        for flag, path in (("csv", args.csv), ("plot", args.plot), ("layouts", args.layouts)):
            if path:
                print(f"{flag}: {path}")
    return 0
