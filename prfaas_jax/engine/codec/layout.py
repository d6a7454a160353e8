"""Canonical layout of one sequence's state: which tensors, and how they map to ``ModelState``.

``canonical_tensors(cfg, L)`` lists the tensors (model/state.py's canonical representation) in
wire order; ``canonical_arrays`` reads them out of one row of a (batched) state as host arrays
(``wire_view`` / ``wire_bytes``: one array as little-endian bytes), ``growing_rows`` reads some
positions of one growing cache of a state still being prefilled, and ``StateBuffers`` /
``state_from_arrays`` lay them back out as a batch-1 state of a given capacity, each tensor
written straight into the field that holds it. The prefix cache stores the same arrays;
``KvPrefix`` holds the leading rows of the growing caches a receiver already has.
SWA rings keep position ``p`` in slot ``p mod W'`` (``W'`` the ring size, the array's axis 1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.config import LayerKind, ModelConfig, dtype_nbytes
from prfaas_jax.engine.host_memory import POOLED_BYTES, STATE_BLOCKS
from prfaas_jax.model.state import (
    DeltaState,
    KvState,
    LayerState,
    LightningState,
    MlaState,
    ModelState,
    WindowKvState,
    window_capacity,
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor of one sequence: what it is, its dtype and its exact shape."""

    layer: int
    kind: LayerKind
    name: str  # the field of the layer's state pytree it comes from
    dtype: str  # a config dtype name
    shape: tuple[int, ...]
    token_axis: bool  # axis 0 counts positions (MLA, GQA, SWA) and frames split whole tokens

    def __str__(self) -> str:
        axis = ", token axis 0" if self.token_axis else ""
        shape = ", ".join(map(str, self.shape))
        return f"layer {self.layer} {self.kind.value} {self.name} {self.dtype}[{shape}]{axis}"

    @property
    def itemsize(self) -> int:
        return dtype_nbytes(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def unit_bytes(self) -> int:
        """Chunks are multiples of this: one token row, or one element for fixed-size state."""
        if self.token_axis:
            return math.prod(self.shape[1:]) * self.itemsize
        return self.itemsize


@dataclasses.dataclass(frozen=True)
class KvPrefix:
    """The first ``length`` positions of every growing cache (MLA, GQA) of one sequence, as
    canonical host arrays keyed by (layer, field): what a receiver holds of a prompt, so that a
    stream with ``base = length`` need not carry them."""

    length: int
    rows: dict[tuple[int, str], np.ndarray]


def canonical_tensors(cfg: ModelConfig, length: int) -> list[TensorSpec]:
    """The tensors that ``length`` tokens of state occupy, layer by layer (model/state.py)."""
    specs = []
    for layer, kind in enumerate(cfg.layers):
        if kind is LayerKind.MLA:
            fields = {"c_kv": (cfg.mla.kv_lora_rank,), "k_rope": (cfg.mla.qk_rope_head_dim,)}
            rows = length
        elif kind in (LayerKind.GQA, LayerKind.SWA):
            att = cfg.attention if kind is LayerKind.GQA else cfg.swa
            fields = {
                "k": (att.num_kv_heads, att.head_dim),
                "v": (att.num_kv_heads, att.value_dim),
            }
            rows = length if kind is LayerKind.GQA else min(length, att.window)
        else:
            lin = cfg.linear
            heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
            shape = (heads, lin.head_dim, lin.v_head_dim)
            specs.append(TensorSpec(layer, kind, "recurrent", cfg.state_dtype, shape, False))
            if kind is not LayerKind.LIGHTNING:
                shape = (lin.conv_kernel - 1, lin.conv_channels)
                specs.append(TensorSpec(layer, kind, "conv", cfg.dtype, shape, False))
            continue
        for name, tail in fields.items():
            specs.append(TensorSpec(layer, kind, name, cfg.dtype, (rows, *tail), True))
    return specs


_LAYER_CLASSES: dict[LayerKind, type] = {
    LayerKind.MLA: MlaState,
    LayerKind.GQA: KvState,
    LayerKind.SWA: WindowKvState,
    LayerKind.KDA: DeltaState,
    LayerKind.GDN: DeltaState,
    LayerKind.LIGHTNING: LightningState,
}


def _ring_slots(length: int, count: int, ring: int) -> np.ndarray:
    """Ring slots of the last ``count`` positions before ``length``, in position order."""
    return np.arange(length - count, length) % ring


def wire_view(array: np.ndarray) -> memoryview:
    """``array``'s elements as raw little-endian bytes in C order (what the codec ships): a
    view of the array itself where it is C-contiguous on a little-endian host, else a copy."""
    # Reinterpret as same-width unsigned ints so the byte order is explicit for every dtype,
    # bfloat16 included (ml_dtypes types carry no byte order of their own).
    width = array.dtype.itemsize
    raw = np.ascontiguousarray(array).view(f"u{width}")
    return memoryview(raw.astype(f"<u{width}", copy=False)).cast("B")


def wire_bytes(array: np.ndarray) -> bytes:
    """``wire_view`` as a ``bytes`` copy."""
    return bytes(wire_view(array))


def row_length(state: ModelState, row: int) -> tuple[int, int]:
    """``(batch size, L of row ``row``)`` of ``state``; ValueError for a missing row."""
    lengths = np.asarray(state.lengths)
    if lengths.ndim != 1 or not 0 <= row < lengths.shape[0]:
        raise ValueError(f"row {row} is not a row of a state with lengths shape {lengths.shape}")
    length = int(lengths[row])
    if length < 0:
        raise ValueError(f"row {row} has negative length {length}")
    return lengths.shape[0], length


def _field(state: ModelState, cfg: ModelConfig, spec: TensorSpec, batch: int) -> jax.Array:
    """The state field that holds ``spec``, checked against it (ValueError if it cannot)."""
    if len(state.layers) != cfg.num_layers:
        raise ValueError(f"state has {len(state.layers)} layers, {cfg.name} has {cfg.num_layers}")
    layer: LayerState = state.layers[spec.layer]
    where = f"layer {spec.layer} ({spec.kind.value}) {spec.name}"
    if type(layer) is not _LAYER_CLASSES[spec.kind]:
        raise ValueError(f"layer {spec.layer} is a {type(layer).__name__}, not {spec.kind}")
    array: jax.Array = getattr(layer, spec.name)
    if array.dtype != jnp.dtype(spec.dtype):
        raise ValueError(f"{where} has dtype {array.dtype}, the config says {spec.dtype}")
    fixed = (batch, *spec.shape)
    if spec.token_axis:
        # Growing caches may hold more positions than L, SWA rings more slots than min(L, W).
        ok = len(array.shape) == len(fixed) and array.shape[0] == batch
        ok = ok and array.shape[2:] == fixed[2:] and array.shape[1] >= spec.shape[0]
    else:
        ok = array.shape == fixed
    if not ok:
        raise ValueError(f"{where} has shape {array.shape}, which cannot hold {spec.shape}")
    return array


def canonical_arrays(
    state: ModelState, cfg: ModelConfig, row: int, *, layers: Container[int] | None = None
) -> tuple[int, list[tuple[TensorSpec, np.ndarray]]]:
    """Row ``row`` of ``state`` as L and its canonical tensors (host arrays, position order);
    of ``layers`` only, if given (the others are not read).

    Raises ValueError when the state does not fit ``cfg`` (layer types, dtypes, shapes, L).
    """
    batch, length = row_length(state, row)
    tensors = []
    for spec in canonical_tensors(cfg, length):
        if layers is not None and spec.layer not in layers:
            continue
        array = _field(state, cfg, spec, batch)
        # The live positions are selected on the host: slicing [:L] on device would compile a
        # new XLA op for every distinct L. A batch-1 state is its row: on a CPU the host array
        # is a view of the device buffer, no copy. Of a batch, the row is taken on device (one
        # compiled op per state shape), not the whole batch brought to the host.
        data = np.asarray(array)[row] if batch == 1 else np.asarray(array[row])
        if spec.kind is LayerKind.SWA:
            data = data[_ring_slots(length, spec.shape[0], array.shape[1])]
        elif spec.token_axis:
            data = data[:length]
        tensors.append((spec, data))
    return length, tensors


def growing_rows(
    state: ModelState, cfg: ModelConfig, spec: TensorSpec, row: int, start: int, stop: int
) -> np.ndarray:
    """Positions ``[start, stop)`` of the growing cache ``spec`` (MLA, GQA) in row ``row``.

    For a state whose first ``stop`` positions are final but whose L may still grow (a chunked
    prefill's working state). A host copy: the state's buffers may be donated once this returns.
    """
    if not spec.kind.has_growing_state:
        raise ValueError(f"{spec} is not a growing cache")
    batch, length = row_length(state, row)
    if not 0 <= start <= stop <= length:
        raise ValueError(f"positions [{start}, {stop}) are not all final in a state of L={length}")
    array = _field(state, cfg, dataclasses.replace(spec, shape=(stop, *spec.shape[1:])), batch)
    # The whole field to the host, then the rows: a device slice would compile once per
    # distinct (start, stop), i.e. once per prompt length.
    return np.array(np.asarray(array)[row, start:stop])


_ALIGN = 64  # XLA:CPU adopts a host buffer aligned to this as an array's memory, no copy


def _aligned(shape: tuple[int, ...], dtype: np.dtype, *, zeros: bool) -> np.ndarray:
    """A new C-contiguous host array whose data starts on an ``_ALIGN``-byte boundary: a large
    one in a block of `STATE_BLOCKS` (pages an earlier state used, not faulted in again)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= POOLED_BYTES:
        raw = STATE_BLOCKS.take(nbytes)  # page-aligned
        if zeros:
            raw[:] = 0
        return raw.view(dtype).reshape(shape)
    raw = (np.zeros if zeros else np.empty)(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class StateBuffers:
    """The host buffers of a batch-1 state being assembled from canonical tensors.

    ``canonical(i)`` is tensor ``i`` of ``canonical_tensors(cfg, length)`` as a writable array
    of its canonical shape, placed where the state keeps it: a growing cache's first ``length``
    rows of a field of ``capacity`` positions (zeros beyond), a fixed-size tensor's whole field;
    an SWA window is a buffer of its own, laid into its ring by ``state()``. Writing the
    tensors (a decoder, frame by frame) therefore builds the state with no further copy:
    ``state()`` hands the fields to JAX, which on a CPU adopts the aligned buffers as they are.
    A field of 1 MiB or more is a block of `STATE_BLOCKS`, pages an earlier state left mapped.
    Nothing may write to the buffers after ``state()``.
    """

    def __init__(self, cfg: ModelConfig, length: int, capacity: int) -> None:
        self.cfg, self.length = cfg, length
        self.specs = canonical_tensors(cfg, length)
        self._fields: list[np.ndarray] = []
        self._canonical: list[np.ndarray] = []
        for spec in self.specs:
            dtype = np.dtype(jnp.dtype(spec.dtype))
            if spec.kind is LayerKind.SWA:
                ring = window_capacity(cfg.swa.window, capacity)
                field = _aligned((1, ring, *spec.shape[1:]), dtype, zeros=True)
                canonical = np.empty(spec.shape, dtype)
            elif spec.token_axis:
                # The first ``length`` rows are written whole; only the rows past them are zeroed.
                field = _aligned((1, capacity, *spec.shape[1:]), dtype, zeros=False)
                field[0, length:] = 0
                canonical = field[0, :length]
            else:
                field = _aligned((1, *spec.shape), dtype, zeros=False)
                canonical = field[0]
            self._fields.append(field)
            self._canonical.append(canonical)

    def canonical(self, index: int) -> np.ndarray:
        return self._canonical[index]

    def state(self) -> ModelState:
        for spec, field, canonical in zip(self.specs, self._fields, self._canonical, strict=True):
            if spec.kind is LayerKind.SWA:
                field[0, _ring_slots(self.length, spec.shape[0], field.shape[1])] = canonical
        fields: list[dict[str, jax.Array]] = [{} for _ in self.cfg.layers]
        # One device_put for all fields: per-array calls cost ~40 µs each in dispatch alone.
        for spec, array in zip(self.specs, jax.device_put(self._fields), strict=True):
            fields[spec.layer][spec.name] = array
        layers = tuple(
            _LAYER_CLASSES[kind](**f) for kind, f in zip(self.cfg.layers, fields, strict=True)
        )
        return ModelState(lengths=jnp.array([self.length], jnp.int32), layers=layers)


def state_from_arrays(
    cfg: ModelConfig,
    length: int,
    tensors: Sequence[tuple[TensorSpec, np.ndarray]],
    capacity: int,
) -> ModelState:
    """A batch-1 state from ``canonical_tensors(cfg, length)``'s arrays, caches of ``capacity``."""
    buffers = StateBuffers(cfg, length, capacity)
    index = {(spec.layer, spec.name): i for i, spec in enumerate(buffers.specs)}
    filled = set()
    for spec, array in tensors:
        i = index[(spec.layer, spec.name)]
        if array.shape != buffers.specs[i].shape:
            raise ValueError(f"{buffers.specs[i]} given an array of shape {array.shape}")
        buffers.canonical(i)[...] = array
        filled.add(i)
    if len(filled) != len(buffers.specs):
        missing = [str(buffers.specs[i]) for i in range(len(buffers.specs)) if i not in filled]
        raise ValueError(f"no array for {', '.join(missing)}")
    return buffers.state()
