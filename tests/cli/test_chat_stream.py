"""`prfaas chat` shows a reply as it arrives: the chat loop (`chat_loop`) against an in-process
cluster of fake engines whose decode worker takes 20 ms a step, its output stream recording
when each piece was written.

Oracles: the fake model's tokens (`fake_tokens`), shown whole the way the terminal shows a reply
(the UTF-8 decode of the bytes, with what is not UTF-8 escaped), and the clock: the first piece
of the reply is written while the decode worker still has many steps to go.
"""

from __future__ import annotations

import io
import time

import pytest
from serving_support import fake_config, fake_instances, serve_in_process

from prfaas_jax.cli.chat_command import chat_loop
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, fake_tokens
from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.loadgen.chat import Conversation

CFG = load_model_config("tiny")
STEP_S = 0.02
NEW = 40  # tokens per reply: 0.8 s of decode steps


class Recorded(io.StringIO):
    """An output stream that remembers when each write came."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.writes.append((time.monotonic(), text))
        return super().write(text)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    config = load_cluster_config(fake_config(tmp_path_factory.mktemp("chat") / "cluster.toml"))
    engines = fake_instances(CFG)
    slow = FakeDecodeEngine(CFG, max_slots=4, max_len=512, step_s=STEP_S)
    engines["pd-1"] = (Role.PD_DECODE, slow)
    with serve_in_process(config, engines) as cluster:
        yield cluster.router


def _shown_whole(tokens: list[int]) -> str:
    text = bytes(tokens).decode("utf-8", errors="backslashreplace")
    return "".join(c if c.isprintable() or c == "\\" else repr(c)[1:-1] for c in text)


def _reply_writes(out: Recorded) -> list[tuple[float, str]]:
    """The writes of the reply itself: after ``model> `` and before the summary line."""
    first = next(i for i, (_, t) in enumerate(out.writes) if t.startswith("model> "))
    last = next(i for i, (_, t) in enumerate(out.writes) if "[turn 1: " in t)
    return [(at, t) for at, t in out.writes[first:last] if t.removeprefix("model> ").strip("'")]


@pytest.mark.parametrize("ids", [False, True])
def test_a_reply_is_shown_as_its_tokens_arrive(router, ids):
    conversation = Conversation(router, max_new_tokens=NEW, tokenizer=ByteTokenizer())
    message = "1,2,3" if ids else "stream this"
    prompt = [1, 2, 3] if ids else ByteTokenizer().encode(message + "\n")
    tokens = fake_tokens(prompt, NEW, CFG.vocab_size)
    out = Recorded()
    failed = chat_loop(conversation, io.StringIO(message + "\n"), out, ids=ids)
    assert failed == 0
    reply = ",".join(map(str, tokens)) if ids else f"'{_shown_whole(tokens)}'"
    lines = out.getvalue().split("\n")
    assert lines[0] == f"model> {reply}"
    assert lines[1].startswith("  [turn 1: ") and lines[2:] == [""]
    pieces = _reply_writes(out)
    assert len(pieces) >= 5  # in pieces, not whole
    # The first piece came while at least half the decode steps were still to run.
    assert pieces[-1][0] - pieces[0][0] > NEW * STEP_S / 2
