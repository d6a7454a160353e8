"""Hugging Face checkpoint import: ``load_hf(dir) -> (ModelConfig, Params)``, ``hf_config`` and
``convert_hf`` (HF directory → orbax checkpoint, ``prfaas convert-hf``).

A checkpoint directory holds ``config.json`` and safetensors weights (one file or shards with an
index) in the hub layout that ``save_pretrained`` writes. ``model_type`` picks the family module
(``model/hf/<family>.py``), which maps the config onto a ``ModelConfig`` and the tensors onto this
package's parameter layout, following that checkpoint's own conventions (docs/hf-import.md).
The result is checked leaf by leaf against ``init_params``'s structure, shapes and dtypes, so an
imported model is interchangeable with a randomly initialised one: same jitted functions, same
state, same orbax layout. Every problem with the checkpoint raises ``CheckpointError``. The
checkpoint's context length (``max_position_embeddings``) is the positional range its weights
were trained for: the config's ``max_len`` with ``max_len_fixed``, which no run may lift.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import CheckpointError, ConfigError
from prfaas_jax.model import checkpoint
from prfaas_jax.model.hf import (
    bailing_hybrid,
    kimi_linear,
    mimo_v2_flash,
    minimax,
    qwen3_next,
)
from prfaas_jax.model.hf.reader import HfConfig, TensorReader, read_hf_config
from prfaas_jax.model.hybrid import Params, param_specs

_FAMILIES: dict[str, ModuleType] = {
    module.FAMILY: module
    for module in (kimi_linear, minimax, qwen3_next, mimo_v2_flash, bailing_hybrid)
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def _family(hf: HfConfig) -> ModuleType:
    module = _FAMILIES.get(hf.model_type)
    if module is None:
        raise CheckpointError(
            f"{hf.source}: model_type {hf.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    return module


def _config(hf: HfConfig, directory: Path, name: str | None) -> ModelConfig:
    try:
        cfg = _family(hf).config_from_hf(hf, name or directory.resolve().name)
        return dataclasses.replace(cfg, max_len_fixed=True)
    except ConfigError as err:
        raise CheckpointError(f"{hf.source}: {err}") from None


def hf_config(directory: str | os.PathLike[str], *, name: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory, without reading its weights."""
    return _config(read_hf_config(directory), Path(directory), name)


def _finalise(arrays: dict, cfg: ModelConfig, family: str) -> Params:
    """Cast the converted arrays to the dtypes ``init_params`` uses, checking the structure."""
    spec = param_specs(cfg)
    if jax.tree.structure(arrays) != jax.tree.structure(spec):
        raise AssertionError(f"the {family} importer does not produce init_params' structure")

    def cast(array, leaf):
        if array.shape != leaf.shape:
            raise AssertionError(f"{family} importer: shape {array.shape} != {leaf.shape}")
        return jnp.asarray(array, leaf.dtype)

    return jax.tree.map(cast, arrays, spec)


def load_hf(
    directory: str | os.PathLike[str], *, name: str | None = None
) -> tuple[ModelConfig, Params]:
    """Read ``config.json`` and the safetensors weights of ``directory``."""
    hf = read_hf_config(directory)
    cfg = _config(hf, Path(directory), name)
    module = _family(hf)
    reader = TensorReader(directory)
    arrays = module.convert(reader, cfg, hf)
    ignored = (*module.IGNORED, *(("lm_head\\.weight",) if cfg.tie_embeddings else ()))
    reader.finish(ignored)
    return cfg, _finalise(arrays, cfg, module.FAMILY)


# What a checkpoint's tokenizer and chat template need (engine/tokenizer.py reads them); they go
# with the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def convert_hf(
    directory: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False
) -> dict:
    """Import ``directory`` and save it as an orbax checkpoint in ``out``, with the tokenizer
    files it has (`TOKENIZER_FILES`); a JSON-able summary."""
    hf = read_hf_config(directory)
    cfg, params = load_hf(directory)
    path = checkpoint.save_checkpoint(out, cfg, params, overwrite=overwrite)
    tokenizer = [name for name in TOKENIZER_FILES if (Path(directory) / name).is_file()]
    for name in tokenizer:
        shutil.copyfile(Path(directory) / name, path / name)
    leaves = jax.tree.leaves(params)
    return {
        "source": str(Path(directory).resolve()),
        "model_type": hf.model_type,
        "name": cfg.name,
        "layers": [str(kind) for kind in cfg.layers],
        "num_params": sum(int(leaf.size) for leaf in leaves),
        "param_bytes": sum(int(leaf.nbytes) for leaf in leaves),
        "dtype": cfg.dtype,
        "checkpoint": str(path),
        "config": str(path / checkpoint.CONFIG_FILE),
        "tokenizer": tokenizer,
    }
