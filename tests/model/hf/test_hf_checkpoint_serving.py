"""An imported Hugging Face checkpoint served with its own tokenizer: a tiny Qwen3-Next with a
byte-level BPE tokenizer and a ChatML template goes through `prfaas convert-hf` (which copies the
tokenizer files), `prfaas generate --prompt` and the OpenAI front door of a cluster whose
``[model] preset`` is the converted checkpoint (router and real JAX engines in this process).

The oracles are independent of the code under test: `transformers`' tokenizer loaded from the
same files (prompt ids, chat-template ids, decoded text) and single-process generation with the
model's own engines; the served text must equal that generation, cut at the first
end-of-sequence id, decoded by `transformers`.
"""

from __future__ import annotations

import json

import openai
import pytest
from hf_fixtures import make_tiny
from serving_support import fake_config, serve_in_process
from tokenizer_support import write_hf_tokenizer

from prfaas_jax.cli import main
from prfaas_jax.cli.prompt_input import prompt_digest
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.generate import generate
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import GREEDY
from prfaas_jax.model.weights import load_model
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.frontdoor.app import cluster_front_door

transformers = pytest.importorskip("transformers")

MAX_LEN = 256
NEW = 12
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MESSAGES = [
    {"role": "system", "content": "Answer with one colour."},
    {"role": "user", "content": "Which door opens after sunset? ünïcödé 🚀"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF directory, converted checkpoint, transformers' tokenizer of the HF directory)."""
    root = tmp_path_factory.mktemp("hf-serving")
    hf = make_tiny("qwen3_next", root / "hf", vocab_size=384)
    write_hf_tokenizer(hf, vocab_size=320)
    out = root / "ckpt"
    assert main(["convert-hf", str(hf), str(out), "--json"]) == 0
    return hf, out, transformers.AutoTokenizer.from_pretrained(str(hf))


def expected(cfg, params, reference, prompt_ids: list[int], n: int) -> tuple[str, list[int]]:
    """Single-process greedy generation cut after the first end-of-sequence id, and its text."""
    tokens, _, _ = generate(params, cfg, prompt_ids, n, GREEDY)
    eos = {reference.convert_tokens_to_ids("<|im_end|>"), reference.eos_token_id}
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    kept = tokens if cut is None else tokens[: cut + 1]
    return reference.decode(kept, skip_special_tokens=True), kept


def test_convert_hf_copies_the_tokenizer_files(checkpoint, capsys):
    hf, out, _ = checkpoint
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (hf / name).read_bytes()
    assert main(["convert-hf", str(hf), str(out), "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] == list(TOKENIZER_FILES)


def test_generate_prompt_text_goes_through_the_checkpoints_tokenizer(checkpoint, capsys):
    _, out, reference = checkpoint
    text = "The key to the blue door is"
    argv = ["generate", "--checkpoint", str(out), "--prompt", text, "--max-new-tokens", "6"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ids = reference(text)["input_ids"]
    assert (result["prompt_len"], result["prompt_sha256"]) == (len(ids), prompt_digest(ids))
    assert result["text"] == reference.decode(result["tokens"], skip_special_tokens=True)


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """The converted checkpoint behind a router (t = 64) and the front door of its config."""
    _, out, _ = checkpoint
    cfg, params = load_model(str(out))
    path = tmp_path_factory.mktemp("hf-cluster") / "cluster.toml"
    sections = {"model": {"preset": str(out), "engine": "jax"}, "engine": {"max_len": MAX_LEN}}
    config = load_cluster_config(fake_config(path, **sections))
    prefill = PrefillEngine(cfg, params, buckets=[32, 128], chunk_len=128)  # one request at a time
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, prefill),
        "pd-1": (Role.PD_DECODE, DecodeEngine(cfg, params, max_slots=2, max_len=MAX_LEN)),
    }
    with (
        serve_in_process(config, engines) as cluster,
        cluster_front_door(config, cluster.servers["router"].address) as door,
    ):
        client = openai.OpenAI(base_url=door.base_url, api_key="-", max_retries=0)
        yield client, str(out), cfg, params


def test_the_sdk_streams_a_chat_whose_text_is_the_models_generation(served, checkpoint):
    client, model, cfg, params = served
    reference = checkpoint[2]
    prompt_ids = list(
        reference.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    text, kept = expected(cfg, params, reference, prompt_ids, NEW)
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(kept))


@pytest.mark.parametrize("prompt", ["Prefill as a service ships", "x" * 90])  # PD, PrfaaS
def test_a_completion_of_text_equals_the_models_generation(served, checkpoint, prompt):
    client, model, cfg, params = served
    reference = checkpoint[2]
    prompt_ids = reference(prompt)["input_ids"]
    text, kept = expected(cfg, params, reference, prompt_ids, NEW)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0)
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == ("length" if len(kept) == NEW else "stop")
    assert reply.usage.completion_tokens == len(kept)


def test_a_conversation_the_template_refuses_is_a_400(served):
    client, model, _, _ = served
    with pytest.raises(openai.BadRequestError, match="may not open with the assistant"):
        client.chat.completions.create(
            model=model, messages=[{"role": "assistant", "content": "hello"}], max_tokens=2
        )
