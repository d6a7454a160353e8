"""The batched prefill warm-up behind a worker's start (serving/worker/batch_warmup.py).

On the fake prefill engine, given the batched engine's warm-up calls (`bucket`, `batch_shapes`,
`compile_batch`) with a `compile_batch` that blocks until the test releases it: while a batch's
shape is not compiled the prefill queue runs its prompts one per call — none waits for the
compile, and each reply is the fake model's tokens for its prompt, as in a batch — and once the
shapes are compiled the same queue batches them; `stop` ends the thread between two shapes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from serving_support import GatedPrefill, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.engine.sampling_params import GREEDY
from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster_sections import EngineSection
from prfaas_jax.serving.loadgen.warm_wait import wait_warm
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.worker.batch_warmup import BatchWarmup
from prfaas_jax.serving.worker.prefill_queue import PrefillQueue, QueuedPrefill

CFG = load_model_config("tiny")
WAIT_S = 20.0  # every wait is for an event; this only bounds a broken run
# One block size (64: every prompt's bucket), batches of up to 4 rows, states of 512 positions.
SECTION = EngineSection(max_len=512, chunk_len=64, buckets=(64,), prefill_batch_rows=4)
SHAPES = [(1, 64, 512), (2, 64, 512), (4, 64, 512)]  # fewest rows first


class SlowCompiles(GatedPrefill):
    """The gated fake engine, holding each `compile_batch` at `release`; `compiling` lists
    each shape it began."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.compile_began = threading.Event(), threading.Event()
        self.compiling: list[tuple[int, int, int]] = []

    def bucket(self, size: int) -> int:
        return 64

    def batch_shapes(self, lengths: Sequence[int], **_: object) -> set[tuple[int, int, int]]:
        return {(len(lengths), 64, 512)}  # the test's batches: 2 prompts of ≤ 64 tokens

    def compile_batch(self, rows: int, block_len: int, capacity: int) -> None:
        self.compiling.append((rows, block_len, capacity))
        self.compile_began.set()
        assert self.release.wait(WAIT_S), "the test never released the compile"


def prompt(n: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % CFG.vocab_size for i in range(n)]


def queue_round(queue: PrefillQueue, engine: SlowCompiles, prompts: list[list[int]]) -> list:
    """The first prompt holds the engine until the others wait behind it; each one's first
    token, in order."""
    engine.gate.clear()
    engine.entered.clear()
    firsts: list = [None] * len(prompts)

    def run(index: int) -> None:
        tokens = prompts[index]
        request = QueuedPrefill(
            tokens,
            GREEDY,
            start=lambda: None,
            alone=lambda: engine.prefill(tokens, max_len=512),
            row_done=lambda _: None,
            batchable=lambda: True,
            stopped=lambda: False,
        )
        firsts[index] = queue.run(request, engine).first_token

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    threads[0].start()
    assert engine.entered.wait(WAIT_S)
    for thread in threads[1:]:
        thread.start()
    assert wait_for(lambda: queue.waiting == len(prompts) - 1, WAIT_S)
    engine.gate.set()
    for thread in threads:
        thread.join(WAIT_S)
    return firsts


def test_a_batch_not_yet_compiled_runs_one_prompt_per_call_and_waits_for_no_compile():
    engine = SlowCompiles()
    warmup = BatchWarmup(engine, SECTION)  # type: ignore[arg-type]
    assert warmup.shapes == SHAPES
    queue = PrefillQueue(max_rows=4, max_tokens=4096, max_len=512, ready=warmup.ready)
    warmup.start()
    try:
        assert engine.compile_began.wait(WAIT_S)
        assert warmup.warming == len(SHAPES)  # what the worker's stats report
        prompts = [prompt(40, 1), prompt(20, 2), prompt(33, 3)]
        firsts = queue_round(queue, engine, prompts)
        # The first shape's compile still blocks: the two waiting prompts ran alone, around it.
        assert engine.compiling == SHAPES[:1] and not engine.release.is_set()
        # (The two waiting prompts join the queue in whichever order their threads reach it.)
        assert engine.calls[0] == [prompts[0]] and queue.calls == {1: 3}
        assert sorted(engine.calls[1:]) == sorted([p] for p in prompts[1:])
        assert firsts == [fake_tokens(p, 1, CFG.vocab_size)[0] for p in prompts]
        engine.release.set()
        assert warmup.wait(WAIT_S) and engine.compiling == SHAPES and warmup.warming == 0
        assert warmup.ready([20, 33])
        more = [prompt(40, 4), prompt(20, 5), prompt(33, 6)]
        firsts = queue_round(queue, engine, more)
    finally:
        engine.release.set()
        warmup.stop()
    # Now the two waiting prompts share one call, and reply what they would alone.
    assert engine.calls[3] == [more[0]] and queue.calls == {1: 4, 2: 1}
    assert len(engine.calls) == 5 and sorted(engine.calls[4]) == sorted(more[1:])
    assert firsts == [fake_tokens(p, 1, CFG.vocab_size)[0] for p in more]


def test_stop_ends_the_warm_up_between_two_shapes():
    engine = SlowCompiles()
    warmup = BatchWarmup(engine, SECTION)  # type: ignore[arg-type]
    warmup.start()
    assert engine.compile_began.wait(WAIT_S)
    assert not warmup.stop(timeout=0.05)  # the first shape still compiles
    engine.release.set()
    assert warmup.wait(WAIT_S)
    assert engine.compiling == SHAPES[:1]  # no shape begun after the stop
    assert warmup.ready([20]) and not warmup.ready([20, 33])
    assert warmup.warming == 0  # stopped: nothing more will compile, nothing to wait for


class ScriptedRouter:
    """A router stub whose `GetStats` answers the given stats in turn (then the last)."""

    def __init__(self, *answers: pb.RouterStats) -> None:
        self.answers, self.calls = list(answers), 0

    def GetStats(self, request: pb.GetStatsRequest, timeout: float) -> pb.RouterStats:  # noqa: N802
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


def stats(*workers: tuple[int, int]) -> pb.RouterStats:
    """Router stats of workers given as (max_slots, batch calls warming); 0 slots: unheard."""
    return pb.RouterStats(
        workers=[
            pb.WorkerStats(name=f"w{i}", max_slots=slots, batch_calls_warming=warming)
            for i, (slots, warming) in enumerate(workers)
        ]
    )


def test_a_bench_waits_until_every_worker_is_heard_and_warm():
    unheard, warming, warm = stats((4, 0), (0, 0)), stats((4, 0), (4, 2)), stats((4, 0), (4, 0))
    router = ScriptedRouter(unheard, warming, warming, warm)
    assert wait_warm(router, timeout_s=WAIT_S, poll_s=0.001) is warm and router.calls == 4
    with pytest.raises(UserError, match="2 batched prefill calls still compiling"):
        wait_warm(ScriptedRouter(warming), timeout_s=0.01, poll_s=0.001)
    # A worker never heard (down since the router started) is waited for only so long.
    router = ScriptedRouter(unheard)
    assert wait_warm(router, poll_s=0.001, unheard_s=0.05) is unheard and router.calls > 1
