"""Fault injection in the prefill workers' state transfers: `FaultInjector` and `TransferFaults`.

Configured by the cluster's `[faults]` section (`FaultsSection`). Per state transfer (one
`PushState` stream from a prefill worker to a decode worker), independently:

- with probability `corrupt_frame_prob`, one byte of one data frame is flipped (XOR with a
  non-zero value) after the frame is made and before it is sent. Never the header, so the
  stream opens normally; the receiver's decoder finds the frame's CRC32 wrong and
  rejects the whole stream (INVALID_ARGUMENT), and the prefill RPC fails with that status.
- with probability `drop_transfer_prob`, the link dies midway: after k of the stream's n frames
  (k uniform in [1, n − 1], so the header always leaves and the handoff never does) the sender
  cancels the stream, as a dead connection would; the decode worker sees a cancelled RPC and
  the prefill RPC fails with UNAVAILABLE ("link dropped").
- with probability `blank_state_prob`, the state is replaced by zeros of the same shapes before it
  is encoded: a well-formed stream (header, checksums, trailer all valid) of a wrong state. No
  check on the wire can see it; only the tokens decoded from it can (`prfaas demo` with a trained
  recall model: the answers through the shipped state collapse).

Each worker draws from its own `random.Random(seed + crc32(name))`, so a run is reproducible
per worker (the order of transfers on a worker is the only source of variation). With both
probabilities zero `FaultInjector.build` returns None and the prefill path runs unchanged.
Injected faults are logged at INFO (`faults: …`, one line each; the soak harness counts them in
the workers' logs) and counted in `corrupted` / `dropped`.
"""

from __future__ import annotations

import logging
import random
import threading
import zlib

import jax
import jax.numpy as jnp

from prfaas_jax.engine.codec.format import DATA_MAGIC, DATA_PREFIX_SIZE, StateHeader
from prfaas_jax.model.state import ModelState
from prfaas_jax.serving.cluster_sections import FaultsSection

log = logging.getLogger("prfaas.faults")

# The log lines the soak harness (serving/loadgen/soak_report.py) counts; one per injected fault.
CORRUPT_MARK = "faults: corrupted"
DROP_MARK = "faults: dropped"
BLANK_MARK = "faults: blanked"


def blank(state: ModelState) -> ModelState:
    """A state of zeros with ``state``'s shapes, dtypes and lengths."""
    return ModelState(lengths=state.lengths, layers=jax.tree.map(jnp.zeros_like, state.layers))


def flip_byte(frame: bytes, position: int, mask: int) -> bytes:
    """`frame` with byte `position` XOR `mask` (mask in 1..255, so the byte always changes)."""
    out = bytearray(frame)
    out[position] ^= mask
    return bytes(out)


class TransferFaults:
    """The faults planned for one transfer; the prefill worker's outbox applies them.

    `corrupt(frame)` is called on every frame as it is made (engine thread) and returns the
    frame to send; `cut(sent)` is asked by the sending thread before it sends a frame, with the
    number of frames already sent, and says whether the link drops now."""

    def __init__(
        self,
        injector: FaultInjector,
        label: str,
        *,
        corrupt_data_frame: int | None,
        corrupt_pick: float,
        corrupt_mask: int,
        cut_after: int | None,
        num_frames: int,
        blank_state: bool = False,
    ) -> None:
        self._injector, self.label = injector, label
        self.blank_state = blank_state  # encode zeros instead of the state (`state`)
        self.corrupt_data_frame, self.cut_after = corrupt_data_frame, cut_after
        self._pick, self._mask, self.num_frames = corrupt_pick, corrupt_mask, num_frames
        self._data_frames = 0
        self._blanked = False
        self.dropped = False  # the link was cut (the sender cancelled the stream)

    def corrupt(self, frame: bytes) -> bytes:
        if self.corrupt_data_frame is None or bytes(frame[: len(DATA_MAGIC)]) != DATA_MAGIC:
            return frame
        index = self._data_frames
        self._data_frames += 1
        if index != self.corrupt_data_frame:
            return frame
        # A payload byte when there is one (bit rot in the data), else one of the prefix's.
        low = DATA_PREFIX_SIZE if len(frame) > DATA_PREFIX_SIZE else len(DATA_MAGIC)
        position = low + int(self._pick * (len(frame) - low))
        self._injector.record_corrupt(self.label, index, position)
        return flip_byte(frame, position, self._mask)

    def state(self, state: ModelState) -> ModelState:
        """The state to encode: ``state``, or zeros of its shapes when the state is blanked."""
        if not self.blank_state:
            return state
        if not self._blanked:
            self._blanked = True
            self._injector.record_blank(self.label)
        return blank(state)

    def cut(self, sent: int) -> bool:
        if self.cut_after is None or sent < self.cut_after or self.dropped:
            return False
        self.dropped = True
        self._injector.record_drop(self.label, sent, self.num_frames)
        return True


class FaultInjector:
    """One worker's fault source: `plan` draws the faults of each transfer."""

    def __init__(self, section: FaultsSection, name: str) -> None:
        self.section, self.name = section, name
        self._rng = random.Random(section.seed + zlib.crc32(name.encode()))
        self._lock = threading.Lock()
        self.corrupted = self.dropped = self.blanked = 0

    @classmethod
    def build(cls, section: FaultsSection, name: str) -> FaultInjector | None:
        """An injector, or None when `[faults]` injects nothing (no per-frame cost at all)."""
        if not section.enabled:
            return None
        log.info(
            "faults: on for %s's state transfers (corrupt_frame_prob %g, drop_transfer_prob %g, "
            "blank_state_prob %g)",
            name,
            section.corrupt_frame_prob,
            section.drop_transfer_prob,
            section.blank_state_prob,
        )
        return cls(section, name)

    def plan(self, header: StateHeader, extra_frames: int, label: str) -> TransferFaults | None:
        """The faults of the transfer of the state `header` describes, which sends the codec's
        frames and `extra_frames` more (the handoff); None for a clean transfer."""
        num_frames = header.num_frames + extra_frames
        with self._lock:
            rng = self._rng
            corrupt = rng.random() < self.section.corrupt_frame_prob
            drop = rng.random() < self.section.drop_transfer_prob
            frames = header.num_data_frames
            data_frame = rng.randrange(frames) if corrupt and frames else None
            pick, mask = rng.random(), rng.randrange(1, 256)
            cut_after = rng.randint(1, num_frames - 1) if drop and num_frames > 1 else None
            # Drawn last, and only when asked for: runs without it keep their fault sequence.
            blank_state = self.section.blank_state_prob > 0 and (
                rng.random() < self.section.blank_state_prob
            )
        if data_frame is None and cut_after is None and not blank_state:
            return None
        return TransferFaults(
            self,
            label,
            corrupt_data_frame=data_frame,
            corrupt_pick=pick,
            corrupt_mask=mask,
            cut_after=cut_after,
            num_frames=num_frames,
            blank_state=blank_state,
        )

    def record_corrupt(self, label: str, index: int, position: int) -> None:
        with self._lock:
            self.corrupted += 1
        log.info("%s data frame %d (byte %d) of %s", CORRUPT_MARK, index, position, label)

    def record_blank(self, label: str) -> None:
        with self._lock:
            self.blanked += 1
        log.info("%s the state of %s", BLANK_MARK, label)

    def record_drop(self, label: str, sent: int, num_frames: int) -> None:
        with self._lock:
            self.dropped += 1
        log.info("%s the link after %d of %d frames of %s", DROP_MARK, sent, num_frames, label)
