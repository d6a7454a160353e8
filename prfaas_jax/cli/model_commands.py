"""The commands that run a model in this process: `add_generate`, `add_prefill`, `add_decode`,
`add_state` (``state inspect``) and `add_convert_hf`.

Each ``add_<name>`` declares a subcommand's flags and sets its ``_run_<name>``, which imports
the library (and with it JAX) only when the command runs, checks what argparse cannot, and
prints a table or, with ``--json``, JSON. The flows themselves are in cli/generation.py and
cli/state_files.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import TYPE_CHECKING

from prfaas_jax.cli.flags import (
    add_impl_flag,
    add_json_flag,
    add_max_len_flag,
    add_mesh_flag,
    add_model_flags,
    add_prompt_flags,
    add_sampling_flags,
    print_json,
)
from prfaas_jax.errors import UserError
from prfaas_jax.tables import key_value
from prfaas_jax.wire_precision import WirePrecision

if TYPE_CHECKING:
    from prfaas_jax.cli.generation import GenerateRequest, GenerateResult
    from prfaas_jax.cli.state_files import DecodeFileResult, PrefillFileResult


def _check_new_tokens(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")


def _request(args: argparse.Namespace, max_new_tokens: int = 1) -> GenerateRequest:
    from prfaas_jax.cli.generation import GenerateRequest
    from prfaas_jax.cli.prompt_input import prompt_from_args

    ids, text = prompt_from_args(args)
    return GenerateRequest(
        model=args.model,
        seed=args.seed,
        prompt_ids=ids,
        prompt_text=text,
        max_new_tokens=max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        sample_seed=args.sample_seed,
        impl=args.impl,
        mesh=args.mesh,
        max_len=args.max_len,
    )


def _print_result(
    args: argparse.Namespace, result: GenerateResult | PrefillFileResult | DecodeFileResult
) -> int:
    if args.json:
        print_json(result.to_json())
    else:
        print(result.to_table())
    return 0


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate tokens from a model preset with random (seeded) weights, or a checkpoint",
        description="Prefill a prompt and decode new tokens. Weights are drawn from --seed, so "
        "the same command always prints the same tokens, unless --hf, --checkpoint or a "
        "checkpoint directory as --model supplies real ones (docs/hf-import.md).",
    )
    add_model_flags(p)
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
    add_prompt_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to make (default: 16)")
    add_sampling_flags(p)
    add_impl_flag(p)
    p.add_argument(
        "--tiling",
        choices=["auto", "gpu", "tpu"],
        default="auto",
        help="with --impl pallas: tile the kernels by Triton's (gpu) or Mosaic's (tpu) block "
        "rules wherever they run, e.g. the TPU's tiling in the CPU interpreter (default: the "
        "backend's own, docs/kernels.md)",
    )
    add_mesh_flag(p)
    add_max_len_flag(p)
    p.add_argument(
        "--dump-logits",
        metavar="FILE.npy",
        help="also save the prompt's prefill logits [T, vocab] float32 to this .npy file",
    )
    add_json_flag(p, help="print machine-readable JSON (the prompt as its length and SHA-256)")
    p.add_argument(
        "--include-prompt",
        action="store_true",
        help="with --json: list the prompt's token ids too",
    )
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from prfaas_jax.cli.generation import generate_from_preset

    _check_new_tokens(args)
    if args.include_prompt and not args.json:
        raise UserError("--include-prompt adds the prompt to the JSON output: it needs --json")
    if args.tiling != "auto" and args.impl != "pallas":
        raise UserError(f"--tiling {args.tiling} tiles Pallas kernels: it needs --impl pallas")
    request = dataclasses.replace(
        _request(args, args.max_new_tokens),
        hf_dir=args.hf,
        checkpoint=args.checkpoint,
        dump_logits=args.dump_logits,
    )
    from prfaas_jax.ops.pallas_backend import forced_tiling

    tiling = contextlib.nullcontext() if args.tiling == "auto" else forced_tiling(args.tiling)
    with tiling:
        result = generate_from_preset(request)
    if args.json:
        print_json(result.to_json(include_prompt=args.include_prompt))
    else:
        print(result.to_table())
    return 0


def add_convert_hf(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-hf",
        help="convert a Hugging Face checkpoint into an orbax checkpoint",
        description="Import a Hugging Face checkpoint directory (config.json + *.safetensors; "
        "families: kimi_linear, minimax, qwen3_next, mimo_v2_flash, bailing_hybrid) and write "
        "OUT/config.toml plus the parameters under OUT/params/ (orbax), and copy its tokenizer "
        "files (tokenizer.json, tokenizer_config.json, ...) if it has them. Run it with "
        "`prfaas generate --checkpoint OUT --prompt TEXT` (or --model OUT), or serve it: "
        "[model] preset = OUT.",
        epilog="example: prfaas convert-hf ./Kimi-Linear-48B-A3B-Instruct ./kimi-ckpt",
    )
    p.add_argument("hf_dir", metavar="DIR", help="Hugging Face checkpoint directory")
    p.add_argument("out", metavar="OUT", help="directory for the orbax checkpoint")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in OUT")
    add_json_flag(p)
    p.set_defaults(run=_run_convert_hf)


def _run_convert_hf(args: argparse.Namespace) -> int:
    from prfaas_jax.model.hf import convert_hf

    summary = convert_hf(args.hf_dir, args.out, overwrite=args.force)
    if args.json:
        print_json(summary)
        return 0
    rows = [
        ("model_type", summary["model_type"]),
        ("name", summary["name"]),
        ("layers", ",".join(summary["layers"])),
        ("parameters", f"{summary['num_params']:,} ({summary['param_bytes']:,} bytes)"),
        ("dtype", summary["dtype"]),
        ("checkpoint", summary["checkpoint"]),
        ("tokenizer", ", ".join(summary["tokenizer"]) or "none (text is byte-level)"),
    ]
    print(key_value(rows))
    return 0


def add_prefill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefill",
        help="prefill a prompt and write its model state (and first token) to a file",
        description="Run a prompt through the prefill engine and write the state's frames plus "
        "a handoff frame (first token, sampling settings) to a state file that `prfaas decode` "
        "continues, in this process or another.",
        epilog="example: prfaas prefill --prompt-ids 5,17,42 --out /tmp/state.prfs --json",
    )
    add_model_flags(p)
    add_prompt_flags(p)
    p.add_argument("--out", required=True, metavar="FILE", help="state file to write")
    p.add_argument(
        "--chunk-len", type=int, default=512, help="tokens per prefill call (default: 512)"
    )
    p.add_argument(
        "--wire",
        metavar="PRECISION",
        default="native",
        help="encode the state in this wire precision: native (exact, the default), bf16, "
        "fp8_e4m3, int8, or per kind as state=int8,kv=bf16 (docs/wire-format.md)",
    )
    add_sampling_flags(p)
    add_impl_flag(p)
    add_mesh_flag(p)
    add_max_len_flag(p)
    add_json_flag(p)
    p.set_defaults(run=_run_prefill)


def _run_prefill(args: argparse.Namespace) -> int:
    from prfaas_jax.cli.state_files import prefill_to_file

    if args.chunk_len < 1:
        raise UserError("--chunk-len must be at least 1")
    try:
        precision = WirePrecision.parse(args.wire)
    except ValueError as err:
        raise UserError(f"--wire: {err}") from None
    written = prefill_to_file(
        _request(args), args.out, chunk_len=args.chunk_len, precision=precision
    )
    return _print_result(args, written)


def add_decode(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode",
        help="continue a state file written by `prfaas prefill`",
        description="Check a state file against the model, load it into the decode engine and "
        "generate the tokens after its first token (sampling as recorded by prefill). --model "
        "and --seed must be the ones the file was prefilled with.",
        epilog="example: prfaas decode --state /tmp/state.prfs --max-new-tokens 8 --json",
    )
    add_model_flags(p)
    p.add_argument("--state", required=True, metavar="FILE", help="state file to continue")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=16,
        help="tokens to make after the file's first token (default: 16)",
    )
    add_impl_flag(p)
    add_mesh_flag(p)
    add_max_len_flag(p)
    add_json_flag(p)
    p.set_defaults(run=_run_decode)


def _run_decode(args: argparse.Namespace) -> int:
    from prfaas_jax.cli.state_files import decode_file

    _check_new_tokens(args)
    result = decode_file(
        args.state,
        model=args.model,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        impl=args.impl,
        mesh=args.mesh,
        max_len=args.max_len,
    )
    return _print_result(args, result)


def add_state(sub: argparse._SubParsersAction) -> None:
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
    add_json_flag(inspect)
    inspect.set_defaults(run=_run_state_inspect)


def _run_state_inspect(args: argparse.Namespace) -> int:
    from prfaas_jax.cli.state_files import format_inspection, inspect_file

    info = inspect_file(args.file)
    if args.json:
        print_json(info)
    else:
        print(format_inspection(info))
    return 0
