"""How the soak judges one request's stream (serving/loadgen/soak_report.py: `classify_stream`):
a prefix of the expected tokens is fine, a repeated token is a duplicate, anything else wrong.
The soak itself runs a cluster of real processes: tests/cluster/test_soak.py."""

from __future__ import annotations

from prfaas_jax.serving.loadgen.soak_report import classify_stream


def test_classify_stream():
    expected = [10, 11, 12, 13, 14]
    assert classify_stream([], expected) == "ok"
    assert classify_stream([10, 11, 12], expected) == "ok"
    assert classify_stream(expected, expected) == "ok"
    # A resume that re-sent the last two tokens, then went on.
    assert classify_stream([10, 11, 12, 11, 12, 13], expected) == "duplicated"
    assert classify_stream([10, 11, 11], expected) == "duplicated"
    assert classify_stream([*expected, 14], expected) == "duplicated"  # longer than asked
    assert classify_stream([10, 12, 13], expected) == "wrong"  # a gap
    assert classify_stream([10, 11, 99], expected) == "wrong"
