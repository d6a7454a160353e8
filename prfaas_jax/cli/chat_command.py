"""`prfaas chat`: a multi-turn conversation with a running cluster from the terminal.

Each line read from stdin is a message (text, or token ids with ``--ids``); the reply is printed
with one line on what the turn cost: the route, the cached share of the conversation, TTFT and
the state bytes shipped (serving/loadgen/chat.py). ``/reset`` starts a new conversation, an
empty line is skipped, end of input (Ctrl-D) ends the session. With ``--json`` each turn is one
JSON line. Exit status 1 when any turn failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from prfaas_jax.cli.flags import add_json_flag, add_sampling_flags, parse_int_list
from prfaas_jax.cli.serving_commands import (
    add_client_security_flags,
    add_router_flags,
    client_security,
    read_ready_file,
)
from prfaas_jax.errors import UserError

if TYPE_CHECKING:
    from prfaas_jax.serving.loadgen.chat import Turn

RESET = "/reset"


def add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="hold a multi-turn conversation with a running cluster (`prfaas serve`)",
        description="Read messages from stdin, one per line, and send each turn as the whole "
        "conversation so far to the router, as a chat client would. After each reply a line "
        "shows where the turn went and what the prefix cache and the link did: route, prompt "
        "and cached tokens, TTFT, state bytes shipped. /reset starts over; Ctrl-D ends.",
        epilog="example: prfaas serve --ready-file ready.json & prfaas chat --ready-file "
        "ready.json",
    )
    add_router_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per reply (default: 32)")
    p.add_argument(
        "--ids",
        action="store_true",
        help="messages are token ids (comma-separated) rather than text",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a directory with tokenizer.json for the text (default: the served checkpoint's, "
        "if it has one; else byte-level)",
    )
    add_sampling_flags(p)
    p.add_argument("--timeout", type=float, default=300.0, help="per-turn deadline in s")
    add_client_security_flags(p)
    add_json_flag(p, help="print each turn as one JSON line")
    p.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    import grpc

    from prfaas_jax.engine.sampling_params import SamplingParams
    from prfaas_jax.engine.tokenizer import load_tokenizer
    from prfaas_jax.serving.loadgen.chat import Conversation
    from prfaas_jax.serving.proto import prfaas_pb2 as pb
    from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
    from prfaas_jax.serving.transport.security import router_channel

    router = args.router or read_ready_file(args.ready_file)["router"]
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.sample_seed
    )
    interactive = sys.stdin.isatty()
    failed = 0
    with router_channel(router, client_security(args)) as channel:
        stub = pb_grpc.RouterStub(channel)
        try:
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        except grpc.RpcError as err:
            raise UserError(f"no router at {router}: {err.code().name}: {err.details()}") from None
        tokenizer = (
            None
            if args.ids
            else load_tokenizer(stats.model, stats.vocab_size, override=args.tokenizer)
        )
        conversation = Conversation(
            stub,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            timeout_s=args.timeout,
            tokenizer=tokenizer,
        )
        if not args.json:
            print(
                f"chat with {stats.model} at {router}: up to {stats.max_len:,} tokens of "
                f"conversation; {RESET} starts over, Ctrl-D ends",
                file=sys.stderr,
            )
        while True:
            if interactive:
                print("you> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            message = line.rstrip("\n")
            if not message.strip():
                continue
            if message.strip() == RESET:
                conversation.reset()
                continue
            try:
                if args.ids:
                    turn = conversation.say_ids(parse_int_list(message))
                else:
                    turn = conversation.say(message)
            except (UserError, argparse.ArgumentTypeError) as err:
                failed += 1
                print(f"error: {err}", file=sys.stderr)
                continue
            if args.json:
                print(json.dumps(turn.to_json()), flush=True)
            else:
                print(f"model> {_shown(turn)}\n  [{turn.summary()}]", flush=True)
    return 1 if failed else 0


def _shown(turn: Turn) -> str:
    """A reply for the terminal: text with the bytes that are not UTF-8 escaped (``\\xa3``),
    so a model that answers in raw byte values shows them; token ids for ``--ids``."""
    if turn.text is None:
        return ",".join(map(str, turn.tokens))
    if any(not 0 <= token < 256 for token in turn.tokens):  # beyond the byte range
        return repr(turn.text)
    text = bytes(turn.tokens).decode("utf-8", errors="backslashreplace")
    printable = (c if c.isprintable() or c == "\\" else repr(c)[1:-1] for c in text)
    return "'" + "".join(printable) + "'"
