"""Every Pallas kernel lowers for TPU (Mosaic) and GPU (Triton) on a machine with neither.

Lowering runs every rule the backend's Pallas lowering has — Mosaic's block tiling, SMEM scalars,
the primitives each compiler takes — so a kernel that breaks one fails here, in CI, and not first
on an accelerator; only the compilers' own passes (Triton to PTX, Mosaic to TPU code: register and
VMEM budgets) need the device. Each kernel runs at its default block sizes, as ``impl="pallas"``
calls it, for every layout of ``kernel_layouts`` (every shipped preset's heads and head dims,
K, V in {64, 128, 256}, batch 2, lengths off the chunk and block grid), on three abstract devices:
a TPU v5e and a v6e (``jax.sharding.use_abstract_mesh``: the kernels tile for the platform of
the abstract device, see ``ops/pallas_backend.py``) and a CUDA GPU. The lowered module must hold
the kernel as the backend's custom call (``tpu_custom_call`` / ``__gpu$xla.gpu.triton``) under the
kernel's name: lowering the interpreter instead would hold neither.
"""

import re

import jax
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, use_abstract_mesh

from prfaas_jax.ops.attention import MlaDecodeBlockSizes, mla_decode_pallas
from prfaas_jax.ops.pallas_backend import Backend, forced_tiling, target_backend

from .kernel_layouts import KERNELS, call, layouts

# name: (platform, device kind, custom-call target)
DEVICES = {
    "tpu-v5e": ("tpu", "TPU v5 lite", "tpu_custom_call"),
    "tpu-v6e": ("tpu", "TPU v6 lite", "tpu_custom_call"),
    "cuda": ("cuda", "NVIDIA H200", "__gpu$xla.gpu.triton"),
}
KERNEL_NAMES = {
    "kda": "delta_rule_chunk",
    "gdn": "delta_rule_chunk",
    "lightning": "lightning_chunk",
    "flash": "flash_attention",
    "mla-decode": "mla_decode",
}
LAYOUTS = layouts()
CASES = [(kernel, layout) for kernel in KERNELS for layout in LAYOUTS[kernel]]


def _mesh(device: str) -> AbstractMesh:
    platform, kind, _ = DEVICES[device]
    abstract = AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    return AbstractMesh((1,), ("x",), abstract_device=abstract)


def _lower(device: str, fn, args) -> str:
    with use_abstract_mesh(_mesh(device)):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(DEVICES[device][0],))
    return lowered.as_text()


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize(
    ("kernel", "layout"), CASES, ids=[f"{kernel}-{layout.name}" for kernel, layout in CASES]
)
def test_kernel_lowers_at_default_block_sizes(kernel, layout, device):
    text = _lower(device, *call(kernel, layout))
    target, name = DEVICES[device][2], KERNEL_NAMES[kernel]
    calls = [line for line in text.splitlines() if f"custom_call @{target}(" in line]
    assert calls and all(re.search(rf'name = "{name}"', line) for line in calls)


def test_every_preset_is_in_the_matrix():
    """The layouts come from the presets: at least one per kernel family the presets use."""
    names = {layout.name for entries in LAYOUTS.values() for layout in entries}
    assert {"kimi-linear-48b", "qwen3-next-80b", "ring-2.5-1t", "deepseek-v3"} <= names
    assert {"mimo-v2-flash-swa", "tiny-gdn", "tiny-lightning", "tiny-swa-gqa"} <= names


def test_tiling_follows_the_target():
    """The abstract device's platform picks the tiling; ``forced_tiling`` overrides it; the CPU
    interpreter tiles as Triton does."""
    assert target_backend() is Backend.GPU
    with use_abstract_mesh(_mesh("tpu-v6e")):
        assert target_backend() is Backend.TPU
    with forced_tiling("tpu"):
        assert target_backend() is Backend.TPU
        with use_abstract_mesh(_mesh("cuda")):
            assert target_backend() is Backend.TPU
    assert target_backend() is Backend.GPU


def test_block_size_that_breaks_mosaic_is_named():
    """A non-default block that Mosaic cannot tile (32 slots: not a lane tile, not the whole
    cache) is refused with the block's name before Pallas lowers; Triton takes it."""
    _, args = call("mla-decode", LAYOUTS["mla-decode"][0])  # 300 slots in 2 splits of 160
    blocks = MlaDecodeBlockSizes(block_k=32, num_splits=2)

    def split(*a):
        kw = {"q_pos": a[6], "kv_pos": a[7], "scale": 0.1, "interpret": False}
        return mla_decode_pallas(*a[:6], **kw, block_sizes=blocks)

    assert "triton" in _lower("cuda", split, args)
    with pytest.raises(ValueError, match="block_k = 32 breaks Mosaic"):
        _lower("tpu-v5e", split, args)
