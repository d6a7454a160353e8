"""The state wire codec: a ``ModelState`` of one sequence ↔ self-placing, checksummed frames.

``wire`` holds ``encode`` / ``decode`` / ``inspect``; ``format`` the byte layout of each frame;
``layout`` the state ↔ canonical-tensor mapping; ``stream`` the encoder that ships cache rows
while a chunked prefill runs; ``decoder`` the decoder that places frames as they arrive;
``checksum`` the CRC32; ``precision`` the narrower encodings a tensor may travel in (bf16,
fp8, int8 with scales); ``file`` the file container; ``handoff`` the frame that hands a
prefilled request (first token, sampling) to a decode engine. The format is specified in
docs/wire-format.md.
"""

from prfaas_jax.engine.codec.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    KvPrefix,
    StateDecodeError,
    StateHeader,
    StateTrailer,
    StreamDecoder,
    StreamEncoder,
    TensorEntry,
    TensorSpec,
    WirePrecision,
    decode,
    encode,
    inspect,
    inspect_trailer,
    payload_nbytes,
    read_frames,
    write_file,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "KvPrefix",
    "StateDecodeError",
    "StateHeader",
    "StateTrailer",
    "StreamDecoder",
    "StreamEncoder",
    "TensorEntry",
    "TensorSpec",
    "WirePrecision",
    "decode",
    "encode",
    "inspect",
    "inspect_trailer",
    "payload_nbytes",
    "read_frames",
    "write_file",
]
