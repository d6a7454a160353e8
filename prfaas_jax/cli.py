"""The ``prfaas`` command: argument handling only.

Each subcommand has an ``_add_<name>`` function that declares its flags and a ``_run_<name>``
function that calls into the library and prints. Heavy imports (JAX) happen inside the ``_run_``
functions so that ``prfaas --help`` and the pure-Python commands start instantly.

The module is long because it holds the flags of every subcommand (generate, prefill, decode,
state, convert-hf, kv, plan, simulate, serve, demo, bench, certs) in one place, where ``--help``
texts stay consistent; each ``_run_`` function is a few lines that call the library.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence

from prfaas_jax.errors import UserError

Runner = Callable[[argparse.Namespace], int]


def _print_json(payload: object) -> None:
    json.dump(payload, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _parse_int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


# --- generate, prefill, decode, state ------------------------------------------------------


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name or model TOML path (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights (default: 0)")


def _add_prompt_flags(p: argparse.ArgumentParser) -> None:
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", type=_parse_int_list, help="comma-separated token ids")
    prompt.add_argument("--prompt", help="text, encoded with the byte-level tokenizer")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    p.add_argument("--sample-seed", type=int, default=0, help="seed for sampling (default: 0)")


def _add_impl_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        default="chunk",
        choices=["reference", "chunk", "pallas"],
        help="op implementation: token-by-token reference, chunked (default) or Pallas kernels "
        "(interpreted on CPU, compiled on GPU/TPU)",
    )


def _add_mesh_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        metavar="SPEC",
        help="shard the model over a device mesh, e.g. tensor=4 or tensor=2,expert=4[,data=K] "
        "(default: one device; multi-host and CPU testing: docs/sharding.md)",
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate tokens from a model preset with random (seeded) weights, or a checkpoint",
        description="Prefill a prompt and decode new tokens. Weights are drawn from --seed, so "
        "the same command always prints the same tokens, unless --hf, --checkpoint or a "
        "checkpoint directory as --model supplies real ones (docs/hf-import.md).",
    )
    _add_model_flags(p)
    weights = p.add_mutually_exclusive_group()
    weights.add_argument(
        "--hf",
        metavar="DIR",
        help="run a Hugging Face checkpoint (config.json + *.safetensors) instead of --model",
    )
    weights.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="run an orbax checkpoint written by `prfaas convert-hf` (--model DIR works too)",
    )
    _add_prompt_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to make (default: 16)")
    _add_sampling_flags(p)
    _add_impl_flag(p)
    _add_mesh_flag(p)
    p.add_argument(
        "--dump-logits",
        metavar="FILE.npy",
        help="also save the prompt's prefill logits [T, vocab] float32 to this .npy file",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_generate)


def _request(args: argparse.Namespace, max_new_tokens: int = 1):
    from prfaas_jax.engine.generate import GenerateRequest

    return GenerateRequest(
        model=args.model,
        seed=args.seed,
        prompt_ids=args.prompt_ids,
        prompt_text=args.prompt,
        max_new_tokens=max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        sample_seed=args.sample_seed,
        impl=args.impl,
        mesh=args.mesh,
    )


def _print_result(args: argparse.Namespace, result) -> int:
    if args.json:
        _print_json(result.to_json())
    else:
        print(result.to_table())
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from prfaas_jax.engine.generate import generate_from_preset

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    request = dataclasses.replace(
        _request(args, args.max_new_tokens),
        hf_dir=args.hf,
        checkpoint=args.checkpoint,
        dump_logits=args.dump_logits,
    )
    return _print_result(args, generate_from_preset(request))


# --- convert-hf -----------------------------------------------------------------------------


def _add_convert_hf(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-hf",
        help="convert a Hugging Face checkpoint into an orbax checkpoint",
        description="Import a Hugging Face checkpoint directory (config.json + *.safetensors; "
        "families: kimi_linear, minimax, qwen3_next, mimo_v2_flash, bailing_hybrid) and write "
        "OUT/config.toml plus the parameters under OUT/params/ (orbax). Run it with "
        "`prfaas generate --checkpoint OUT` (or --model OUT).",
        epilog="example: prfaas convert-hf ./Kimi-Linear-48B-A3B-Instruct ./kimi-ckpt",
    )
    p.add_argument("hf_dir", metavar="DIR", help="Hugging Face checkpoint directory")
    p.add_argument("out", metavar="OUT", help="directory for the orbax checkpoint")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in OUT")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_convert_hf)


def _run_convert_hf(args: argparse.Namespace) -> int:
    from prfaas_jax.model.hf import convert_hf

    summary = convert_hf(args.hf_dir, args.out, overwrite=args.force)
    if args.json:
        _print_json(summary)
        return 0
    rows = [
        ("model_type", summary["model_type"]),
        ("name", summary["name"]),
        ("layers", ",".join(summary["layers"])),
        ("parameters", f"{summary['num_params']:,} ({summary['param_bytes']:,} bytes)"),
        ("dtype", summary["dtype"]),
        ("checkpoint", summary["checkpoint"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0


def _add_prefill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefill",
        help="prefill a prompt and write its model state (and first token) to a file",
        description="Run a prompt through the prefill engine and write the state's frames plus "
        "a handoff frame (first token, sampling settings) to a state file that `prfaas decode` "
        "continues, in this process or another.",
        epilog="example: prfaas prefill --prompt-ids 5,17,42 --out /tmp/state.prfs --json",
    )
    _add_model_flags(p)
    _add_prompt_flags(p)
    p.add_argument("--out", required=True, metavar="FILE", help="state file to write")
    p.add_argument(
        "--chunk-len", type=int, default=512, help="tokens per prefill call (default: 512)"
    )
    _add_sampling_flags(p)
    _add_impl_flag(p)
    _add_mesh_flag(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_prefill)


def _run_prefill(args: argparse.Namespace) -> int:
    from prfaas_jax.engine.generate import prefill_to_file

    if args.chunk_len < 1:
        raise UserError("--chunk-len must be at least 1")
    return _print_result(args, prefill_to_file(_request(args), args.out, chunk_len=args.chunk_len))


def _add_decode(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode",
        help="continue a state file written by `prfaas prefill`",
        description="Check a state file against the model, load it into the decode engine and "
        "generate the tokens after its first token (sampling as recorded by prefill). --model "
        "and --seed must be the ones the file was prefilled with.",
        epilog="example: prfaas decode --state /tmp/state.prfs --max-new-tokens 8 --json",
    )
    _add_model_flags(p)
    p.add_argument("--state", required=True, metavar="FILE", help="state file to continue")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=16,
        help="tokens to make after the file's first token (default: 16)",
    )
    _add_impl_flag(p)
    _add_mesh_flag(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_decode)


def _run_decode(args: argparse.Namespace) -> int:
    from prfaas_jax.engine.generate import decode_file

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    result = decode_file(
        args.state,
        model=args.model,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        impl=args.impl,
        mesh=args.mesh,
    )
    return _print_result(args, result)


def _add_state(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("state", help="look at state files", description="Look at state files.")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    inspect = actions.add_parser(
        "inspect",
        help="print a state file's header, tensor table and payload bytes",
        description="Print a state file's header (format version, model fingerprint, tokens), "
        "its per-tensor table, the payload bytes and the first token. Every frame's checksum "
        "is verified; no model is needed.",
    )
    inspect.add_argument("file", metavar="FILE", help="state file")
    inspect.add_argument("--json", action="store_true", help="print machine-readable JSON")
    inspect.set_defaults(run=_run_state_inspect)


def _run_state_inspect(args: argparse.Namespace) -> int:
    from prfaas_jax.engine.generate import format_inspection, inspect_file

    info = inspect_file(args.file)
    if args.json:
        _print_json(info)
    else:
        print(format_inspection(info))
    return 0


# --- plan -----------------------------------------------------------------------------------


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search the throughput-optimal threshold and prefill/decode split (paper Eqs. 3-8)",
        description="Evaluate the PrfaaS throughput model for every routing threshold t on the "
        "config's grid and every N_p/N_d split of the local PD cluster, and print the best "
        "configuration beside the homogeneous-PD and naive-heterogeneous baselines (the paper's "
        "Table 6).",
        epilog="example: prfaas plan --config configs/plans/case-study-1t.toml --bandwidth 5",
    )
    p.add_argument(
        "--config", required=True, help="plan TOML (see configs/plans/ and docs/planning.md)"
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        metavar="GBPS",
        help="PrfaaS egress bandwidth B_out in Gbps (default: the config's prfaas.egress_gbps)",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also save Λ_max and the stage bounds against N_p/N_d and t, and a heatmap over "
        "(t, N_p), to this PNG (needs matplotlib)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from prfaas_jax.planning.plan_config import load_plan_config
    from prfaas_jax.planning.plan_report import draw_plan, format_plan, plan_to_json
    from prfaas_jax.policy.search import search

    if args.bandwidth is not None and not args.bandwidth > 0:
        raise UserError(f"--bandwidth must be a positive number of Gbps, got {args.bandwidth}")
    config = load_plan_config(args.config, egress_gbps=args.bandwidth)
    plan = search(config.model, config.baseline, thresholds=config.thresholds)
    if args.plot:
        draw_plan(plan, args.plot)
    if args.json:
        _print_json(plan_to_json(plan, config))
    else:
        print(format_plan(plan, config))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


# --- simulate -------------------------------------------------------------------------------


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="discrete-event cluster simulation driving the router's policy objects",
        description="Simulate each deployment of the config under its workload (Poisson, gamma "
        "or a Mooncake trace), with prefill queues, decode slots, a shared inter-cluster link and "
        "prefix caches, routed by the router's own threshold rule, controller and rebalancer. "
        "Prints TTFT, TPOT, offload, egress, queues, t and role changes per deployment, with the "
        "simulated saturation throughput beside the analytic Λ_max.",
        epilog="example: prfaas simulate --config configs/sim/case-study-1t.toml --plot sim.png",
    )
    p.add_argument(
        "--config", required=True, help="simulation TOML (see configs/sim/ and docs/simulator.md)"
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also save TTFT CDFs, egress over time and t over time to this PNG (needs matplotlib)",
    )
    p.add_argument("--seed", type=int, help="workload seed (default: the config's)")
    p.add_argument("--requests", type=int, help="requests per run (default: the config's)")
    p.add_argument("--rate", type=float, help="offered requests/s (default: the config's)")
    p.add_argument(
        "--no-saturation", action="store_true", help="skip the saturation-throughput searches"
    )
    p.set_defaults(run=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from prfaas_jax.sim.config import load_sim_config, with_overrides
    from prfaas_jax.sim.report import format_run, run_to_json
    from prfaas_jax.sim.run import simulate

    config = with_overrides(
        load_sim_config(args.config), seed=args.seed, requests=args.requests, rate=args.rate
    )

    def progress(message: str) -> None:
        print(f"prfaas simulate: {message}", file=sys.stderr, flush=True)

    run = simulate(config, saturation=not args.no_saturation, progress=progress)
    if args.plot:
        from prfaas_jax.sim.plot import draw_run

        draw_run(run, args.plot)
    if args.json:
        _print_json(run_to_json(run))
    else:
        print(format_run(run))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


# --- kv -------------------------------------------------------------------------------------


def _add_kv(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv",
        help="state (KV cache) size and KV throughput Φ_kv of real models, per prompt length",
        description="Per prompt length: the canonical state of one sequence by formula (total, "
        "growing, windowed, fixed, per layer kind), the bytes of the state the real prefill "
        "returns for the full-size config (abstract evaluation: no weights are materialised), "
        "the codec's payload, T_prefill (a measured profile of the hardware, or an estimate from "
        "counted FLOPs) and Φ_kv = S_kv / T_prefill (paper Eq. 1). See docs/kv.md.",
        epilog="examples: prfaas kv --model kimi-linear-48b · "
        "prfaas kv --compare minimax-m2.5,mimo-v2-flash --lengths 32K · prfaas kv --paper",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="preset name or model TOML path")
    what.add_argument(
        "--compare", metavar="A,B,...", help="several models side by side, with ratios to the first"
    )
    what.add_argument(
        "--paper",
        action="store_true",
        help="our S_kv and Φ_kv next to the paper's Tables 3 and 5 and its §2.3 egress figures",
    )
    p.add_argument(
        "--lengths",
        help="comma-separated prompt lengths in tokens, K = 1024 (default: 1K,8K,32K,128K)",
    )
    p.add_argument(
        "--hardware",
        default="h200x8",
        help="hardware name in configs/hardware/ or a TOML path (default: h200x8)",
    )
    p.add_argument(
        "--estimate",
        action="store_true",
        help="estimate T_prefill from counted FLOPs even where a measured profile exists",
    )
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="skip tracing the real prefill (measured_bytes is null); --paper never traces",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_kv)


def _run_kv(args: argparse.Namespace) -> int:
    from prfaas_jax.config import load_model_config
    from prfaas_jax.engine.kvsize import state_sizes
    from prfaas_jax.planning import kv_report, kv_vs_paper
    from prfaas_jax.planning.hardware import load_hardware

    if args.paper and args.lengths is not None:
        raise UserError("--paper uses the paper's lengths 1K,8K,32K,128K; drop --lengths")
    lengths = kv_report.parse_lengths("1K,8K,32K,128K" if args.lengths is None else args.lengths)
    if args.paper:
        names = list(kv_vs_paper.PAPER_MODELS)
    elif args.compare is not None:
        names = [name.strip() for name in args.compare.split(",") if name.strip()]
        if len(names) < 2:
            raise UserError("--compare needs at least two models, e.g. --compare A,B")
    else:
        names = [args.model]
    hardware = load_hardware(args.hardware)
    configs = [load_model_config(name) for name in names]

    def progress(cfg, length: int, seconds: float) -> None:
        print(
            f"prfaas kv: traced {cfg.name} prefill at {kv_report.format_length(length)} "
            f"in {seconds:.1f} s",
            file=sys.stderr,
        )

    measure = not (args.no_measure or args.paper)
    reports = [
        kv_report.kv_report(
            cfg,
            state_sizes(cfg, lengths, measure=measure, progress=progress),
            hardware,
            estimate=args.estimate,
        )
        for cfg in configs
    ]
    if args.paper:
        by_name = {report.cfg.name: report for report in reports}
        payload, text = kv_vs_paper.paper_json(by_name), kv_vs_paper.format_paper(by_name)
    elif args.compare is not None:
        payload, text = kv_report.compare_json(reports), kv_report.format_compare(reports)
    else:
        payload, text = kv_report.report_json(reports[0]), kv_report.format_report(reports[0])
    if args.json:
        _print_json(payload)
    else:
        print(text)
    return 0 if all(report.consistent for report in reports) else 1


# --- demo, serve, bench --------------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: a toy PrfaaS-PD cluster of real processes serving a checked workload",
        description="Start the toy cluster (router, PrfaaS prefill, PD prefill and decode "
        "workers as separate processes on loopback, with an emulated inter-cluster link), send "
        "a concurrent mix of short and long prompts, print each request's route, uncached "
        "length, threshold, TTFT, decode tokens/s and state bytes against state_nbytes, and "
        "check every output against single-process generation. Exit status 1 on any mismatch.",
    )
    p.add_argument(
        "--config",
        default="toy",
        help="cluster config: a name under configs/clusters/ or a TOML path (default: toy)",
    )
    p.add_argument("--log-dir", help="where the processes' logs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.loadgen.demo import run_demo

    return run_demo(args.config, as_json=args.json, log_dir=args.log_dir)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run a toy cluster (router + workers as processes on loopback) until Ctrl-C",
        description="Start the router and one worker process per instance of the cluster "
        "config, wait until every server reports SERVING, write the ready file, and run until "
        "SIGINT or SIGTERM, then stop every process.",
        epilog="example: prfaas serve --config configs/clusters/toy.toml --ready-file ready.json",
    )
    p.add_argument("--config", required=True, help="cluster TOML (see configs/clusters/)")
    p.add_argument(
        "--ready-file",
        help="write JSON {router, metrics, model, seed, workers: {name: {address, pid, role}}} "
        "here once every server is SERVING (removed on shutdown)",
    )
    p.add_argument("--log-dir", help="where the processes' logs go (default: a temp dir)")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.cluster.launcher import serve

    return serve(args.config, args.ready_file, log_dir=args.log_dir)


def _parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise UserError(f"--goodput expects metric:milliseconds, got {item!r}") from None
    return slos


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test a running router (vllm bench serve conventions)",
        description="Send prompts to a router at a Poisson or gamma arrival rate and report "
        "TTFT, TPOT, ITL and end-to-end latency (mean, median, std, percentiles), goodput "
        "against SLOs, the fraction offloaded to PrfaaS and the inter-cluster egress.",
        epilog="example: prfaas bench --router 127.0.0.1:50051 --num-prompts 50 "
        "--request-rate 4 --burstiness 0.5 --goodput ttft:500 tpot:50",
    )
    p.add_argument("--router", required=True, help="router address host:port (the ready file's)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrivals per second; inf sends all at once (default)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the inter-arrival gaps: 1 Poisson, <1 burstier (default 1)",
    )
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument(
        "--input-dist",
        choices=["paper", "lognormal", "uniform", "fixed"],
        default="paper",
        help="prompt lengths: the paper's log-normal scaled to the model (default), a "
        "log-normal, uniform around --input-len, or fixed",
    )
    p.add_argument("--input-len", type=int, default=64, help="fixed/uniform length (default 64)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="uniform: ±ratio (default 0.5)")
    p.add_argument("--lognormal-mu", type=float, default=4.0, help="lognormal: mu (default 4.0)")
    p.add_argument("--lognormal-sigma", type=float, default=1.0, help="lognormal: sigma")
    p.add_argument(
        "--length-scale",
        type=float,
        help="paper: scale of the 128..131072-token distribution (default: fit max_len)",
    )
    p.add_argument("--output-len", type=int, default=16, help="new tokens each (default 16)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--metric-percentiles",
        type=_parse_int_list,
        default=[50, 90, 99],
        help="comma-separated percentiles (default 50,90,99)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline in s")
    p.add_argument(
        "--ca-cert", default="", help="PEM CA that signed the router's certificate: use TLS"
    )
    p.add_argument(
        "--token-file", default="", help="file holding the router's bearer token ([security])"
    )
    p.add_argument("--cert", default="", help="client certificate PEM, for a router without token")
    p.add_argument("--key", default="", help="its private key PEM")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.loadgen.bench import (
        BenchOptions,
        format_summary,
        run_bench,
        summarize,
    )
    from prfaas_jax.serving.transport.security import client_section

    opts = BenchOptions(
        router=args.router,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_dist=args.input_dist,
        input_len=args.input_len,
        range_ratio=args.range_ratio,
        lognormal_mu=args.lognormal_mu,
        lognormal_sigma=args.lognormal_sigma,
        length_scale=args.length_scale,
        output_len=args.output_len,
        seed=args.seed,
        percentiles=tuple(float(p) for p in args.metric_percentiles),
        goodput=_parse_goodput(args.goodput),
        timeout_s=args.timeout,
        security=client_section(
            ca_cert=args.ca_cert, cert=args.cert, key=args.key, token_file=args.token_file
        ),
    )
    records, context = run_bench(opts)
    summary = summarize(records, context, opts)
    if args.json:
        _print_json(summary)
    else:
        print(format_summary(summary, opts))
    return 0 if summary["failed"] == 0 else 1


def _add_certs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certs",
        help="make a CA, a node certificate and a router token for a cluster's [security]",
        description="Write ca.pem (a new CA), node.pem and node-key.pem (a certificate it "
        "signed for 127.0.0.1 and localhost, for servers and clients alike; every process of "
        "a toy cluster shares it) and router.token (a random bearer token); the key and the "
        "token are readable by their owner only. The CA's key is not kept. Point the cluster "
        "config's [security] section at them (docs/serving.md, Security).",
        epilog="example: prfaas certs --out certs/ --days 30",
    )
    p.add_argument("--out", required=True, help="directory to write into (created if missing)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.set_defaults(run=_run_certs)


def _run_certs(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.transport.certs import write_cluster_credentials

    if args.days < 1:
        raise UserError("--days must be ≥ 1")
    paths = write_cluster_credentials(args.out, days=args.days)
    names = ", ".join(path.name for path in paths.values())
    print(f"wrote {names} to {args.out}; for the cluster config:\n\n[security]")
    for key, path in paths.items():
        print(f'{key} = "{path.resolve()}"')
    return 0


# --- entry point ----------------------------------------------------------------------------

_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_demo,
    _add_generate,
    _add_prefill,
    _add_decode,
    _add_state,
    _add_convert_hf,
    _add_plan,
    _add_simulate,
    _add_kv,
    _add_serve,
    _add_bench,
    _add_certs,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prfaas",
        description="Prefill-as-a-Service for hybrid-attention LLMs, in JAX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Runner = args.run
    try:
        if getattr(args, "mesh", None):
            from prfaas_jax.model.sharding import initialize_distributed

            # Before any device is touched: a mesh may span hosts (docs/sharding.md).
            initialize_distributed()
        return run(args)
    except UserError as err:
        print(f"prfaas {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prfaas {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
