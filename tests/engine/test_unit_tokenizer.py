"""The printable tokenizer of the recall models (engine/unit_tokenizer.py), as recall-tiny ships it.

Oracles: the ids themselves (decode then encode must give them back, one id at a time and in
sequences that put every unit beside every kind of neighbour), `ByteTokenizer` (ASCII text and
the byte-level chat template encode alike), the task's split of the vocabulary (keys below V/2,
values above), and `transformers`' fast tokenizer, what third-party clients load it as.
"""

from __future__ import annotations

import json
import random

import pytest

from prfaas_jax.engine.tokenizer import ByteTokenizer, HFTokenizer, byte_chat_text, load_tokenizer
from prfaas_jax.engine.unit_tokenizer import tokenizer_config, unit_text, unit_tokenizer
from prfaas_jax.toml_config import config_dir

FOLDER = config_dir() / "models" / "recall-tiny"
VOCAB = 256


@pytest.fixture(scope="module")
def served() -> HFTokenizer:
    tokenizer = load_tokenizer("recall-tiny", VOCAB)  # the preset name, as a cluster names it
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.directory == FOLDER
    return tokenizer


def test_every_id_is_one_printable_unit_that_encodes_back_to_it(served):
    texts = [served.decode([i]) for i in range(VOCAB)]
    assert len(set(texts)) == VOCAB
    for i, text in enumerate(texts):
        assert served.encode(text) == [i], (i, text)
        assert text.isprintable() or text in "\t\n", (i, text)
        assert text == unit_text(i, VOCAB)
    assert texts[65] == "A" and texts[17] == "⟨k17⟩" and texts[203] == "⟨v203⟩"
    assert texts[0] == "⟨unk⟩" and served.encode("é") == [0]  # outside the vocabulary
    assert served.eos_ids == frozenset()  # a recall model's replies run to their budget


def test_sequences_round_trip_and_stream_unit_by_unit(served):
    rng = random.Random(0)
    sequences = [list(range(VOCAB)), list(range(VOCAB))[::-1]]
    sequences += [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))] for _ in range(200)]
    for ids in sequences:
        assert served.encode(served.decode(ids)) == ids
    stream = served.detokenizer()
    pieces = [stream.push([i]) for i in sequences[0]]
    assert pieces == [unit_text(i, VOCAB) for i in sequences[0]] and stream.finish() == ""


def test_ascii_text_and_the_chat_template_encode_as_bytes_do(served):
    text = "Hello, PrfaaS!\tkeys <k17> and [v203]\n"
    assert served.encode(text) == ByteTokenizer().encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}]
    assert served.chat_ids(messages) == ByteTokenizer().encode(byte_chat_text(messages))


def test_the_shipped_files_are_what_the_module_writes():
    shipped = json.loads((FOLDER / "tokenizer.json").read_text("utf-8"))
    assert shipped == json.loads(unit_tokenizer(VOCAB).to_str())
    config = json.loads((FOLDER / "tokenizer_config.json").read_text("utf-8"))
    assert config == tokenizer_config(4096)


def test_transformers_loads_the_folder_by_path_and_counts_a_reply_exactly(served):
    """As a client's ``AutoTokenizer.from_pretrained(folder)`` loads it: as the class that
    ``tokenizer_config.json`` names (``PreTrainedTokenizerFast``, checked above)."""
    from transformers import PreTrainedTokenizerFast

    third_party = PreTrainedTokenizerFast.from_pretrained(str(FOLDER))
    ids = list(range(VOCAB))
    reply = served.decode(ids)
    assert third_party.encode(reply, add_special_tokens=False) == ids
    assert third_party.decode(ids) == reply and len(third_party) == VOCAB
