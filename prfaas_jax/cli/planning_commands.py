"""The capacity-planning commands, pure Python except for kv's traces: `add_plan`, `add_simulate`
and `add_kv`.

Each ``add_<name>`` declares a subcommand's flags and sets its ``_run_<name>``, which imports
the library when the command runs and prints a table or, with ``--json``, JSON. simulate and
kv show their progress on stderr (cli/progress.py).
"""

from __future__ import annotations

import argparse

from prfaas_jax.cli.flags import add_json_flag, print_json
from prfaas_jax.cli.progress import progress
from prfaas_jax.errors import UserError
from prfaas_jax.wire_precision import WirePrecision


def add_plan(sub: argparse._SubParsersAction) -> None:
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
        "--model",
        help="take S_kv from this model's state (preset, model TOML or HF config.json) instead "
        "of the config's [kv_size_mib]",
    )
    p.add_argument(
        "--prfaas-hardware",
        metavar="HW",
        help="with --model: T_prefill on the PrfaaS cluster from this hardware file (its measured "
        "profile of the model, else the FLOP estimate), e.g. h200x8",
    )
    p.add_argument(
        "--local-hardware",
        metavar="HW",
        help="with --model: T_prefill on the local PD cluster from this hardware file, e.g. h20x8",
    )
    p.add_argument(
        "--wire",
        nargs="+",
        metavar="PRECISION",
        help="with --model: plan with the state as it crosses the link in each of these wire "
        "precisions (native, bf16, fp8_e4m3, int8, or per kind as state=int8,kv=bf16) and "
        "print t, the split, Λ_max and egress side by side (docs/wire-format.md)",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also save Λ_max and the stage bounds against N_p/N_d and t, and a heatmap over "
        "(t, N_p), to this PNG (needs matplotlib)",
    )
    add_json_flag(p)
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from prfaas_jax.planning.plan_config import load_plan_config
    from prfaas_jax.planning.plan_report import draw_plan, format_plan, plan_to_json
    from prfaas_jax.policy.search import search

    if args.bandwidth is not None and not args.bandwidth > 0:
        raise UserError(f"--bandwidth must be a positive number of Gbps, got {args.bandwidth}")
    config = load_plan_config(args.config, egress_gbps=args.bandwidth)
    if args.wire is not None:
        return _plan_per_wire(args, config)
    if args.model is not None:
        config = _with_model(config, args.model, args.prfaas_hardware, args.local_hardware)
    elif args.prfaas_hardware or args.local_hardware:
        raise UserError("--prfaas-hardware and --local-hardware need --model (whose profile)")
    plan = search(config.model, config.baseline, thresholds=config.thresholds)
    if args.plot:
        draw_plan(plan, args.plot)
    if args.json:
        print_json(plan_to_json(plan, config))
    else:
        print(format_plan(plan, config))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def _plan_per_wire(args: argparse.Namespace, config) -> int:
    """`prfaas plan --wire …`: one search per wire precision, side by side."""
    from prfaas_jax.planning.plan_report import format_wire_plans, wire_plans_to_json
    from prfaas_jax.policy.search import search

    if args.model is None:
        raise UserError(
            "--wire needs --model: the state's make-up decides what each precision saves"
        )
    if args.plot:
        raise UserError("--plot draws one plan: leave out --wire, or give one --model plan")
    settings = []
    for text in args.wire:
        try:
            settings.append(WirePrecision.parse(text))
        except ValueError as err:
            raise UserError(f"--wire: {err}") from None
    plans = []
    for setting in settings:
        planned = _with_model(
            config, args.model, args.prfaas_hardware, args.local_hardware, precision=setting
        )
        plans.append(
            (
                setting,
                planned,
                search(planned.model, planned.baseline, thresholds=planned.thresholds),
            )
        )
    if args.json:
        print_json(wire_plans_to_json(plans))
    else:
        print(format_wire_plans(plans, args.model))
    return 0


def _with_model(
    config,
    model: str,
    prfaas_hardware: str | None,
    local_hardware: str | None,
    *,
    precision: WirePrecision | None = None,
):
    """The plan with ``model``'s own S_kv (the byte formula, piecewise linear in l, exact; on
    the wire in ``precision``, if given) and T_prefill profiles from the hardware files named."""
    from prfaas_jax.engine.kvsize import state_sizes
    from prfaas_jax.model.weights import load_config
    from prfaas_jax.planning.codesign import kv_profile_from_sizes, kv_profile_lengths
    from prfaas_jax.planning.hardware import load_hardware
    from prfaas_jax.policy.profiles import Profile
    from prfaas_jax.state_bytes import state_nbytes

    cfg = load_config(model)
    lengths = kv_profile_lengths(cfg, (cfg.max_len,))
    if precision is None:
        kv = kv_profile_from_sizes(state_sizes(cfg, lengths, measure=False))
    else:
        kv = Profile.table(lengths, [state_nbytes(cfg, n, precision) / 2**20 for n in lengths])
    prfaas_s = local_s = None
    if prfaas_hardware is not None:
        prfaas_s, _ = load_hardware(prfaas_hardware).prefill_profile(cfg)
    if local_hardware is not None:
        local_s, _ = load_hardware(local_hardware).prefill_profile(cfg)
    return config.with_profiles(kv_size_mib=kv, prfaas_prefill_s=prfaas_s, local_prefill_s=local_s)


def add_simulate(sub: argparse._SubParsersAction) -> None:
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
    add_json_flag(p)
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
    with progress("simulate", quiet=args.json) as shown:

        def say(message: str) -> None:
            shown.update(description=" ".join(["simulate", *message.split()]))

        run = simulate(config, saturation=not args.no_saturation, progress=say)
    if args.plot:
        from prfaas_jax.sim.plot import draw_run

        draw_run(run, args.plot)
    if args.json:
        print_json(run_to_json(run))
    else:
        print(format_run(run))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def add_kv(sub: argparse._SubParsersAction) -> None:
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
    what.add_argument(
        "--model", help="preset name, model TOML, or a Hugging Face config.json (or its folder)"
    )
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
    p.add_argument(
        "--wire",
        metavar="PRECISION",
        default="native",
        help="also the state's bytes and Φ_kv on the wire in this precision: bf16, fp8_e4m3, "
        "int8, or per kind as state=int8,kv=bf16 (docs/wire-format.md; default: native only)",
    )
    p.add_argument(
        "--allocator",
        choices=("canonical", "paged"),
        default="canonical",
        help="paged: also the bytes a request holds in the engines' block pool (pages of "
        "--block-size tokens, linear states as whole pages; docs/kv.md)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        metavar="N",
        help="with --allocator paged: the attention block in tokens, raised to a multiple "
        "whose page holds a linear state (default: 16)",
    )
    add_json_flag(p)
    p.set_defaults(run=_run_kv)


def _paged_reports(configs: list, lengths: tuple[int, ...], block_size: int) -> list:
    from prfaas_jax.engine.page_layout import page_layout, paged_size
    from prfaas_jax.planning.kv_pages import PagedReport

    if block_size < 1:
        raise UserError(f"--block-size must be a positive token count, got {block_size}")
    reports = []
    for cfg in configs:
        layout = page_layout(cfg, block_size)
        rows = [paged_size(layout, cfg, length) for length in lengths]
        reports.append(
            PagedReport(cfg.name, block_size, layout.tokens_per_page, layout.page_bytes, rows)
        )
    return reports


def _run_kv(args: argparse.Namespace) -> int:
    from prfaas_jax.engine.kvsize import state_sizes
    from prfaas_jax.model.weights import load_config
    from prfaas_jax.planning import kv_report, kv_vs_paper
    from prfaas_jax.planning.hardware import load_hardware
    from prfaas_jax.planning.kv_report import KvView

    try:
        precision = WirePrecision.parse(args.wire)
    except ValueError as err:
        raise UserError(f"--wire: {err}") from None
    selection = kv_report.select_kv(
        model=args.model,
        compare=args.compare,
        paper=args.paper,
        lengths=args.lengths,
        measure=not args.no_measure,
    )
    if args.allocator == "paged" and selection.view is KvView.PAPER:
        raise UserError("--allocator paged goes with --model or --compare, not --paper")
    hardware = load_hardware(args.hardware)
    configs = [load_config(name) for name in selection.models]
    paged = None
    if args.allocator == "paged":
        paged = _paged_reports(configs, selection.lengths, args.block_size)
    traces = len(configs) * len(selection.lengths)
    quiet = args.json or not selection.measure
    with progress("kv: tracing the prefill", total=traces, unit="traces", quiet=quiet) as shown:

        def traced(cfg, length: int, seconds: float) -> None:
            done = f"{cfg.name} at {kv_report.format_length(length)} in {seconds:.1f} s"
            shown.update(advance=1, description=f"kv: traced {done}")

        sizes = [
            state_sizes(cfg, selection.lengths, measure=selection.measure, progress=traced)
            for cfg in configs
        ]
    reports = [
        kv_report.kv_report(cfg, cfg_sizes, hardware, estimate=args.estimate, precision=precision)
        for cfg, cfg_sizes in zip(configs, sizes, strict=True)
    ]
    if selection.view is KvView.PAPER:
        by_name = {report.cfg.name: report for report in reports}
        payload, text = kv_vs_paper.paper_json(by_name), kv_vs_paper.format_paper(by_name)
    elif selection.view is KvView.COMPARE:
        payload, text = kv_report.compare_json(reports), kv_report.format_compare(reports)
    else:
        payload, text = kv_report.report_json(reports[0]), kv_report.format_report(reports[0])
    if paged is not None:
        from prfaas_jax.planning.kv_pages import format_paged, paged_json

        entries = payload["models"] if selection.view is KvView.COMPARE else [payload]
        for entry, report in zip(entries, paged, strict=True):
            entry["paged"] = paged_json(report)
        text = "\n\n".join([text, *(format_paged(report) for report in paged)])
    if args.json:
        print_json(payload)
    else:
        print(text)
    return 0 if all(report.consistent for report in reports) else 1
