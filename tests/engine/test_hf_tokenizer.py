"""A checkpoint's own tokenizer (`HFTokenizer`, engine/tokenizer.py) against `transformers`
loading the same files: the ids of a prompt, the ids of a chat through its template, the text
of ids; its streamed text against its one-shot decode; and `load_tokenizer`'s choice."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_support import ENDOFTEXT, IM_END, write_hf_tokenizer

from prfaas_jax.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from prfaas_jax.errors import UserError

TEXTS = [
    "The key to the blue door",
    "  leading spaces, café, 日本語, 🚀 and a tab\there",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Answer with one colour."},
        {"role": "user", "content": "Which door opens after sunset?"},
        {"role": "assistant", "content": "The red one."},
        {"role": "user", "content": "ünïcödé 🚀"},
    ],
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_hf_tokenizer(tmp_path_factory.mktemp("hf-tokenizer"))


@pytest.fixture(scope="module")
def reference(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def tokenizer(directory):
    return HFTokenizer(directory)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert ids == reference(text)["input_ids"]
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_equal_transformers_chat_template(tokenizer, reference, messages):
    expected = reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.chat_ids(messages) == list(expected)
    assert tokenizer.chat_text(messages).endswith("<|im_start|>assistant\n")


def test_the_templates_own_refusal_is_a_user_error(tokenizer):
    with pytest.raises(UserError, match="may not open with the assistant"):
        tokenizer.chat_ids([{"role": "assistant", "content": "hello"}])


def test_end_of_sequence_ids_come_from_both_configs(tokenizer, reference):
    ids = {reference.convert_tokens_to_ids(IM_END), reference.convert_tokens_to_ids(ENDOFTEXT)}
    assert tokenizer.eos_ids == ids and tokenizer.vocab_size == len(reference)


@settings(max_examples=60)
@given(data=st.data())
def test_streamed_pieces_join_to_the_one_shot_decode(tokenizer, data):
    """Any ids (specials, ids that cut a character) in any grouping: the pieces plus what
    `finish` adds equal `decode` of all of them."""
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    stream = tokenizer.detokenizer()
    pieces = [stream.push(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    assert "".join(pieces) + stream.finish() == tokenizer.decode(ids)


def test_load_tokenizer_picks_the_directorys_own_or_the_byte_one(directory, tmp_path):
    assert isinstance(load_tokenizer(directory, 1000), HFTokenizer)
    assert isinstance(load_tokenizer("tiny", 256), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path, 256), ByteTokenizer)  # no tokenizer.json
    with pytest.raises(UserError, match="more than the model's vocabulary of 300"):
        load_tokenizer(directory, 300)
    with pytest.raises(UserError, match="at least 256"):
        load_tokenizer("tiny", 255)
    assert isinstance(load_tokenizer("tiny", 1000, override=directory), HFTokenizer)
    with pytest.raises(UserError, match=r"no tokenizer\.json there"):
        load_tokenizer(directory, 1000, override=tmp_path)


def test_broken_files_are_one_line_errors(directory, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="is not a JSON object"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": IM_END}))
    with pytest.raises(UserError, match="has no chat template"):
        HFTokenizer(tmp_path).chat_ids([{"role": "user", "content": "hi"}])
    broken = {"chat_template": "{% for m in messages %}{{ m['content'] ~ }}{% endfor %}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(broken))
    with pytest.raises(UserError, match="is not valid"):  # at load, not per request
        HFTokenizer(tmp_path)
    failing = {"chat_template": "{{ messages[0]['content'] + 1 }}"}  # str + int
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(failing))
    with pytest.raises(UserError, match="fails on these messages"):
        HFTokenizer(tmp_path).chat_ids([{"role": "user", "content": "hi"}])
