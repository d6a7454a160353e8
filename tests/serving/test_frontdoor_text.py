"""`TextStream` (serving/frontdoor/text.py) against one-shot decoding.

Oracles: without stop strings, the pieces of any split of the ids join to
``ByteTokenizer.decode`` of all of them; with stop strings, to that text up to the first
occurrence of any of them (``str.find``), and nothing after.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.serving.frontdoor.text import TextStream

DECODE = ByteTokenizer().decode
# Multi-byte characters, stray continuation bytes, and ids past the byte range.
IDS = st.lists(
    st.one_of(
        st.integers(0, 255),
        st.sampled_from([*"é€😀".encode(), 0x80, 0xBF, 300]),
    ),
    max_size=40,
)


def streamed(ids: list[int], cuts: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    stream = TextStream(stop)
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    pieces = [stream.push(ids[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*pieces, stream.finish()], stream.stopped


@settings(max_examples=300)
@given(IDS, st.lists(st.integers(0, 64), max_size=10))
def test_pieces_join_to_the_one_shot_decoding(ids, cuts):
    pieces, stopped = streamed(ids, cuts)
    assert "".join(pieces) == DECODE(ids) and not stopped


@settings(max_examples=300)
@given(IDS, st.lists(st.integers(0, 64), max_size=10), st.data())
def test_a_stop_string_cuts_the_text_where_it_first_appears(ids, cuts, data):
    text = DECODE(ids)
    start = data.draw(st.integers(0, max(len(text) - 1, 0)))
    size = data.draw(st.integers(1, 3))
    stop = (text[start : start + size] or "zz", "\x00never\x00")
    pieces, stopped = streamed(ids, cuts, stop)
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    assert "".join(pieces) == (text[: min(found)] if found else text)
    assert stopped == bool(found)


def test_one_token_at_a_time_holds_back_a_possible_stop():
    stream = TextStream(("lo w",))
    pieces = [stream.push([b]) for b in b"hello world"]
    # Three characters held back; "hel" sent; "lo w" found whole at the 7th token; then nothing.
    assert pieces == ["", "", "", "h", "e", "l", "", "", "", "", ""]
    assert stream.stopped
    assert stream.push(list(b"more")) == "" and stream.finish() == ""


def test_an_unfinished_character_waits_for_its_last_byte():
    stream = TextStream()
    euro = list("€".encode())
    assert [stream.push([b]) for b in euro] == ["", "", "€"]
    assert stream.push(euro[:2]) == "" and stream.finish() == "\N{REPLACEMENT CHARACTER}"
