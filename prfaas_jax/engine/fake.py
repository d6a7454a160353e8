"""Engines whose outputs are computable by hand: `FakePrefillEngine`, `FakeDecodeEngine`.

Also exposes `fake_tokens`, the expected output of a request, `fake_draw`, how a sampled request
picks each token, and `STATE_MISMATCH`, the words
of the error a state that does not match its tokens raises. They serve the serving-plane tests
(and `engine = "fake"` clusters) without a model, JetStream-style, but implement the engine
interface of engine/api.py, as the JAX engines do, and hold a real `ModelState`, so the real
codec carries it. The fake model is autoregressive: over a vocabulary of V, the token that
follows a sequence (prompt, then the tokens generated so far) of length L and sum S is

    next(seq) = (2·S + L) mod V

so for a prompt with sum S and length L, token 0 = (2S + L) mod V (prefill's first token) and
token i+1 = (3·token_i + 1) mod V (appending t adds 2t + 1 to 2S + L). x ↦ 3x + 1 has no short
cycles mod a power of two (every orbit mod 256 is 128 long), so outputs stay well spread. As
every token depends on the whole sequence before it, a request resumed from prompt + its first
k tokens continues exactly where it stopped — and one resumed from the wrong tokens does not.

Sampling is a deterministic function of the request's key, as in the JAX engines: with a
temperature > 0, token i of a request (i = 0 from prefill, then the decode steps; a resumed
request starts at `SamplingParams.first_index`) is next(seq) + d mod V, d = mix(mix(seed) + i)
mod w, w the candidates the settings keep: ⌊min(top_k or V, V) · top_p⌋, at least 1 (`fake_draw`).
So an engine that drops the seed, the knobs or the index of a resumed request makes other tokens,
and top_k = 1 is greedy, as it is for the real sampler.

Log-probabilities (`fake_logprobs`): the fake model's logits after a sequence are −d/4 for the
token d places after next(seq) (mod V), so token t has log-probability −d/4 − log Z,
Z = Σ_{d<V} e^{−d/4}, and the k most likely tokens are next(seq) + 0, …, k − 1. `score` gives
them for a prompt's positions, the decode engine for each token it makes when asked.

The state of a sequence x sets every value of every tensor of every layer, each from a 64-bit
hash of the tokens it summarises: h(x[:0]) = 0, h(x[:p+1]) = mix(h(x[:p]) + x[p] + 1), with
`mix` splitmix64's finaliser. Element e (C order) of tensor `name` of layer i holds
(b − 128) / 64, b the top 8 bits of mix(mix(h ⊕ salt) + e·φ), salt = mix(i·2³² + crc32(name)),
φ = 0x9E3779B97F4A7C15: a value on a 1/64 grid in [−2, 2), exact in every float dtype. Row p
of a growing cache (MLA c_kv / k_rope, GQA k / v) or an SWA window uses h(x[:p+1]), so the
state of a prefix is exactly the first rows of the longer sequence's; recurrent states and conv
tails use h(x), the whole sequence. Column 0 of the first growing cache holds the token x[p]
itself at position p, so the tokens can be read back from a state.

Decode reads the tokens back from the state it receives (rounded to the nearest integer: a lossy
wire precision rounds them by less than ½), recomputes the state from them and compares every
tensor bit for bit with that state as one of the wire precisions delivers it
(engine/fake_precision.py: native, bf16, int8, fp8_e4m3; row by row for a growing cache, whose
rows may come from different transfers, whole for the others). The engine is not told which
precision a state crossed in, so it takes what one of them delivers and nothing else: a value
one quantum off is refused as any other. On any difference `insert` (and `check_state`, which the
decode worker calls for a request with nothing to decode) raises an `EngineError` naming the
tensor and the first element that differs (the decode worker fails the request with
INVALID_ARGUMENT). It then absorbs the first token it is handed and tracks each slot's running
sum and length. It keeps no tensors: the state after a decoded token is by definition that of
the longer sequence, which is what a prefill of prompt + the tokens so far makes, so a request
resumed elsewhere checks like any other. Prefill after a `prefix` state (a cached or fetched
prefix) checks it the same way first, so a prefix cache that serves one prefix's KV with the
linear checkpoint of another prefix, or of another length, fails the prefill. Optional sleeps
(`seconds_per_token` of prefill, `step_s` per decode step) emulate compute time.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.api import split_layers
from prfaas_jax.engine.codec.layout import (
    TensorSpec,
    canonical_arrays,
    canonical_tensors,
    state_from_arrays,
)
from prfaas_jax.engine.fake_precision import first_undelivered
from prfaas_jax.engine.logprobs import TokenLogprobs
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError, LengthLimitError
from prfaas_jax.model import ModelState

STATE_MISMATCH = "does not match its tokens"

_PHI = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: spreads element indices


def next_token(total: int, length: int, vocab_size: int) -> int:
    """The token after a sequence of `length` tokens that sum to `total`."""
    return (2 * total + length) % vocab_size


def _fake_logprob(token: int, greedy: int, vocab_size: int) -> float:
    distance = (token - greedy) % vocab_size
    log_z = math.log((1 - math.exp(-vocab_size / 4)) / (1 - math.exp(-1 / 4)))  # Σ_{d<V} e^{−d/4}
    return -distance / 4 - log_z


def fake_logprobs(token: int, greedy: int, top: int, vocab_size: int) -> TokenLogprobs:
    """The fake model's `TokenLogprobs` of `token` where its greedy choice is `greedy`."""
    likeliest = [(greedy + d) % vocab_size for d in range(top)]
    return TokenLogprobs(
        token,
        _fake_logprob(token, greedy, vocab_size),
        tuple((t, _fake_logprob(t, greedy, vocab_size)) for t in likeliest),
    )


def fake_draw(token: int, sampling: SamplingParams, index: int, vocab_size: int) -> int:
    """Token `index` of a request with `sampling`, whose greedy choice is `token`."""
    if sampling.greedy:
        return token
    keep = min(sampling.top_k or vocab_size, vocab_size)
    keep = max(1, math.floor(keep * sampling.top_p))
    seed = _mix(np.array([sampling.seed], np.uint64))
    offset = int(_mix(seed + np.uint64(index))[0] % np.uint64(keep))
    return (token + offset) % vocab_size


def fake_tokens(
    prompt: Sequence[int], num_tokens: int, vocab_size: int, sampling: SamplingParams = GREEDY
) -> list[int]:
    """The `num_tokens` tokens the fake engines produce for `prompt` with `sampling`."""
    total, length, out = sum(prompt), len(prompt), []
    for i in range(num_tokens):
        greedy = next_token(total, length, vocab_size)
        out.append(fake_draw(greedy, sampling, sampling.first_index + i, vocab_size))
        total, length = total + out[-1], length + 1
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on a uint64 array (products wrap mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _prefix_hashes(tokens: Sequence[int]) -> np.ndarray:
    """h(tokens[:p + 1]) for every p."""
    out = np.empty(len(tokens), np.uint64)
    h = np.zeros(1, np.uint64)
    for p, token in enumerate(tokens):
        h = _mix(h + np.uint64(token + 1))
        out[p] = h[0]
    return out


def _values(spec: TensorSpec, hashes: np.ndarray) -> np.ndarray:
    """`spec`'s tensor, one row per hash (a position, or the whole tensor for fixed-size ones)."""
    salt = _mix(np.array([(spec.layer << 32) | zlib.crc32(spec.name.encode())], np.uint64))
    rows = _mix(hashes ^ salt)
    elements = np.arange(math.prod(spec.shape) // len(hashes), dtype=np.uint64)
    top = _mix(rows[:, None] + elements[None, :] * _PHI) >> np.uint64(56)
    values = (top.astype(np.float32) - 128) / 64  # exact: 8 significant bits, a power of 2 scale
    return values.astype(jnp.dtype(spec.dtype)).reshape(spec.shape)


def _token_tensor(specs: Sequence[TensorSpec]) -> int:
    """Index of the tensor whose column 0 holds the token ids: the first growing cache."""
    return next(i for i, spec in enumerate(specs) if spec.kind.has_growing_state)


def _check_model(cfg: ModelConfig) -> None:
    """The fake engines need a growing cache whose dtype holds every token id exactly."""
    growing = [spec for spec in canonical_tensors(cfg, 1) if spec.kind.has_growing_state]
    if not growing:
        raise EngineError(f"the fake engines need a growing KV cache; {cfg.name!r} has none")
    if cfg.vocab_size > 2 ** (jnp.finfo(jnp.dtype(growing[0].dtype)).nmant + 1):
        raise EngineError(f"{growing[0].dtype} cannot hold {cfg.name!r}'s token ids exactly")


def _arrays(cfg: ModelConfig, tokens: Sequence[int]) -> list[tuple[TensorSpec, np.ndarray]]:
    """The canonical tensors of the fake state of `tokens` (module docstring)."""
    hashes = _prefix_hashes(tokens)
    specs = canonical_tensors(cfg, len(tokens))
    arrays = []
    for spec in specs:
        rows = hashes[len(hashes) - spec.shape[0] :] if spec.token_axis else hashes[-1:]
        arrays.append(_values(spec, rows))
    holder = arrays[_token_tensor(specs)]
    holder.reshape(len(tokens), -1)[:, 0] = tokens
    return list(zip(specs, arrays, strict=True))


def _checked_tokens(cfg: ModelConfig, state: ModelState, what: str) -> list[int]:
    """The tokens `state` holds (row 0), once every tensor is checked to be their fake state
    as some wire precision delivers it (module docstring)."""
    try:
        length, arrays = canonical_arrays(state, cfg, 0)
    except ValueError as err:
        raise EngineError(f"{what} does not fit {cfg.name!r}: {err}") from err
    if length == 0:
        raise EngineError(f"{what} is empty")
    first = _token_tensor([spec for spec, _ in arrays])
    spec, holder = arrays[first]
    column = holder.reshape(length, -1)[:, 0].astype(np.float64)
    # A lossy precision moves an id by less than ½; the comparison below then holds the column
    # to exactly what it delivers. NaN fails every comparison, so it is refused too.
    ids_f = np.rint(column)
    bad = np.flatnonzero(
        ~((np.abs(column - ids_f) < 0.5) & (ids_f >= 0) & (ids_f < cfg.vocab_size))
    )
    if bad.size:
        p = int(bad[0])
        raise EngineError(f"{what} {STATE_MISMATCH}: {spec} holds {column[p]} at position {p}")
    ids = [int(t) for t in ids_f]
    expected = _arrays(cfg, ids)
    # The tokens' own tensor first: a damaged token id then shows where it is, not as a
    # recurrent state that does not match the wrong tokens.
    for n in [first, *(n for n in range(len(arrays)) if n != first)]:
        (spec, got), want = arrays[n], expected[n][1]
        unit = first_undelivered(spec, got, want)
        if unit is None:
            continue
        unsigned = f"u{spec.itemsize}"
        differs = np.flatnonzero(got.view(unsigned) != want.view(unsigned))
        inside = differs[differs >= unit * (got.size // len(got) if spec.token_axis else 0)]
        index = tuple(int(i) for i in np.unravel_index(inside[0], spec.shape))
        where = f"element {index}"
        if spec.token_axis:  # rows of an SWA window are its last positions
            where = f"position {length - spec.shape[0] + index[0]}, element {index[1:]}"
        raise EngineError(
            f"{what} {STATE_MISMATCH}: {spec} differs at {where} ({got[index]} ≠ "
            f"{want[index]}; {differs.size} of {got.size} elements)"
        )
    return ids


@dataclasses.dataclass(frozen=True)
class FakePrefillResult:
    state: ModelState
    first_token: int
    num_tokens: int  # tokens computed (after the prefix)
    prefix_len: int = 0


class FakePrefillEngine:
    """`PrefillEngineLike`: the fake state of the prefix's tokens and the prompt. With
    ``layer_groups > 1`` and an ``on_layers`` callback it streams by groups of layers as the
    JAX engine does, its compute time (``seconds_per_token``) spread evenly over the layers:
    each group's callback runs once that group's share of the time has passed. With
    ``chunk_len`` > 0, ``on_chunk`` sees the state at every ``chunk_len`` tokens past the prefix
    and at the prompt's end, as the JAX engine's chunks; with 0, once, at the end."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seconds_per_token: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        layer_groups: int = 1,
        chunk_len: int = 0,
    ) -> None:
        _check_model(cfg)
        self.cfg, self.seconds_per_token, self._sleep = cfg, seconds_per_token, sleep
        self.groups = split_layers(cfg.num_layers, layer_groups)
        self.chunk_len = chunk_len

    def score(self, tokens: Sequence[int], top: int = 0) -> list[TokenLogprobs]:
        """`fake_logprobs` of each of ``tokens[1:]`` after the tokens before it."""
        ids, vocab = [int(t) for t in tokens], self.cfg.vocab_size
        return [
            fake_logprobs(ids[p], next_token(sum(ids[:p]), p, vocab), top, vocab)
            for p in range(1, len(ids))
        ]

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefix: ModelState | None = None,
        on_chunk: Callable[[ModelState, int], None] | None = None,
        sampling: SamplingParams = GREEDY,
        max_len: int | None = None,
        on_layers: Callable[[ModelState, int, range], None] | None = None,
    ) -> FakePrefillResult:
        new = [int(t) for t in tokens]
        if not new:
            raise EngineError("the prompt is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in new):
            raise EngineError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        head = [] if prefix is None else _checked_tokens(self.cfg, prefix, "the prefix state")
        ids = head + new
        capacity = max_len or len(ids)
        if len(ids) > capacity:
            raise LengthLimitError(f"prompt ({len(ids)}) exceeds max_len {capacity}")
        compute_s = self.seconds_per_token * len(new)  # only the uncached part costs
        state = state_from_arrays(self.cfg, len(ids), _arrays(self.cfg, ids), capacity)
        if on_layers is not None and len(self.groups) > 1:  # its one call, layer by layer
            for group in self.groups:
                if compute_s:
                    self._sleep(compute_s * len(group) / self.cfg.num_layers)
                on_layers(state, len(ids), group)
        elif compute_s:
            self._sleep(compute_s)
        if on_chunk is not None:
            step = self.chunk_len or len(new)
            for end in range(len(head) + step, len(ids), step):
                on_chunk(
                    state_from_arrays(self.cfg, end, _arrays(self.cfg, ids[:end]), capacity), end
                )
            on_chunk(state, len(ids))
        vocab = self.cfg.vocab_size
        first = fake_draw(
            next_token(sum(ids), len(ids), vocab), sampling, sampling.first_index, vocab
        )
        return FakePrefillResult(state, first, len(new), len(head))

    def prefill_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_len: int | None = None,
        max_batch_tokens: int = 4096,
        sampling: Sequence[SamplingParams] | None = None,
    ) -> list[FakePrefillResult]:
        """`prefill` of each prompt, as the JAX engine's `prefill_batch`: one emulated compute
        time for all of them (``seconds_per_token`` per token), no prefix, no callbacks.
        ``max_batch_tokens`` only bounds the JAX engine's calls."""
        sampling = [GREEDY] * len(prompts) if sampling is None else list(sampling)
        if len(sampling) != len(prompts):
            raise EngineError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
        if self.seconds_per_token:
            self._sleep(self.seconds_per_token * sum(len(p) for p in prompts))
        alone = FakePrefillEngine(self.cfg)  # the rows' outputs, without their time again
        return [
            alone.prefill(p, sampling=s, max_len=max_len)
            for p, s in zip(prompts, sampling, strict=True)
        ]


@dataclasses.dataclass
class _Slot:
    total: int  # sum of the sequence so far: the state's tokens, then every token absorbed
    length: int  # its length
    remaining: int
    sampling: SamplingParams
    index: int  # key-schedule index of the next token
    logprobs: int | None = None  # alternatives per token; None: none asked
    finished: bool = False


class FakeDecodeEngine:
    """`DecodeEngineLike`: insert / step / is_finished / free over `max_slots` slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_slots: int,
        max_len: int,
        step_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        _check_model(cfg)
        self.cfg, self.max_slots, self.max_len = cfg, max_slots, max_len
        self.step_s, self._sleep = step_s, sleep
        self._slots: list[_Slot | None] = [None] * max_slots
        self._logprobs: dict[int, TokenLogprobs] = {}

    @property
    def free_slots(self) -> list[int]:
        return [i for i, slot in enumerate(self._slots) if slot is None]

    @property
    def active_slots(self) -> list[int]:
        return [i for i, slot in enumerate(self._slots) if slot and not slot.finished]

    def fits(self, requests: list[tuple[int, int]]) -> int:
        """As many of ``requests`` as there are free slots."""
        return min(len(requests), len(self.free_slots))

    def insert(
        self,
        state: ModelState,
        first_token: int,
        sampling: SamplingParams = GREEDY,
        *,
        max_new_tokens: int,
        eos_id: int | None = None,
        logprobs: int | None = None,
    ) -> int:
        prompt = self._checked(state)
        length = len(prompt)
        if length + max_new_tokens > self.max_len:
            raise LengthLimitError(
                f"state ({length}) + {max_new_tokens} exceed max_len {self.max_len}"
            )
        if not self.free_slots:
            raise EngineError(f"all {self.max_slots} slots are busy")
        slot = self.free_slots[0]
        # The first token (sampled by prefill) is the next input, as in the real engine.
        self._slots[slot] = _Slot(
            sum(prompt) + int(first_token),
            length + 1,
            max_new_tokens,
            sampling,
            sampling.first_index + 1,
            logprobs,
        )
        return slot

    def check_state(self, state: ModelState) -> None:
        self._checked(state)

    def _checked(self, state: ModelState) -> list[int]:
        """The tokens of `state`, once it is checked to be their fake state and to fit."""
        prompt = _checked_tokens(self.cfg, state, "the state")
        if len(prompt) > self.max_len:
            raise LengthLimitError(f"state ({len(prompt)}) exceeds max_len {self.max_len}")
        return prompt

    def step(self) -> list[tuple[int, int]]:
        active = self.active_slots
        if not active:
            return []
        if self.step_s:
            self._sleep(self.step_s)
        out, self._logprobs = [], {}
        vocab = self.cfg.vocab_size
        for i in active:
            slot = self._slots[i]
            assert slot is not None
            greedy = next_token(slot.total, slot.length, vocab)
            token = fake_draw(greedy, slot.sampling, slot.index, vocab)
            if slot.logprobs is not None:
                self._logprobs[i] = fake_logprobs(token, greedy, slot.logprobs, vocab)
            out.append((i, token))
            slot.index += 1
            slot.total, slot.length = slot.total + token, slot.length + 1
            slot.remaining -= 1
            slot.finished = slot.remaining == 0
        return out

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        return self._logprobs.get(slot)

    def is_finished(self, slot: int) -> bool:
        entry = self._slots[slot]
        if entry is None:
            raise EngineError(f"slot {slot} holds no request")
        return entry.finished

    def free(self, slot: int) -> None:
        if self._slots[slot] is None:
            raise EngineError(f"slot {slot} holds no request")
        self._slots[slot] = None
