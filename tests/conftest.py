"""Shared fixtures: jitted model entry points (one compile cache for the whole session), and the
compiler settings of the pytest process and of every process a test starts.

The suite is compile-bound on a CPU: its programs are tiny, so compiling one costs far more
than running it, and XLA is told to skip most optimization work
(``jax_disable_most_optimizations``, the JAX flag made for that case; about 40 % less compile
time), and XLA:CPU emits fused loops with its older, simpler emitters
(``--xla_cpu_use_fusion_emitters=false``; another ~20 % of a model's compile time, the same
programs), each program in one piece (``--xla_cpu_parallel_codegen_split_count=1``: XLA:CPU
splits a module 32 ways to compile the pieces on parallel threads, which buys nothing when four
pytest processes share two cores and costs ~6 % of the suite's CPU time in per-piece work).
Both variables are set before JAX is imported, so every process a test starts compiles the
same way; ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` and an ``XLA_FLAGS`` that names
``--xla_cpu_use_fusion_emitters=true`` (which leaves the split count alone too) run the suite
with the compiler users get (tests/test_default_compiler.py runs a subset
so in every run; the report header's ``compiler:`` line names the settings a run used). Child
processes (``prfaas`` subprocesses, cluster workers, the sharding runs) share one persistent
compilation cache with the pytest processes, made for the session
(``child_cache_home``): the first process to compile a program stores it and the others load
it, and so does a module that needs a program again after ``release_compiled_programs``. (JAX
reports a load as a compile too, so the compile counts tests/engine/test_engines.py bounds are
the same with or without it.) Seeded weights go the same way, through the seeded-weights cache
beneath the same home (model/seeded_weights.py): each preset and seed is drawn once per run.

Every executable XLA:CPU keeps alive holds ~18 memory mappings, and a process may hold at most
``vm.max_map_count`` (65,530 by default): the whole suite in one process compiles more than
that allows, and the compile that crosses the limit crashes (a segmentation fault inside
LLVM). After any test module that leaves the process above a third of the limit,
``release_compiled_programs`` clears JAX's caches, which frees the executables and their
mappings; later modules compile what they need again.

Hypothesis runs derandomized by default (the ``repeatable`` profile): every run of the suite —
here, on CI, on a user's machine — tries the same examples, so a red run reproduces, and a
failing example is printed with the blob that replays it (``@reproduce_failure``). The
per-example deadline is off, as every property test here already sets it: compiles and a shared
2-core machine make per-example timings meaningless. ``HYPOTHESIS_PROFILE=explore`` draws new
examples on every run, for a local search beyond the fixed ones.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # before JAX reads it
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        filter(
            None,
            [
                os.environ.get("XLA_FLAGS"),
                "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1",
            ],
        )
    )

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from jax.experimental.compilation_cache import compilation_cache

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.compile_cache import default_compile_cache_dir, default_weights_cache_dir
from prfaas_jax.engine.tracing_gc import collect_for_tracing
from prfaas_jax.model import decode_step, init_state, prefill
from prfaas_jax.model.seeded_weights import seeded_params, use_weights_cache

jax.config.update("jax_enable_compilation_cache", False)
# Also where a plugin imported JAX before this file set the variable.
_TRUE = ("1", "true", "yes", "y", "t", "on")
jax.config.update(
    "jax_disable_most_optimizations",
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in _TRUE,
)

settings.register_profile("repeatable", derandomize=True, print_blob=True, deadline=None)
settings.register_profile("explore", print_blob=True, deadline=None)
# Loaded before the test modules are imported: their `settings(...)` objects inherit from it.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

PRESETS = ("tiny", "tiny-gdn", "tiny-lightning", "tiny-swa")

jit_prefill = jax.jit(prefill, static_argnames=("cfg", "impl"))
jit_decode = jax.jit(decode_step, static_argnames=("cfg", "impl"))


def greedy_generation(
    params: dict, cfg, prompts: list[list[int]], steps: int, max_len: int
) -> list[list[int]]:
    """Greedy tokens of each prompt (the first included), from the model alone: one padded
    ``prefill`` over every prompt with the token-by-token reference ops, then ``steps`` batched
    ``decode_step``s — no buckets, chunks, slots, pages or codec."""
    lengths = [len(p) for p in prompts]
    tokens = np.zeros((len(prompts), max(lengths)), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    valid = jnp.asarray(lengths, jnp.int32)
    state = init_state(cfg, len(prompts), max_len)
    logits, state = jit_prefill(
        params, cfg, jnp.asarray(tokens), state, impl="reference", valid_len=valid
    )
    token = jnp.argmax(logits[jnp.arange(len(prompts)), valid - 1], axis=-1)
    out = [token]
    for _ in range(steps):
        logits, state = jit_decode(params, cfg, token, state)
        token = jnp.argmax(logits, axis=-1)
        out.append(token)
    return np.stack([np.asarray(t) for t in out], axis=1).tolist()


@functools.cache
def preset(name: str):
    """``(cfg, params)`` of a preset with seed-0 weights, built once per session (and drawn
    once per suite: the session's seeded-weights cache, `child_cache_home`)."""
    cfg = load_model_config(name)
    return cfg, seeded_params(cfg, 0)


@pytest.fixture(params=PRESETS)
def model(request):
    return preset(request.param)


@pytest.fixture(scope="session", autouse=True)
def child_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's cache home; child processes compile through the XLA cache beneath it.

    JAX reads its ``JAX_*`` variables when it is imported, so setting them here reaches only the
    processes started from now on. A cluster whose config says ``[engine] compile_cache = true``
    passes its workers ``$XDG_CACHE_HOME/prfaas_jax/xla`` instead: a test that starts one in a
    subprocess (`prfaas serve`, `prfaas demo`) gives it ``XDG_CACHE_HOME`` = this home, one that
    starts it in process passes ``compile_cache=os.environ["JAX_COMPILATION_CACHE_DIR"]``; both
    land in the same directory.
    """
    # Under pytest-xdist every worker has its own base temp; their common parent holds one
    # cache home for the whole run, so a program compiled by one worker's children is loaded
    # by the others' (an entry read while half written is an error JAX recovers from by
    # compiling, as it does for the workers of one cluster sharing the cache).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        home = tmp_path_factory.getbasetemp().parent / "cache-home"
        home.mkdir(exist_ok=True)
    else:
        home = tmp_path_factory.mktemp("cache-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(home))
        compile_cache = default_compile_cache_dir()  # where the workers look under this home
    # This process compiles through the same cache: a program another worker (or this one,
    # before ``release_compiled_programs``) compiled is loaded instead of compiled again.
    jax.config.update("jax_compilation_cache_dir", str(compile_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()  # JAX decided "no cache" at the first compile, if one ran
    # Seeded weights too: the first process to draw a preset stores it, the rest read it (and
    # so do the workers started with a compile cache: they look under the same home).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(home))
        use_weights_cache(default_weights_cache_dir())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_COMPILATION_CACHE_DIR", str(compile_cache))
        # Every program counts: the test programs are small but many processes compile them.
        patch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        patch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        yield home


def pytest_report_header() -> str:
    """The compiler settings this run's processes use (a run with the compiler users get says
    so: tests/test_default_compiler.py reads this line)."""
    reduced = jax.config.read("jax_disable_most_optimizations")
    return (
        f"compiler: jax_disable_most_optimizations={reduced}, XLA_FLAGS={os.environ['XLA_FLAGS']}"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test run first, each file's tests still together and in order: under
    pytest-xdist (`-n`, pyproject's addopts) the long files start at once and the short ones fill
    the gaps, instead of one long file running alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # a stable sort keeps the rest


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collector set as the package's processes set it (engine/tracing_gc.py), once the
    test modules are imported: by then a full collection walks JAX, Flax, torch, transformers
    and every test module, and tracing a full-size config started one every few milliseconds
    (a third of test_kvsize.py's CPU time). `release_compiled_programs` still collects in full."""
    collect_for_tracing()


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return sum(1 for _ in maps)


MAX_MAPPINGS = 20_000  # a third of Linux's default vm.max_map_count


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs() -> Iterator[None]:
    yield
    if os.path.exists("/proc/self/maps") and _mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()
