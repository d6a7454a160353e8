"""The model–system co-design commands: `add_codesign` (``prfaas codesign``) and `add_profile`
(``prfaas profile``).

codesign reads a sweep (planning/codesign_config.py), hands planning/codesign.py the two
measurements it needs — state sizes by abstract evaluation (engine/kvsize.py) and recall by
training (train/recall_probe.py) — and prints the table, ``--json``, ``--csv`` and ``--plot``.
profile times the engines on this device (engine/profiling.py) and writes a prefill profile file
(planning/hardware.py `MeasuredPrefill`), or checks one against a new timing run.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from prfaas_jax.cli.flags import (
    add_compile_cache_flag,
    add_json_flag,
    add_mesh_flag,
    add_model_flags,
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
        "--plot codesign.png",
    )
    p.add_argument("--config", required=True, help="sweep TOML (see configs/codesign/)")
    p.add_argument(
        "--quick", action="store_true", help="the sweep's [toy.quick] training (minutes on CPU)"
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
    toy = sweep.quick if args.quick else sweep.toy
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

        def say(message: str) -> None:
            shown.update(description=f"codesign {message}")

        rows = run_codesign(
            sweep,
            base,
            measure=measure,
            recall=None if args.no_recall else recall,
            shipped=None if args.no_recall else shipped,
            toy_base=toy_base,
            toy=toy,
            say=say,
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


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="time the prefill engine over lengths and decode over batch sizes; write a profile",
        description="Time the prefill engine over prompt lengths and the decode engine over batch "
        "sizes on the current device, and write a prefill profile file: a plan config takes it "
        'as [*.prefill_time_s] kind = "measured", path = FILE (so prfaas simulate does too), '
        "and a hardware file lists it in prefill_profiles (prfaas kv, plan --model). With "
        "--check FILE it times the lengths again and prints FILE's prediction against them.",
        epilog="example: prfaas profile --model tiny --lengths 64,256,1024 --out tiny-cpu.toml",
    )
    add_model_flags(p)
    p.add_argument("--lengths", default="64,256,1024", help="prompt lengths (default: 64,256,1024)")
    p.add_argument("--batch-sizes", default="1,16,64", help="decode batch sizes (default: 1,16,64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (default: 3)")
    p.add_argument("--impl", default="chunk", choices=["reference", "chunk", "pallas"])
    p.add_argument("--source", default="", help="what the file says was measured (default: device)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", metavar="FILE", help="write the profile here (TOML)")
    out.add_argument("--check", metavar="FILE", help="compare this profile with a new timing run")
    add_mesh_flag(p)
    add_json_flag(p)
    p.set_defaults(run=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    import jax

    from prfaas_jax.engine import profiling
    from prfaas_jax.model.weights import load_model
    from prfaas_jax.planning.hardware import load_measured
    from prfaas_jax.planning.kv_report import parse_lengths
    from prfaas_jax.tables import table

    lengths = sorted(set(parse_lengths(args.lengths)))
    batches = sorted(set(parse_lengths(args.batch_sizes)))
    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    if args.mesh:
        raise UserError("prfaas profile times one device; drop --mesh")
    expected = load_measured(args.check) if args.check else None
    cfg, params = load_model(args.model, seed=args.seed)
    if expected is not None and expected.model != cfg.name:
        raise UserError(f"--check {args.check} profiles {expected.model}, not {cfg.name}")
    steps = len(lengths) + (0 if expected else len(batches))
    with progress("profile", total=steps, unit="points", quiet=args.json) as shown:

        def done(message: str) -> None:
            shown.update(advance=1, description=f"profile: {message}")

        prefill_s = profiling.time_prefill(
            cfg, params, lengths, repeats=args.repeats, impl=args.impl, done=done
        )
        decode_s = (
            []
            if expected
            else profiling.time_decode(
                cfg, params, batches, repeats=max(args.repeats, 8), impl=args.impl, done=done
            )
        )
    device = jax.devices()[0]
    source = args.source or f"prfaas profile on {device.platform} ({device.device_kind})"
    if expected is not None:
        rows = []
        for length, seconds in zip(lengths, prefill_s, strict=True):
            predicted = expected.profile(length)
            rows.append(
                {
                    "length": length,
                    "predicted_s": predicted,
                    "measured_s": seconds,
                    "error": predicted / seconds - 1,
                }
            )
        if args.json:
            print_json({"model": cfg.name, "profile": args.check, "rows": rows})
        else:
            body = [
                [
                    r["length"],
                    f"{r['predicted_s']:.4f}",
                    f"{r['measured_s']:.4f}",
                    f"{100 * r['error']:+.1f} %",
                ]
                for r in rows
            ]
            print(f"prfaas profile --check {args.check}: {cfg.name} on {source}\n")
            print(table(body, headers=["length", "predicted s", "measured s", "error"]))
        return 0
    monotone = all(b >= a for a, b in itertools.pairwise(prefill_s)) and all(
        b >= a for a, b in itertools.pairwise(decode_s)
    )
    text = "\n".join(
        [
            f"# Measured by `prfaas profile --model {args.model}` ({args.impl} ops, best of "
            f"{args.repeats}).",
            f'model = "{cfg.name}"',
            f'source = "{source}"',
            f"lengths = [{', '.join(map(str, lengths))}]",
            f"prefill_s = [{', '.join(f'{s:.6g}' for s in prefill_s)}]",
            f"decode_batch_sizes = [{', '.join(map(str, batches))}]",
            f"decode_step_s = [{', '.join(f'{s:.6g}' for s in decode_s)}]",
            "",
        ]
    )
    try:
        Path(args.out).write_text(text)
    except OSError as err:
        raise UserError(f"--out: cannot write {args.out}: {err.strerror}") from None
    load_measured(args.out)  # what was written reads back
    payload = {
        "model": cfg.name,
        "source": source,
        "out": args.out,
        "lengths": lengths,
        "prefill_s": prefill_s,
        "decode_batch_sizes": batches,
        "decode_step_s": decode_s,
        "monotone": monotone,
    }
    if args.json:
        print_json(payload)
    else:
        print(text)
        print(f"written: {args.out}" + ("" if monotone else " (NOT monotone: a noisy run)"))
    return 0
