"""One prefill engine across JAX processes: `ProcessGroup`, `join`, `CommandChannel`,
`LeaderPrefillEngine` and `follow`.

A multi-process instance is one `jax.distributed` job whose mesh spans every process's devices
(e.g. 2 processes × 2 CPU devices under ``tensor=4``). JAX is multi-controller: every process
must run the same jitted calls in the same order, each on its own shards, and meet the others in
the collectives. Only process 0, the *leader*, serves RPCs; before each prefill it publishes the
call on a `CommandChannel` and the *followers* (`follow`) replay it on their own engine:

    leader                                   follower(s)
    prefill(tokens) ──► channel["cmd/n"] ──► engine.prefill(tokens)
    engine.prefill(tokens)  ◄─ collectives ─►        (result dropped)
    on_chunk(state, n)  (gathered, local)

The channel is the key-value store of JAX's coordination service, which `jax.distributed`
already runs on process 0 — the same service Orbax uses to coordinate multi-host checkpoints —
so an instance needs no other socket, on one host or several. Each command is one JSON value
under ``prfaas/cmd/<n>``, read once and deleted by each follower.

What every process replays must be decided before any collective, so a request a process
refuses (a token outside the vocabulary) is refused by every process at the same point. For the
same reason the leader absorbs the whole prompt before streaming: `on_chunk` runs once, on the
finished state (gathered to the leader and placed on its own device), not after each chunk — a
multi-process instance ships its state after the prefill instead of overlapping the two
(docs/serving.md), and it takes no prefix (a cached state would have to reach every process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax._src import distributed  # the coordination service's client: no public handle yet

from prfaas_jax.engine.api import OnChunk, OnLayers, PrefillEngineLike, PrefillOutput
from prfaas_jax.engine.logprobs import TokenLogprobs
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError, UserError
from prfaas_jax.model.state import ModelState

_KEY = "prfaas/cmd/"


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a multi-process instance."""

    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_devices: int  # CPU devices this process adds to the mesh

    def __post_init__(self) -> None:
        if not 0 <= self.process_id < self.num_processes:
            raise UserError(
                f"process id {self.process_id} outside [0, {self.num_processes}) processes"
            )
        if self.local_devices < 1:
            raise UserError(f"local devices must be ≥ 1, got {self.local_devices}")

    @property
    def leader(self) -> bool:
        return self.process_id == 0


def join(group: ProcessGroup, *, timeout_s: int = 60) -> None:
    """Join the instance's `jax.distributed` job; before anything touches a device. On CPU each
    process contributes ``local_devices`` devices and the collectives run over gloo (TCP). A
    peer silent for 10 s is declared dead, and a process leaving waits at most 5 s for the
    others: the launcher restarts an instance as a whole, so nothing waits on a lost peer."""
    jax.config.update("jax_num_cpu_devices", group.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        group.coordinator,
        # Where it listens is where it is dialled, not JAX's default of every interface.
        coordinator_bind_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=10,
        shutdown_timeout_seconds=5,
    )


class LeaderLostError(EngineError):
    """The leader's coordination service went away (the leader exited or died)."""


class CommandChannel:
    """Leader → followers, in order, over the coordination service's key-value store."""

    def __init__(self, client: object | None = None) -> None:
        self._client = client if client is not None else distributed.global_state.client
        if self._client is None:
            raise EngineError("no jax.distributed job: join() the instance first")
        self._next = 0

    def send(self, command: dict) -> None:
        self._client.key_value_set(f"{_KEY}{self._next}", json.dumps(command))
        self._next += 1

    def receive(self, timeout_s: float) -> dict | None:
        """The next command, or None when none came within ``timeout_s``; `LeaderLostError` when the
        coordination service is gone."""
        key = f"{_KEY}{self._next}"
        try:
            text = self._client.blocking_key_value_get(key, int(timeout_s * 1000))
        except jax.errors.JaxRuntimeError as err:
            if "DEADLINE_EXCEEDED" in str(err):
                return None
            raise LeaderLostError(f"lost the leader's coordination service: {err}") from None
        self._next += 1
        self._client.key_value_delete(key)
        return json.loads(text)


def _prefill_command(tokens: Sequence[int], sampling: SamplingParams, max_len: int | None) -> dict:
    ids = np.asarray(tokens, np.int64).reshape(-1)
    return {
        "op": "prefill",
        "tokens": ids.tolist(),
        "sampling": dataclasses.asdict(sampling),
        "max_len": max_len,
    }


class LeaderPrefillEngine:
    """The leader's face of a multi-process engine: each `prefill` is published to the
    followers, then run here. Calls are serialized (the followers replay them in order)."""

    def __init__(self, engine: PrefillEngineLike, channel: CommandChannel) -> None:
        self.engine, self.channel = engine, channel
        self._lock = threading.Lock()

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefix: ModelState | None = None,
        on_chunk: OnChunk | None = None,
        sampling: SamplingParams = GREEDY,
        max_len: int | None = None,
        on_layers: OnLayers | None = None,
    ) -> PrefillOutput:
        del on_layers  # the state is gathered whole at the end: nothing to stream by layers
        if prefix is not None:
            raise EngineError("a multi-process instance takes no prefix state")
        with self._lock:
            self.channel.send(_prefill_command(tokens, sampling, max_len))
            result = self.engine.prefill(tokens, sampling=sampling, max_len=max_len)
        if on_chunk is not None:
            on_chunk(result.state, result.prefix_len + result.num_tokens)
        return result

    def score(self, tokens: Sequence[int], top: int = 0) -> list[TokenLogprobs]:
        """Published and run as `prefill` is: every process runs the same program."""
        ids = np.asarray(tokens, np.int64).reshape(-1).tolist()
        with self._lock:
            self.channel.send({"op": "score", "tokens": ids, "top": top})
            return self.engine.score(ids, top)

    def close(self) -> None:
        """Tell the followers to exit (they also exit when the coordination service goes)."""
        with self._lock:
            self.channel.send({"op": "stop"})


def follow(engine: PrefillEngineLike, channel: CommandChannel, stop: threading.Event) -> int:
    """A follower's loop: replay every command until the leader says stop (or ``stop`` is
    set); returns the prefills replayed. A refused request is refused by the leader too.
    Raises `LeaderLostError` if the leader goes away unasked (when stopping, it may go first)."""
    replayed = 0
    while not stop.is_set():
        try:
            command = channel.receive(timeout_s=0.5)
        except LeaderLostError:
            if stop.is_set():
                break
            raise
        if command is None:
            continue
        if command["op"] == "stop":
            break
        if command["op"] not in ("prefill", "score"):
            raise EngineError(f"unknown command {command['op']!r} from the leader")
        # A request the leader refused is refused here at the same point, before any collective.
        with contextlib.suppress(UserError):
            if command["op"] == "score":
                engine.score(command["tokens"], command["top"])
            else:
                engine.prefill(
                    command["tokens"],
                    sampling=SamplingParams(**command["sampling"]),
                    max_len=command["max_len"],
                )
        replayed += 1
    return replayed
