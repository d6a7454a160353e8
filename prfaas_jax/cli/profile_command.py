"""`prfaas profile`: time the engines on this device (engine/profiling.py) and write a prefill
profile file (planning/hardware.py `MeasuredPrefill`), or check one against a new timing run.

With ``--config CLUSTER`` it times the engines as that cluster's workers run them: its model
at its `[engine] max_len`, its ops, prefill buckets and chunk length, decode slots of its
capacity. With ``--node-class NAME`` too, it times them on one node of that class: the command
runs again inside a cgroup with the class's CPU quota and cores (serving/cluster/cgroups.py),
keeps the mean of the runs (what a rationed node sustains) and removes the cgroup after.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
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


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="time the prefill engine over lengths and decode over batch sizes; write a profile",
        description="Time the prefill engine over prompt lengths and the decode engine over batch "
        "sizes on the current device, and write a prefill profile file: a plan config takes it "
        'as [*.prefill_time_s] kind = "measured", path = FILE (so prfaas simulate does too), '
        "and a hardware file lists it in prefill_profiles (prfaas kv, plan --model). With "
        "--check FILE it times the lengths again and prints FILE's prediction against them. "
        "With --config the engines run as that cluster's workers run them; with --node-class "
        "too, on one node of that class (its CPU quota and cores, by cgroups: needs root).",
        epilog="examples: prfaas profile --model tiny --lengths 64,256,1024 --out tiny-cpu.toml\n"
        "  sudo prfaas profile --config configs/clusters/hetero.toml --node-class h20 "
        "--out h20.toml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_flags(p)
    p.set_defaults(model=None)  # default tiny, unless --config names the model
    p.add_argument("--lengths", default="64,256,1024", help="prompt lengths (default: 64,256,1024)")
    p.add_argument("--batch-sizes", default="1,16,64", help="decode batch sizes (default: 1,16,64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (default: 3)")
    p.add_argument("--impl", choices=["reference", "chunk", "pallas"], help="default: chunk")
    p.add_argument("--source", default="", help="what the file says was measured (default: device)")
    p.add_argument(
        "--config",
        metavar="CLUSTER",
        help="time the engines as this cluster config's workers run them (model, max_len, impl, "
        "buckets, chunk_len)",
    )
    p.add_argument(
        "--node-class",
        metavar="NAME",
        help="time them on one node of the config's [node_classes.NAME] (a cgroup; root)",
    )
    p.add_argument("--in-node-class", help=argparse.SUPPRESS)  # the run inside the cgroup
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", metavar="FILE", help="write the profile here (TOML)")
    out.add_argument("--check", metavar="FILE", help="compare this profile with a new timing run")
    add_compile_cache_flag(p)
    add_mesh_flag(p)
    add_json_flag(p)
    p.set_defaults(run=_run_profile)


def _in_node_class(args: argparse.Namespace, config) -> int:
    """Run this command again inside a cgroup of the class; its exit status."""
    from prfaas_jax.serving.cluster.cgroups import NodeCgroups

    classes = dict(config.node_classes)
    if args.node_class not in classes:
        known = ", ".join(classes) or "none"
        raise UserError(f"{config.path} has no [node_classes.{args.node_class}] (classes: {known})")
    argv = [sys.executable, "-m", "prfaas_jax.cli", "profile", "--config", str(config.path)]
    argv += ["--lengths", args.lengths, "--batch-sizes", args.batch_sizes]
    argv += ["--repeats", str(args.repeats), "--in-node-class", args.node_class]
    argv += ["--out", args.out] if args.out else ["--check", args.check]
    argv += ["--source", args.source] if args.source else []
    argv += ["--json"] if args.json else []
    argv += [] if args.compile_cache else ["--no-compile-cache"]
    cgroups = NodeCgroups()
    try:
        prefix = cgroups.enter(
            f"profile-{args.node_class}", args.node_class, classes[args.node_class]
        )
        return subprocess.run([*prefix, *argv], check=False).returncode
    finally:
        cgroups.close()


def _run_profile(args: argparse.Namespace) -> int:
    from prfaas_jax.planning.hardware import load_measured
    from prfaas_jax.planning.kv_report import parse_lengths

    lengths = sorted(set(parse_lengths(args.lengths)))
    batches = sorted(set(parse_lengths(args.batch_sizes)))
    if args.repeats < 1:
        raise UserError("--repeats must be at least 1")
    if args.mesh:
        raise UserError("prfaas profile times one device; drop --mesh")
    config = None
    if args.config:
        from prfaas_jax.serving.cluster_config import load_cluster_config

        if args.model:
            raise UserError("--config names the model: drop --model")
        config = load_cluster_config(args.config)
        if args.impl and args.impl != config.model.impl:
            raise UserError(f"--config runs impl {config.model.impl}: drop --impl")
    elif args.node_class:
        raise UserError("--node-class needs --config (the cluster config that defines the class)")
    if args.node_class:
        return _in_node_class(args, config)
    expected = load_measured(args.check) if args.check else None
    return _time_and_report(args, config, lengths, batches, expected)


def _time_and_report(args, config, lengths, batches, expected) -> int:
    import jax

    from prfaas_jax.engine import profiling
    from prfaas_jax.model.weights import load_model
    from prfaas_jax.planning.hardware import load_measured
    from prfaas_jax.tables import table

    use_compile_cache(args)
    engine: dict = {"impl": args.impl or "chunk"}
    decode: dict = {"impl": args.impl or "chunk"}
    if config is not None:
        from prfaas_jax.serving.cluster_config import serving_model_config

        cfg = serving_model_config(config)
        params = load_model(config.model.preset, seed=config.model.seed)[1]
        engine = {
            "impl": config.model.impl,
            "buckets": config.engine.buckets,
            "chunk_len": config.engine.chunk_len,
            "max_len": config.engine.max_len,  # a worker's prefill fills a slot of this capacity
        }
        decode = {"impl": config.model.impl, "max_len": config.engine.max_len}
        if args.in_node_class:
            engine["mean"] = decode["mean"] = True
        name = str(config.path)
    else:
        name = args.model or "tiny"
        cfg, params = load_model(name, seed=args.seed)
    if expected is not None and expected.model != cfg.name:
        raise UserError(f"--check {args.check} profiles {expected.model}, not {cfg.name}")
    steps = len(lengths) + (0 if expected else len(batches))
    with progress("profile", total=steps, unit="points", quiet=args.json) as shown:

        def done(message: str) -> None:
            shown.update(advance=1, description=f"profile: {message}")

        prefill_s = profiling.time_prefill(
            cfg, params, lengths, repeats=args.repeats, done=done, **engine
        )
        decode_s = (
            []
            if expected
            else profiling.time_decode(
                cfg, params, batches, repeats=max(args.repeats, 8), done=done, **decode
            )
        )
    device = jax.devices()[0]
    source = args.source or f"prfaas profile on {device.platform} ({device.device_kind})"
    if args.in_node_class and not args.source:
        source += f", node class {args.in_node_class} of {name}"
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
    how = "mean" if engine.get("mean") else "best"
    text = "\n".join(
        [
            f"# Measured by `prfaas profile {'--config ' if config else '--model '}{name}` "
            f"({engine['impl']} ops, {how} of {args.repeats}).",
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
