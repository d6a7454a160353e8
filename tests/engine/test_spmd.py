"""engine/spmd.py's protocol, in one process: the leader publishes each prefill before running
it, a follower replays exactly those calls in order (a refused one included, which both refuse),
and the loop ends on the leader's stop, on the caller's stop, or with `LeaderLostError` when the
coordination service goes unasked. The key-value store is an in-memory stand-in with the
coordination client's methods and errors; tests/cluster/test_multiprocess_instance.py runs the
real one between two JAX processes."""

from __future__ import annotations

import threading

import jax
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakePrefillEngine
from prfaas_jax.engine.sampling import GREEDY, SamplingParams
from prfaas_jax.engine.spmd import (
    CommandChannel,
    LeaderLostError,
    LeaderPrefillEngine,
    ProcessGroup,
    follow,
)
from prfaas_jax.errors import EngineError, UserError


class KeyValueStore:
    """The coordination client's key-value calls, over a dict."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.deleted: list[str] = []
        self.closed = False
        self._cond = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self._cond:
            assert key not in self.values, f"{key} written twice"
            self.values[key] = value
            self._cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self._cond:
            self._cond.wait_for(lambda: key in self.values or self.closed, timeout_ms / 1e3)
            if self.closed:
                raise jax.errors.JaxRuntimeError("UNAVAILABLE: Socket closed")
            if key not in self.values:
                raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() {key}")
            return self.values[key]

    def key_value_delete(self, key: str) -> None:
        with self._cond:
            del self.values[key]
            self.deleted.append(key)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Recording(FakePrefillEngine):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.calls: list[tuple] = []

    def prefill(self, tokens, *, prefix=None, on_chunk=None, sampling=GREEDY, max_len=None, **kw):
        self.calls.append((list(tokens), sampling, max_len, on_chunk is not None))
        assert kw.get("on_layers") is None  # a multi-process instance never streams by layers
        return super().prefill(
            tokens, prefix=prefix, on_chunk=on_chunk, sampling=sampling, max_len=max_len
        )


@pytest.fixture
def cfg():
    return load_model_config("tiny")


def start_follower(cfg, store, stop):
    engine, outcome = Recording(cfg), {}

    def run() -> None:
        try:
            outcome["replayed"] = follow(engine, CommandChannel(store), stop)
        except Exception as err:  # handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return engine, outcome, thread


def test_follower_replays_every_call_in_order(cfg):
    store, stop = KeyValueStore(), threading.Event()
    follower, outcome, thread = start_follower(cfg, store, stop)
    inner = Recording(cfg)
    leader = LeaderPrefillEngine(inner, CommandChannel(store))
    seen: list[tuple[int, int]] = []
    calls = [
        ([5, 6, 7], GREEDY, 64),
        ([1] * 40, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3), 128),
        ([9, 2], SamplingParams(seed=1, first_index=4), None),
    ]
    results = []
    for tokens, sampling, max_len in calls:
        on_chunk = lambda state, done: seen.append((int(state.lengths[0]), done))  # noqa: E731
        results.append(
            leader.prefill(tokens, sampling=sampling, max_len=max_len, on_chunk=on_chunk)
        )
    with pytest.raises(EngineError, match="outside the vocabulary"):
        leader.prefill([cfg.vocab_size + 3])
    after = leader.prefill([4, 4])  # a refusal leaves both sides in step
    leader.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and "error" not in outcome
    # Replayed without the callback (only the leader streams), the refused call included.
    expected = [(t, s, m, False) for t, s, m in calls]
    expected += [([cfg.vocab_size + 3], GREEDY, None, False), ([4, 4], GREEDY, None, False)]
    assert follower.calls == expected
    assert outcome["replayed"] == 5
    # The leader ran each call once, without a per-chunk callback, then streamed the whole
    # state once: every position counted.
    assert [c[3] for c in inner.calls] == [False] * 5
    assert seen == [(3, 3), (40, 40), (2, 2)]
    assert [r.first_token for r in results] == [
        FakePrefillEngine(cfg).prefill(t, sampling=s, max_len=m).first_token for t, s, m in calls
    ]
    assert after.num_tokens == 2
    assert store.values == {} and store.deleted == [f"prfaas/cmd/{i}" for i in range(6)]


def test_a_prefix_is_refused_before_anything_is_sent(cfg):
    store = KeyValueStore()
    engine = FakePrefillEngine(cfg)
    leader = LeaderPrefillEngine(engine, CommandChannel(store))
    prefix = engine.prefill([1, 2, 3]).state
    with pytest.raises(EngineError, match="no prefix"):
        leader.prefill([4], prefix=prefix)
    assert store.values == {}


def test_the_caller_stops_an_idle_follower(cfg):
    store, stop = KeyValueStore(), threading.Event()
    _, outcome, thread = start_follower(cfg, store, stop)
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive() and outcome == {"replayed": 0}


def test_a_lost_leader_ends_the_follower(cfg):
    store, stop = KeyValueStore(), threading.Event()
    _, outcome, thread = start_follower(cfg, store, stop)
    store.close()
    thread.join(timeout=5)
    assert isinstance(outcome.get("error"), LeaderLostError)
    # While stopping, the leader may go first: not an error.
    store, stop = KeyValueStore(), threading.Event()
    stop.set()
    store.close()
    assert follow(Recording(cfg), CommandChannel(store), stop) == 0


def test_an_unknown_command_is_an_error(cfg):
    store = KeyValueStore()
    store.key_value_set("prfaas/cmd/0", '{"op": "reshard"}')
    with pytest.raises(EngineError, match="unknown command 'reshard'"):
        follow(Recording(cfg), CommandChannel(store), threading.Event())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_processes": 2, "process_id": 2, "local_devices": 2}, "outside"),
        ({"num_processes": 2, "process_id": -1, "local_devices": 2}, "outside"),
        ({"num_processes": 2, "process_id": 1, "local_devices": 0}, "local devices"),
    ],
)
def test_process_group_checks(fields, message):
    with pytest.raises(UserError, match=message):
        ProcessGroup("127.0.0.1:1", **fields)
    assert ProcessGroup("h:1", 2, 0, 2).leader and not ProcessGroup("h:1", 2, 1, 2).leader
