"""A prefill worker takes the short prompts waiting for its engine into one batched call.

In process on loopback: a router, a PD prefill worker and a decode worker. The fake engines
first (`engine/fake.py`: every token computable by hand), holding the engine on a first prompt
while others queue: the waiting one-chunk prompts run in one `prefill_batch` call, each reply is
the fake model's tokens for its own prompt and sampling, and each request keeps its own report,
cancellation and prefix hit. Then the tiny JAX engines: concurrent short prompts share a call
and every reply equals single-process generation (batch-1 prefill, its state straight into a
decode slot: `engine/generate.py`'s steps, on the same compiled engines).
"""

from __future__ import annotations

import threading

import grpc
import jax
import numpy as np
import pytest
from conftest import preset
from serving_support import (
    GatedPrefill,
    Reply,
    fake_config,
    generate,
    serve_in_process,
    wait_for,
)

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.fake import (
    FakeDecodeEngine,
    FakePrefillEngine,
    fake_tokens,
)
from prfaas_jax.engine.generate import decode_alone
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.worker.engines import EngineFactory
from prfaas_jax.serving.worker.prefill_queue import PrefillQueue, QueuedPrefill

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
NEW = 4
WAIT_S = 20.0  # every wait is for an event; this only bounds a broken run


def prompt(n: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % VOCAB for i in range(n)]


def test_waiting_short_prompts_share_one_call_and_keep_their_own_replies(tmp_path):
    engine = GatedPrefill()
    sections = {"prefix_cache": {"enabled": True}}
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml", **sections))
    instances = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(CFG)),
        "pd-0": (Role.PD_PREFILL, engine),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=8, max_len=512)),
    }
    first = prompt(40, 1)
    waiting = {  # request id -> prompt and sampling, all ≤ t = 64 tokens: the PD route
        "a": (prompt(20, 2), GREEDY),
        "b": (prompt(33, 3), SamplingParams(temperature=0.8, top_k=20, seed=7)),
        "c": (prompt(7, 4), GREEDY),
        "hit": (first + prompt(9, 5), GREEDY),  # the first prompt's state is cached by then
        "gone": (prompt(25, 6), GREEDY),  # cancelled while it waits
    }
    replies: dict[str, Reply] = {}

    def run(request_id: str, tokens: list[int], sampling: SamplingParams) -> None:
        knobs = {"temperature": sampling.temperature, "top_k": sampling.top_k}
        knobs |= {"seed": sampling.seed} if sampling.seed else {}
        replies[request_id] = generate(cluster.router, tokens, NEW, request_id=request_id, **knobs)

    with serve_in_process(config, instances, prefix_caches=True) as cluster:
        service = cluster.prefill["pd-0"]
        threads = [threading.Thread(target=run, args=("first", first, GREEDY))]
        threads[0].start()
        assert engine.entered.wait(WAIT_S)
        for request_id, (tokens, sampling) in waiting.items():
            if request_id == "gone":
                continue
            threads.append(threading.Thread(target=run, args=(request_id, tokens, sampling)))
            threads[-1].start()
        gone = cluster.router.Generate(
            pb.GenerateRequest(
                request_id="gone", prompt_token_ids=waiting["gone"][0], max_new_tokens=NEW
            ),
            timeout=60,
        )
        assert wait_for(lambda: service.waiting == 5, WAIT_S), service.waiting
        gone.cancel()
        assert wait_for(lambda: service.waiting == 4, WAIT_S), service.waiting
        assert service.queued == 5
        engine.gate.set()
        for thread in threads:
            thread.join(WAIT_S)
        with pytest.raises(grpc.RpcError) as err:
            next(gone)
        assert err.value.code() is grpc.StatusCode.CANCELLED

    # The three fresh prompts in one call (shortest first: engine/batched_prefill.py keeps the
    # caller's order, the queue its arrival order); the hit alone, after its cached prefix.
    batched = [call for call in engine.calls if len(call) > 1]
    assert len(batched) == 1
    assert sorted(map(len, batched[0])) == sorted(len(waiting[r][0]) for r in "abc")
    assert service.batch_calls == {1: 2, 3: 1}
    assert engine.calls[0] == [first] and [first + prompt(9, 5)] not in engine.calls
    assert [prompt(9, 5)] in engine.calls  # only the part the cache did not cover
    for request_id, (tokens, sampling) in [("first", (first, GREEDY)), *waiting.items()]:
        if request_id == "gone":
            continue
        reply = replies[request_id]
        assert reply.tokens == fake_tokens(tokens, NEW, VOCAB, sampling), request_id
        assert reply.report.route == "pd" and reply.report.attempts == 1
        assert reply.report.prompt_len == len(tokens)
        assert reply.report.cached_len == (len(first) if request_id == "hit" else 0)
        assert reply.report.prefill_s > 0


def test_concurrent_short_prompts_on_the_jax_engines_equal_single_process_generation(tmp_path):
    cfg, params = preset("tiny")
    cfg = cfg.with_max_len(128)  # as a worker's engines take the cluster's limit
    prefill = PrefillEngine(cfg, params, chunk_len=32, buckets=(32, 128))
    decode = DecodeEngine(cfg, params, max_slots=2, max_len=128)
    sections = {"model": {"preset": "tiny", "engine": "jax"}, "engine": {"max_len": 128}}
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml", **sections))
    calls: list[int] = []
    batch = prefill.prefill_batch

    class Spy:  # the engine, counting the rows of each batched call
        chunk_len = prefill.chunk_len

        def __getattr__(self, name: str) -> object:
            return getattr(prefill, name)

        def prefill_batch(self, prompts, **options):
            calls.append(len(prompts))
            return batch(prompts, **options)

    gate, entered = threading.Event(), threading.Event()

    class Held(Spy):  # holds the engine on the first prompt until the others wait
        def prefill(self, tokens, **options):
            entered.set()
            assert gate.wait(WAIT_S)
            return prefill.prefill(tokens, **options)

    instances = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, Held()),
        "pd-1": (Role.PD_DECODE, decode),
    }
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (30, 9, 17, 32, 21)]
    replies: dict[int, list[int]] = {}

    def run(index: int) -> None:
        replies[index] = generate(cluster.router, prompts[index], NEW).tokens

    with serve_in_process(config, instances) as cluster:
        service = cluster.prefill["pd-0"]
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        threads[0].start()
        assert entered.wait(WAIT_S)
        for thread in threads[1:]:
            thread.start()
        assert wait_for(lambda: service.waiting == len(prompts) - 1, WAIT_S), service.waiting
        gate.set()
        for thread in threads:
            thread.join(60)
    assert calls == [len(prompts) - 1] and service.batch_calls == {1: 1, 4: 1}
    for index, tokens in enumerate(prompts):
        # Single-process generation: batch-1 prefill, its state straight into a decode slot.
        alone = prefill.prefill(tokens, max_len=128)
        slot = decode.insert(alone.state, alone.first_token, max_new_tokens=NEW - 1)
        assert replies[index] == [alone.first_token, *decode_alone(decode, slot)], index


def test_the_worker_compiles_its_batched_calls_behind_its_start(tmp_path):
    """Once `EngineFactory.warm_batches` (serving/worker/batch_warmup.py) has ended, a
    batched call of one-chunk prompts within `[engine]`'s limits compiles nothing: its shapes
    (block 8 at 2 rows, and at 1) and their first-token samplers are compiled already (which
    shapes, `warm_shapes`), and the queue may run it (`batch_ready`)."""
    engine_keys = {"max_len": 16, "chunk_len": 8, "buckets": [8, 16], "max_slots": 2}
    engine_keys |= {"prefill_batch_rows": 2, "prefill_batch_tokens": 16}
    sections = {"model": {"preset": "tiny", "engine": "jax"}, "engine": engine_keys}
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml", **sections))
    factory = EngineFactory(config)
    engine = factory.prefill_engine()
    assert factory.batch_ready([3, 8])  # no warm-up started: batches compile on first use
    factory.warm_batches()
    try:
        assert factory.wait_batches(WAIT_S)
    finally:
        factory.close()
    assert factory.batch_ready([3, 8]) and factory.batch_ready([3, 8, 5])
    compiles: list[str] = []

    def on_event(event: str, *_, **__) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    prompts = [prompt(n, offset) for n, offset in ((3, 0), (8, 5), (5, 9))]
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        outputs = engine.prefill_batch(prompts, max_len=16, max_batch_tokens=16, threads=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert [o.num_tokens for o in outputs] == [3, 8, 5] and compiles == []


def test_a_request_whose_own_part_fails_fails_alone():
    """Straight on the queue: of three waiting requests, the one whose `start` raises (its push
    could not open) and the one whose `row_done` raises (its stream failed) fail with their own
    errors; the engine call and the third request go on."""
    engine = GatedPrefill()
    queue = PrefillQueue(max_rows=8, max_tokens=4096, max_len=512)
    prompts = {name: prompt(10 + i, i) for i, name in enumerate(["first", "ok", "start", "row"])}
    errors = {"start": RuntimeError("start"), "row": RuntimeError("row")}
    outcomes: dict[str, object] = {}

    def part(name: str, which: str) -> None:
        if which == name and name in errors:
            raise errors[name]

    def run(name: str) -> None:
        request = QueuedPrefill(
            prompts[name],
            GREEDY,
            start=lambda: part(name, "start"),
            alone=lambda: engine.prefill(prompts[name], max_len=512),
            row_done=lambda _: part(name, "row"),
            batchable=lambda: True,
            stopped=lambda: False,
        )
        try:
            outcomes[name] = queue.run(request, engine).first_token
        except RuntimeError as err:
            outcomes[name] = err

    threads = {name: threading.Thread(target=run, args=(name,)) for name in prompts}
    threads["first"].start()
    assert engine.entered.wait(WAIT_S)
    for name in ["ok", "start", "row"]:
        threads[name].start()
    assert wait_for(lambda: queue.waiting == 3, WAIT_S)
    engine.gate.set()
    for thread in threads.values():
        thread.join(WAIT_S)
    assert outcomes["start"] is errors["start"] and outcomes["row"] is errors["row"]
    for name in ["first", "ok"]:
        assert outcomes[name] == fake_tokens(prompts[name], 1, VOCAB)[0]
    # One call after the first, of the two whose `start` went through, in their arrival order.
    assert len(engine.calls) == 2
    assert sorted(engine.calls[1]) == sorted([prompts["ok"], prompts["row"]])
    assert queue.calls == {1: 1, 2: 1}
