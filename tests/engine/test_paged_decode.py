"""The paged decode engine: the tokens of the slot engine and of single-process greedy
generation for every tiny preset, alone, interleaved and on a prefix shared by several live
requests (copy-on-write); the pool's accounting of what a prefix hit maps instead of allocating.

Greedy generation, the prompts, the prefill and the slot engine are test_engines.py's (the
model alone: one padded ``prefill`` with the reference ops, then ``decode_step`` per token), so
the programs they compile are shared with it.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from conftest import PRESETS, preset
from test_engines import LENGTHS, MAX_LEN, NEW, prompt, reference
from test_engines import engines as slot_engines

from prfaas_jax.cli import main
from prfaas_jax.engine import codec
from prfaas_jax.engine.api import DecodeEngineLike
from prfaas_jax.engine.block_pool import NoFreePageError
from prfaas_jax.engine.codec.layout import canonical_arrays
from prfaas_jax.engine.paged_decode import PagedDecodeEngine
from prfaas_jax.engine.sampling import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError, LengthLimitError

BLOCK = 4


@functools.cache
def engines(name: str):
    """``(cfg, params, prefill engine, slot engine, paged engine)``."""
    cfg, params, prefill, slots = slot_engines(name)
    pages = PagedDecodeEngine(
        cfg, params, num_pages=160, block_size=BLOCK, max_slots=4, max_len=MAX_LEN, buckets=(64,)
    )
    return cfg, params, prefill, slots, pages


def drain(engine, slots: list[int]) -> dict[int, list[int]]:
    """Step until every slot finishes; each slot's tokens (then freed)."""
    out: dict[int, list[int]] = {slot: [] for slot in slots}
    while not all(engine.is_finished(slot) for slot in slots):
        for slot, token in engine.step():
            out[slot].append(token)
    for slot in slots:
        engine.free(slot)
    return out


def alone(engine, state, first: int, sampling=GREEDY, new: int = NEW) -> list[int]:
    slot = engine.insert(state, first, sampling, max_new_tokens=new)
    return [first, *drain(engine, [slot])[slot]]


@pytest.mark.parametrize("name", PRESETS)
def test_tokens_equal_slots_and_greedy_generation(name):
    _, _, prefill, slots, pages = engines(name)
    results = {length: prefill.prefill(prompt(length)) for length in LENGTHS}
    for length, result in results.items():
        want = reference(name)[length]
        assert alone(slots, result.state, result.first_token) == want, f"{name} L={length}"
        assert alone(pages, result.state, result.first_token) == want, f"{name} L={length}"
    # All at once, inserted at different steps: the same tokens.
    first = pages.insert(results[50].state, results[50].first_token, max_new_tokens=NEW)
    early = [token for slot, token in pages.step() if slot == first]
    rest = [
        pages.insert(results[n].state, results[n].first_token, max_new_tokens=NEW)
        for n in LENGTHS[:2]
    ]
    got = drain(pages, [first, *rest])
    assert early + got[first] == reference(name)[50][1:]
    for slot, length in zip(rest, LENGTHS[:2], strict=True):
        assert got[slot] == reference(name)[length][1:]
    assert (pages.pool.used_pages, pages.pool.reserved) == (0, 0)


@pytest.mark.parametrize("name", ["tiny", "tiny-swa"])
def test_pages_hold_the_state(name):
    """The pages of an inserted request gather back to the state it was given, tensor by
    tensor in the codec's canonical form, and the codec encodes the same bytes from them."""
    cfg, _, prefill, _, pages = engines(name)
    assert isinstance(pages, DecodeEngineLike)
    result = prefill.prefill(prompt(45))
    slot = pages.insert(result.state, result.first_token, max_new_tokens=1)
    encoded = b"".join(
        bytes(frame) for frame in codec.encode(pages.request_state(slot), cfg, stream_id=7)
    )
    assert encoded == b"".join(
        bytes(frame) for frame in codec.encode(result.state, cfg, stream_id=7)
    )
    length, want = canonical_arrays(result.state, cfg, 0)
    _, got = canonical_arrays(pages.request_state(slot), cfg, 0)
    assert length == 45 and len(got) == len(want)
    for (spec, a), (_, b) in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=spec.name)
    assert pages.pool.used_pages == pages.layout.request_pages(45)
    pages.free(slot)


def _unshared_pages(pages: PagedDecodeEngine, prefix_len: int, length: int) -> int:
    """Pages a request of ``length`` positions needs beyond a prefix of ``prefix_len`` held by
    another request: counted from the block geometry alone."""
    ring = pages.layout.ring_pages
    count = 0
    for kind in pages.cfg.layers:
        if kind.is_linear:
            count += 1
            continue
        per_page = pages.layout.tokens(kind)
        full = prefix_len // per_page  # blocks the prefix holds in full
        blocks = -(-length // per_page)
        if ring and kind.value == "swa":
            held = range(max(0, blocks - ring), blocks)
            prefix_held = range(max(0, -(-prefix_len // per_page) - ring), full)
            count += sum(b not in prefix_held for b in held)
        else:
            count += blocks - full
    return count


@pytest.mark.parametrize("name", PRESETS)
def test_shared_prefix_maps_pages_and_copies_on_write(name):
    cfg, _, prefill, slots, pages = engines(name)
    base = prefill.prefill(prompt(45))
    suffix = np.random.default_rng(7).integers(0, 256, 7).tolist()
    longer = prefill.prefill(suffix, prefix=base.state)  # 52 positions
    assert int(longer.state.lengths[0]) == 52
    sampled = SamplingParams(temperature=1.0, seed=7)
    want_a = alone(slots, base.state, base.first_token)
    want_b = alone(slots, base.state, base.first_token, sampled)
    want_c = alone(slots, longer.state, longer.first_token)

    a = pages.insert(base.state, base.first_token, max_new_tokens=NEW)
    held_a = pages.pool.used_pages
    assert held_a == pages.layout.request_pages(45)
    prefix = pages.share(a)
    # The whole state of B is the prefix: every page mapped, none allocated.
    b = pages.insert(base.state, base.first_token, sampled, max_new_tokens=NEW, prefix=prefix)
    assert pages.pool.used_pages == held_a
    # C continues the prefix: only the blocks past its full ones, and its own linear states.
    c = pages.insert(longer.state, longer.first_token, max_new_tokens=NEW, prefix=prefix)
    assert pages.pool.used_pages == held_a + _unshared_pages(pages, 45, 52)
    attention = next(i for i, kind in enumerate(cfg.layers) if not kind.is_linear)
    shared = pages.table(a).pages[attention][0]
    assert pages.pool.refcount(shared) >= 3  # A, the prefix, B (and C for a full block)
    pages.release(prefix)
    got = drain(pages, [a, b, c])
    assert [base.first_token, *got[a]] == want_a
    assert [base.first_token, *got[b]] == want_b
    assert [longer.first_token, *got[c]] == want_c
    assert want_a != want_b  # B really decoded its own continuation on the shared pages
    assert (pages.pool.used_pages, pages.pool.reserved) == (0, 0)


@pytest.mark.parametrize("name", PRESETS)
def test_kv_allocator_paged_is_the_pools_accounting(name, capsys):
    """`prfaas kv --allocator paged` against the bytes the pool really holds for a prefilled
    request of each length, and after it decoded six more tokens."""
    argv = ["kv", "--model", name, "--allocator", "paged", "--block-size", str(BLOCK)]
    argv += ["--lengths", "1,7,17,23,50,56", "--no-measure", "--json"]
    assert main(argv) == 0
    paged = json.loads(capsys.readouterr().out)["paged"]
    cli = {row["length"]: row["paged_bytes"] for row in paged["rows"]}
    _, _, prefill, _, pages = engines(name)
    for length in (1, 17, 50):
        result = prefill.prefill(prompt(length))
        slot = pages.insert(result.state, result.first_token, max_new_tokens=NEW)
        assert pages.pool.used_bytes == cli[length], f"{name} L={length}"
        for _ in range(NEW):
            pages.step()
        assert pages.pool.used_bytes == cli[length + NEW], f"{name} L={length + NEW}"
        pages.free(slot)


def test_a_full_pool_refuses_before_taking_anything():
    cfg, params = preset("tiny")
    _, _, prefill, _, _ = engines("tiny")
    result = prefill.prefill(prompt(45))
    small = PagedDecodeEngine(cfg, params, num_pages=8, block_size=BLOCK, max_slots=2, max_len=64)
    need = small.pages_needed(45, NEW)
    assert need == 6  # ⌈51/20⌉ = 3 MLA pages + 3 KDA pages, all at insert
    # In order, each with every page it may need: 6 + 6 > 8; two one-token requests, 4 + 4.
    assert small.fits([(45, NEW), (1, 1)]) == 1 and small.fits([(1, 1), (1, 1)]) == 2
    slot = small.insert(result.state, result.first_token, max_new_tokens=NEW)
    assert small.fits([(1, 1)]) == 0  # 2 pages left
    with pytest.raises(NoFreePageError):
        small.insert(result.state, result.first_token, max_new_tokens=NEW)
    assert small.free_slots == [1] and small.pool.used_pages == 6
    small.free(slot)
    assert (small.pool.used_pages, small.pool.reserved) == (0, 0)
    with pytest.raises(EngineError, match="holds no request"):
        small.free(slot)
    # More pages than the whole pool has: past the engine's limit, not a wait for pages.
    tinier = PagedDecodeEngine(cfg, params, num_pages=5, block_size=BLOCK, max_slots=2, max_len=64)
    with pytest.raises(LengthLimitError, match="the pool has 5"):
        tinier.insert(result.state, result.first_token, max_new_tokens=NEW)
    assert (tinier.pool.used_pages, tinier.pool.reserved) == (0, 0)


def _scored_run(engine, result, sampling) -> tuple[list, list]:
    """``(token, logprobs(slot))`` of a request that asks for 3 alternatives and of one that
    does not, decoded together; a third request, freed before the first step, leaves the asking
    one in a slot other than its row of the paged engine's packed batch."""
    spare = engine.insert(result.state, result.first_token, max_new_tokens=NEW)
    plain = engine.insert(result.state, result.first_token, sampling, max_new_tokens=NEW)
    asked = engine.insert(
        result.state, result.first_token, sampling, max_new_tokens=NEW, logprobs=3
    )
    engine.free(spare)
    made: dict[int, list] = {plain: [], asked: []}
    while engine.active_slots:
        for slot, token in engine.step():
            made[slot].append((token, engine.logprobs(slot)))
    engine.free(plain)
    engine.free(asked)
    return made[plain], made[asked]


def test_logprobs_are_the_slot_engines():
    """The paged engine reports each token's log-probability and top alternatives as the slot
    engine does (whose numbers tests/engine/test_logprobs.py holds to a prefill's scores)."""
    _, _, prefill, slots, pages = engines("tiny")
    result = prefill.prefill(prompt(45))
    sampled = SamplingParams(temperature=1.0, seed=3)
    _, want = _scored_run(slots, result, sampled)
    plain, got = _scored_run(pages, result, sampled)
    assert all(lp is None for _, lp in plain)
    assert [t for t, _ in plain] == [t for t, _ in got] == [t for t, _ in want]
    for (token, a), (_, b) in zip(want, got, strict=True):
        assert a.token == b.token == token
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(b.top) == 3
        np.testing.assert_allclose([v for _, v in b.top], [v for _, v in a.top], atol=1e-5)
    assert (pages.pool.used_pages, pages.pool.reserved) == (0, 0)


@pytest.mark.parametrize("name", ["tiny", "tiny-swa"])
def test_attention_through_the_paged_kernels(name):
    """``paged_attention=True`` under ``impl="pallas"``: attention layers read their pages
    through the Pallas paged kernels (interpreted) — the greedy tokens of generation, which the
    jnp gather path gives too (above), for MLA (tiny) and for GQA with an SWA ring that wraps
    (tiny-swa, window 8), two requests at once."""
    cfg, params, prefill, _, _ = engines(name)
    pages = PagedDecodeEngine(
        cfg,
        params,
        num_pages=64,
        block_size=BLOCK,
        max_slots=2,
        max_len=MAX_LEN,
        buckets=(64,),
        impl="pallas",
        paged_attention=True,
    )
    results = {length: prefill.prefill(prompt(length)) for length in (17, 50)}
    slots = {
        pages.insert(r.state, r.first_token, max_new_tokens=NEW): n for n, r in results.items()
    }
    got = drain(pages, list(slots))
    for slot, length in slots.items():
        assert [results[length].first_token, *got[slot]] == reference(name)[length], length
    assert (pages.pool.used_pages, pages.pool.reserved) == (0, 0)
