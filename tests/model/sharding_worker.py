"""Sharded generation on 8 host devices, run by tests/model/test_sharding.py in a subprocess.

The device count is fixed when JAX starts, and the pytest process has already started it with
one device, so this script sets ``XLA_FLAGS`` itself before importing JAX. ``python
sharding_worker.py CASE`` prints one JSON object: greedy tokens unsharded and per mesh, and the
``PartitionSpec`` of sample leaves as the engines placed them. Cases (one process each, so the
test runs them side by side):

- ``tiny``: the preset on ``tensor=4`` (its 2 KDA/MLA heads do not divide 4: replicated, the
  MLPs and experts split) and on ``tensor=2,expert=4`` (every head axis split);
- ``wide``: a 2-block KDA+MLA variant with 4 heads on ``tensor=4`` (every head axis split), and
  a state prefilled on ``tensor=2`` decoded on ``tensor=4`` through the codec's bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # after XLA_FLAGS: the device count is read when JAX starts

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.generate import generate
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling import GREEDY
from prfaas_jax.model import init_params
from prfaas_jax.model.sharding import make_mesh

MESHES = {"tiny": ("tensor=4", "tensor=2,expert=4"), "wide": ("tensor=4",)}
PROMPT = [7, 42, 3, 99, 250, 18, 64, 5, 131, 77, 12]
NEW_TOKENS = 6
MAX_LEN = 32


def wide(cfg: ModelConfig) -> ModelConfig:
    """``tiny`` cut to one KDA+dense and one MLA+MoE block, with 4 KDA and 4 MLA heads so that
    ``tensor=4`` splits every head axis (two blocks: half the compile time of four)."""
    return dataclasses.replace(
        cfg,
        name="tiny-wide",
        layers=cfg.layers[2:],
        mlps=(cfg.mlps[0], cfg.mlps[-1]),
        linear=dataclasses.replace(cfg.linear, num_heads=4, num_v_heads=4),
        mla=dataclasses.replace(cfg.mla, num_heads=4),
    )


def spec(array: jax.Array) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec]


def placed_specs(engine: PrefillEngine) -> dict[str, list]:
    layers = engine.params["layers"]
    return {
        "kda.q_proj": spec(layers[0]["mixer"]["q_proj"]),
        "kda.o_proj": spec(layers[0]["mixer"]["o_proj"]),
        "mla.kv_b": spec(layers[-1]["mixer"]["kv_b"]),
        "mla.kv_a": spec(layers[-1]["mixer"]["kv_a"]),
        "moe.experts_up": spec(layers[-1]["mlp"]["experts_up"]),
        "dense.down": spec(layers[0]["mlp"]["down"]),
    }


def cross_mesh(cfg: ModelConfig, params: dict) -> dict:
    """Prefill on tensor=2, ship the state as codec bytes, decode on tensor=4."""
    prefill_engine = PrefillEngine(cfg, params, mesh=make_mesh("tensor=2"))
    working: list[list] = []  # the working state's layout, seen while it is on the mesh
    result = prefill_engine.prefill(
        PROMPT,
        max_len=MAX_LEN,
        on_chunk=lambda state, _: working.append(spec(state.layers[0].recurrent)),
    )
    frames = [bytes(frame) for frame in codec.encode(result.state, cfg)]
    state = codec.decode(frames, cfg, max_len=MAX_LEN)
    decode_engine = DecodeEngine(
        cfg, params, max_slots=1, max_len=MAX_LEN, mesh=make_mesh("tensor=4")
    )
    slot = decode_engine.insert(state, result.first_token, max_new_tokens=NEW_TOKENS - 1)
    tokens = [result.first_token]
    while not decode_engine.is_finished(slot):
        tokens += [token for _, token in decode_engine.step()]
    slot_spec = spec(decode_engine._state.layers[0].recurrent)
    return {"tokens": tokens, "prefill_state_spec": working[-1], "decode_state_spec": slot_spec}


def run(case: str) -> dict:
    tiny = load_model_config("tiny")
    cfg = tiny if case == "tiny" else wide(tiny)
    params = init_params(jax.random.PRNGKey(0), cfg)
    out: dict = {"devices": jax.device_count(), "layers": [str(kind) for kind in cfg.layers]}
    out["unsharded"] = generate(params, cfg, PROMPT, NEW_TOKENS, GREEDY)[0]
    for mesh_spec in MESHES[case]:
        mesh = make_mesh(mesh_spec)
        out[mesh_spec] = generate(params, cfg, PROMPT, NEW_TOKENS, GREEDY, mesh=mesh)[0]
        out[f"specs {mesh_spec}"] = placed_specs(PrefillEngine(cfg, params, mesh=mesh))
    if case == "wide":
        out["tensor=2 -> tensor=4"] = cross_mesh(cfg, params)
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
