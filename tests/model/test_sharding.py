"""Sharding rules and sharded engines on 8 host CPU devices (tests/model/sharding_worker.py).

The pytest process already runs JAX on one device, so the mesh runs happen in subprocesses that
set ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts; the two cases run
side by side. Mesh-spec parsing and the device-count error need no mesh and run here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from prfaas_jax.model.sharding import MeshError, MeshSpec, make_mesh, parse_mesh_spec

WORKER = pathlib.Path(__file__).with_name("sharding_worker.py")


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    # LLVM optimisation off: the runs are compile-bound (~40% less CPU) and both sides of every
    # comparison are compiled alike in the same process.
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}"}
    procs = {
        case: subprocess.Popen(
            [sys.executable, str(WORKER), case],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for case in ("tiny", "wide")
    }
    out = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        out[case] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_parse_mesh_spec():
    assert parse_mesh_spec("tensor=2,expert=4") == MeshSpec(tensor=2, expert=4)
    assert parse_mesh_spec(" data=2 , tensor=4 ").num_devices == 8
    for bad in ("", "tensor", "tensor=x", "pipeline=2", "tensor=2,tensor=2", "tensor=0"):
        with pytest.raises(MeshError):
            parse_mesh_spec(bad)


def test_mesh_larger_than_the_devices_is_a_clear_error():
    with pytest.raises(MeshError, match=r"needs 4096 devices but \d+ are visible"):
        make_mesh("tensor=64,expert=64")


@pytest.mark.slow
def test_sharded_generate_matches_unsharded(runs):
    tiny, wide = runs["tiny"], runs["wide"]
    assert tiny["devices"] == 8
    assert tiny["tensor=4"] == tiny["unsharded"]
    assert tiny["tensor=2,expert=4"] == tiny["unsharded"]
    assert wide["tensor=4"] == wide["unsharded"]


def test_rules_split_what_divides_and_replicate_the_rest(runs):
    # tiny has 2 KDA/MLA heads: tensor=4 must replicate them but still split MLPs and experts.
    t4 = runs["tiny"]["specs tensor=4"]
    assert t4["kda.q_proj"] == [None, None] and t4["mla.kv_b"] == [None, None]
    assert t4["dense.down"] == ["tensor", None]
    assert t4["moe.experts_up"] == [None, None, "tensor"]
    t2e4 = runs["tiny"]["specs tensor=2,expert=4"]
    assert t2e4["kda.q_proj"] == [None, "tensor"] and t2e4["kda.o_proj"] == ["tensor", None]
    assert t2e4["mla.kv_b"] == [None, "tensor"]
    assert t2e4["mla.kv_a"] == []  # the latent projection feeds every head: replicated
    assert t2e4["moe.experts_up"] == ["expert", None, "tensor"]
    wide = runs["wide"]["specs tensor=4"]
    assert wide["kda.q_proj"] == [None, "tensor"] and wide["mla.kv_b"] == [None, "tensor"]


def test_state_prefilled_on_tensor2_decodes_on_tensor4(runs):
    wide = runs["wide"]
    cross = wide["tensor=2 -> tensor=4"]
    assert cross["tokens"] == wide["unsharded"]
    # The recurrent state really was split by head on both sides of the codec bytes.
    assert cross["prefill_state_spec"][:2] == [None, "tensor"]
    assert cross["decode_state_spec"][:2] == [None, "tensor"]
