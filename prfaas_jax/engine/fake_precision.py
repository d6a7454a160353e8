"""What each wire precision delivers of a fake state's tensor: `delivered`, `encodings_for`
and `first_undelivered`, with which the fake engines' whole-state check (engine/fake.py)
accepts a state as any wire precision delivers it, and nothing else.

Written from the encodings' specification (docs/wire-format.md, "Wire precision";
prfaas_jax/wire_precision.py) with NumPy and ml_dtypes casts, not with the codec's functions,
so the check holds the codec to the rule rather than to itself:

- ``native``: the values as they are;
- ``bf16``: float32 values rounded to bfloat16 (to nearest, ties to even), back to float32; a
  tensor of another dtype travels natively;
- ``int8`` and ``fp8_e4m3``: per vector along the last axis, scale = amax / 127 (int8) or
  amax / 448 (float8_e4m3fn's largest), computed in float32; each element divided by the scale
  (a zero scale divides by 1), clipped to ± that limit and rounded to nearest even, as an
  integer (int8) or to float8_e4m3fn; the receiver multiplies back in float32 and casts to the
  tensor's dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from prfaas_jax.engine.codec.layout import TensorSpec
from prfaas_jax.wire_precision import ENCODINGS, NATIVE, applies

_LIMITS = {"int8": 127.0, "fp8_e4m3": 448.0}


def encodings_for(dtype: str) -> list[str]:
    """The encodings a tensor of config dtype ``dtype`` can arrive in, each once."""
    return list(dict.fromkeys(applies(encoding, dtype) for encoding in ENCODINGS))


def delivered(values: np.ndarray, encoding: str) -> np.ndarray:
    """``values`` (one tensor, its own dtype) as a receiver holds them after they crossed the
    wire in ``encoding`` (module docstring)."""
    if encoding == NATIVE:
        return values
    if encoding == "bf16":
        return values.astype(ml_dtypes.bfloat16).astype(values.dtype)
    limit = np.float32(_LIMITS[encoding])
    x = values.astype(np.float32).reshape(-1, values.shape[-1] if values.ndim else 1)
    scale = (np.abs(x).max(axis=1, initial=0.0) / limit).astype(np.float32)
    divisor = np.where(scale > 0, scale, np.float32(1))[:, None]
    q = np.clip(x / divisor, -limit, limit)
    element = np.int8 if encoding == "int8" else ml_dtypes.float8_e4m3fn  # int8 has no −0
    q = (np.rint(q) if encoding == "int8" else q).astype(element).astype(np.float32)
    return (q * scale[:, None]).reshape(values.shape).astype(values.dtype)


def first_undelivered(spec: TensorSpec, got: np.ndarray, want: np.ndarray) -> int | None:
    """The first unit of ``got`` that no wire precision delivers of ``want``, bit for bit: a
    row of a growing cache (rows may come from different transfers: a decode worker's cached
    prefix and the rows pushed after it), or 0, the whole of a fixed-size tensor. None: none."""
    bits = f"u{spec.itemsize}"
    units = len(got) if spec.token_axis else 1
    arrived = np.zeros(units, bool)
    for encoding in encodings_for(spec.dtype):
        same = got.view(bits) == delivered(want, encoding).view(bits)
        arrived |= same.reshape(units, -1).all(axis=1)
    bad = np.flatnonzero(~arrived)
    return int(bad[0]) if bad.size else None
