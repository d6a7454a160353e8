"""The on-disk caches of work a process would otherwise redo: JAX's persistent compilation cache
(`default_compile_cache_dir`, `enable_compile_cache`) and the seeded-weights cache
(`default_weights_cache_dir`, `enable_weights_cache`; model/seeded_weights.py).

A program compiled once is stored on disk and loaded by every later process that needs it: the
worker processes of one cluster share their executables this way, and a second `prfaas train`
or `prfaas codesign` of the same layouts skips its compiles (on CPU the train step and the
weight initialiser of a toy model take 10-20 s to compile). A preset's seeded weights are
drawn once and read from a file by every later process that asks for the same config and seed.
Both live under ``$XDG_CACHE_HOME/prfaas_jax`` (``~/.cache/prfaas_jax``) by default.
"""

from __future__ import annotations

import os
from pathlib import Path


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prfaas_jax"


def default_compile_cache_dir() -> Path:
    return _cache_home() / "xla"


def default_weights_cache_dir() -> Path:
    return _cache_home() / "weights"


def enable_weights_cache(directory: str | os.PathLike[str] | None = None) -> None:
    """Read and keep seeded weights in ``directory`` (None: `default_weights_cache_dir`)."""
    from prfaas_jax.model.seeded_weights import use_weights_cache

    use_weights_cache(default_weights_cache_dir() if directory is None else directory)


def enable_compile_cache(directory: str | os.PathLike[str] | None = None) -> None:
    """Compile through the cache in ``directory``; None keeps a cache directory already set
    (``JAX_COMPILATION_CACHE_DIR``) and otherwise uses `default_compile_cache_dir`. Call it
    before the first compile: JAX decides whether to use a cache then."""
    import jax

    if directory is None:
        directory = jax.config.jax_compilation_cache_dir or default_compile_cache_dir()
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Every executable counts: the toy model's compiles are short but there are many of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
