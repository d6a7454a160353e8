"""`prfaas chat` against `prfaas serve` with no config given (the toy cluster, as `prfaas demo`
runs it): a five-turn text conversation that grows past the 512 tokens the toy once held, where
from the second turn every report shows the whole previous prompt as cached — the prefix cache
at work, seen from the command line — and the replies are the model's greedy continuations.
Then the chat's one-line errors: a router that is not there, and a turn past max_len."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from serving_support import prfaas_serve, wait_for

from prfaas_jax.engine.tokenizer import load_tokenizer
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


def served_tokenizer():
    """The toy model's tokenizer: recall-tiny's printable one (ASCII text encodes as bytes)."""
    preset = load_cluster_config("toy").model.preset
    tokenizer = load_tokenizer(preset, 256)
    assert tokenizer.decode([203]) == "⟨v203⟩"
    return tokenizer


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


@pytest.fixture(scope="module")
def ready_file(tmp_path_factory, child_cache_home):
    """`prfaas serve` with no --config (the toy cluster) and its OpenAI front door, shared by
    this module's tests."""
    root = tmp_path_factory.mktemp("serve")
    with prfaas_serve(root, "--openai-port", "0", cache_home=child_cache_home) as ready:
        yield ready


@pytest.mark.slow
def test_a_five_turn_conversation_with_the_default_cluster(ready_file):
    result = chat(ready_file, MESSAGES, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    turns = [json.loads(line) for line in result.stdout.splitlines()]
    shown = chat(ready_file, MESSAGES[:1])  # the human-readable form
    max_len = load_cluster_config("toy").engine.max_len
    too_long = chat(ready_file, ["x" * max_len])

    tokenizer = served_tokenizer()
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


@pytest.mark.slow
def test_the_openai_sdk_streams_the_models_greedy_text(ready_file, tmp_path):
    """`prfaas openai` in front of the toy cluster: the `openai` SDK's streamed completion is
    single-process greedy generation decoded by the served tokenizer, with the right usage; a
    bad request is a 400 and the door keeps serving; SIGTERM stops it with status 0. The door
    `prfaas serve --openai-port` runs answers a chat the same way."""
    import openai

    from prfaas_jax.engine.generate import generate
    from prfaas_jax.engine.sampling import SamplingParams

    address_file = tmp_path / "door.json"
    command = [sys.executable, "-m", "prfaas_jax.cli", "openai", "--ready-file", str(ready_file)]
    door = subprocess.Popen(
        [*command, "--port", "0", "--address-file", str(address_file)], stderr=subprocess.PIPE
    )
    try:
        assert wait_for(address_file.exists, timeout_s=60), door.stderr.read1().decode()
        base_url = json.loads(address_file.read_text())["base_url"]
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        [model] = [m.id for m in client.models.list()]
        prompt = MESSAGES[0]
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=prompt, max_tokens=10**6)
        again = client.completions.create(model=model, prompt="a", max_tokens=2, temperature=0)
        served = openai.OpenAI(base_url=json.loads(ready_file.read_text())["openai"], api_key="-")
        chat = served.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "a"}], max_tokens=3, temperature=0
        )
    finally:
        door.send_signal(signal.SIGTERM)
        status = door.wait(timeout=30)
    cfg, params = load_model(model, seed=load_cluster_config("toy").model.seed)
    tokenizer = served_tokenizer()
    ids = tokenizer.encode(prompt)
    expected = generate(params, cfg, ids, NEW_TOKENS, SamplingParams())[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(expected)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    expected_again = generate(params, cfg, tokenizer.encode("a"), 2, SamplingParams())[0]
    assert again.choices[0].text == tokenizer.decode(expected_again)
    chat_ids = tokenizer.encode("<|user|>\na\n<|assistant|>\n")  # the documented template
    expected_chat = generate(params, cfg, chat_ids, 3, SamplingParams())[0]
    assert chat.choices[0].message.content == tokenizer.decode(expected_chat)
    assert status == 0
