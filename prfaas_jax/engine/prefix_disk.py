"""The prefix cache's disk tier: `DiskTier`, a directory of whole-prefix state files kept under a
byte bound in LRU order, its entries (`DiskEntry`) and counters (`DiskStats`).

What the host pool (engine/prefix_cache.py) evicts as a checkpoint — the fixed-size state at
exactly ``L`` tokens — spills here together with the KV of its ``L`` tokens, as one file: the
whole prefix state, reusable alone, so a long session that pauses past the host pool's reach
resumes from disk instead of recomputing its context.

A file is the codec's file container (engine/codec/file.py): a prompt frame — ``b"PRFPROMT"``,
a u32 token count, the tokens as little-endian int32, the CRC32 of all that — then the state's
own frames (header with the model's fingerprint, data frames, trailer: a CRC32 per frame and per
tensor, docs/wire-format.md). Its name is the BLAKE2b of the tokens, so it names the prefix. A
file is written to a temporary name and renamed, so a crash never leaves half a file under an
entry's name.

Nothing on disk is trusted. At start (`DiskTier(directory, …)` on a directory a previous process
filled) every file is checked: the container, the prompt frame's CRC and its name, every
frame's CRC and the header's token count; a file that fails is deleted (``dropped``). A load
(`load`) decodes the state against the model (`codec.decode`: fingerprint, shapes, tensor
CRCs); a file that fails then (bit rot since the scan) is deleted too and the caller recomputes
the prefix: a corrupt entry costs compute, never a wrong output.

Not thread-safe: the prefix cache's lock guards it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.checksum import crc32
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import ModelState

PROMPT_MAGIC = b"PRFPROMT"
_PROMPT_HEAD = struct.Struct("<8sI")
_CRC = struct.Struct("<I")
SUFFIX = ".prfs"


@dataclasses.dataclass(frozen=True)
class DiskEntry:
    tokens: tuple[int, ...]  # the prefix the file holds the state of
    nbytes: int  # the file's size

    @property
    def name(self) -> str:
        return entry_name(self.tokens)


@dataclasses.dataclass
class DiskStats:
    capacity_bytes: int
    used_bytes: int = 0
    entries: int = 0
    writes: int = 0  # spills written
    write_failures: int = 0  # spills the file system refused (full, read-only): not kept
    loads: int = 0  # entries read back and verified
    evictions: int = 0  # entries deleted for room
    dropped: int = 0  # files that failed a check (at start or on load), deleted


def entry_name(tokens: Sequence[int]) -> str:
    """The file name of the prefix ``tokens``."""
    digest = hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16)
    return digest.hexdigest() + SUFFIX


def pack_prompt(tokens: Sequence[int]) -> bytes:
    body = _PROMPT_HEAD.pack(PROMPT_MAGIC, len(tokens)) + np.asarray(tokens, "<i4").tobytes()
    return body + _CRC.pack(crc32(body))


def parse_prompt(frame: bytes) -> tuple[int, ...]:
    """The tokens of a prompt frame; ``StateDecodeError`` when it is malformed or damaged."""
    if len(frame) < _PROMPT_HEAD.size + _CRC.size or frame[:8] != PROMPT_MAGIC:
        raise codec.StateDecodeError("no prompt frame (b'PRFPROMT') first")
    _, count = _PROMPT_HEAD.unpack_from(frame)
    end = _PROMPT_HEAD.size + 4 * count
    if len(frame) != end + _CRC.size:
        raise codec.StateDecodeError(f"a prompt frame of {count} tokens is {len(frame)} bytes")
    if _CRC.unpack_from(frame, end)[0] != crc32(frame[:end]):
        raise codec.StateDecodeError("the prompt frame's CRC32 does not match")
    return tuple(int(t) for t in np.frombuffer(frame, "<i4", count, _PROMPT_HEAD.size))


class DiskTier:
    """A directory of prefix states under ``capacity_bytes`` (module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        cfg: ModelConfig,
        *,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be ≥ 0, got {capacity_bytes}")
        self.directory, self.cfg, self.max_frame_bytes = Path(directory), cfg, max_frame_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stats = DiskStats(capacity_bytes)
        self._entries: collections.OrderedDict[str, DiskEntry] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()
        self._reload()

    # --- at start ---------------------------------------------------------------------------

    def _reload(self) -> None:
        """Check every file a previous process left (oldest first, so LRU order survives) and
        keep the good ones; the rest, and leftover temporary files, are deleted."""
        for leftover in self.directory.glob(f"*{SUFFIX}.tmp"):
            leftover.unlink(missing_ok=True)
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            try:
                frames = codec.read_frames(path)
                tokens = parse_prompt(frames[0]) if frames else ()
                if not tokens or entry_name(tokens) != path.name:
                    raise codec.StateDecodeError(f"{path.name} does not name its prompt")
                if codec.inspect(frames[1:]).length != len(tokens):
                    raise codec.StateDecodeError(f"{path.name}: the state is not its prompt's")
                codec.payload_nbytes(frames[1:])  # every frame's structure and CRC32
            except (UserError, OSError, ValueError):
                self.stats.dropped += 1
                path.unlink(missing_ok=True)
                continue
            self._add(DiskEntry(tokens, path.stat().st_size))
        self.evict_to_fit()

    # --- reading ----------------------------------------------------------------------------

    def entries(self) -> list[DiskEntry]:
        """Every entry, least recently used first."""
        return list(self._entries.values())

    def holds(self, tokens: Sequence[int]) -> bool:
        return entry_name(tokens) in self._entries

    def longest(self, tokens: Sequence[int], limit: int) -> DiskEntry | None:
        """The longest entry that is a prefix of ``tokens`` of at most ``limit`` tokens."""
        for length in sorted(self._lengths, reverse=True):
            if length <= limit:
                entry = self._entries.get(entry_name(tokens[:length]))
                if entry is not None:
                    return entry
        return None

    def load(self, entry: DiskEntry) -> ModelState | None:
        """The entry's state, decoded and verified against the model (and made most recently
        used); None when the file fails a check — it is deleted (`drop`)."""
        path = self.directory / entry.name
        try:
            frames = codec.read_frames(path)
            if not frames or parse_prompt(frames[0]) != entry.tokens:
                raise codec.StateDecodeError(f"{entry.name} holds another prompt")
            state = codec.decode(frames[1:], self.cfg, max_len=len(entry.tokens))
        except (UserError, OSError, ValueError):
            self.drop(entry)
            self.stats.dropped += 1
            return None
        self._use(entry.name)
        self.stats.loads += 1
        return state

    # --- writing ----------------------------------------------------------------------------

    def touch(self, tokens: Sequence[int]) -> None:
        """Make the entry of ``tokens`` the most recently used."""
        self._use(entry_name(tokens))

    def _use(self, name: str) -> None:
        self._entries.move_to_end(name)
        # The file's time is the order a restarted worker reloads in (module docstring).
        os.utime(self.directory / name)

    def put(self, tokens: Sequence[int], state: ModelState) -> list[DiskEntry] | None:
        """Write the state of ``tokens`` (row 0 of ``state``) as an entry, then delete least
        recently used entries until the tier fits its bound: the entries deleted (the new one
        among them when it alone is over the bound); None when the file could not be written
        (the prefix is then simply not kept: a spill never fails the prefill that caused it)."""
        tokens = tuple(tokens)
        frames = [
            pack_prompt(tokens),
            *codec.encode(state, self.cfg, max_frame_bytes=self.max_frame_bytes),
        ]
        path = self.directory / entry_name(tokens)
        temporary = path.with_name(path.name + ".tmp")
        try:
            size = codec.write_file(temporary, frames)
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            self.stats.write_failures += 1
            return None
        if path.name in self._entries:  # rewritten: the new file replaced the old one
            self._forget(self._entries[path.name])
        self._add(DiskEntry(tokens, size))
        self.stats.writes += 1
        return self.evict_to_fit()

    def evict_to_fit(self) -> list[DiskEntry]:
        evicted = []
        while self.stats.used_bytes > self.stats.capacity_bytes and self._entries:
            entry = next(iter(self._entries.values()))
            self.drop(entry)
            self.stats.evictions += 1
            evicted.append(entry)
        return evicted

    def drop(self, entry: DiskEntry) -> None:
        """Forget the entry and delete its file."""
        if entry.name in self._entries:
            self._forget(entry)
            (self.directory / entry.name).unlink(missing_ok=True)

    def _forget(self, entry: DiskEntry) -> None:
        del self._entries[entry.name]
        self._lengths[len(entry.tokens)] -= 1
        if not self._lengths[len(entry.tokens)]:
            del self._lengths[len(entry.tokens)]
        self.stats.used_bytes -= entry.nbytes
        self.stats.entries -= 1

    def _add(self, entry: DiskEntry) -> None:
        self._entries[entry.name] = entry
        self._lengths[len(entry.tokens)] += 1
        self.stats.used_bytes += entry.nbytes
        self.stats.entries += 1
