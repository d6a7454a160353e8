"""Where a model's weights come from: ``load_model`` resolves a preset, an HF checkpoint or an
orbax checkpoint to ``(ModelConfig, Params)``.

* ``hf_dir``: a Hugging Face checkpoint directory, imported (model/hf/importer.py);
* ``checkpoint``, or ``model`` naming a directory that holds ``config.toml`` + ``params/`` (a
  path, or a preset folder ``configs/models/<name>/`` such as the trained ``recall-tiny``): an
  orbax checkpoint (model/checkpoint.py);
* otherwise ``model`` is a preset name or TOML path and the weights are drawn from ``seed``
  (through the seeded-weights cache when a process uses one: model/seeded_weights.py).

``load_config`` is the config alone, for commands that need no weights (``prfaas kv``,
``plan --model``, ``codesign``): a preset, a model TOML, a checkpoint folder, or a Hugging Face
``config.json`` (or a folder holding one), mapped by the family importers of model/hf/.
"""

from __future__ import annotations

from pathlib import Path

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.errors import UserError
from prfaas_jax.model.checkpoint import is_checkpoint, load_checkpoint
from prfaas_jax.model.hf import hf_config, load_hf
from prfaas_jax.model.hybrid import Params
from prfaas_jax.model.seeded_weights import seeded_params
from prfaas_jax.toml_config import resolve


def load_model(
    model: str,
    *,
    seed: int = 0,
    hf_dir: str | None = None,
    checkpoint: str | None = None,
) -> tuple[ModelConfig, Params]:
    """The config and weights named by the arguments (see the module docstring)."""
    if hf_dir is not None and checkpoint is not None:
        raise UserError("give either an HF checkpoint or an orbax checkpoint, not both")
    if hf_dir is not None:
        return load_hf(hf_dir)
    if checkpoint is not None:
        return load_checkpoint(checkpoint)
    found = resolve("models", model)
    if is_checkpoint(found):
        return load_checkpoint(found)
    cfg = load_model_config(found)
    return cfg, seeded_params(cfg, seed)


def load_config(model: str) -> ModelConfig:
    """The config named by ``model``, without weights (module docstring)."""
    path = Path(model)
    if path.name == "config.json" and path.is_file():
        return hf_config(path.parent)
    if path.is_dir() and (path / "config.json").is_file() and not is_checkpoint(path):
        return hf_config(path)
    return load_model_config(model)
