"""`prfaas chat` against `prfaas serve` with no config given (the toy cluster, as `prfaas demo`
runs it): a five-turn text conversation that grows past the 512 tokens the toy once held, where
from the second turn every report shows the whole previous prompt as cached — the prefix cache
at work, seen from the command line — and the replies are the model's greedy continuations.
Then the chat's one-line errors: a router that is not there, and a turn past max_len."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from serving_support import prfaas_serve

from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.model import init_state, prefill
from prfaas_jax.model.weights import load_model
from prfaas_jax.serving.cluster_config import load_cluster_config

TIE_LOGIT = 1e-4
# Five messages of 100-200 bytes: with 32-token replies the conversation passes 700 tokens.
MESSAGES = [
    "The key to the blue door is under the third stone of the garden path, left side. " * 2,
    "Remember also that the red door opens only after sunset, and only from the inside.",
    "Which door did I say opens only after sunset? Answer with one colour, please. " * 2,
    "Now list both doors and where their keys are, in the order I first mentioned them. " * 2,
    "Thank you. Summarise the whole conversation so far in a single short sentence. " * 2,
]
NEW_TOKENS = 32


def chat(ready_file, lines: list[str], *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "prfaas_jax.cli", "chat", "--ready-file", str(ready_file)]
    return subprocess.run(
        [*command, "--max-new-tokens", str(NEW_TOKENS), *extra],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_greedy(turns: list[dict], contexts: list[list[int]]) -> None:
    """One teacher-forced reference pass over the final conversation checks every reply."""
    cfg, params = load_model(load_cluster_config("toy").model.preset, seed=0)
    final = contexts[-1] + turns[-1]["tokens"]
    logits, _ = prefill(
        params, cfg, jnp.asarray([final], jnp.int32), init_state(cfg, 1, len(final))
    )
    logits = np.asarray(logits[0])
    for turn, context in zip(turns, contexts, strict=True):
        for i, token in enumerate(turn["tokens"]):
            step = logits[len(context) - 1 + i]
            assert step[token] >= step.max() - TIE_LOGIT, (turn["turn"], i)


@pytest.mark.slow
def test_a_five_turn_conversation_with_the_default_cluster(tmp_path, child_cache_home):
    with prfaas_serve(tmp_path, cache_home=child_cache_home) as ready_file:  # no --config
        result = chat(ready_file, MESSAGES, "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        turns = [json.loads(line) for line in result.stdout.splitlines()]
        shown = chat(ready_file, MESSAGES[:1])  # the human-readable form
        max_len = load_cluster_config("toy").engine.max_len
        too_long = chat(ready_file, ["x" * max_len])

    tokenizer = ByteTokenizer()
    contexts, context = [], []
    for message, turn in zip(MESSAGES, turns, strict=True):
        context = context + tokenizer.encode(message + "\n")
        contexts.append(context)
        assert turn["prompt_len"] == len(context) and len(turn["tokens"]) == NEW_TOKENS
        assert turn["text"] == tokenizer.decode(turn["tokens"])
        context = context + turn["tokens"] + tokenizer.encode("\n")
    assert [t["turn"] for t in turns] == [1, 2, 3, 4, 5]
    assert turns[0]["cached_len"] == 0
    for previous, turn in itertools.pairwise(turns):
        assert turn["cached_len"] == previous["prompt_len"], turn  # all of the last prompt
    assert turns[-1]["prompt_len"] + NEW_TOKENS > 512
    assert_greedy(turns, contexts)

    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("model> ") and "turn 1: " in shown.stdout
    assert "cached" in shown.stdout and "TTFT" in shown.stdout
    assert too_long.returncode == 1
    [error] = too_long.stderr.strip().splitlines()[-1:]
    assert error.startswith("error: the cluster refused the turn: INVALID_ARGUMENT")
    assert "Traceback" not in too_long.stderr


def test_chat_without_a_router_is_one_line(tmp_path):
    ready = tmp_path / "ready.json"
    ready.write_text(json.dumps({"router": "127.0.0.1:1"}))
    result = chat(ready, ["hello"])
    [line] = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "error: no router at 127.0.0.1:1: UNAVAILABLE" in line
    missing = chat(tmp_path / "missing.json", ["hello"])
    assert missing.returncode == 2 and "cannot read the ready file" in missing.stderr
