"""Device meshes and the sharding rules of params and states: ``MeshSpec``, ``parse_mesh_spec``,
``make_mesh``, ``param_shardings``, ``state_shardings``, ``shard_params``, ``shard_state``,
``to_host``, ``initialize_distributed`` and ``MeshError``.

A mesh always has the three axes ``(data, expert, tensor)`` (size 1 when not asked for), built
from a spec string ``tensor=N[,expert=M][,data=K]``. The rules only *place* arrays: ``jit``
(GSPMD) propagates the placement through ``prefill``/``decode_step`` and inserts the
collectives, so sharded and unsharded runs compute the same function. A dim is split over an
axis only when the axis size divides both the dim and the number of heads (or experts) laid
along it — shards then hold whole heads — otherwise it is replicated:

==============================  ===========================================================
leaf                            split
==============================  ===========================================================
q/k/v/gate/head-gate columns    ``tensor`` by head (Q heads, KV heads, linear V heads)
``o_proj`` rows, per-head vecs  ``tensor`` by head (``A_log``, ``dt_bias``, ``sinks``)
MLA ``q_a``, ``kv_a``, norms    replicated: the latent is shared by every head
fused ``conv``, Lightning qkv   replicated: columns are ``[q ‖ k ‖ v]``, not head-contiguous
dense/shared SwiGLU             ``tensor`` on the intermediate dim
routed experts                  ``expert`` on the expert dim, ``tensor`` on the expert width
router, score bias, LM head     router replicated; embed/LM head ``tensor`` on the vocab
state ``lengths`` and axis 0    ``data`` (the batch)
MLA ``c_kv``/``k_rope``         replicated over ``tensor`` (one latent for all heads)
GQA/SWA ``k``/``v``             ``tensor`` on the KV-head axis
KDA/GDN/Lightning recurrent     ``tensor`` on the head axis; the short-conv tail replicated
==============================  ===========================================================

Multi-host: call ``jax.distributed.initialize`` before building a mesh; ``jax.devices()`` is
then global and the same spec spans hosts, and ``to_host`` gathers arrays no one process holds
whole (docs/sharding.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from prfaas_jax.config import LayerKind, ModelConfig
from prfaas_jax.mesh_spec import MESH_AXES, MeshError, MeshSpec, parse_mesh_spec
from prfaas_jax.model.hybrid import Params, param_specs
from prfaas_jax.model.state import (
    DeltaState,
    KvState,
    LayerState,
    LightningState,
    ModelState,
    WindowKvState,
)

_DELTA = (LayerKind.KDA, LayerKind.GDN)
_SOFTMAX = (LayerKind.GQA, LayerKind.SWA)


def initialize_distributed() -> bool:
    """Join the multi-host run that ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0),
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` describe, one process per host; ``False``
    (nothing done) when ``JAX_COORDINATOR_ADDRESS`` is unset. Must run before anything touches
    a device: afterwards ``jax.devices()`` lists every host's devices."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return False
    try:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
        process_id = int(os.environ["JAX_PROCESS_ID"])
    except (KeyError, ValueError):
        raise MeshError(
            "JAX_COORDINATOR_ADDRESS is set, so JAX_NUM_PROCESSES and JAX_PROCESS_ID must be "
            "integers too (docs/sharding.md)"
        ) from None
    jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id)
    return True


def make_mesh(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, expert, tensor)`` mesh over the first ``spec.num_devices`` of ``devices``
    (default: ``jax.devices()``, every host's after ``jax.distributed.initialize``)."""
    spec = parse_mesh_spec(spec) if isinstance(spec, str) else spec
    devices = list(jax.devices() if devices is None else devices)
    if spec.num_devices > len(devices):
        raise MeshError(
            f"mesh {spec} needs {spec.num_devices} devices but {len(devices)} are visible; on "
            f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count={spec.num_devices} before "
            "JAX starts, across hosts call jax.distributed.initialize first (docs/sharding.md)"
        )
    grid = np.array(devices[: spec.num_devices], dtype=object)
    return Mesh(grid.reshape(spec.data, spec.expert, spec.tensor), MESH_AXES)


def _axis(mesh: Mesh, name: str, dim: int, units: int) -> str | None:
    """``name`` if splitting a dim of ``dim`` elements (``units`` heads/experts) over it gives
    every device whole units; ``None`` (replicate) otherwise."""
    size = mesh.shape[name]
    return name if size > 1 and units % size == 0 and dim % size == 0 else None


def _spec(ndim: int, **split: str | None) -> PartitionSpec:
    """A spec with ``split[f"d{i}"]`` on dim ``i`` and nothing elsewhere."""
    return PartitionSpec(*(split.get(f"d{i}") for i in range(ndim)))


def _mixer_rule(cfg: ModelConfig, kind: LayerKind, name: str) -> tuple[int, int] | None:
    """``(dim, heads)``: the dim of mixer leaf ``name`` laid out by head, and the head count."""
    if kind in _DELTA or kind is LayerKind.LIGHTNING:
        lin = cfg.linear
        heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
        by_head = {
            "q_proj": (1, lin.num_heads),
            "k_proj": (1, lin.num_heads),
            "o_proj": (0, heads),
            "A_log": (0, heads),
            "dt_bias": (0, heads),
        }
        by_head.update(
            (key, (1, heads))
            for key in ("v_proj", "b_proj", "a_proj", "z_proj", "f_proj", "g_proj", "f_b", "g_b")
        )
        if kind is LayerKind.LIGHTNING:
            by_head["gate_proj"] = (1, heads)
        return by_head.get(name)
    if kind is LayerKind.MLA:
        heads = cfg.mla.num_heads
        return {
            "q_proj": (1, heads),
            "q_b": (1, heads),
            "kv_b": (1, heads),
            "o_proj": (0, heads),
            "gate_proj": (1, heads),
        }.get(name)
    att = cfg.attention if kind is LayerKind.GQA else cfg.swa
    return {
        "q_proj": (1, att.num_heads),
        "k_proj": (1, att.num_kv_heads),
        "v_proj": (1, att.num_kv_heads),
        "gate_proj": (1, att.num_heads),
        "o_proj": (0, att.num_heads),
        "sinks": (0, att.num_heads),
    }.get(name)


def _mlp_spec(mesh: Mesh, name: str, shape: tuple[int, ...]) -> PartitionSpec:
    ndim = len(shape)
    if name in ("gate", "up"):  # [D, F]: column-parallel
        return _spec(ndim, d1=_axis(mesh, "tensor", shape[1], shape[1]))
    if name == "down":  # [F, D]: row-parallel, its partial sums reduced by GSPMD
        return _spec(ndim, d0=_axis(mesh, "tensor", shape[0], shape[0]))
    if name.startswith("experts_"):  # [E, D, W] (gate/up) or [E, W, D] (down)
        width_dim = 1 if name == "experts_down" else 2
        width = _axis(mesh, "tensor", shape[width_dim], shape[width_dim])
        return _spec(ndim, d0=_axis(mesh, "expert", shape[0], shape[0]), **{f"d{width_dim}": width})
    return PartitionSpec()  # router, score_bias, shared_gate: tiny, read by every token


def _param_spec(cfg: ModelConfig, mesh: Mesh, path: tuple, shape: tuple[int, ...]) -> PartitionSpec:
    keys = [getattr(entry, "key", getattr(entry, "idx", None)) for entry in path]
    ndim = len(shape)
    if keys[0] == "embed":  # [V, D]: the gather becomes a masked local gather + all-reduce
        return _spec(ndim, d0=_axis(mesh, "tensor", shape[0], shape[0]))
    if keys[0] == "lm_head":  # [D, V]: vocab-parallel logits
        return _spec(ndim, d1=_axis(mesh, "tensor", shape[1], shape[1]))
    if keys[0] != "layers":
        return PartitionSpec()
    index, block, name = keys[1], keys[2], keys[-1]
    if block == "mlp":
        return _mlp_spec(mesh, name, shape)
    if block != "mixer":
        return PartitionSpec()  # pre-norm scales
    rule = _mixer_rule(cfg, cfg.layers[index], name)
    if rule is None:
        return PartitionSpec()
    dim, heads = rule
    return _spec(ndim, **{f"d{dim}": _axis(mesh, "tensor", shape[dim], heads)})


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Params:
    """``init_params``' pytree with a ``NamedSharding`` per leaf (the table above)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, _param_spec(cfg, mesh, path, leaf.shape)),
        param_specs(cfg),
    )


def _layer_state_specs(
    cfg: ModelConfig, kind: LayerKind, layer: LayerState, mesh: Mesh, batch: str | None
) -> LayerState:
    """``layer`` with a ``PartitionSpec`` in place of each array."""

    def by_head(array: jax.Array, axis: int, heads: int) -> PartitionSpec:
        return _spec(
            array.ndim, d0=batch, **{f"d{axis}": _axis(mesh, "tensor", array.shape[axis], heads)}
        )

    if isinstance(layer, (KvState, WindowKvState)):
        heads = (cfg.attention if kind is LayerKind.GQA else cfg.swa).num_kv_heads
        return type(layer)(k=by_head(layer.k, 2, heads), v=by_head(layer.v, 2, heads))
    if isinstance(layer, DeltaState):
        return DeltaState(
            recurrent=by_head(layer.recurrent, 1, cfg.linear.num_v_heads),
            conv=_spec(layer.conv.ndim, d0=batch),  # [q ‖ k ‖ v] channels: not by head
        )
    if isinstance(layer, LightningState):
        return LightningState(recurrent=by_head(layer.recurrent, 1, cfg.linear.num_heads))
    # MLA: the latent c_kv/k_rope feeds every head, so every tensor shard needs all of it.
    return jax.tree.map(lambda array: _spec(array.ndim, d0=batch), layer)


def state_shardings(state: ModelState, cfg: ModelConfig, mesh: Mesh) -> ModelState:
    """``state``'s pytree (arrays or ``ShapeDtypeStruct``s) with a ``NamedSharding`` per leaf:
    batch over ``data`` when it divides, heads over ``tensor`` as the table above says."""
    rows = state.lengths.shape[0]
    batch = _axis(mesh, "data", rows, rows)
    specs = ModelState(
        lengths=PartitionSpec(batch),
        layers=tuple(
            _layer_state_specs(cfg, kind, layer, mesh, batch)
            for kind, layer in zip(cfg.layers, state.layers, strict=True)
        ),
    )
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda node: isinstance(node, PartitionSpec),
    )


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """``params`` placed on ``mesh`` by the rules (a copy; works from host or any device)."""
    return jax.device_put(params, param_shardings(cfg, mesh))


def shard_state(state: ModelState, cfg: ModelConfig, mesh: Mesh) -> ModelState:
    """``state`` placed on ``mesh`` by the rules: how a layout-free (codec-decoded, host or
    single-device) state is resharded onto the decode mesh, whatever mesh prefilled it."""
    return jax.device_put(state, state_shardings(state, cfg, mesh))


def to_host(tree: object) -> object:
    """Every array leaf of ``tree`` as a NumPy array of its *global* value, on every process.

    On one host that is ``np.asarray``; an array split across hosts is all-gathered first (every
    process must call this, as with any collective), so a multi-host prefill hands the codec the
    same layout-free state a single device would.
    """

    def one(leaf: object) -> np.ndarray:
        if isinstance(leaf, jax.Array) and not (
            leaf.is_fully_addressable or leaf.is_fully_replicated
        ):
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(leaf)

    return jax.tree.map(one, tree)
