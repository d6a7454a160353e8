"""Prefill and decode engines: state handoff in and across processes, continuous batching, and
bounded compiles.

"Greedy generation" is computed from the model alone (conftest's ``greedy_generation``): one
padded ``prefill`` over all prompt lengths of a preset (with the token-by-token reference ops,
while the engines use the chunked ones), then batched ``decode_step``s — no buckets, chunks,
slots or codec. Every preset
runs every prompt length in process through the codec. Across processes, where each new process
pays its own compiles, a TCP socket carries two presets (every length) and a ``prfaas prefill`` /
``prfaas decode`` file a third: GDN, Lightning, MLA, GQA and SWA states cross a process boundary
(KDA's state has GDN's layout).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import PRESETS, greedy_generation, preset

from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.format import StateDecodeError
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff, split_handoff
from prfaas_jax.engine.decode import DecodeEngine, NoFreeSlotError, step_rows
from prfaas_jax.engine.prefill import PrefillEngine, default_buckets, split_layers
from prfaas_jax.engine.sampling import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError
from prfaas_jax.model import init_state, state_nbytes

CHUNK = 16
LENGTHS = (1, CHUNK - 1, CHUNK, CHUNK + 1, 50)  # 50 ≫ C: four calls, and past the SWA window
NEW = 6  # tokens after the first
MAX_LEN = 64


def prompt(length: int) -> list[int]:
    return np.random.default_rng(length).integers(0, 256, length).tolist()


@functools.cache
def engines(name: str) -> tuple:
    """``(cfg, params, prefill engine, decode engine)``, compiled once per session."""
    cfg, params = preset(name)
    # One bucket: every test prompt compiles to the same (16-token block, 64-position) call.
    prefill_engine = PrefillEngine(cfg, params, chunk_len=CHUNK, buckets=(MAX_LEN,))
    return cfg, params, prefill_engine, DecodeEngine(cfg, params, max_slots=4, max_len=MAX_LEN)


@functools.cache
def reference(name: str) -> dict[int, list[int]]:
    """Greedy tokens (first included) of every prompt length, straight from the model."""
    cfg, params = preset(name)
    table = greedy_generation(params, cfg, [prompt(n) for n in LENGTHS], NEW, MAX_LEN)
    return dict(zip(LENGTHS, table, strict=True))


def run_alone(engine: DecodeEngine, state, first: int, sampling=GREEDY, **kw) -> list[int]:
    slot = engine.insert(state, first, sampling, **kw)
    tokens = [first]
    while not engine.is_finished(slot):
        tokens += [token for s, token in engine.step() if s == slot]
    engine.free(slot)
    return tokens


@pytest.mark.parametrize("name", PRESETS)
def test_codec_handoff_matches_greedy_generation(name):
    cfg, _, prefill_engine, decode_engine = engines(name)
    for length in LENGTHS:
        done: list[int] = []
        result = prefill_engine.prefill(prompt(length), on_chunk=lambda _, n, d=done: d.append(n))
        assert done == [min(end, length) for end in range(CHUNK, length + CHUNK, CHUNK)]
        assert result.state.capacity == length  # just what is needed
        frames = [bytes(frame) for frame in codec.encode(result.state, cfg, max_frame_bytes=2048)]
        assert codec.payload_nbytes(frames) == state_nbytes(cfg, length)
        state = codec.decode(frames, cfg, max_len=MAX_LEN)
        tokens = run_alone(decode_engine, state, result.first_token, max_new_tokens=NEW)
        assert tokens == reference(name)[length], f"{name} L={length}"
    assert prefill_engine.compile_count == 1


def _cli(*argv: str, env: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "prfaas_jax.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def subprocess_env():
    """Child processes run on the CPU and share the session's compilation cache
    (tests/conftest.py), so only the first one compiles each program."""
    return dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.mark.slow
def test_file_handoff_across_processes(tmp_path, subprocess_env):
    name, length = "tiny-swa", 50
    path = tmp_path / "state.prfs"
    ids = ",".join(map(str, prompt(length)))
    common = ("--model", name, "--json")
    flags = ("--prompt-ids", ids, "--chunk-len", str(CHUNK), "--out", str(path))
    made = _cli("prefill", *common, *flags, env=subprocess_env)
    assert made.returncode == 0, made.stderr
    report = json.loads(made.stdout)
    assert report["tokens"] == length
    assert report["payload_bytes"] == state_nbytes(preset(name)[0], length)
    assert {"compile_s", "run_s", "total_s"} <= set(report["timings"])
    flags = ("--state", str(path), "--max-new-tokens", str(NEW))
    decoded = _cli("decode", *common, *flags, env=subprocess_env)
    assert decoded.returncode == 0, decoded.stderr
    tokens = [report["first_token"], *json.loads(decoded.stdout)["tokens"]]
    assert tokens == reference(name)[length]


SERVER = """
import json, socket, struct, sys
import jax
from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.sampling import GREEDY
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model import init_params

server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
engines = {}
for name, prompt in json.loads(sys.argv[1]):
    cfg = load_model_config(name)
    if name not in engines:
        params = init_params(jax.random.PRNGKey(0), cfg)
        engines[name] = PrefillEngine(cfg, params, chunk_len=16, buckets=(64,))
    result = engines[name].prefill(prompt)
    frames = list(codec.encode(result.state, cfg, max_frame_bytes=1024))
    frames.append(pack_handoff(Handoff(result.first_token, GREEDY), frames[0]))
    for frame in [*frames, b""]:  # an empty record ends a state
        conn.sendall(struct.pack("<I", len(frame)) + frame)
conn.close()
"""


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        assert more, "the server closed the connection early"
        data += more
    return data


@pytest.mark.slow
def test_socket_handoff_across_processes(subprocess_env):
    jobs = [(name, length) for name in ("tiny-gdn", "tiny-lightning") for length in LENGTHS]
    payload = json.dumps([[name, prompt(length)] for name, length in jobs])
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, payload],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env,
    )
    try:
        port = int(server.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=600) as conn:
            for name, length in jobs:
                frames = []
                while size := struct.unpack("<I", _recv_exact(conn, 4))[0]:
                    frames.append(_recv_exact(conn, size))
                assert len(frames) > 2  # small frames: the state arrived in pieces
                cfg, _, _, decode_engine = engines(name)
                state_frames, handoff = split_handoff(frames)
                state = codec.decode(state_frames, cfg, max_len=MAX_LEN)
                tokens = run_alone(decode_engine, state, handoff.first_token, max_new_tokens=NEW)
                assert tokens == reference(name)[length], f"{name} L={length}"
        assert server.wait(timeout=60) == 0, server.stderr.read()
    finally:
        server.kill()
        server.communicate()


def test_continuous_batching_matches_requests_run_alone():
    _, _, prefill_engine, engine = engines("tiny")
    requests = {
        "a": (5, SamplingParams(), 7),
        "b": (17, SamplingParams(temperature=0.8, seed=3), 9),
        "c": (30, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11), 4),
        "d": (1, SamplingParams(temperature=0.7, seed=5), 6),
        "e": (12, SamplingParams(temperature=1.2, top_p=0.8, seed=2**40 + 1), 5),
    }
    prefilled = {
        key: prefill_engine.prefill(prompt(length), sampling=sampling)
        for key, (length, sampling, _) in requests.items()
    }

    def insert(key, **kw):
        _, sampling, budget = requests[key]
        result = prefilled[key]
        return engine.insert(
            result.state, result.first_token, sampling, max_new_tokens=budget, **kw
        )

    alone = {}
    for key, (_, sampling, budget) in requests.items():
        result = prefilled[key]
        alone[key] = run_alone(
            engine, result.state, result.first_token, sampling, max_new_tokens=budget
        )
    # d stops at an EOS of its own (a decode-step token, so the budget is not what stops it).
    eos = alone["d"][2]
    alone["d"] = alone["d"][: alone["d"].index(eos, 1) + 1]

    got = {key: [prefilled[key].first_token] for key in requests}
    owner = {insert("a"): "a"}
    schedule = {1: ["b"], 3: ["c", "d"]}
    waiting = ["e"]
    step = 0
    while owner:
        for key in schedule.get(step, []):
            owner[insert(key, eos_id=eos if key == "d" else None)] = key
        for slot, token in engine.step():
            got[owner[slot]].append(token)
        for slot in [s for s in owner if engine.is_finished(s)]:
            engine.free(slot)
            del owner[slot]
            if waiting:  # reuse the freed slot mid-flight
                owner[insert(waiting.pop())] = "e"
        step += 1
    assert got == alone
    assert len(set(map(tuple, got.values()))) == len(got)


def test_step_rows_hold_every_active_slot():
    # (active slots, max_slots) → rows: the smallest power of two past the highest slot.
    cases = {
        ((0,), 8): 1,
        ((1,), 8): 2,
        ((0, 2), 8): 4,
        ((3,), 8): 4,
        ((4,), 8): 8,
        ((0, 7), 8): 8,
        ((4,), 6): 6,
    }
    for (active, max_slots), rows in cases.items():
        assert step_rows(list(active), max_slots) == rows


def test_steps_over_fewer_rows_leave_every_request_its_tokens():
    """Eight slots: a request alone steps over 1 row, with five more over 8, then over 1 again;
    its tokens, and each of the others', equal those it makes alone."""
    cfg, params, prefill_engine, _ = engines("tiny")
    engine = DecodeEngine(cfg, params, max_slots=8, max_len=MAX_LEN)
    budgets = {5: 20, 9: 3, 13: 4, 17: 2, 21: 5, 26: 3}  # prompt length → new tokens
    prefilled = {n: prefill_engine.prefill(prompt(n)) for n in budgets}
    alone = {
        n: run_alone(engine, r.state, r.first_token, max_new_tokens=budgets[n])
        for n, r in prefilled.items()
    }
    got = {n: [r.first_token] for n, r in prefilled.items()}
    owner = {engine.insert(prefilled[5].state, prefilled[5].first_token, max_new_tokens=20): 5}
    step = 0
    while owner:
        if step == 2:  # slots 1-5: the step spans all eight rows until they finish
            for n in list(budgets)[1:]:
                r = prefilled[n]
                owner[engine.insert(r.state, r.first_token, max_new_tokens=budgets[n])] = n
            assert step_rows(engine.active_slots, 8) == 8
        for slot, token in engine.step():
            got[owner[slot]].append(token)
        for slot in [s for s in owner if engine.is_finished(s)]:
            engine.free(slot)
            del owner[slot]
        step += 1
    assert step > 8  # the first request outlived the others, back on 1 row
    assert got == alone


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_k=40, seed=7)])
def test_resumed_request_continues_its_tokens(sampling):
    """A request cut after k tokens and resumed — prefill of prompt + those k tokens, sampling
    from index k (`first_index`) — yields exactly the tokens the uninterrupted run yields."""
    _, _, prefill_engine, engine = engines("tiny")
    start, total = prompt(17), 9
    whole = prefill_engine.prefill(start, sampling=sampling)
    expected = run_alone(engine, whole.state, whole.first_token, sampling, max_new_tokens=total - 1)
    for k in (1, 4):
        resumed = dataclasses.replace(sampling, first_index=k)
        result = prefill_engine.prefill(start + expected[:k], sampling=resumed)
        rest = run_alone(
            engine, result.state, result.first_token, resumed, max_new_tokens=total - k - 1
        )
        assert expected[:k] + rest == expected, k


def test_engine_errors():
    cfg, _, prefill_engine, engine = engines("tiny")
    result = prefill_engine.prefill(prompt(10))
    slots = [engine.insert(result.state, result.first_token, max_new_tokens=4) for _ in range(4)]
    with pytest.raises(NoFreeSlotError, match="all 4 slots are busy"):
        engine.insert(result.state, result.first_token, max_new_tokens=4)
    for slot in slots:
        engine.free(slot)
    with pytest.raises(EngineError, match="exceed the decode engine's max_len 64"):
        engine.insert(result.state, result.first_token, max_new_tokens=MAX_LEN - 9)
    swa_cfg, _ = preset("tiny-swa")
    with pytest.raises(EngineError, match="does not fit model 'tiny': layer 0 is a KvState"):
        engine.insert(init_state(swa_cfg, 1, 10), 0, max_new_tokens=4)
    # check_state: insert's checks of the state alone, with no slot and no copy.
    engine.check_state(result.state)
    with pytest.raises(EngineError, match="does not fit model 'tiny': layer 0 is a KvState"):
        engine.check_state(init_state(swa_cfg, 1, 10))
    with pytest.raises(EngineError, match="one sequence, got a batch of 2"):
        engine.check_state(init_state(cfg, 2, 10))
    too_long = init_state(cfg, 1, MAX_LEN + 1)
    too_long = type(too_long)(np.array([MAX_LEN + 1], np.int32), too_long.layers)
    with pytest.raises(EngineError, match=f"more than capacity {MAX_LEN}"):
        engine.check_state(too_long)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.insert(result.state, cfg.vocab_size, max_new_tokens=4)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        prefill_engine.prefill([1, 2, cfg.vocab_size])
    with pytest.raises(EngineError, match="exceed"):
        prefill_engine.prefill([1] * (cfg.max_len + 1))
    assert engine.free_slots == [0, 1, 2, 3]


def test_handoff_frame_is_checked():
    cfg, _, prefill_engine, _ = engines("tiny")
    sampling = SamplingParams(temperature=0.5, top_k=7, seed=9)
    frames = list(codec.encode(prefill_engine.prefill(prompt(10)).state, cfg))
    handoff = Handoff(123, sampling)
    frame = pack_handoff(handoff, frames[0])
    assert split_handoff([*frames, frame]) == (frames, handoff)
    for index in range(len(frame)):
        broken = bytearray(frame)
        broken[index] ^= 0x01
        with pytest.raises(StateDecodeError):
            split_handoff([*frames, bytes(broken)])
    other = list(codec.encode(prefill_engine.prefill(prompt(11)).state, cfg))
    with pytest.raises(StateDecodeError, match="another state stream"):
        split_handoff([*other, frame])
    with pytest.raises(StateDecodeError, match="handoff"):
        split_handoff(frames)


def test_prefix_continuation_equals_one_prefill():
    _, _, prefill_engine, _ = engines("tiny-lightning")
    ids = prompt(50)
    whole = prefill_engine.prefill(ids)
    prefix = prefill_engine.prefill(ids[:20]).state
    done = []
    rest = prefill_engine.prefill(ids[20:], prefix=prefix, on_chunk=lambda s, n: done.append(n))
    assert done == [32, 48, 50]  # the first call completes the chunk the prefix ended in
    assert rest.first_token == whole.first_token
    np.testing.assert_allclose(rest.logits_last, whole.logits_last, atol=1e-4)
    for a, b in zip(jax.tree.leaves(rest.state), jax.tree.leaves(whole.state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    # The engine donates only buffers it made: the caller's prefix is still usable.
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(prefix))


@pytest.mark.parametrize("name", ["tiny"])
def test_layerwise_prefill_streams_each_group_once_its_states_are_final(name):
    """The last call as segments over groups of layers: ``on_layers`` sees every group once, in
    order, with that group's states already final (equal to the result's) while the layers
    after it still hold the previous call's; the result equals the whole-call prefill, and
    every earlier call still goes through ``on_chunk``. Streamed through the codec it decodes
    to the greedy tokens."""
    cfg, params, whole, decode_engine = engines(name)
    layered = PrefillEngine(cfg, params, chunk_len=CHUNK, buckets=(MAX_LEN,), layer_groups=3)
    assert [list(g) for g in layered.groups] == [[0, 1], [2], [3]]  # 4 layers in 3 groups
    for length in (CHUNK - 1, 50):
        ids, seen, chunks = prompt(length), [], []
        encoder = codec.StreamEncoder(cfg, length, max_frame_bytes=2048, stream_id=7)
        frames = [encoder.header()]
        snapshots = {}

        def on_layers(state, done, layers, encoder=encoder, frames=frames, snapshots=snapshots):
            seen.append((done, layers))  # noqa: B023 (read right after the call)
            snapshots[layers.start] = [np.asarray(x) for x in jax.tree.leaves(state.layers)]
            frames.extend(encoder.layer_frames(state, layers))

        def on_chunk(state, done, encoder=encoder, chunks=chunks, frames=frames):
            chunks.append(done)
            frames.extend(encoder.ready_frames(state, done))

        result = layered.prefill(ids, on_chunk=on_chunk, on_layers=on_layers, max_len=MAX_LEN)
        reference_result = whole.prefill(ids)
        assert seen == [(length, group) for group in layered.groups]
        assert chunks == [min(end, length) for end in range(CHUNK, length + CHUNK, CHUNK)]
        assert result.first_token == reference_result.first_token
        np.testing.assert_allclose(result.logits_last, reference_result.logits_last, atol=1e-4)
        final = [jax.tree.leaves(layer) for layer in result.state.layers]
        for group in layered.groups:
            # In the snapshot taken for this group, its layers are final already.
            snapshot, start = snapshots[group.start], 0
            for index, leaves in enumerate(final):
                for leaf in leaves:
                    if index in group:
                        np.testing.assert_array_equal(snapshot[start], np.asarray(leaf))
                    start += 1
        rest = list(encoder.finish(result.state))
        assert len(rest) == 1  # the trailer: every tensor left with its layer group
        frames += rest
        state = codec.decode(frames, cfg, max_len=MAX_LEN)
        tokens = run_alone(decode_engine, state, result.first_token, max_new_tokens=NEW)
        assert tokens == reference(name)[length], f"{name} L={length}"
    with pytest.raises(EngineError, match="layer_groups must be ≥ 1"):
        PrefillEngine(cfg, params, layer_groups=0)


def test_split_layers_tiles_the_stack():
    assert split_layers(4, 3) == (range(0, 2), range(2, 3), range(3, 4))
    assert split_layers(4, 9) == tuple(range(i, i + 1) for i in range(4))
    assert split_layers(61, 4) == (range(0, 16), range(16, 31), range(31, 46), range(46, 61))
    assert split_layers(5, 1) == (range(0, 5),)


def test_plan_pads_to_buckets_and_cuts_at_chunk_multiples():
    cfg, params = preset("tiny")
    engine = PrefillEngine(cfg, params, chunk_len=512)
    assert engine.buckets == default_buckets(4096) == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    plan = engine.plan(300)
    assert (plan.block_len, plan.capacity, plan.chunks) == (512, 512, ((0, 300),))
    plan = engine.plan(1100)
    assert (plan.block_len, plan.capacity) == (512, 2048)
    assert plan.chunks == ((0, 512), (512, 1024), (1024, 1100))
    plan = engine.plan(600, prefix_len=700, max_len=1400)
    assert (plan.block_len, plan.capacity) == (512, 1400)
    assert plan.chunks == ((700, 1024), (1024, 1300))
    assert engine.plan(3, prefix_len=5).block_len == 16


def test_compiles_are_bounded_by_the_buckets():
    """50 distinct prompt lengths up to 2048 on the default buckets and chunk length."""
    cfg, params = preset("tiny-swa")
    engine = PrefillEngine(cfg, params)
    # Spread geometrically, so every bucket is hit while the total work stays small.
    spread = np.unique(np.geomspace(1, 2048, 80).round().astype(int))
    lengths = np.unique(spread[np.linspace(0, len(spread) - 1, 50).round().astype(int)])
    assert len(lengths) == 50 and (lengths.min(), lengths.max()) == (1, 2048)
    compiles = []

    def on_event(event: str, *_, **__) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for length in lengths:
            engine.prefill(np.arange(length) % cfg.vocab_size)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    used = {engine.plan(int(n)).capacity for n in lengths}
    print(
        f"{len(lengths)} lengths: {engine.compile_count} prefill executables, {len(used)} buckets "
        f"used, {len(compiles)} XLA compiles in all"
    )
    assert engine.compile_count <= len(used) <= sum(b <= 2048 for b in engine.buckets)
    # Nothing else compiles per length: the one extra program is the first-token sampler.
    assert len(compiles) <= engine.compile_count + 1
