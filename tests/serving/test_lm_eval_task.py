"""The lm-eval task shipped in bench/lm_eval/recall/: its documents are what recall-tiny's
retrieval task asks (the first ones redrawn here with `recall_prompt`, every one checked against
the facts in its own prompt), and its tokenizer maps each character back to the token id the
document holds."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import pytest

from prfaas_jax.engine.tokenizer import load_tokenizer
from prfaas_jax.serving.loadgen.demo import recall_task
from prfaas_jax.train.tasks import recall_prompt

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
TASK = BENCH / "lm_eval" / "recall"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lm_eval_recall", BENCH / "lm_eval_recall.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASK / name).read_text("utf-8").splitlines()]


def test_the_tokenizer_maps_each_character_to_its_token_id():
    tokenizer = json.loads((TASK / "tokenizer" / "tokenizer.json").read_text("utf-8"))
    assert tokenizer["model"]["type"] == "BPE" and tokenizer["model"]["merges"] == []
    assert tokenizer["model"]["vocab"] == {chr(0x100 + i): i for i in range(256)}
    assert tokenizer["normalizer"] is None and tokenizer["pre_tokenizer"] is None


def test_the_documents_ask_what_their_prompts_hold(bench):
    docs, gen = read("recall.jsonl"), read("recall_gen.jsonl")
    assert len(docs) == bench.DOCS and len(gen) > 100
    for doc in docs:
        ids = doc["ids"]
        assert doc["context"] == "".join(chr(0x100 + t) for t in ids)
        facts = [ids[3 * f : 3 * f + 3] for f in range(4)]
        assert [k for k, _, _ in facts].count(ids[-1]) == 1  # the asked key, once in the facts
        assert doc["choices"] == ["".join(chr(0x100 + t) for t in fact[1:]) for fact in facts]
        assert facts[doc["gold"]][0] == ids[-1]
        assert doc["target"] == doc["choices"][doc["gold"]]
    for doc in gen:
        facts = [doc["ids"][3 * f : 3 * f + 3] for f in range(4)]
        (value,) = [fact[1:] for fact in facts if fact[0] == doc["ids"][-1]]
        assert len(bytes(value).decode("utf-8")) == 1  # one UTF-8 character, as chosen
        assert doc["answer"] == load_tokenizer("recall-tiny", 256).decode(value)  # served text


def test_the_first_documents_are_the_held_out_prompts(bench):
    spec = recall_task(bench.MODEL)
    key = jax.random.PRNGKey(bench.HELD_OUT_SEED)
    for i, doc in enumerate(read("recall.jsonl")[:3]):
        assert recall_prompt(jax.random.fold_in(key, i), spec)[0] == doc["ids"]


def test_the_yaml_tasks_name_the_shipped_files():
    for name, data in (("recall_mc", "recall.jsonl"), ("recall_ll", "recall.jsonl"),
                       ("recall_gen", "recall_gen.jsonl")):  # fmt: skip
        text = (TASK / f"{name}.yaml").read_text("utf-8")
        assert f"task: {name}\n" in text and f"test: {data}\n" in text
