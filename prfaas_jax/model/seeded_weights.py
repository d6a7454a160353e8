"""Seeded weights kept on disk: `seeded_params`, `use_weights_cache`, `cache_key`.

A preset without a checkpoint gets its weights from `init_params(PRNGKey(seed), cfg)`: one
compiled program, whose compile is most of the cost: for ``tiny`` on 2 CPU cores, 7.5 CPU-s
cold and still 1.7–1.9 CPU-s per process with the program in JAX's persistent cache (the
``load_model`` call in a fresh process). Every worker of a toy cluster, every ``prfaas
generate`` and every test process draws the same few presets, so the first process to draw
``(cfg, seed)`` writes the arrays to a file and the others read it (0.3–0.5 CPU-s).

The file is named by `cache_key`: a SHA-256 of everything that decides the drawn values — the
whole config, the seed, the source of ``prfaas_jax/model`` and ``prfaas_jax/config.py``, the
versions of JAX, jaxlib, Flax and NumPy, the backend, the PRNG settings and the compiler flags.
A change to any of them names a new file; nothing is ever overwritten with different values.

A file is an ``.npz`` (a zip, each member CRC-checked on read, loaded without pickle) of the
leaves of ``param_specs(cfg)`` in tree order as raw bytes, ``leaf_0000`` on. Reading checks
the member names and each size against the spec; a file that fails any check (truncated,
corrupted, written by a bug) is drawn afresh and replaced, with a warning, so a bad file costs
time, never wrong weights. Writes go to a temporary file renamed into place: concurrent
workers may each write the same file, and a reader sees a whole one or none.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.model.hybrid import Params, init_params, param_specs

log = logging.getLogger("prfaas.weights")

_PACKAGE = Path(__file__).resolve().parents[1]  # prfaas_jax/
_directory: Path | None = None


def use_weights_cache(directory: str | os.PathLike[str] | None) -> None:
    """Keep seeded weights in ``directory`` from now on (None: draw them every time)."""
    global _directory
    _directory = None if directory is None else Path(directory)


def weights_cache_dir() -> Path | None:
    """Where seeded weights are kept, or None when they are drawn every time."""
    return _directory


def seeded_params(cfg: ModelConfig, seed: int) -> Params:
    """``init_params(PRNGKey(seed), cfg)``, through the cache when one is in use."""
    if _directory is None:
        return init_params(jax.random.PRNGKey(seed), cfg)
    path = _directory / f"{cache_key(cfg, seed)}.npz"
    if path.exists():
        try:
            return read_params(path, cfg)
        except ValueError as err:
            log.warning("drawing the weights again: %s", err)
    params = init_params(jax.random.PRNGKey(seed), cfg)
    try:
        write_params(path, params)
    except OSError as err:  # a read-only or full disk costs the next process a draw, no more
        log.warning("seeded weights not cached: %s", err)
    return params


def cache_key(cfg: ModelConfig, seed: int) -> str:
    """Hex SHA-256 of what decides the values ``init_params(PRNGKey(seed), cfg)`` draws."""
    versions = {name: metadata.version(name) for name in ("jax", "jaxlib", "flax", "numpy")}
    settings = {
        "backend": jax.default_backend(),
        "prng": jax.config.jax_default_prng_impl,
        "threefry_partitionable": jax.config.jax_threefry_partitionable,
        "disable_most_optimizations": jax.config.read("jax_disable_most_optimizations"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    blob = json.dumps(
        {"config": cfg.to_dict(), "seed": seed, "versions": versions, "settings": settings},
        sort_keys=True,
    )
    digest = hashlib.sha256(blob.encode())
    digest.update(_source_digest())
    return digest.hexdigest()


@functools.cache  # the source does not change under a running process
def _source_digest() -> bytes:
    """SHA-256 of the code that builds and draws a model: ``model/**.py`` and ``config.py``."""
    files = [*sorted((_PACKAGE / "model").rglob("*.py")), _PACKAGE / "config.py"]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.relative_to(_PACKAGE).as_posix().encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.digest()


def write_params(path: Path, params: Params) -> None:
    """Store ``params``' leaves (tree order, raw bytes) at ``path``, atomically."""
    leaves = [np.ascontiguousarray(leaf) for leaf in jax.tree.leaves(params)]
    members = {f"leaf_{i:04d}": leaf.reshape(-1).view(np.uint8) for i, leaf in enumerate(leaves)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            np.savez(file, **members)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_params(path: Path, cfg: ModelConfig) -> Params:
    """The weights `write_params` stored at ``path`` for ``cfg``; ValueError, naming what is
    wrong, for a file that is not exactly that."""
    specs, tree = jax.tree.flatten(param_specs(cfg))
    names = [f"leaf_{i:04d}" for i in range(len(specs))]
    try:
        stored = np.load(path, allow_pickle=False)
        if not isinstance(stored, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz file")
        with stored:
            if sorted(stored.files) != names:
                raise ValueError(f"holds {len(stored.files)} arrays, expected {len(names)}")
            leaves = [
                _leaf(stored[name], spec, name) for name, spec in zip(names, specs, strict=True)
            ]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path}: {err}") from err
    return jax.tree.unflatten(tree, [jax.numpy.asarray(leaf) for leaf in leaves])


def _leaf(raw: np.ndarray, spec: jax.ShapeDtypeStruct, where: str) -> np.ndarray:
    expected = int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize
    if raw.dtype != np.uint8 or raw.shape != (expected,):
        raise ValueError(f"{where}: {raw.dtype} {raw.shape}, expected {expected} bytes")
    return raw.view(spec.dtype).reshape(spec.shape)
