"""Fault injection (`[faults]`, serving/transfer/faults.py): seeded per worker, a corrupted
stream is rejected by the codec, and a prefill whose push is corrupted or cut fails at once with
the status the router retries on.

The last two tests run a `PrefillService` and a `DecodeService` (fake engines) in process on
one loopback gRPC server, as tests/serving/test_state_streaming.py does.
"""

from __future__ import annotations

import time

import grpc
import pytest
from serving_support import serve_workers

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.format import DATA_MAGIC
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.errors import ConfigError
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.cluster_sections import FaultsSection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer.data_path import DataListener
from prfaas_jax.serving.transfer.faults import FaultInjector, TransferFaults
from prfaas_jax.serving.transport.link import LinkProfile, LinkShaper
from prfaas_jax.serving.transport.server import ServingServer
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService

CFG = load_model_config("tiny")
FRAME_BYTES = 1024  # many data frames per state, so the corrupted one is one of several
PROMPT = [(5 * i + 1) % CFG.vocab_size for i in range(90)]


def frames_of(prompt: list[int]) -> list[bytes]:
    state = FakePrefillEngine(CFG).prefill(prompt, max_len=512).state
    return list(codec.encode(state, CFG, max_frame_bytes=FRAME_BYTES))


def plans(injector: FaultInjector, n: int) -> list[tuple[int | None, int | None]]:
    header = codec.inspect(frames_of(PROMPT)[:1])
    out = []
    for i in range(n):
        plan = injector.plan(header, 1, f"r{i}")
        out.append((None, None) if plan is None else (plan.corrupt_data_frame, plan.cut_after))
    return out


# --- the config section ---------------------------------------------------------------------


def write(tmp_path, text: str):
    path = tmp_path / "cluster.toml"
    path.write_text('[model]\npreset = "tiny"\n' + text)
    return path


def test_faults_section(tmp_path):
    assert load_cluster_config(write(tmp_path, "")).faults == FaultsSection()
    assert not FaultsSection().enabled
    config = load_cluster_config(
        write(tmp_path, "[faults]\ncorrupt_frame_prob = 0.25\ndrop_transfer_prob = 1\nseed = 7\n")
    )
    assert (
        config.faults == FaultsSection(corrupt_frame_prob=0.25, drop_transfer_prob=1.0, seed=7)
        and config.faults.enabled
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("corrupt_frame_prob = 1.5\n", "faults.corrupt_frame_prob: must be in [0, 1]"),
        ("drop_transfer_prob = -0.1\n", "faults.drop_transfer_prob: must be in [0, 1]"),
        ("seed = 0.5\n", "faults.seed: expected an integer"),
        ("kill_prob = 0.1\n", "faults.kill_prob: unknown key"),
    ],
)
def test_faults_section_errors(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_cluster_config(write(tmp_path, "[faults]\n" + text))


def test_the_former_section_name_is_refused_with_the_new_one(tmp_path):
    path = write(tmp_path, "[chaos]\ncorrupt_frame_prob = 0.25\n")
    with pytest.raises(ConfigError) as refused:
        load_cluster_config(path)
    assert str(refused.value) == f"{path}: [chaos] is now [faults]"


# --- the injector ---------------------------------------------------------------------------


def test_off_means_no_injector():
    assert FaultInjector.build(FaultsSection(), "prfaas-0") is None


def test_seeded_per_worker():
    section = FaultsSection(corrupt_frame_prob=0.3, drop_transfer_prob=0.3, seed=11)
    first = plans(FaultInjector(section, "prfaas-0"), 200)
    assert first == plans(FaultInjector(section, "prfaas-0"), 200)
    assert first != plans(FaultInjector(section, "pd-0"), 200)
    assert first != plans(
        FaultInjector(
            FaultsSection(corrupt_frame_prob=0.3, drop_transfer_prob=0.3, seed=12), "prfaas-0"
        ),
        200,
    )
    # Independent draws per transfer: both rates near 0.3 (3.5 σ bounds over 200 transfers).
    for rate in (
        sum(c is not None for c, _ in first) / 200,
        sum(d is not None for _, d in first) / 200,
    ):
        assert 0.18 < rate < 0.42


def test_a_corrupted_stream_is_rejected_by_the_codec():
    frames = frames_of(PROMPT)
    header = codec.inspect(frames[:1])
    assert header.num_data_frames > 4
    for seed in range(20):
        injector = FaultInjector(FaultsSection(corrupt_frame_prob=1.0, seed=seed), "pd-0")
        plan = injector.plan(header, 1, "r")
        assert isinstance(plan, TransferFaults) and plan.cut_after is None
        sent = [plan.corrupt(frame) for frame in frames]
        changed = [i for i, (a, b) in enumerate(zip(frames, sent, strict=True)) if a != b]
        assert len(changed) == 1 and injector.corrupted == 1
        (i,) = changed
        assert i > 0 and frames[i][:4] == DATA_MAGIC  # a data frame, never the header
        assert sum(x != y for x, y in zip(frames[i], sent[i], strict=True)) == 1  # one byte
        with pytest.raises(codec.StateDecodeError):
            codec.decode(sent, CFG, max_len=512)
    codec.decode(frames, CFG, max_len=512)  # the clean stream still decodes


def test_a_drop_cuts_between_the_header_and_the_handoff():
    header = codec.inspect(frames_of(PROMPT)[:1])
    total = header.num_frames + 1
    cuts = set()
    for seed in range(50):
        injector = FaultInjector(FaultsSection(drop_transfer_prob=1.0, seed=seed), "prfaas-0")
        plan = injector.plan(header, 1, "r")
        assert plan is not None and plan.corrupt_data_frame is None
        assert 1 <= plan.cut_after <= total - 1
        assert [plan.cut(sent) for sent in range(plan.cut_after)] == [False] * plan.cut_after
        assert plan.cut(plan.cut_after) and plan.dropped and injector.dropped == 1
        cuts.add(plan.cut_after)
    assert len(cuts) > 10  # the cut falls anywhere in the stream


# --- a prefill worker with faults on ----------------------------------------------------------


@pytest.fixture(params=["pd", "prfaas", "pd+data", "prfaas+data"])
def workers(request):
    """`start(faults)`: a PD or PrfaaS (shaped) prefill worker and a decode worker; "+data":
    the pushes' frames take the data path (serving/transfer/data_path.py)."""
    kind, _, via = request.param.partition("+")

    def start(section: FaultsSection) -> tuple[str, DecodeService, FaultInjector]:
        shaper = None
        if kind == "prfaas":
            shaper = LinkShaper(LinkProfile(bandwidth_bytes_per_s=50e6, latency_s=0.002))
        injector = FaultInjector(section, kind)
        prefill = PrefillService(
            engine=lambda: FakePrefillEngine(CFG),
            cfg=CFG,
            max_len=512,
            frame_bytes=FRAME_BYTES,
            shaper=shaper,
            admit=lambda context: None,
            faults=injector,
        )
        decode = DecodeService(
            engine=lambda: FakeDecodeEngine(CFG, max_slots=4, max_len=512),
            cfg=CFG,
            max_len=512,
            admit=lambda context: None,
            data_path=DataListener() if via else None,
        )
        server = serve_workers(prefill, decode)
        started.append((server, decode))
        return server.address, decode, injector

    started: list[tuple[ServingServer, DecodeService]] = []
    yield start, kind
    for server, decode in started:
        decode.stop()
        server.stop(grace_s=0.5)
        if decode.data_path is not None:
            assert decode.data_path.claimed > 0  # the pushes took the data path
            decode.data_path.close()


def prefill(address: str, request_id: str) -> pb.PrefillReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.PrefillWorkerStub(channel).Prefill(
            pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=PROMPT, decode_address=address
            ),
            timeout=30,
        )


@pytest.mark.parametrize(
    ("section", "code", "words"),
    [
        (FaultsSection(corrupt_frame_prob=1.0), grpc.StatusCode.INVALID_ARGUMENT, "checksum"),
        (FaultsSection(drop_transfer_prob=1.0), grpc.StatusCode.UNAVAILABLE, "link dropped"),
    ],
)
def test_a_faulty_push_fails_the_prefill_promptly(workers, section, code, words):
    start, kind = workers
    address, decode, injector = start(section)
    for i in range(5):
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            prefill(address, f"r{i}")
        assert time.monotonic() - began < 5.0
        assert err.value.code() == code, err.value.details()
        assert words.lower() in err.value.details().lower()
        if kind == "prfaas" and code == grpc.StatusCode.UNAVAILABLE:
            assert "inter-cluster link dropped" in err.value.details()
    assert injector.corrupted + injector.dropped == 5
    assert decode.stats()["state_bytes_received"] == 0  # no damaged state was accepted


def test_clean_transfers_are_untouched(workers):
    start, _ = workers
    address, _, injector = start(FaultsSection(corrupt_frame_prob=1e-9, seed=3))
    with grpc.insecure_channel(address) as channel:
        tokens = pb_grpc.DecodeWorkerStub(channel).Generate(
            pb.DecodeRequest(request_id="ok", prompt_len=len(PROMPT), max_new_tokens=5),
            timeout=30,
        )
        prefill(address, "ok")
        assert [t for m in tokens for t in m.token_ids] == fake_tokens(PROMPT, 5, CFG.vocab_size)
    assert injector.corrupted == injector.dropped == 0
