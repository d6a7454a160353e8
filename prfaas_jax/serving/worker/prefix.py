"""A worker's hybrid prefix cache on the wire: `PrefixService` (`prfaas.v1.PrefixCache`: `Lookup`,
`Export`; and `fetch`, the importing side) and `build_prefix_cache` (the `[prefix_cache]`
section → `PrefixCache`, with the log line that says what can hit).

Lookup and Events — how the router learns each cluster's cached prefix. `Events` streams every
change of the cache (blocks and linear checkpoints stored and evicted; prfaas_jax/prefix_events.py):
a snapshot first, then each batch as it happens, and a fresh snapshot when the reader has fallen
behind the log. The router keeps an index of them (serving/router/cache_feed.py) and answers the
cached lengths itself. `Lookup(prompt)` asks directly: the router sends it to every instance its
index is not in step with (`lookup_prefixes`, serving/router/handles.py, waiting at most
`LOOKUP_TIMEOUT_S`; one that does not answer counts as holding nothing), or to every instance
with `[router] cache_index = false`. The answer is exact and current: the instance runs the same
`match` its prefill will (KV blocks *and* a linear checkpoint at exactly that length),
read-only. A prefill's reply carries the number of the cache's last event once the prompt was
kept (`cache_seq`), so the router knows when its index is behind that instance.

Transfer — when the router picks an instance whose own prefix is shorter than another
instance's (the bandwidth-abundant case across clusters, or a busy holder inside one), it names
the holder in `PrefillRequest.prefix_source`. The chosen worker calls the holder's
`Export(prompt)` *before* it waits for its engine, so the fetch overlaps its queue: the holder
matches the prompt, builds the prefix state and streams it as codec frames (`codec.encode`; its
payload is `state_nbytes(cfg, P)`), through its `LinkShaper` when the transfer crosses clusters
and the holder is a PrfaaS worker (the link emulated is PrfaaS egress). The importer decodes it
(`codec.decode` checks everything), prefills only the rest, and keeps the prefix in its own
cache once its engine has taken it (a prefix the engine refuses fails that request and is not
kept). A fetch that fails (evicted since the lookup, holder gone, bad frames) is logged and
counted, and the prefill recomputes instead: a lost prefix costs compute, never the request.
"""

from __future__ import annotations

import logging
import math
import pathlib
import threading
from collections.abc import Iterator, Sequence

import grpc
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.api import PrefillEngineLike
from prfaas_jax.engine.cached_prefill import CachedPrefill
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.engine.prefix_disk import DiskTier
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import ModelState, state_nbytes
from prfaas_jax.serving.cluster_config import ClusterConfig
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport import security as transport
from prfaas_jax.serving.transport.cache_events import batch_to_proto
from prfaas_jax.serving.transport.link import LinkShaper
from prfaas_jax.serving.transport.server import CHANNEL_OPTIONS

log = logging.getLogger("prfaas.prefix")
EVENTS_POLL_S = 0.5  # how often an idle event stream checks that its reader is still there


def build_prefix_cache(
    cfg: ModelConfig, config: ClusterConfig, name: str = "worker"
) -> PrefixCache | None:
    """The worker's pool from `[prefix_cache]` (None when disabled), with its disk tier under
    ``disk_dir``/``name`` when set (reloaded and verified: what a previous process of this
    instance left), and one log line saying which prefixes can hit, so a cache that can never
    hit is visible at start."""
    section = config.prefix_cache
    if not section.enabled:
        log.info("prefix cache: disabled ([prefix_cache] enabled = false)")
        return None
    disk = None
    if section.disk_dir:
        directory = pathlib.Path(section.disk_dir) / name
        disk = DiskTier(directory, int(section.disk_capacity_mib * 2**20), cfg)
        log.info(
            "prefix cache disk tier: %s, %.1f MiB; reloaded %d entries (%d bytes), dropped %d "
            "that failed their checks",
            directory,
            section.disk_capacity_mib,
            disk.stats.entries,
            disk.stats.used_bytes,
            disk.stats.dropped,
        )
    cache = PrefixCache(
        cfg,
        capacity_bytes=section.capacity_bytes,
        block_size=section.block_size,
        checkpoint_every=section.checkpoint_every,
        disk=disk,
    )
    stride = section.block_size * section.checkpoint_every
    # Checkpoints are saved where a prefill chunk ends on the stride, and at each prompt's end.
    mid_prompt = math.lcm(stride, config.engine.chunk_len)
    log.info(
        "prefix cache: %.1f MiB; KV in blocks of %d tokens; linear-state checkpoints at every "
        "prompt's end and every %d tokens within a prompt: a prompt reuses the longest cached "
        "prompt it extends, or a multiple of %d tokens it shares",
        section.capacity_mib,
        section.block_size,
        mid_prompt,
        mid_prompt,
    )
    longest = state_nbytes(cfg, config.engine.max_len)
    if longest > section.capacity_bytes:
        log.warning(
            "prefix cache: %d bytes cannot hold one %d-token state (%d bytes): long prompts "
            "evict each other",
            section.capacity_bytes,
            config.engine.max_len,
            longest,
        )
    return cache


class PrefixService(pb_grpc.PrefixCacheServicer):
    """One worker's prefix cache: prefill through it (`reuse`), answer lookups, export and
    import prefixes, count it all (`stats`)."""

    def __init__(
        self,
        *,
        cfg: ModelConfig,
        cache: PrefixCache | None,
        max_len: int,
        frame_bytes: int,
        shaper: LinkShaper | None,
        fetch_timeout_s: float = 60.0,
        security: SecuritySection | None = None,
    ) -> None:
        """`security`: how fetches reach other instances' `Export` (None: plaintext)."""
        self.cfg, self.cache, self.max_len = cfg, cache, max_len
        self.security = security
        self.frame_bytes, self.shaper, self.fetch_timeout_s = frame_bytes, shaper, fetch_timeout_s
        self.reuse = CachedPrefill(cache)
        self._lock = threading.Lock()
        self._stubs: dict[str, pb_grpc.PrefixCacheStub] = {}
        self.exports = self.export_bytes = 0
        self.imports = self.import_bytes = self.import_failures = 0

    def _add(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def warm(self, engine: PrefillEngineLike) -> None:
        """Run the prefix path once before serving (a scratch pool: one prompt, then a hit on
        it), so the first real hit pays no compile (host → device copies, row reads)."""
        if self.cache is None:
            return
        scratch = PrefixCache(
            self.cfg,
            capacity_bytes=4 * state_nbytes(self.cfg, 3),
            block_size=self.cache.block_size,
            checkpoint_every=self.cache.checkpoint_every,
        )
        reuse = CachedPrefill(scratch)
        for prompt in ([0, 0], [0, 0, 0]):
            reuse.prefill(engine, prompt, max_len=self.max_len)

    # --- the holder's side ----------------------------------------------------------------

    def prefetch(self, tokens: Sequence[int]) -> None:
        """Read the disk tier's prefix of ``tokens`` back into host memory (engine/
        prefix_cache.py), before the prefill waits for its engine."""
        if self.cache is not None:
            self.cache.prefetch(tokens)

    def Lookup(  # noqa: N802
        self, request: pb.PrefixLookupRequest, context: grpc.ServicerContext
    ) -> pb.PrefixLookupReply:
        tokens = list(request.prompt_token_ids)
        return pb.PrefixLookupReply(cached_len=self.reuse.cached_len(tokens))

    def Export(  # noqa: N802
        self, request: pb.PrefixExportRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PrefixChunk]:
        tokens = list(request.prompt_token_ids)
        hit = None if self.cache is None else self.cache.match(tokens, record=False)
        if hit is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no cached prefix of this prompt")
        assert self.cache is not None
        # At the fixed capacity max_len: reading rows back for the codec compiles per shape.
        state = self.cache.build_state(hit, self.max_len)
        frames = list(codec.encode(state, self.cfg, max_frame_bytes=self.frame_bytes))
        yield pb.PrefixChunk(length=hit.length)
        shaped = request.cross_cluster and self.shaper is not None
        for frame in self.shaper.send(frames) if shaped else frames:
            if not context.is_active():
                return  # the importer gave up: stop using the link
            yield pb.PrefixChunk(frame=frame)
        self._add("exports", 1)
        self._add("export_bytes", state_nbytes(self.cfg, hit.length))

    def Events(  # noqa: N802
        self, request: pb.PrefixEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PrefixEventBatch]:
        if self.cache is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no prefix cache")
        assert self.cache is not None
        cache, seq = self.cache, request.after
        events = cache.events_since(seq) if seq else None
        while context.is_active():
            if events is None:  # a new reader, or one the log has left behind
                seq, stored = cache.snapshot()
                yield batch_to_proto(
                    stored, snapshot=True, last_seq=seq, block_size=cache.block_size
                )
            elif events:
                seq = events[-1][0]
                yield batch_to_proto(
                    [event for _, event in events],
                    snapshot=False,
                    last_seq=seq,
                    block_size=cache.block_size,
                )
            events = cache.wait_events(seq, EVENTS_POLL_S)

    def cache_seq(self) -> int:
        """The number of the cache's last event (0: no cache), for `PrefillReply.cache_seq`."""
        return 0 if self.cache is None else self.cache.events.last_seq

    # --- the importer's side --------------------------------------------------------------

    def _stub(self, address: str) -> pb_grpc.PrefixCacheStub:
        with self._lock:
            if address not in self._stubs:
                channel = transport.channel(address, self.security, CHANNEL_OPTIONS)
                self._stubs[address] = pb_grpc.PrefixCacheStub(channel)
            return self._stubs[address]

    def fetch(
        self, address: str, tokens: Sequence[int], *, cross_cluster: bool
    ) -> ModelState | None:
        """The prefix of `tokens` that the instance at `address` holds, or None when it cannot
        be had (the prefill then reuses what the local cache has and computes the rest)."""
        request = pb.PrefixExportRequest(prompt_token_ids=tokens, cross_cluster=cross_cluster)
        try:
            stream = self._stub(address).Export(request, timeout=self.fetch_timeout_s)
            head = next(stream, None)
            frames = [chunk.frame for chunk in stream]
            if head is None or not 0 < head.length < len(tokens):
                raise UserError(f"the holder offered a {getattr(head, 'length', 0)}-token prefix")
            state = codec.decode(frames, self.cfg, max_len=self.max_len)
            length = int(np.asarray(state.lengths)[0])
            if length != head.length:
                raise UserError(f"the frames hold {length} tokens, the holder said {head.length}")
        except (grpc.RpcError, UserError, ValueError) as err:
            detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
            log.warning("prefix fetch from %s failed, recomputing: %s", address, detail)
            self._add("import_failures", 1)
            return None
        self._add("imports", 1)
        self._add("import_bytes", state_nbytes(self.cfg, length))
        return state

    # --- stats ----------------------------------------------------------------------------

    def stats(self) -> pb.PrefixCacheStats:
        reuse = self.reuse.stats
        with self._lock:
            out = pb.PrefixCacheStats(
                enabled=self.cache is not None,
                prompt_tokens=reuse.prompt_tokens,
                reused_tokens=reuse.reused_tokens,
                computed_tokens=reuse.computed_tokens,
                exports=self.exports,
                export_bytes=self.export_bytes,
                imports=self.imports,
                import_bytes=self.import_bytes,
                import_failures=self.import_failures,
            )
        if self.cache is not None:
            cache, pool = self.cache, self.cache.stats
            out.block_size, out.checkpoint_every = cache.block_size, cache.checkpoint_every
            out.capacity_bytes, out.used_bytes = pool.capacity_bytes, pool.used_bytes
            out.blocks, out.checkpoints = pool.blocks, pool.checkpoints
            out.lookups, out.hits, out.evictions = pool.lookups, pool.hits, pool.evictions
            out.spills, out.disk_hits = pool.spills, pool.disk_hits
            if cache.disk is not None:
                disk = cache.disk.stats
                out.disk_capacity_bytes, out.disk_used_bytes = disk.capacity_bytes, disk.used_bytes
                out.disk_entries, out.disk_dropped = disk.entries, disk.dropped
        return out
