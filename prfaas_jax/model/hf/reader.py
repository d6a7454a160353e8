"""Reading a Hugging Face checkpoint directory: ``HfConfig`` (config.json) and ``TensorReader``.

``TensorReader`` serves the tensors of ``model.safetensors``, of the shards listed in
``model.safetensors.index.json``, or of every ``*.safetensors`` file in the directory. It parses
the safetensors format itself (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then raw little-endian data) and memory-maps the data, so
bf16 checkpoints load through ``ml_dtypes`` without torch. Every tensor taken is checked against
the shape the config implies, and ``finish`` rejects tensors nobody took: a checkpoint that does
not match its config fails with a one-line ``CheckpointError`` naming the tensor.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from prfaas_jax.errors import CheckpointError

_REQUIRED = object()

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

_MODEL_DTYPES = ("float32", "bfloat16", "float16")


class HfConfig:
    """Typed access to ``config.json`` with the family's defaults and one-line errors."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw = raw
        self.source = source

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type", ""))

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def _value(self, names: Sequence[str], default: Any) -> tuple[str, Any]:
        for name in names:
            if self.raw.get(name) is not None:
                return name, self.raw[name]
        if default is _REQUIRED:
            raise CheckpointError(f"{self.source}: missing the required key {names[0]!r}")
        return names[0], default

    def get_int(self, *names: str, default: Any = _REQUIRED) -> int:
        name, value = self._value(names, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.source}: {name!r} must be an integer, got {value!r}")
        return value

    def get_float(self, *names: str, default: Any = _REQUIRED) -> float:
        name, value = self._value(names, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.source}: {name!r} must be a number, got {value!r}")
        return float(value)

    def get_bool(self, *names: str, default: Any = _REQUIRED) -> bool:
        name, value = self._value(names, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.source}: {name!r} must be true or false, got {value!r}")
        return value

    def get_list(self, *names: str, default: Any = _REQUIRED) -> list:
        name, value = self._value(names, default)
        if not isinstance(value, list):
            raise CheckpointError(f"{self.source}: {name!r} must be a list, got {value!r}")
        return value

    def get_dict(self, *names: str, default: Any = _REQUIRED) -> dict:
        name, value = self._value(names, default)
        if not isinstance(value, dict):
            raise CheckpointError(f"{self.source}: {name!r} must be an object, got {value!r}")
        return value

    def dtype(self) -> str:
        """The model dtype named by ``dtype`` / ``torch_dtype`` (float32 when absent)."""
        name, value = self._value(("dtype", "torch_dtype"), "float32")
        value = str(value).removeprefix("torch.")
        if value not in _MODEL_DTYPES:
            raise CheckpointError(
                f"{self.source}: {name!r} is {value!r}; supported: {', '.join(_MODEL_DTYPES)}"
            )
        return value

    def unsupported(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {what} is not supported")


def read_hf_config(directory: str | Path) -> HfConfig:
    """Parse ``DIR/config.json``."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"not a checkpoint directory: {directory}")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no config.json in {directory}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return HfConfig(raw, str(path))


class _Entry:
    __slots__ = ("dtype", "file", "offset", "shape")

    def __init__(self, file: Path, dtype: np.dtype, shape: tuple[int, ...], offset: int):
        self.file, self.dtype, self.shape, self.offset = file, dtype, shape, offset


def _read_header(path: Path) -> dict[str, _Entry]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise CheckpointError(f"{path} is not a safetensors file (bad header length)")
            header = json.loads(fh.read(length))
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} is not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (bad header)")
    entries: dict[str, _Entry] = {}
    data_start = 8 + length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for {name!r}") from None
        if code not in _DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {code}; supported: {sorted(_DTYPES)} "
                "(quantised checkpoints are not supported)"
            )
        dtype = _DTYPES[code]
        if end - begin != dtype.itemsize * int(np.prod(shape)) or data_start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent data offsets")
        entries[name] = _Entry(path, dtype, shape, data_start + begin)
    return entries


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"cannot read {index}: {err}") from None
        missing = [n for n in names if not (directory / n).exists()]
        if missing:
            raise CheckpointError(f"{index} lists missing shard(s): {', '.join(missing)}")
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    return files


class TensorReader:
    """The tensors of a checkpoint directory, taken by name with their expected shapes."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._entries: dict[str, _Entry] = {}
        for path in _shard_files(self.directory):
            for name, entry in _read_header(path).items():
                if name in self._entries:
                    raise CheckpointError(f"tensor {name!r} appears in more than one shard")
                self._entries[name] = entry
        self._taken: set[str] = set()
        self._maps: dict[Path, np.memmap] = {}

    def has(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def take(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """Tensor ``name`` as a float32 array, after checking it has ``shape``."""
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"missing tensor {name!r} in {self.directory}")
        if entry.shape != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(entry.shape)}, expected {list(shape)}"
            )
        self._taken.add(name)
        data = self._maps.get(entry.file)
        if data is None:
            data = self._maps[entry.file] = np.memmap(entry.file, dtype=np.uint8, mode="r")
        count = int(np.prod(entry.shape))
        raw = data[entry.offset : entry.offset + count * entry.dtype.itemsize]
        # float32 in between: every conversion (transpose, split, 1 + w) is exact in it, and the
        # final cast to the model dtype happens once, in one place (hf.py).
        return np.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape).astype(np.float32)

    def linear(self, name: str, in_dim: int, out_dim: int) -> np.ndarray:
        """An ``nn.Linear`` weight (``[out, in]``) transposed to our ``[in, out]``."""
        return self.take(name, (out_dim, in_dim)).T

    def first_present(self, names: Iterable[str]) -> str:
        """The first of ``names`` in the checkpoint (or the first name, for the error message)."""
        names = list(names)
        return next((n for n in names if self.has(n)), names[0])

    def skip(self, names: Iterable[str]) -> None:
        """Mark tensors the model deliberately does not use (e.g. multi-token-prediction heads)."""
        self._taken.update(n for n in names if n in self._entries)

    def finish(self, ignore: Sequence[str] = ()) -> None:
        """Fail if a tensor was never taken, unless its name fully matches an ``ignore`` regex.

        Empty tensors are never unexpected: transformers saves zero-width layers (e.g. shared
        experts of width ``moe_intermediate_size · 0``) that hold nothing.
        """
        patterns = [re.compile(p) for p in ignore]
        extra = [
            n
            for n in sorted(set(self._entries) - self._taken)
            if int(np.prod(self._entries[n].shape)) and not any(p.fullmatch(n) for p in patterns)
        ]
        if extra:
            more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
            raise CheckpointError(
                f"unexpected tensor(s) in {self.directory}: {', '.join(extra[:3])}{more}"
            )
