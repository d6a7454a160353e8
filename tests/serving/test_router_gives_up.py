"""The router gives up: every attempt fails, or no instance is left to try.

In process (serving_support.serve_in_process): the router over a PrfaaS prefill (prfaas-0), a PD
prefill (pd-0) and a PD decode worker (pd-1) on loopback servers, fake engines.

- Attempts exhausted. With fault injection (serving/transfer/faults.py) corrupting, or cutting,
  every state transfer of the prefill workers, each attempt fails; with `max_attempts = 3` (not
  the default 4) the client gets, after exactly three attempts, the last attempt's status —
  INVALID_ARGUMENT for a corrupt frame, UNAVAILABLE for a cut link — with details naming the
  attempts (docs/serving.md, "Status codes"). Three is counted four ways: prompts the prefill
  engines computed, transfers the injectors damaged, the router's "attempt k failed" log lines,
  and its `retries` counter (attempts after the first).
- A refusal no retry can change. A worker whose engine holds fewer tokens than the router
  admits (a prefill engine on PD or PrfaaS, or the decode engine, at 200 of the cluster's 512)
  refuses a 300-token prompt as past its limit, marked final: the client gets INVALID_ARGUMENT
  at once, after one attempt — one prompt computed, one "attempt 1 failed" line, no retry —
  where a corrupt state above is tried `max_attempts` times.
- No live instance. Every worker dies under a request that is streaming: the router waits
  `retry_wait_s` for an instance to come back, then fails it UNAVAILABLE, having streamed only
  correct tokens; a new request that finds no live instance fails UNAVAILABLE at once, with no
  attempt made. The wait is a lower bound, checked from the moment the workers stopped; upper
  bounds are generous deadlines only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import grpc
import pytest
from serving_support import fake_config, serve_in_process, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, FakePrefillResult
from prfaas_jax.engine.fake import fake_tokens as expected
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.cluster_sections import FaultsSection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.faults import FaultInjector

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
MAX_ATTEMPTS = 3
RETRY_WAIT_S = 3.0
WAIT_S = 30.0  # bounds a broken run only
SHORT = 200  # tokens an engine of `test_a_refusal_past_an_engines_limit_is_not_retried` holds


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 41 * i) % VOCAB for i in range(n)]


class CountingPrefill(FakePrefillEngine):
    def __init__(self) -> None:
        super().__init__(CFG)
        self.prompts: list[list[int]] = []

    def prefill(self, tokens: Sequence[int], **options: object) -> FakePrefillResult:
        self.prompts.append(list(tokens))
        return super().prefill(tokens, **options)


class ShortPrefill(CountingPrefill):
    """A prefill engine that holds `SHORT` tokens, fewer than the cluster's max_len."""

    def prefill(self, tokens: Sequence[int], **options: object) -> FakePrefillResult:
        return super().prefill(tokens, **{**options, "max_len": SHORT})


def instances(decode_step_s: float = 0.0):
    return {
        "prfaas-0": (Role.PRFAAS_PREFILL, CountingPrefill()),
        "pd-0": (Role.PD_PREFILL, CountingPrefill()),
        "pd-1": (
            Role.PD_DECODE,
            FakeDecodeEngine(CFG, max_slots=4, max_len=512, step_s=decode_step_s),
        ),
    }


def computed(engines) -> int:
    return sum(len(engine.prompts) for role, engine in engines.values() if role.is_prefill)


@pytest.mark.parametrize(
    ("faults", "code", "words"),
    [
        ({"corrupt_frame_prob": 1.0}, grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        ({"drop_transfer_prob": 1.0}, grpc.StatusCode.UNAVAILABLE, "link dropped after"),
    ],
    ids=["corrupt", "drop"],
)
def test_attempts_exhausted_end_with_the_last_status(tmp_path, caplog, faults, code, words):
    path = fake_config(tmp_path / "cluster.toml", router={"max_attempts": MAX_ATTEMPTS})
    config = load_cluster_config(path)
    section = FaultsSection(**faults, seed=7)
    faults = {name: FaultInjector(section, name) for name in ("prfaas-0", "pd-0")}
    engines = instances()
    with serve_in_process(config, engines, faults=faults) as cluster:
        for n in (20, 100):  # PD, then PrfaaS
            before = computed(engines)
            request = pb.GenerateRequest(prompt_token_ids=prompt(n, n), max_new_tokens=6)
            with caplog.at_level(logging.WARNING, logger="prfaas.router"):
                caplog.clear()
                with pytest.raises(grpc.RpcError) as err:
                    list(cluster.router.Generate(request, timeout=WAIT_S))

                def attempts_logged() -> list[str]:
                    failed = [
                        r.getMessage() for r in caplog.records if "failed (" in r.getMessage()
                    ]
                    return [m.split(": attempt ")[1][:1] for m in failed]

                # The client may hear the status before the last attempt's line is written.
                wait_for(lambda: len(attempts_logged()) >= MAX_ATTEMPTS, WAIT_S)
                assert attempts_logged() == ["1", "2", "3"]
            assert err.value.code() is code
            details = err.value.details()
            assert details.startswith(f"{MAX_ATTEMPTS} attempts failed; the last: ")
            assert words in details
            assert computed(engines) - before == MAX_ATTEMPTS
        damaged = sum(f.corrupted + f.dropped for f in faults.values())
        assert damaged == 2 * MAX_ATTEMPTS
        # The decode worker lets go of the last dropped stream on its own time.
        wait_for(lambda: not cluster.decode["pd-1"].busy, WAIT_S)
        assert not cluster.decode["pd-1"].busy
        stats = cluster.stats()
        assert stats.retries == 2 * (MAX_ATTEMPTS - 1)
        assert (stats.requests_failed, stats.requests_in_flight) == (2, 0)
        assert cluster.core.finished == {("pd", "error"): 1, ("prfaas", "error"): 1}


@pytest.mark.parametrize(
    ("short", "threshold", "route"),
    [("prefill", 1000, "pd"), ("prefill", 64, "prfaas"), ("decode", 64, "prfaas")],
    ids=["pd-prefill", "prfaas-prefill", "decode"],
)
def test_a_refusal_past_an_engines_limit_is_not_retried(tmp_path, caplog, short, threshold, route):
    path = fake_config(tmp_path / "cluster.toml", router={"threshold": threshold})
    config = load_cluster_config(path)
    engines = instances()
    if short == "prefill":
        engines = {**engines, "prfaas-0": (Role.PRFAAS_PREFILL, ShortPrefill())}
        engines["pd-0"] = (Role.PD_PREFILL, ShortPrefill())
    else:
        engines["pd-1"] = (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=SHORT))
    with serve_in_process(config, engines) as cluster:
        long = prompt(300, 3)
        request = pb.GenerateRequest(prompt_token_ids=long, max_new_tokens=6)
        with (
            caplog.at_level(logging.WARNING, logger="prfaas.router"),
            pytest.raises(grpc.RpcError) as err,
        ):
            list(cluster.router.Generate(request, timeout=WAIT_S))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert details.startswith("not retried: invalid_argument: ")
        assert f"max_len {SHORT}" in details
        failed = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
        assert len(failed) == 1 and ": attempt 1 failed (invalid_argument: " in failed[0]
        assert computed(engines) == 1
        stats = cluster.stats()
        assert (stats.retries, stats.requests_failed, stats.requests_in_flight) == (0, 1, 0)
        assert cluster.core.finished == {(route, "error"): 1}
        # The same cluster serves what fits.
        fits = prompt(150, 4)
        tokens = [
            t
            for m in cluster.router.Generate(
                pb.GenerateRequest(prompt_token_ids=fits, max_new_tokens=6), timeout=WAIT_S
            )
            for t in m.token_ids
        ]
        assert tokens == expected(fits, 6, VOCAB)


def test_no_live_instance_waits_retry_wait_s_then_unavailable(tmp_path):
    path = fake_config(tmp_path / "cluster.toml", router={"retry_wait_s": RETRY_WAIT_S})
    config = load_cluster_config(path)
    engines = instances(decode_step_s=0.02)
    long = prompt(20, 5)
    with serve_in_process(config, engines) as cluster:
        request = pb.GenerateRequest(prompt_token_ids=long, max_new_tokens=200)
        call = cluster.router.Generate(request, timeout=WAIT_S)
        received: list[int] = []
        ended: list[grpc.RpcError] = []

        def read() -> None:
            try:
                for message in call:
                    received.extend(message.token_ids)
            except grpc.RpcError as err:
                ended.append(err)

        reader = threading.Thread(target=read)
        reader.start()
        assert wait_for(lambda: len(received) >= 3, WAIT_S), "the stream never started"
        for name in ("prfaas-0", "pd-0", "pd-1"):
            cluster.servers[name].stop(grace_s=0)
        died = time.monotonic()
        reader.join(WAIT_S + RETRY_WAIT_S)
        waited = time.monotonic() - died
        assert not reader.is_alive() and len(ended) == 1, "the request neither failed nor ended"
        err = ended[0]
        assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
        assert "no live prefill or no live decode instance" in err.details()
        assert RETRY_WAIT_S <= waited < RETRY_WAIT_S + 15.0
        assert received == expected(long, len(received), VOCAB) and len(received) < 200
        assert cluster.core.workers["pd-1"].down

        # A new request finds no live decode instance: refused at once, nothing attempted.
        before = computed(engines)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            list(
                cluster.router.Generate(pb.GenerateRequest(prompt_token_ids=long, max_new_tokens=4))
            )
        assert time.monotonic() - started < RETRY_WAIT_S / 2
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == "no live prefill or no live decode instance is serving"
        assert computed(engines) == before
        stats = cluster.stats()
        assert (stats.requests_failed, stats.requests_in_flight) == (2, 0)


def test_a_stopping_router_refuses_new_requests_and_finishes_those_in_flight(tmp_path):
    """`RouterCore.stop_admitting` (the router's first step on SIGTERM): a request in flight
    streams to its end, every new one fails UNAVAILABLE at once, with no attempt made."""
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml"))
    engines = instances(decode_step_s=0.02)
    long = prompt(20, 9)
    with serve_in_process(config, engines) as cluster:
        request = pb.GenerateRequest(prompt_token_ids=long, max_new_tokens=40)
        call = cluster.router.Generate(request, timeout=WAIT_S)
        first = next(call)
        cluster.core.stop_admitting()
        before = computed(engines)
        for n in (20, 100):  # PD, PrfaaS
            new = pb.GenerateRequest(prompt_token_ids=prompt(n, n), max_new_tokens=4)
            with pytest.raises(grpc.RpcError) as err:
                list(cluster.router.Generate(new, timeout=WAIT_S))
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "the router is stopping"
        assert computed(engines) == before
        tokens = [*first.token_ids, *(t for m in call for t in m.token_ids)]
        assert tokens == expected(long, 40, VOCAB)
        assert cluster.core.finished == {("pd", "ok"): 1}
