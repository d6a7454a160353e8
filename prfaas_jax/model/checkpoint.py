"""Orbax checkpoints of a model: ``save_checkpoint``, ``load_checkpoint``, ``is_checkpoint``, and
``config_to_toml``.

A checkpoint is a directory::

    DIR/config.toml    the ModelConfig, in the preset format (load_model_config(DIR) reads it)
    DIR/params/        the parameter pytree, written by orbax's StandardCheckpointer

Restoring targets ``param_specs(cfg)``, so the loaded parameters have exactly the structure,
shapes and dtypes of ``init_params(cfg)``; a checkpoint that does not fit its config fails with
``CheckpointError``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.errors import CheckpointError
from prfaas_jax.model.hybrid import Params, param_specs

CONFIG_FILE = "config.toml"
PARAMS_DIR = "params"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def _runs(kinds: list[str]) -> list[str]:
    """``["kda", "kda", "mla"]`` → ``["kda*2", "mla"]`` (the preset shorthand)."""
    out: list[list] = []
    for kind in kinds:
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    return [kind if count == 1 else f"{kind}*{count}" for kind, count in out]


def config_to_toml(cfg: ModelConfig) -> str:
    """The config in the preset TOML format; ``load_model_config`` reads back an equal config."""
    raw = cfg.to_dict()
    raw["layers"] = _runs(raw["layers"])
    raw["mlps"] = _runs(raw["mlps"])
    lines = []
    tables = []
    for key, value in raw.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, table in tables:
        lines += ["", f"[{key}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def is_checkpoint(directory: str | os.PathLike[str]) -> bool:
    path = Path(directory)
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def save_checkpoint(
    directory: str | os.PathLike[str], cfg: ModelConfig, params: Params, *, overwrite: bool = False
) -> Path:
    """Write ``DIR/config.toml`` and ``DIR/params/``; returns the directory."""
    path = Path(directory).resolve()
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory")
    if (path / PARAMS_DIR).exists() or (path / CONFIG_FILE).exists():
        if not overwrite:
            raise CheckpointError(f"{path} already holds a checkpoint (pass --force to replace it)")
        shutil.rmtree(path / PARAMS_DIR, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    # The config goes last: a directory with config.toml is a complete checkpoint.
    (path / CONFIG_FILE).write_text(config_to_toml(cfg))
    return path


def load_checkpoint(directory: str | os.PathLike[str]) -> tuple[ModelConfig, Params]:
    """Read a checkpoint written by ``save_checkpoint`` (e.g. by ``prfaas convert-hf``)."""
    path = Path(directory).resolve()
    if not is_checkpoint(path):
        raise CheckpointError(
            f"{directory} is not a checkpoint (expected {CONFIG_FILE} and {PARAMS_DIR}/ in it; "
            "`prfaas convert-hf` writes one)"
        )
    cfg = load_model_config(path)
    # Every leaf whole on this process's first device: in a multi-process job each process reads
    # the full tree (Orbax otherwise asks for the saving run's topology).
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), param_specs(cfg)
    )
    try:
        params = ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)
    except (ValueError, KeyError, TypeError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"cannot restore {path / PARAMS_DIR}: {first_line}") from None
    # Orbax hands back lists where the target had tuples, and arrays committed to a device:
    # rebuild the target's exact pytree of uncommitted arrays, like init_params' and load_hf's,
    # so one compiled prefill/decode serves weights from any source.
    leaves = [jnp.asarray(np.asarray(leaf)) for leaf in jax.tree.leaves(params)]
    return cfg, jax.tree.unflatten(jax.tree.structure(target), leaves)
