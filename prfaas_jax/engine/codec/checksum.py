"""The wire format's CRC32, at memory speed.

The checksum is zlib's CRC32 (the IEEE 802.3 polynomial, docs/wire-format.md), computed by
zlib-ng, whose folding implementation runs several times faster than the zlib CPython links
(bench/codec.py prints both), with the same values. ``crc32_combine(a, b, n)`` is the CRC of
``A + B`` from ``a = crc32(A)``, ``b = crc32(B)`` and ``n = len(B)``: the codec reads each
payload byte once and derives both the frame's CRC (prefix + payload) and the whole tensor's
(its frames' payloads in order) from that one pass.
"""

from __future__ import annotations

from zlib_ng.zlib_ng import crc32, crc32_combine

__all__ = ["crc32", "crc32_combine"]
