"""Flag groups several commands share, and what reads them back.

`add_model_flags` (--model, --seed), `add_prompt_flags` (--prompt-ids | --prompt |
--prompt-ids-file | --prompt-file),
`add_sampling_flags` (--temperature, --top-k, --top-p, --sample-seed), `add_max_len_flag`,
`add_impl_flag`,
`add_mesh_flag`, `add_compile_cache_flag` (read back by `use_compile_cache`) and `add_json_flag`
declare them; `parse_int_list` is the type of comma-separated integer flags, `print_json` writes a
``--json`` payload to stdout. Declaring a group in one place
keeps its names, defaults and help texts the same in every command.
"""

from __future__ import annotations

import argparse
import json
import sys

from prfaas_jax.config import Impl


def parse_int_list(text: str) -> list[int]:
    """``"5,17,42"`` → [5, 17, 42]; an argparse type, so a bad value is a usage error."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def print_json(payload: object) -> None:
    json.dump(payload, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def add_json_flag(p: argparse.ArgumentParser, help: str = "print machine-readable JSON") -> None:
    p.add_argument("--json", action="store_true", help=help)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name or model TOML path (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights (default: 0)")


def add_prompt_flags(p: argparse.ArgumentParser) -> None:
    """One prompt, four ways; `cli.prompt_input.prompt_from_args` reads them back."""
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", type=parse_int_list, help="comma-separated token ids")
    prompt.add_argument(
        "--prompt",
        help="text, encoded with the checkpoint's tokenizer.json if it has one, else byte-level",
    )
    prompt.add_argument(
        "--prompt-ids-file",
        metavar="FILE",
        help="token ids from FILE ('-': stdin): integers separated by commas or whitespace, or "
        "a 1-D integer .npy array (for prompts too long for a command line)",
    )
    prompt.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="text from FILE ('-': stdin), encoded like --prompt",
    )


def add_max_len_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-len",
        type=int,
        metavar="N",
        help="tokens (prompt + new) this run may hold, in place of the model's max_len: "
        "raise it for long prompts on a small preset (default: the model's)",
    )


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    p.add_argument("--sample-seed", type=int, default=0, help="seed for sampling (default: 0)")


def add_impl_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        default="chunk",
        choices=[impl.value for impl in Impl],
        help="op implementation: token-by-token reference, chunked (default) or Pallas kernels "
        "(interpreted on CPU, compiled on GPU/TPU)",
    )


def add_mesh_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        metavar="SPEC",
        help="shard the model over a device mesh, e.g. tensor=4 or tensor=2,expert=4[,data=K] "
        "(default: one device; multi-host and CPU testing: docs/sharding.md)",
    )


def add_compile_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="compile everything afresh instead of through JAX's persistent cache "
        "($JAX_COMPILATION_CACHE_DIR, else ~/.cache/prfaas_jax/xla), and draw a preset's "
        "seeded weights afresh instead of reading them from ~/.cache/prfaas_jax/weights",
    )


def use_compile_cache(args: argparse.Namespace) -> None:
    """Honour `add_compile_cache_flag`: call before anything compiles."""
    if args.compile_cache:
        from prfaas_jax.engine.compile_cache import enable_compile_cache, enable_weights_cache

        enable_compile_cache()
        enable_weights_cache()
