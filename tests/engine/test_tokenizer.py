"""The byte-level tokenizer of the toy presets: UTF-8 round trip, and U+FFFD for what is not
text (a token beyond the byte range, an invalid byte sequence)."""

from __future__ import annotations

import pytest

from prfaas_jax.engine.tokenizer import ByteTokenizer, check_byte_vocab
from prfaas_jax.errors import UserError

REPLACEMENT = "\ufffd"


def test_round_trip_of_utf8_text():
    tokenizer = ByteTokenizer()
    text = "PrfaaS: Λ_max ≈ 3.24 — 🚀"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= t < 256 for t in ids)
    assert tokenizer.decode(ids) == text


def test_tokens_beyond_the_bytes_print_as_the_replacement_character():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, 256, 105]) == f"h{REPLACEMENT}i"
    assert tokenizer.decode([300, 70000]) == REPLACEMENT * 2
    # A token beyond the bytes cuts a multi-byte character: the cut bytes are replaced too.
    euro = list("€".encode())
    assert tokenizer.decode([*euro[:2], 256, *euro]) == f"{REPLACEMENT}{REPLACEMENT}€"


def test_invalid_utf8_prints_as_the_replacement_character():
    assert ByteTokenizer().decode([0x61, 0xFF, 0x62]) == f"a{REPLACEMENT}b"


def test_prompt_text_needs_the_byte_vocabulary():
    check_byte_vocab(256)
    with pytest.raises(UserError, match="at least 256"):
        check_byte_vocab(255)
