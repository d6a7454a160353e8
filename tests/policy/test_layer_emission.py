"""The layer-wise emission model (policy/layer_emission.py) against hand-computed cases: the
simulator's K equal pieces, a link slower than the compute, and the same bytes in the other
order."""

from __future__ import annotations

import pytest

from prfaas_jax.policy.layer_emission import Group, exposed_transfer_s, uniform_groups


def test_equal_pieces_on_a_fast_link_expose_the_last_piece():
    # 8 Gbps = 1 GB/s; 60 pieces of 1 s of compute and 1 GB of state in all: each piece's
    # 16.7 MB leaves in 16.7 ms, before the next is computed; the last one is exposed — the
    # simulator's S / (K · B).
    groups = uniform_groups(prefill_s=1.0, nbytes=1e9, chunks=60)
    assert exposed_transfer_s(groups, gbps=8.0) == pytest.approx(1.0 / 60)


def test_a_slow_link_exposes_what_it_could_not_send():
    # 2 GB on a 1 GB/s link, produced in two halves at 0.5 s and 1 s: the link sends from
    # 0.5 s to 2.5 s, 1.5 s after the prefill's end.
    groups = [Group(0.5, 1e9), Group(0.5, 1e9)]
    assert exposed_transfer_s(groups, gbps=8.0) == pytest.approx(1.5)


def test_the_same_bytes_first_hide_and_last_show():
    big_first = [Group(0.25, 0.75e9), Group(0.25, 0), Group(0.25, 0), Group(0.25, 0.05e9)]
    big_last = list(reversed(big_first))
    # First: 0.75 s on the link from 0.25 s (done at 1.0 s), then the last 0.05 GB at 1.0 s.
    assert exposed_transfer_s(big_first, gbps=8.0) == pytest.approx(0.05)
    # Last: 0.05 GB leaves at 0.25 s; the 0.75 GB are ready at 1.0 s and all exposed.
    assert exposed_transfer_s(big_last, gbps=8.0) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="positive rate"):
        exposed_transfer_s(big_first, gbps=0.0)
