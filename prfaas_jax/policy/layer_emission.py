"""Layer-wise emission of a prefill's state onto a link: `exposed_transfer_s(groups, gbps)` and
`uniform_groups(prefill_s, nbytes, chunks)`.

The prefill computes its layers in groups, in order; when a group is done its states are final
and enter the link, which sends them first in, first out at ``gbps``, while the later groups
compute. The exposed transfer is what the link still has to send when the prefill ends: the
time from the prefill's end until the last byte has left. A layout whose big (growing) states
sit in early layers ships them while the later layers compute; one whose big states sit last
exposes them whole.

The simulator's layer-wise link (sim/simulator.py, ``[link] layerwise``, ``chunks = K``) is the
case of K equal groups, each a K-th of the compute and of the bytes: on a link faster than the
compute both give the last K-th of the state at the link's rate, S / (K · B). (The simulator
lets the first (K − 1)/K enter the link when the prefill starts; here a group enters only when
computed, so on a link slower than the compute this model exposes one group's compute more.)
Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """One group of layers: its compute time and the bytes of the states it makes final."""

    compute_s: float
    nbytes: float


def link_seconds(nbytes: float, gbps: float) -> float:
    return 8.0 * nbytes / (gbps * 1e9)


def exposed_transfer_s(groups: Sequence[Group], gbps: float) -> float:
    """Seconds from the end of the prefill (the last group's compute) until the link has sent
    every group's bytes, each group entering it when its compute ends."""
    if not gbps > 0:
        raise ValueError(f"the link needs a positive rate, got {gbps} Gbps")
    now = link_free = 0.0
    for group in groups:
        if group.compute_s < 0 or group.nbytes < 0:
            raise ValueError("a group needs compute_s ≥ 0 and nbytes ≥ 0")
        now += group.compute_s
        if group.nbytes:
            link_free = max(link_free, now) + link_seconds(group.nbytes, gbps)
    return max(0.0, link_free - now)


def uniform_groups(prefill_s: float, nbytes: float, chunks: int) -> list[Group]:
    """The simulator's layer-wise pieces: ``chunks`` equal groups of compute and bytes."""
    return [Group(prefill_s / chunks, nbytes / chunks) for _ in range(chunks)]
