"""The committed stubs are what prfaas.proto generates, and the client port is as specified."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

from google.protobuf.descriptor import FieldDescriptor as T

from prfaas_jax.serving.proto import prfaas_pb2

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "prfaas_jax" / "serving" / "proto"
STUBS = ("prfaas_pb2.py", "prfaas_pb2.pyi", "prfaas_pb2_grpc.py")


def test_stubs_are_current(tmp_path):
    # grpcio-tools is in the test extra: without it this fails here, rather than skip.
    importlib.import_module("grpc_tools.protoc")
    target = tmp_path / "prfaas_jax" / "serving" / "proto"
    target.mkdir(parents=True)
    (target / "prfaas.proto").write_bytes((PROTO_DIR / "prfaas.proto").read_bytes())
    # The same command as regenerate.sh, run on a copy so the tree is never touched.
    command = [sys.executable, "-m", "grpc_tools.protoc", "-I."]
    command += ["--python_out=.", "--pyi_out=.", "--grpc_python_out=."]
    subprocess.run([*command, "prfaas_jax/serving/proto/prfaas.proto"], cwd=tmp_path, check=True)
    for name in STUBS:
        fresh, committed = (target / name).read_text(), (PROTO_DIR / name).read_text()
        # The generator stamps its own version; a newer grpcio-tools alone is not staleness.
        stamp = re.compile(
            r"^(# Protobuf Python Version:|GRPC_GENERATED_VERSION =).*$|^\s+\d+,$", re.MULTILINE
        )
        assert stamp.sub("", fresh) == stamp.sub("", committed), (
            f"{name} is stale: run prfaas_jax/serving/proto/regenerate.sh"
        )


def test_client_port_is_as_specified():
    router = prfaas_pb2.DESCRIPTOR.services_by_name["Router"]
    generate = router.methods_by_name["Generate"]
    assert generate.input_type.name == "GenerateRequest" and generate.server_streaming
    assert not generate.client_streaming and "GetStats" in router.methods_by_name

    def fields(message: str) -> list[tuple[str, int, str]]:
        descriptor = prfaas_pb2.DESCRIPTOR.message_types_by_name[message]
        return [(f.name, f.number, f.type) for f in descriptor.fields]

    assert fields("GenerateRequest") == [
        ("request_id", 1, T.TYPE_STRING),
        ("prompt_token_ids", 2, T.TYPE_INT32),
        ("max_new_tokens", 3, T.TYPE_INT32),
        ("temperature", 4, T.TYPE_FLOAT),
        ("top_p", 5, T.TYPE_FLOAT),
        ("top_k", 6, T.TYPE_INT32),
        ("seed", 7, T.TYPE_UINT64),
        ("logprobs", 8, T.TYPE_INT32),
        ("prompt_logprobs", 9, T.TYPE_BOOL),
        ("wire_precision", 10, T.TYPE_STRING),
    ]
    # A request that names no seed is told apart from seed 0: the router draws it a fresh one.
    assert generate.input_type.fields_by_name["seed"].has_presence
    assert fields("GenerateResponse") == [
        ("token_ids", 1, T.TYPE_INT32),
        ("finished", 2, T.TYPE_BOOL),
        ("report", 3, T.TYPE_MESSAGE),
        ("logprobs", 4, T.TYPE_MESSAGE),
        ("prompt_logprobs", 5, T.TYPE_MESSAGE),
    ]
    assert fields("RequestReport") == [
        ("route", 1, T.TYPE_STRING),
        ("prompt_len", 2, T.TYPE_INT32),
        ("cached_len", 3, T.TYPE_INT32),
        ("uncached_len", 4, T.TYPE_INT32),
        ("threshold", 5, T.TYPE_DOUBLE),
        ("ttft_s", 6, T.TYPE_DOUBLE),
        ("state_bytes", 7, T.TYPE_UINT64),
        ("prefill_instance", 8, T.TYPE_STRING),
        ("decode_instance", 9, T.TYPE_STRING),
        ("attempts", 10, T.TYPE_UINT32),
        ("resumed_from", 11, T.TYPE_INT32),
        ("prefill_s", 12, T.TYPE_DOUBLE),
        ("exposed_transfer_s", 13, T.TYPE_DOUBLE),
        ("decode_cached_len", 14, T.TYPE_INT32),
        ("saved_bytes", 15, T.TYPE_UINT64),
        ("seed", 16, T.TYPE_UINT64),
        ("cache_tier", 17, T.TYPE_ENUM),
        ("wire_precision", 18, T.TYPE_STRING),
    ]
    tiers = prfaas_pb2.DESCRIPTOR.enum_types_by_name["CacheTier"]
    assert [(v.name, v.number) for v in tiers.values] == [
        ("CACHE_TIER_NONE", 0),
        ("CACHE_TIER_HOST", 1),
        ("CACHE_TIER_DISK", 2),
        ("CACHE_TIER_PEER", 3),
        ("CACHE_TIER_DECODE", 4),
    ]
    assert prfaas_pb2.DESCRIPTOR.package == "prfaas.v1"
