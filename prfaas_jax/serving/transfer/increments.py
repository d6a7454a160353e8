"""A decode worker's cache of received KV: `DecodeKvCache`, so a PrfaaS transfer ships increments.

Paper §3.3: on a prefix-cache hit only the incremental part of the state should cross the link.
A decode worker keeps, in a `PrefixCache` of KV blocks only (no checkpoints: every transfer
brings the fixed-size states), the attention KV of the prompts whose states it received. Before
a PrfaaS prefill, the router asks it (`DecodeWorker.ReserveKv`, with the prompt) how many leading
positions it holds: it answers K, the longest run of cached full blocks short of the last token,
and keeps those rows for the request (`reserve`; host arrays, so a later eviction cannot take
them). The prefill worker's stream then leaves them out (`StreamEncoder(base=K)`); the decode
worker stitches its rows onto what arrives (`codec.decode(base=…)`, `take`) and caches the new
state's KV in turn (`keep`). A reservation is used once; one that no state claims within
`hold_s` is dropped.

Decode-aware routing (`[router] decode_aware`): the pool is the node's own prefix pool (the one
its `PrefixCache` service serves and publishes the events of), and ``keep`` stores the received
state's checkpoint too, so the router's index sees what the decode worker holds and a PD
prefill instance can fetch it (`Export`) instead of the prompt crossing the link.

The stitched rows were computed by an earlier prefill of the same tokens, so the state equals the
one a full transfer would carry up to floating-point rounding of a different chunking; the
prompt tokens — not the sender's word — decide which rows are reused.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.codec.layout import KvPrefix
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.model.state import ModelState
from prfaas_jax.serving.cluster_config import ClusterConfig


@dataclasses.dataclass(frozen=True)
class Reservation:
    tokens: tuple[int, ...]  # the prompt the coming state holds
    prefix: KvPrefix  # the rows the state may leave out
    at: float


class DecodeKvCache:
    """Received KV by prompt, and the reservations for states on their way (module docstring)."""

    def __init__(
        self, cache: PrefixCache, *, hold_s: float = 120.0, checkpoints: bool = False
    ) -> None:
        """``checkpoints``: keep each received state's fixed-size part too (decode-aware)."""
        self.cache, self.hold_s, self.checkpoints = cache, hold_s, checkpoints
        self._lock = threading.Lock()
        self._reserved: dict[str, Reservation] = {}

    def reserve(self, request_id: str, tokens: Sequence[int]) -> int:
        """Keep the cached KV of ``tokens``' leading blocks for ``request_id``; their length."""
        prefix = self.cache.kv_prefix(tokens)
        now = time.monotonic()
        with self._lock:
            for stale in [r for r, v in self._reserved.items() if now - v.at > self.hold_s]:
                del self._reserved[stale]
            self._reserved[request_id] = Reservation(tuple(tokens), prefix, now)
        return prefix.length

    def take(self, request_id: str) -> Reservation | None:
        """The request's reservation, once (None: it has none, or it expired)."""
        with self._lock:
            return self._reserved.pop(request_id, None)

    def keep(self, reservation: Reservation, state: ModelState) -> None:
        """Cache the KV of a state received for ``reservation``'s prompt (what it saved the
        link is the router's count: `RequestReport.saved_bytes`)."""
        self.cache.insert(reservation.tokens, state, kv_only=not self.checkpoints)


def build_decode_kv_cache(
    cfg: ModelConfig, config: ClusterConfig, node_pool: PrefixCache | None = None
) -> DecodeKvCache | None:
    """A PD node's cache of received KV: `[prefix_cache]`'s budget and block size, its own pool
    (None when the prefix cache is off); with `[router] decode_aware`, ``node_pool`` (the node's
    prefix pool) with checkpoints."""
    section = config.prefix_cache
    if not section.enabled:
        return None
    hold_s = config.router.request_timeout_s
    if config.router.decode_aware and node_pool is not None:
        return DecodeKvCache(node_pool, hold_s=hold_s, checkpoints=True)
    pool = PrefixCache(cfg, capacity_bytes=section.capacity_bytes, block_size=section.block_size)
    return DecodeKvCache(pool, hold_s=hold_s)
