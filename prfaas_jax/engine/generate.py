"""Single-request flows on a preset with seeded random weights: ``prfaas generate`` and its two
halves across processes, ``prfaas prefill`` (prompt → state file) and ``prfaas decode``.

Weights come from a preset and a seed, or — ``prfaas generate --hf DIR`` / ``--checkpoint DIR`` —
from a Hugging Face or orbax checkpoint (model/weights.py); ``prompt_logits`` gives the prompt's
full prefill logits for ``--dump-logits``.

``generate`` runs the prompt through a ``PrefillEngine`` and the rest through a one-slot
``DecodeEngine``; it returns every generated token, the first one (from prefill) included.
``prefill_to_file`` writes the state's codec frames and a handoff frame (first token, sampling;
engine/decode.py) to a file container; ``decode_file`` checks the whole file against the model
before it builds any weights, then continues the request; ``inspect_file`` describes a file
without a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import HANDOFF_MAGIC, Handoff, pack_handoff, split_handoff
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import DEFAULT_CHUNK_LEN, PrefillEngine, default_buckets, pick_bucket
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.engine.tokenizer import ByteTokenizer, check_byte_vocab
from prfaas_jax.errors import UserError
from prfaas_jax.model import init_params, init_state, prefill
from prfaas_jax.model.sharding import make_mesh
from prfaas_jax.model.weights import load_model
from prfaas_jax.ops.dispatch import Impl


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    model: str = "tiny"
    seed: int = 0
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    sample_seed: int = 0
    impl: str = "chunk"
    hf_dir: str | None = None  # weights from a Hugging Face checkpoint instead of model/seed
    checkpoint: str | None = None  # weights from an orbax checkpoint (prfaas convert-hf)
    dump_logits: str | None = None  # .npy file for the prompt's logits [T, vocab] float32
    mesh: str | None = None  # device mesh spec, e.g. "tensor=4,expert=2" (model/sharding.py)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    model: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    prefill_seconds: float
    decode_seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def to_table(self) -> str:
        rows = [
            ("model", self.model),
            ("prompt tokens", str(len(self.prompt_ids))),
            ("new tokens", ",".join(map(str, self.tokens))),
            ("prefill (s, incl. compile)", f"{self.prefill_seconds:.3f}"),
            ("decode (s, incl. compile)", f"{self.decode_seconds:.3f}"),
        ]
        if self.text is not None:
            rows.append(("text", repr(self.text)))
        return _table(rows)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _prompt_ids(request: GenerateRequest, cfg: ModelConfig) -> list[int]:
    if request.prompt_text is not None:
        check_byte_vocab(cfg.vocab_size)
        ids = ByteTokenizer().encode(request.prompt_text)
    elif request.prompt_ids is not None:
        ids = list(request.prompt_ids)
    else:
        ids = ByteTokenizer().encode("Prefill as a service")[: cfg.vocab_size]
    if not ids:
        raise UserError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"token id(s) {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    return ids


def _decode_alone(engine: DecodeEngine, slot: int) -> list[int]:
    """Step a one-request engine until ``slot`` finishes; its tokens."""
    tokens = []
    while not engine.is_finished(slot):
        tokens.extend(token for _, token in engine.step())
    engine.free(slot)
    return tokens


def generate(
    params: dict,
    cfg: ModelConfig,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    *,
    impl: Impl = Impl.CHUNK,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[list[int], float, float]:
    """Generate ``max_new_tokens``; returns ``(tokens, prefill_seconds, decode_seconds)``.

    With ``mesh`` both engines run sharded on it (model/sharding.py); the tokens are the same.
    """
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_len:
        raise UserError(
            f"prompt ({len(prompt_ids)}) + new tokens ({max_new_tokens}) exceed the model's "
            f"max_len {cfg.max_len}"
        )
    start = time.perf_counter()
    prefill_engine = PrefillEngine(cfg, params, impl=impl, mesh=mesh)
    # One bucketed capacity for both engines: the decode engine takes the state without a copy,
    # and requests whose total falls in the same bucket share every compiled program.
    max_len = prefill_engine.bucket(total)
    prefilled = prefill_engine.prefill(prompt_ids, sampling=sampling, max_len=max_len)
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    tokens = [prefilled.first_token]
    if max_new_tokens > 1:
        engine = DecodeEngine(cfg, params, max_slots=1, max_len=max_len, impl=impl, mesh=mesh)
        slot = engine.insert(
            prefilled.state, prefilled.first_token, sampling, max_new_tokens=max_new_tokens - 1
        )
        tokens += _decode_alone(engine, slot)
    return tokens, prefill_seconds, time.perf_counter() - start


def _sampling(request: GenerateRequest) -> SamplingParams:
    return SamplingParams(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.sample_seed,
    )


_prompt_prefill = jax.jit(prefill, static_argnames=("cfg", "impl"))


def prompt_logits(
    params: dict, cfg: ModelConfig, prompt_ids: list[int], *, impl: Impl = Impl.CHUNK
) -> np.ndarray:
    """Logits ``[T, vocab]`` float32 of one prefill over the whole prompt (``--dump-logits``)."""
    state = init_state(cfg, 1, len(prompt_ids))
    logits, _ = _prompt_prefill(params, cfg, jnp.asarray([prompt_ids], jnp.int32), state, impl=impl)
    return np.asarray(logits[0], np.float32)


def _dump_logits(path: str, logits: np.ndarray) -> None:
    try:
        np.save(path, logits)
    except OSError as err:
        raise UserError(f"cannot write logits to {path}: {err.strerror or err}") from None


def generate_from_preset(request: GenerateRequest) -> GenerateResult:
    """``prfaas generate``: weights from a preset + seed, an HF checkpoint or an orbax one."""
    cfg, params = load_model(
        request.model, seed=request.seed, hf_dir=request.hf_dir, checkpoint=request.checkpoint
    )
    sampling = _sampling(request)
    prompt = _prompt_ids(request, cfg)
    mesh = make_mesh(request.mesh) if request.mesh else None
    tokens, prefill_s, decode_s = generate(
        params, cfg, prompt, request.max_new_tokens, sampling, impl=Impl(request.impl), mesh=mesh
    )
    if request.dump_logits is not None:
        logits = prompt_logits(params, cfg, prompt, impl=Impl(request.impl))
        _dump_logits(request.dump_logits, logits)
    text = ByteTokenizer().decode(tokens) if request.prompt_text is not None else None
    return GenerateResult(
        model=cfg.name,
        prompt_ids=prompt,
        tokens=tokens,
        text=text,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
    )


# --- the two halves, through a state file ----------------------------------------------------


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
        return _table(
            [
                ("model", self.model),
                ("state file", self.path),
                ("prompt tokens", str(self.tokens)),
                ("first token", str(self.first_token)),
                ("payload bytes", f"{self.payload_bytes:,}"),
                ("file bytes", f"{self.file_bytes:,}"),
                ("seconds", _seconds(self.timings)),
            ]
        )


def prefill_to_file(
    request: GenerateRequest, path: str | os.PathLike[str], *, chunk_len: int = DEFAULT_CHUNK_LEN
) -> PrefillFileResult:
    """Prefill ``request``'s prompt and write the state plus its handoff frame to ``path``.

    A file holds one stream, so nothing can mix with it: its stream id is a hash of the state
    rather than random, and the same prefill writes the same bytes.
    """
    cfg = load_model_config(request.model)
    prompt, sampling = _prompt_ids(request, cfg), _sampling(request)
    params = init_params(jax.random.PRNGKey(request.seed), cfg)
    mesh = make_mesh(request.mesh) if request.mesh else None
    engine = PrefillEngine(cfg, params, impl=request.impl, chunk_len=chunk_len, mesh=mesh)
    result = engine.prefill(prompt, sampling=sampling)
    start = time.perf_counter()
    draft = b"".join(codec.encode(result.state, cfg, stream_id=0))
    stream_id = int.from_bytes(hashlib.sha256(draft).digest()[:8], "little")
    frames = list(codec.encode(result.state, cfg, stream_id=stream_id))
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
        return _table(
            [
                ("model", self.model),
                ("state tokens", str(self.state_tokens)),
                ("first token", str(self.first_token)),
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
) -> DecodeFileResult:
    """Continue the request in a ``prefill_to_file`` file for ``max_new_tokens`` more tokens.

    The file is layout-free: ``mesh`` (any spec, or none) need not match the prefill's.
    """
    start = time.perf_counter()
    cfg = load_model_config(model)
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
    params = init_params(jax.random.PRNGKey(seed), cfg)
    device_mesh = make_mesh(mesh) if mesh else None
    engine = DecodeEngine(cfg, params, max_slots=1, max_len=max_len, impl=impl, mesh=device_mesh)
    load_s = time.perf_counter() - start
    slot = engine.insert(
        state, handoff.first_token, handoff.sampling, max_new_tokens=max_new_tokens
    )
    tokens = _decode_alone(engine, slot)
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
    """``inspect_file``'s result as a summary and a per-tensor table."""
    summary = _table(
        [
            ("format version", str(info["version"])),
            ("model fingerprint", info["fingerprint"]),
            ("stream id", info["stream_id"]),
            ("tokens", str(info["tokens"])),
            ("payload bytes", f"{info['payload_bytes']:,}"),
            ("frames", str(info["num_frames"])),
            ("first token", str(info["first_token"])),
        ]
    )
    lines = [
        summary,
        "",
        f"{'id':>3}  {'layer':>5}  {'kind':<9} {'name':<9} {'dtype':<8} "
        f"{'shape':<16} {'bytes':>10}  {'frames':>6}  crc32",
    ]
    for t in info["tensors"]:
        shape = "x".join(map(str, t["shape"]))
        lines.append(
            f"{t['id']:>3}  {t['layer']:>5}  {t['kind']:<9} {t['name']:<9} {t['dtype']:<8} "
            f"{shape:<16} {t['nbytes']:>10,}  {t['num_frames']:>6}  {t['crc32']:08x}"
        )
    return "\n".join(lines)
