"""Whose rules a Pallas kernel is tiled by: ``Backend``, ``target_backend``, ``forced_tiling``,
``check_tile``, ``scalar_spec`` / ``read_scalar`` and ``compiler_params``.

A kernel is written once, but the compiler that lowers it constrains its blocks, and the two
compilers disagree:

- Triton (GPU): every block dimension a power of two (its loads and ``tl.dot`` require it); the
  launch helpers pad every tile to one.
- Mosaic (TPU): the last two dimensions of every block a multiple of (8, 128) or equal to the
  whole array's; a rank-1 block whole or a multiple of 1024; scalars belong in SMEM.

So each block-size class has one default per backend (``get_default(backend)``), and the wrappers
check the tiles they derive with ``check_tile`` before Pallas does, with a message that names the
block size to change. The backend is decided when the kernel is traced, first of:

1. ``forced_tiling(backend)``: the interpreter on CPU with an accelerator's tiling, so the tiling
   an accelerator will run is the tiling the CPU tests check;
2. the platform of the current abstract mesh's device: cross-lowering on a machine without the
   accelerator (``jax.sharding.use_abstract_mesh`` with an ``AbstractDevice(platform="tpu")``);
3. ``jax.default_backend()``: a TPU is ``TPU``; a GPU, and the CPU interpreter, ``GPU`` (the
   interpreter runs either tiling; Triton's smaller tiles interpret faster).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator

import jax
from jax.experimental import pallas as pl

TPU_SUBLANES, TPU_LANES = 8, 128  # Mosaic's tile of the last two block dims (32-bit data)
_forced: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("tiling", default=None)


class Backend(enum.StrEnum):
    GPU = "gpu"  # Triton
    TPU = "tpu"  # Mosaic


_PLATFORMS = {"tpu": Backend.TPU, "gpu": Backend.GPU, "cuda": Backend.GPU, "rocm": Backend.GPU}


def target_backend() -> Backend:
    """The backend whose rules a kernel traced now must satisfy (see the module docstring)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
    return _PLATFORMS.get(platform, Backend.GPU)


@contextlib.contextmanager
def forced_tiling(backend: Backend | str) -> Iterator[None]:
    """Tile every kernel traced inside for ``backend``, wherever it runs.

    JAX's caches key a traced function on its arguments, not on this setting, so they are
    cleared on the way in and out: nothing traced under one tiling is reused under another.
    """
    token = _forced.set(Backend(backend))
    jax.clear_caches()
    try:
        yield
    finally:
        _forced.reset(token)
        jax.clear_caches()


def check_tile(backend: Backend, name: str, block: int, whole: int, *, lanes: bool) -> None:
    """Mosaic's rule for one of a block's last two dims: a whole multiple of the TPU tile
    (128 lanes for the last dim, 8 sublanes for the one before) or the whole array dim.

    Triton's rule (powers of two) holds by construction: block sizes are powers of two and the
    wrappers pad arrays to them.
    """
    unit = TPU_LANES if lanes else TPU_SUBLANES
    if backend is Backend.TPU and block != whole and block % unit:
        raise ValueError(
            f"{name} = {block} breaks Mosaic's tiling: a multiple of {unit} or the whole {whole}"
        )


def scalar_spec(backend: Backend, axis: int) -> pl.BlockSpec:
    """The spec of a [N] array of which program ``(…, i_axis, …)`` reads entry ``i_axis``.

    Triton gets a 0-d block (one scalar load); Mosaic, which has no rank-0 VMEM blocks, gets the
    whole array in SMEM, indexed by the kernel (``read_scalar``).
    """
    if backend is Backend.TPU:
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((None,), lambda *grid: (grid[axis],))


def read_scalar(ref, axis: int) -> jax.Array:
    """This program's entry of a ``scalar_spec(…, axis)`` input."""
    return ref[()] if ref.ndim == 0 else ref[pl.program_id(axis)]


def compiler_params(backend: Backend, *, interpret: bool, grid_rank: int, **triton: int):
    """Launch parameters: Triton's ``num_warps`` / ``num_stages`` on GPUs, Mosaic's grid
    semantics on TPUs (every grid axis independent: "parallel"), none for the interpreter.

    Passing Triton's parameters also selects the Triton backend: without them JAX lowers GPU
    kernels to Mosaic GPU (``jax_pallas_use_mosaic_gpu`` defaults to True), which these kernels,
    written for whole-tile register arithmetic, do not target.
    """
    if interpret:
        return None
    if backend is Backend.TPU:
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_rank)
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(**triton)
