"""`prfaas chat`: a multi-turn conversation with a running cluster from the terminal.

Each line read from stdin is a message (text, or token ids with ``--ids``); the reply is printed
as its tokens arrive (`chat_loop`), then one line on what the turn cost: the route, the cached
share of the conversation, TTFT and the state bytes shipped (serving/loadgen/chat.py).
``/reset`` starts a new conversation, an empty line is skipped, end of input (Ctrl-D) ends the
session. With ``--json`` each turn is one JSON line. Exit status 1 when any turn failed.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from typing import TYPE_CHECKING, TextIO

from prfaas_jax.cli.flags import add_json_flag, add_sampling_flags, parse_int_list
from prfaas_jax.cli.serving_commands import (
    add_client_security_flags,
    add_router_flags,
    client_security,
    read_ready_file,
)
from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.errors import UserError

if TYPE_CHECKING:
    from prfaas_jax.engine.tokenizer import Tokenizer
    from prfaas_jax.serving.loadgen.chat import Conversation, Turn

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
        failed = chat_loop(
            conversation, sys.stdin, sys.stdout, ids=args.ids, json_lines=args.json,
            tokenizer=tokenizer, prompt=sys.stdin.isatty(),
        )  # fmt: skip
    return 1 if failed else 0


def chat_loop(
    conversation: Conversation,
    lines: TextIO,
    out: TextIO,
    *,
    ids: bool = False,
    json_lines: bool = False,
    tokenizer: Tokenizer | None = None,
    prompt: bool = False,
) -> int:
    """Each line of `lines` a turn of `conversation` until the end of input; each reply written
    to `out` as its tokens arrive (one JSON line per turn with `json_lines`), then the turn's
    summary. `prompt`: ask with ``you>`` on stderr. The number of turns that failed."""
    failed = 0
    while True:
        if prompt:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = lines.readline()
        if not line:
            return failed
        message = line.rstrip("\n")
        if not message.strip():
            continue
        if message.strip() == RESET:
            conversation.reset()
            continue
        echo = None if json_lines else ReplyEcho(out, None if ids else tokenizer or ByteTokenizer())
        try:
            if ids:
                turn = conversation.say_ids(parse_int_list(message), echo and echo.push)
            else:
                turn = conversation.say(message, echo and echo.push)
        except (UserError, argparse.ArgumentTypeError) as err:
            failed += 1
            if echo is not None:
                echo.abandon()
            print(f"error: {err}", file=sys.stderr)
            continue
        if echo is None:
            print(json.dumps(turn.to_json()), file=out, flush=True)
        else:
            echo.end(turn)


class ReplyEcho:
    """One reply written to `out` as its tokens arrive: ``model> '…'`` with the bytes that are
    not UTF-8 escaped (``\\xa3``: a model that answers in raw byte values shows them) and other
    characters that do not print spelled as Python escapes, or ``model> 1,2,3`` for token ids
    (`tokenizer` None: ``--ids``); then, at `end`, the turn's summary line."""

    def __init__(self, out: TextIO, tokenizer: Tokenizer | None) -> None:
        self.out, self.tokenizer, self.started = out, tokenizer, False
        self.bytes = tokenizer is None or isinstance(tokenizer, ByteTokenizer)
        self.decoder = (
            codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
            if self.bytes
            else tokenizer.detokenizer()  # type: ignore[union-attr]
        )

    def _write(self, text: str) -> None:
        if not self.started:
            self.out.write("model> " + ("" if self.tokenizer is None else "'"))
            self.started = True
        self.out.write(text)
        self.out.flush()

    def push(self, token_ids: list[int]) -> None:
        if self.tokenizer is None:
            self._write(("," if self.started else "") + ",".join(map(str, token_ids)))
        elif self.bytes:  # an id past the byte range is U+FFFD, as the tokenizer decodes it
            text = "".join(
                self.decoder.decode(bytes([t]))
                if t < 256
                else self.decoder.decode(b"", final=True) + "\ufffd"  # what came before it
                for t in token_ids
            )
            self._write(_printable(text))
        else:
            self._write(_printable(self.decoder.push(token_ids)))

    def _close(self) -> None:
        if self.tokenizer is not None:
            tail = self.decoder.decode(b"", final=True) if self.bytes else self.decoder.finish()
            self._write(_printable(tail) + "'")
        elif not self.started:
            self._write("")

    def end(self, turn: Turn) -> None:
        self._close()
        self.out.write(f"\n  [{turn.summary()}]\n")
        self.out.flush()

    def abandon(self) -> None:
        """A turn that failed: end the line of what came (if anything did)."""
        if self.started:
            self._close()
            self.out.write("\n")
            self.out.flush()


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c == "\\" else repr(c)[1:-1] for c in text)
