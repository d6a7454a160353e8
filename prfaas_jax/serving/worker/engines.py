"""Engine construction for a worker process: `EngineFactory` builds and warms the engines.

A worker builds the engine of its role on demand (at start, and again when the router switches
the node's role) from the cluster config: the real JAX engines (engine/prefill.py, and
engine/decode.py or with `[engine] allocator = "paged"` engine/paged_decode.py) with the preset's
seeded weights, or the hand-computable fakes
(engine/fake.py); the worker sees either through the protocols of engine/api.py. Warming
compiles every executable a request can need — one prefill per length bucket at the fixed
capacity `max_len` (and its segments, with `[engine] layer_groups > 1`), the first-token
sampler, the decode step and the slot insert — so that no request pays a compile (the paged
engine's step, once per power-of-two batch of live rows; its insert still compiles per shape of
a received state and count of its blocks, on first use). The batched prefill calls the prefill
queue can make compile after that, on a thread of their own while the worker serves
(`warm_batches`, serving/worker/batch_warmup.py); until one is compiled the queue runs its
prompts one by one (`batch_ready`). In a
multi-process instance every process builds and warms the same engine, and the leader's is
wrapped to publish each call to the others (engine/spmd.py). The worker processes share JAX's
persistent compilation cache (engine/compile_cache.py): the first to compile an executable
stores it, the others load it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prfaas_jax.config import Impl, ModelConfig
from prfaas_jax.engine.api import DecodeEngineLike, MixedStepLike, PrefillEngineLike
from prfaas_jax.engine.spmd import CommandChannel, LeaderPrefillEngine, ProcessGroup
from prfaas_jax.serving.cluster_config import ClusterConfig, serving_model_config
from prfaas_jax.serving.cluster_sections import Allocator, EngineKind

if TYPE_CHECKING:
    from prfaas_jax.serving.worker.batch_warmup import BatchWarmup

log = logging.getLogger(__name__)


class EngineFactory:
    """Builds (once) and warms the prefill and decode engines of one worker process."""

    def __init__(
        self, config: ClusterConfig, group: ProcessGroup | None = None, *, prfaas: bool = False
    ) -> None:
        """``group``: this process's place in a multi-process instance (engine/spmd.py); its
        leader's prefill engine publishes each call to the followers. ``prfaas``: a PrfaaS
        instance, whose prefill runs on ``[engine] prfaas_mesh`` (else ``prefill_mesh``)."""
        self.config, self.group = config, group
        engine = config.engine
        self.prefill_mesh = engine.prfaas_prefill_mesh if prfaas else engine.prefill_mesh
        # The preset holding [engine] max_len tokens, as the router's: the engines never cut a
        # request to the preset's own limit.
        self.cfg: ModelConfig = serving_model_config(config)
        self._params: dict | None = None
        self._prefill: PrefillEngineLike | None = None
        self._decode: DecodeEngineLike | None = None
        self._mixer: MixedStepLike | None = None
        self._batches: BatchWarmup | None = None  # compiles the batched prefill calls
        self._lock = threading.Lock()

    @property
    def fake(self) -> bool:
        return self.config.model.engine is EngineKind.FAKE

    @property
    def interprets_kernels(self) -> bool:
        """True when ``[model] impl = "pallas"`` meets a machine without a GPU or TPU: the kernels
        then run in the Pallas interpreter — the same outputs, at a fraction of the speed."""
        if self.fake or self.config.model.impl != Impl.PALLAS:
            return False
        from prfaas_jax.ops.pallas_launch import resolve_interpret

        return resolve_interpret(None)

    def _weights(self) -> dict:
        if self._params is None:
            from prfaas_jax.model.weights import load_model

            # A preset's seeded weights, or a checkpoint's (a trained preset such as recall-tiny).
            _, self._params = load_model(self.config.model.preset, seed=self.config.model.seed)
        return self._params

    def prefill_engine(self) -> PrefillEngineLike:
        with self._lock:
            if self._prefill is None:
                start = time.perf_counter()
                engine = self._build_prefill()  # every process warms up alike
                if self.group is not None and self.group.num_processes > 1 and self.group.leader:
                    engine = LeaderPrefillEngine(engine, CommandChannel())
                self._prefill = engine
                log.info("prefill engine ready in %.1f s", time.perf_counter() - start)
            return self._prefill

    def batch_ready(self, lengths: Sequence[int]) -> bool:
        """Whether the prefill queue may run prompts of ``lengths`` in one batched call now:
        each of its calls is compiled, or this factory compiles none ahead (fake engines, or
        an engine given no batched warm-up: their batched calls compile on first use)."""
        batches = self._batches
        return batches is None or batches.ready(lengths)

    @property
    def batch_calls_warming(self) -> int:
        """Batched prefill calls still compiling behind the start (0 without a warm-up)."""
        batches = self._batches
        return 0 if batches is None else batches.warming

    def wait_batches(self, timeout: float | None = None) -> bool:
        """Wait for the batched prefill calls' warm-up to end; True if it has (or there is
        none)."""
        return self._batches is None or self._batches.wait(timeout)

    def close(self) -> None:
        """Stop the batched prefill warm-up (between two compiles); a multi-process leader
        tells its followers to exit."""
        if self._batches is not None:
            self._batches.stop()
        if isinstance(self._prefill, LeaderPrefillEngine):
            self._prefill.close()

    def decode_engine(self) -> DecodeEngineLike:
        with self._lock:
            if self._decode is None:
                start = time.perf_counter()
                self._decode = self._build_decode()
                log.info("decode engine ready in %.1f s", time.perf_counter() - start)
            return self._decode

    def mixer(self) -> MixedStepLike:
        """A mixed PD instance's mixer (serving/worker/mixed.py), over this factory's prefill
        and decode engines (built once): `MixedStep`, or with fake engines `FakeMixedStep`.
        Its blocks run from ``[engine] chunk_len`` / 8 to ``chunk_len`` tokens (4 sizes), each
        compiled here beside every power-of-two batch of decode rows."""
        prefill, decode = self.prefill_engine(), self.decode_engine()
        with self._lock:
            if self._mixer is None:
                if self.fake:
                    from prfaas_jax.engine.fake_mixed import FakeMixedStep

                    self._mixer = FakeMixedStep(prefill, decode)  # type: ignore[arg-type]
                else:
                    from prfaas_jax.engine.mixed_step import MixedStep

                    chunk_len = self.config.engine.chunk_len
                    mixer = MixedStep(
                        prefill,  # type: ignore[arg-type]
                        decode,  # type: ignore[arg-type]
                        min_tokens=max(1, chunk_len // 8),
                    )
                    mixer.warm()
                    self._mixer = mixer
            return self._mixer

    def _build_prefill(self) -> PrefillEngineLike:
        engine_cfg = self.config.engine
        if self.fake:
            from prfaas_jax.engine.fake import FakePrefillEngine

            return FakePrefillEngine(
                self.cfg,
                seconds_per_token=self.config.fake.prefill_s_per_token,
                layer_groups=engine_cfg.layer_groups,
                chunk_len=self.config.fake.chunk_len,
            )
        from prfaas_jax.engine.prefill import PrefillEngine
        from prfaas_jax.model.sharding import make_mesh

        engine = PrefillEngine(
            self.cfg,
            self._weights(),
            impl=self.config.model.impl,
            buckets=engine_cfg.buckets,
            chunk_len=engine_cfg.chunk_len,
            mesh=make_mesh(self.prefill_mesh) if self.prefill_mesh else None,
            layer_groups=engine_cfg.layer_groups,
        )
        from prfaas_jax.engine import codec

        # One prompt per block size a request can use: min(bucket, chunk_len) at capacity
        # max_len; encoding the state compiles the codec's on-device row selection too. With
        # layer groups, once more streamed by layers: a last chunk runs as segments.
        sizes = sorted({min(b, engine_cfg.chunk_len) for b in engine_cfg.buckets})
        streams = [None] if engine_cfg.layer_groups == 1 else [None, lambda *_: None]
        for size, on_layers in itertools.product(sizes, streams):
            prompt = [0] * min(size, engine_cfg.max_len - 1)
            result = engine.prefill(prompt, max_len=engine_cfg.max_len, on_layers=on_layers)
            list(codec.encode(result.state, self.cfg, max_frame_bytes=engine_cfg.frame_bytes))
        return engine

    def warm_batches(self) -> None:
        """Start compiling the batched prefill calls the prefill queue can make, on a thread of
        their own (serving/worker/batch_warmup.py), once: a prefill worker calls it after its
        warm-up. Only a JAX engine on one device in one process, with `[engine]
        prefill_batch_rows` > 1, makes batched calls."""
        engine = self.prefill_engine()
        with self._lock:
            alone = self.group is None or self.group.num_processes == 1
            batched = self.config.engine.prefill_batch_rows > 1 and not self.fake
            if self._batches is not None or not (alone and batched):
                return
            if engine.mesh is not None:  # type: ignore[attr-defined]
                return
            from prfaas_jax.serving.worker.batch_warmup import BatchWarmup

            self._batches = BatchWarmup(engine, self.config.engine)  # type: ignore[arg-type]
            self._batches.start()

    def _build_decode(self) -> DecodeEngineLike:
        engine_cfg = self.config.engine
        if self.fake:
            from prfaas_jax.engine.fake import FakeDecodeEngine

            return FakeDecodeEngine(
                self.cfg,
                max_slots=engine_cfg.max_slots,
                max_len=engine_cfg.max_len,
                step_s=self.config.fake.decode_step_s,
            )
        import functools

        import jax
        import numpy as np

        from prfaas_jax.engine.decode import DecodeEngine
        from prfaas_jax.model import init_state
        from prfaas_jax.model.sharding import make_mesh

        if engine_cfg.allocator is Allocator.PAGED:
            engine = self._paged_decode()
        else:
            engine = DecodeEngine(
                self.cfg,
                self._weights(),
                max_slots=engine_cfg.max_slots,
                max_len=engine_cfg.max_len,
                impl=self.config.model.impl,
                mesh=make_mesh(engine_cfg.decode_mesh) if engine_cfg.decode_mesh else None,
            )
        # A one-token state of capacity max_len compiles the insert and the step (built on the
        # host: jnp.zeros would compile a fill per shape). Both engines' steps compile per
        # power-of-two batch of rows (the paged engine's live rows, the slot engine's first rows
        # up to the highest busy slot), so the warm-up takes 1, 2, 4, … requests at once.
        shapes = jax.eval_shape(functools.partial(init_state, self.cfg, 1, engine_cfg.max_len))
        state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
        state = type(state)(lengths=np.ones(1, np.int32), layers=state.layers)
        batch = 1
        while batch < 2 * engine.max_slots:
            count = min(batch, engine.max_slots)
            slots = [engine.insert(state, 0, max_new_tokens=1) for _ in range(count)]
            engine.step()
            for slot in slots:
                engine.free(slot)
            batch *= 2
        return engine

    def _pages(self) -> tuple[int, int]:
        """``(pages, rows)`` of the paged decode engine: ``[engine] num_pages`` (0: the bytes of
        ``max_slots`` slots of ``max_len``), and a row for each request the pool holds at their
        shortest (two positions each)."""
        from prfaas_jax.engine.page_layout import page_layout
        from prfaas_jax.state_bytes import state_nbytes

        engine_cfg = self.config.engine
        layout = page_layout(self.cfg, engine_cfg.block_size)
        slots_bytes = engine_cfg.max_slots * state_nbytes(self.cfg, engine_cfg.max_len)
        num_pages = engine_cfg.num_pages or max(1, slots_bytes // layout.page_bytes)
        return num_pages, max(1, num_pages // layout.request_pages(2))

    @property
    def decode_rows(self) -> int:
        """Requests the decode engine can decode at once: ``[engine] max_slots``, or the paged
        engine's rows (as many as its pool holds at their shortest)."""
        if self.fake or self.config.engine.allocator is not Allocator.PAGED:
            return self.config.engine.max_slots
        return self._pages()[1]

    def _paged_decode(self) -> DecodeEngineLike:
        """The paged decode engine of ``[engine]`` (`_pages`), with one capacity, ``max_len``,
        as the slot engine's."""
        from prfaas_jax.engine.paged_decode import PagedDecodeEngine

        engine_cfg = self.config.engine
        num_pages, rows = self._pages()
        return PagedDecodeEngine(
            self.cfg,
            self._weights(),
            num_pages=num_pages,
            block_size=engine_cfg.block_size,
            max_slots=rows,
            max_len=engine_cfg.max_len,
            impl=self.config.model.impl,
            buckets=(engine_cfg.max_len,),
        )
