"""Wire precision: a tensor's bytes on the wire in a narrower type than the state keeps.

A tensor's *encoding* (docs/wire-format.md, "Wire precision"):

- ``native``: the canonical dtype's bytes, exact — the default, and what every other encoding is
  measured against;
- ``bf16``: each float32 element rounded to bfloat16 (to nearest, ties to even); for float32
  tensors only (a 16-bit tensor travels as it is);
- ``fp8_e4m3`` and ``int8``: the tensor as vectors along its last axis, each sent as its scale
  (float32, ``amax / 448`` or ``amax / 127``) followed by its elements divided by the scale, as
  float8_e4m3fn (to nearest even) or int8 (to nearest even, within ±127). One scale per
  (head, key-dim) row of a recurrent state, per (token, head) of K and V, per token of an MLA
  latent. A vector of zeros has scale 0.

Decoding multiplies back in float32 and casts to the tensor's dtype. A scale that is negative,
not finite or so large that an element would overflow float32, or an fp8 element that is NaN,
is a decode error; so is, at the sender, a tensor
with non-finite values under a scaled encoding (it could not be carried).

Which encoding each kind of tensor travels in (recurrent states, short-conv tails, MLA latents,
MLA rope keys, GQA/SWA K and V) is a ``WirePrecision`` (prfaas_jax/wire_precision.py, with the
size rule, free of JAX for the router); ``encoding_of`` applies one to a tensor.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from prfaas_jax.config import LayerKind
from prfaas_jax.engine.codec.layout import TensorSpec, wire_view
from prfaas_jax.wire_precision import (
    ENCODINGS,
    NATIVE,
    SCALE_BYTES,
    WIRE_NATIVE,
    WirePrecision,
    encoded_nbytes,
)

__all__ = [
    "ENCODINGS",
    "NATIVE",
    "WIRE_NATIVE",
    "WirePrecision",
    "encoding_of",
    "from_wire",
    "is_scaled",
    "max_scale",
    "nbytes",
    "tensor_kind",
    "to_wire",
    "unit_bytes",
    "valid_for",
]

# The scaled encodings: element type and the largest magnitude an encoder writes.
_SCALED: dict[str, tuple[np.dtype, float]] = {
    "fp8_e4m3": (
        np.dtype(ml_dtypes.float8_e4m3fn),
        float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
    ),
    "int8": (np.dtype(np.int8), 127.0),
}


def valid_for(dtype: str, encoding: str) -> bool:
    """Whether a tensor of config dtype ``dtype`` can travel as ``encoding``."""
    if encoding == "bf16":
        return dtype == "float32"
    return encoding in ENCODINGS


def is_scaled(encoding: str) -> bool:
    return encoding in _SCALED


def unit_bytes(spec: TensorSpec, encoding: str) -> int:
    """Wire bytes of the unit frames are cut in: a token row, or (fixed-size tensors) one
    element, or one scaled vector."""
    if encoding == NATIVE:
        return spec.unit_bytes
    if encoding == "bf16":
        return spec.unit_bytes // spec.itemsize * 2
    vector = SCALE_BYTES + spec.shape[-1]
    if spec.token_axis:
        return math.prod(spec.shape[1:-1]) * vector
    return vector


def nbytes(spec: TensorSpec, encoding: str) -> int:
    """Wire bytes of the whole tensor (the size rule of prfaas_jax/wire_precision.py)."""
    last = spec.shape[-1] if spec.shape else 1
    return encoded_nbytes(math.prod(spec.shape), last, spec.itemsize, spec.dtype, encoding)


def to_wire(array: np.ndarray, encoding: str) -> memoryview:
    """The wire bytes of ``array`` (canonical rows of one tensor) under ``encoding``: a view of
    the array for ``native``, new bytes otherwise. ValueError for non-finite values under a
    scaled encoding."""
    if encoding == NATIVE:
        return wire_view(array)
    if encoding == "bf16":
        return wire_view(array.astype(ml_dtypes.bfloat16))
    element, limit = _SCALED[encoding]
    last = array.shape[-1] if array.ndim else 1
    x = np.asarray(array, np.float32).reshape(-1, last)
    amax = np.abs(x).max(axis=1, initial=0.0)
    if not np.isfinite(amax).all():
        raise ValueError(f"a tensor with non-finite values cannot travel as {encoding}")
    scale = (amax / np.float32(limit)).astype(np.float32)
    divisor = np.where(scale > 0, scale, np.float32(1))[:, None]
    q = np.clip(x / divisor, -limit, limit)
    values = np.rint(q).astype(np.int8) if encoding == "int8" else q.astype(element)
    out = np.empty((x.shape[0], SCALE_BYTES + last), np.uint8)
    out[:, :SCALE_BYTES] = scale.astype("<f4").view(np.uint8).reshape(-1, SCALE_BYTES)
    out[:, SCALE_BYTES:] = values.view(np.uint8)
    return memoryview(out).cast("B")


def from_wire(data: np.ndarray, spec: TensorSpec, rows: int, encoding: str) -> np.ndarray:
    """``rows`` token rows (or the whole tensor) of ``spec`` from their wire bytes ``data``
    (uint8), in the tensor's dtype. ValueError naming the first bad scale or element."""
    shape = (rows, *spec.shape[1:]) if spec.token_axis else spec.shape
    dtype = np.dtype(ml_dtypes.bfloat16) if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
    if encoding == "bf16":
        values = data.view("<u2").view(ml_dtypes.bfloat16).reshape(shape)
        return values.astype(dtype)
    element, _ = _SCALED[encoding]
    last = shape[-1]
    vectors = data.reshape(-1, SCALE_BYTES + last)
    scale = np.ascontiguousarray(vectors[:, :SCALE_BYTES]).view("<f4").reshape(-1)
    top = max_scale(encoding)
    bad = np.flatnonzero(~((scale >= 0) & (scale <= top)))  # NaN fails both
    if bad.size:
        raise ValueError(
            f"vector {bad[0]} has scale {scale[bad[0]]}: not a value in [0, {top:.4g}]"
        )
    values = vectors[:, SCALE_BYTES:].view(element).astype(np.float32)
    if encoding == "fp8_e4m3":
        nan = np.flatnonzero(np.isnan(values).any(axis=1))
        if nan.size:
            raise ValueError(f"vector {nan[0]} holds a NaN element")
    return (values * scale[:, None]).reshape(shape).astype(dtype)


def max_scale(encoding: str) -> np.float32:
    """The largest scale a decoder takes: one whose largest element (int8's −128 included, which
    an encoder never writes) still fits a float32."""
    _, limit = _SCALED[encoding]
    largest = 128.0 if encoding == "int8" else limit
    return np.float32(np.finfo(np.float32).max / np.float32(largest))


def tensor_kind(spec: TensorSpec) -> str:
    """Which of ``KINDS`` a canonical tensor is."""
    if spec.name == "recurrent":
        return "state"
    if spec.name == "conv":
        return "conv"
    if spec.kind is LayerKind.MLA:
        return "latent" if spec.name == "c_kv" else "rope"
    return "kv"


def encoding_of(setting: WirePrecision, spec: TensorSpec) -> str:
    """The encoding ``spec`` travels in under ``setting``."""
    return setting.encoding(tensor_kind(spec), spec.dtype)
