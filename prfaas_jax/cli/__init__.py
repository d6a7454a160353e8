"""The ``prfaas`` command: `main` and `build_parser`.

One module per command group declares its subcommands' flags and runs them: cli/model_commands.py
(generate, prefill, decode, state, convert-hf), cli/training_commands.py (train),
cli/planning_commands.py (plan, simulate, kv), cli/codesign_commands.py (codesign),
cli/profile_command.py (profile), cli/serving_commands.py (demo, serve, certs, soak),
cli/bench_command.py (bench), cli/experiment_command.py (experiment), cli/chat_command.py (chat)
and cli/openai_command.py (openai); cli/flags.py holds the flag groups they share,
cli/prompt_input.py the prompts read from files and cli/progress.py the progress display.
Heavy imports (JAX, gRPC) happen only inside the run functions, so ``prfaas --help`` starts
instantly.

`main` turns a `UserError` into one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from prfaas_jax.cli import (
    bench_command,
    chat_command,
    codesign_commands,
    experiment_command,
    model_commands,
    openai_command,
    planning_commands,
    profile_command,
    serving_commands,
    training_commands,
    wirecheck_command,
)
from prfaas_jax.engine.tracing_gc import collect_for_tracing
from prfaas_jax.errors import UserError

Runner = Callable[[argparse.Namespace], int]

# The order of `prfaas --help`: the main job first, then the model, planning and serving tools.
_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    serving_commands.add_demo,
    model_commands.add_generate,
    model_commands.add_prefill,
    model_commands.add_decode,
    model_commands.add_state,
    model_commands.add_convert_hf,
    training_commands.add_train,
    planning_commands.add_plan,
    planning_commands.add_simulate,
    planning_commands.add_kv,
    wirecheck_command.add_wirecheck,
    codesign_commands.add_codesign,
    profile_command.add_profile,
    serving_commands.add_serve,
    bench_command.add_bench,
    chat_command.add_chat,
    openai_command.add_openai,
    serving_commands.add_certs,
    serving_commands.add_soak,
    experiment_command.add_experiment,
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
        collect_for_tracing()
        return run(args)
    except UserError as err:
        print(f"prfaas {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prfaas {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`prfaas kv --json | head`): stop quietly, as Unix tools do. Point
        # stdout at /dev/null so the interpreter's final flush does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
