"""The ``prfaas`` command: argument handling only.

Each subcommand has an ``_add_<name>`` function that declares its flags and a ``_run_<name>``
function that calls into the library and prints. Heavy imports (JAX) happen inside the ``_run_``
functions so that ``prfaas --help`` and the pure-Python commands start instantly.
"""

from __future__ import annotations

import argparse
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


# --- generate -------------------------------------------------------------------------------


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate tokens from a model preset with random (seeded) weights",
        description="Prefill a prompt and decode new tokens. Weights are drawn from --seed, so "
        "the same command always prints the same tokens.",
    )
    p.add_argument("--model", default="tiny", help="preset name or model TOML path (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights (default: 0)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", type=_parse_int_list, help="comma-separated token ids")
    prompt.add_argument("--prompt", help="text, encoded with the byte-level tokenizer")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to make (default: 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    p.add_argument("--sample-seed", type=int, default=0, help="seed for sampling (default: 0)")
    p.add_argument(
        "--impl",
        default="chunk",
        choices=["reference", "chunk"],
        help="op implementation: token-by-token reference or chunked (default)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from prfaas_jax.engine.generate import GenerateRequest, generate_from_preset

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    request = GenerateRequest(
        model=args.model,
        seed=args.seed,
        prompt_ids=args.prompt_ids,
        prompt_text=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        sample_seed=args.sample_seed,
        impl=args.impl,
    )
    result = generate_from_preset(request)
    if args.json:
        _print_json(result.to_json())
    else:
        print(result.to_table())
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


# --- entry point ----------------------------------------------------------------------------

_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_generate, _add_plan)


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
        return run(args)
    except UserError as err:
        print(f"prfaas {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prfaas {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
