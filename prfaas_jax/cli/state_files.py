"""A request's two halves across processes, through a state file: `prefill_to_file` (``prfaas
prefill``), `decode_file` (``prfaas decode``), and `inspect_file` / `format_inspection` (``prfaas
state inspect``).

`prefill_to_file` writes the state's codec frames and a handoff frame (first token, sampling;
engine/codec/handoff.py) to a file container (engine/codec/file.py); `decode_file` checks the
whole file against the model before it builds any weights, then continues the request with the
same one-slot decode loop as `generate`; `inspect_file` describes a file without a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time

from prfaas_jax.cli.generation import GenerateRequest, prompt_ids, sampling_params, with_max_len
from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import HANDOFF_MAGIC, Handoff, pack_handoff, split_handoff
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.generate import decode_alone
from prfaas_jax.engine.prefill import DEFAULT_CHUNK_LEN, PrefillEngine, default_buckets, pick_bucket
from prfaas_jax.errors import UserError
from prfaas_jax.model.sharding import make_mesh
from prfaas_jax.model.weights import load_model
from prfaas_jax.tables import key_value, table
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision


def _seconds(timings: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in timings.items())


@dataclasses.dataclass(frozen=True)
class PrefillFileResult:
    model: str
    path: str
    tokens: int  # prompt length: the tokens of state in the file
    first_token: int
    payload_bytes: int  # tensor bytes of the state (== state_nbytes(cfg, tokens))
    file_bytes: int
    timings: dict[str, float]  # compile_s, run_s, total_s (prefill), encode_s (frames + file)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def to_table(self) -> str:
        return key_value(
            [
                ("model", self.model),
                ("state file", self.path),
                ("prompt tokens", self.tokens),
                ("first token", self.first_token),
                ("payload bytes", f"{self.payload_bytes:,}"),
                ("file bytes", f"{self.file_bytes:,}"),
                ("seconds", _seconds(self.timings)),
            ]
        )


def prefill_to_file(
    request: GenerateRequest,
    path: str | os.PathLike[str],
    *,
    chunk_len: int = DEFAULT_CHUNK_LEN,
    precision: WirePrecision = WIRE_NATIVE,
) -> PrefillFileResult:
    """Prefill ``request``'s prompt and write the state plus its handoff frame to ``path``, its
    tensors encoded in ``precision`` (docs/wire-format.md, "Wire precision"; native: exact).

    A file holds one stream, so nothing can mix with it: its stream id is a hash of the state
    rather than random, and the same prefill writes the same bytes.
    """
    cfg, params = load_model(request.model, seed=request.seed)
    cfg = with_max_len(cfg, request.max_len)
    prompt, sampling = prompt_ids(request, cfg), sampling_params(request)
    mesh = make_mesh(request.mesh) if request.mesh else None
    engine = PrefillEngine(cfg, params, impl=request.impl, chunk_len=chunk_len, mesh=mesh)
    result = engine.prefill(prompt, sampling=sampling)
    start = time.perf_counter()
    draft = b"".join(codec.encode(result.state, cfg, stream_id=0, precision=precision))
    stream_id = int.from_bytes(hashlib.sha256(draft).digest()[:8], "little")
    frames = list(codec.encode(result.state, cfg, stream_id=stream_id, precision=precision))
    frames.append(pack_handoff(Handoff(result.first_token, sampling), frames[0]))
    try:
        file_bytes = codec.write_file(path, frames)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror}") from None
    return PrefillFileResult(
        model=cfg.name,
        path=os.fspath(path),
        tokens=len(prompt),
        first_token=result.first_token,
        payload_bytes=codec.payload_nbytes(frames[:-1]),
        file_bytes=file_bytes,
        timings={**result.timings, "encode_s": time.perf_counter() - start},
    )


def _read(path: str | os.PathLike[str]) -> list[bytes]:
    try:
        return codec.read_frames(path)
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None


@dataclasses.dataclass(frozen=True)
class DecodeFileResult:
    model: str
    state_tokens: int  # tokens of state in the file
    first_token: int  # from the file's handoff frame
    tokens: list[int]  # the tokens after the first
    timings: dict[str, float]  # load_s (read, check, weights), decode_s

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def to_table(self) -> str:
        return key_value(
            [
                ("model", self.model),
                ("state tokens", self.state_tokens),
                ("first token", self.first_token),
                ("new tokens", ",".join(map(str, self.tokens))),
                ("seconds", _seconds(self.timings)),
            ]
        )


def decode_file(
    path: str | os.PathLike[str],
    *,
    model: str = "tiny",
    seed: int = 0,
    max_new_tokens: int = 16,
    impl: str = "chunk",
    mesh: str | None = None,
    max_len: int | None = None,
) -> DecodeFileResult:
    """Continue the request in a `prefill_to_file` file for ``max_new_tokens`` more tokens.

    The file is layout-free: ``mesh`` (any spec, or none) need not match the prefill's.
    """
    start = time.perf_counter()
    cfg = with_max_len(load_model_config(model), max_len)
    state_frames, handoff = split_handoff(_read(path))
    length = codec.inspect(state_frames).length
    if length + max_new_tokens > cfg.max_len:
        raise UserError(
            f"state ({length} tokens) + new tokens ({max_new_tokens}) exceed the model's "
            f"max_len {cfg.max_len}"
        )
    # A bucketed capacity, as `generate` uses: the two share compiled programs.
    max_len = min(pick_bucket(default_buckets(cfg.max_len), length + max_new_tokens), cfg.max_len)
    # Every byte is checked against the model here, before any weights exist.
    state = codec.decode(state_frames, cfg, max_len=max_len)
    _, params = load_model(model, seed=seed)
    device_mesh = make_mesh(mesh) if mesh else None
    engine = DecodeEngine(cfg, params, max_slots=1, max_len=max_len, impl=impl, mesh=device_mesh)
    load_s = time.perf_counter() - start
    slot = engine.insert(
        state, handoff.first_token, handoff.sampling, max_new_tokens=max_new_tokens
    )
    tokens = decode_alone(engine, slot)
    return DecodeFileResult(
        model=cfg.name,
        state_tokens=length,
        first_token=handoff.first_token,
        tokens=tokens,
        timings={"load_s": load_s, "decode_s": time.perf_counter() - start - load_s},
    )


def inspect_file(path: str | os.PathLike[str]) -> dict:
    """A state file's header, tensor table (with the trailer's CRC32s), payload bytes and
    handoff, without a model.

    Every frame's structure and CRC32 is checked; whether the state fits a model is not.
    """
    frames = _read(path)
    header = codec.inspect(frames)
    handoff = None
    if len(frames) > 1 and bytes(frames[-1][: len(HANDOFF_MAGIC)]) == HANDOFF_MAGIC:
        frames, handoff = split_handoff(frames)
    trailer = codec.inspect_trailer(frames)
    payload = codec.payload_nbytes(frames)
    if payload != header.payload_nbytes:
        raise codec.StateDecodeError(
            f"{path}: the data frames carry {payload} bytes, the header lists "
            f"{header.payload_nbytes}"
        )
    info = {"tokens": header.length, "payload_bytes": payload, **header.to_dict()}
    for row, crc in zip(info["tensors"], trailer.crc32s, strict=True):
        row["crc32"] = crc
    info["first_token"] = None if handoff is None else handoff.first_token
    info["sampling"] = None if handoff is None else dataclasses.asdict(handoff.sampling)
    return info


def format_inspection(info: dict) -> str:
    """`inspect_file`'s result as a summary and a per-tensor table."""
    summary = key_value(
        [
            ("format version", info["version"]),
            ("model fingerprint", info["fingerprint"]),
            ("stream id", info["stream_id"]),
            ("tokens", info["tokens"]),
            ("payload bytes", f"{info['payload_bytes']:,}"),
            ("frames", info["num_frames"]),
            ("first token", info["first_token"]),
        ]
    )
    tensors = [
        (
            t["id"],
            t["layer"],
            t["kind"],
            t["name"],
            t["dtype"],
            "x".join(map(str, t["shape"])),
            f"{t['nbytes']:,}",
            t["wire"],
            f"{t['wire_nbytes']:,}",
            t["num_frames"],
            f"{t['crc32']:08x}",
        )
        for t in info["tensors"]
    ]
    headers = ("id", "layer", "kind", "name", "dtype", "shape", "bytes", "wire", "on wire")
    headers += ("frames", "crc32")
    return summary + "\n\n" + table(tensors, headers=headers, align="rrllllrlrrl")
