"""A training run on disk: ``RunDir`` — resumable orbax states, the exported model, the run record.

Layout of ``--out DIR``::

    DIR/config.toml, DIR/params/   the trained model, a model checkpoint (model/checkpoint.py)
                                   that `prfaas generate/prefill/decode/serve/demo` load
    DIR/run.json                   the task, the training flags and the results (``RunRecord``)
    DIR/state/<step>/              orbax checkpoints of params + optimizer state (the last two)

A run that finds ``DIR/state`` resumes from its latest step, provided the model, task and
training flags in ``run.json`` are the ones it was started with (anything else is a user error:
the resumed run would not be the run it claims to continue).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.model.checkpoint import config_to_toml, save_checkpoint
from prfaas_jax.train.loop import TrainConfig, TrainState, initial_state
from prfaas_jax.train.tasks import TaskSpec

RUN_FILE = "run.json"
STATE_DIR = "state"


def _flags(spec: TaskSpec, config: TrainConfig) -> dict:
    return {
        "task": {k: str(v) if k == "task" else v for k, v in dataclasses.asdict(spec).items()},
        "train": {k: str(v) if k == "impl" else v for k, v in dataclasses.asdict(config).items()},
    }


class RunDir:
    """The output directory of one training run (see the module docstring)."""

    def __init__(self, path: str | Path, cfg: ModelConfig, spec: TaskSpec, config: TrainConfig):
        self.path = Path(path).resolve()
        self.cfg, self.spec, self.config = cfg, spec, config
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"--out {path} exists and is not a directory")
        self._manager: ocp.CheckpointManager | None = None

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
            self._manager = ocp.CheckpointManager(self.path / STATE_DIR, options=options)
        return self._manager

    def _identity(self) -> dict:
        return {"model": config_to_toml(self.cfg), **_flags(self.spec, self.config)}

    def resume(self) -> TrainState | None:
        """The latest saved state of this run, or None for a fresh start."""
        run_file = self.path / RUN_FILE
        if not (self.path / STATE_DIR).is_dir() or not run_file.is_file():
            return None
        try:
            stored = json.loads(run_file.read_text())
        except ValueError as err:
            raise UserError(f"{run_file} is not valid JSON: {err}") from None
        mine = self._identity()
        for part in ("model", "task", "train"):
            if stored.get(part) != mine[part]:
                raise UserError(
                    f"{self.path} holds a run with another {part} configuration"
                    f"{_differences(stored.get(part), mine[part])}; resume it with the flags it "
                    "was started with, or pass a new --out"
                )
        step = self.manager.latest_step()
        if step is None:
            return None

        def fresh() -> dict:
            state = initial_state(self.cfg, dataclasses.replace(self.config, init_from=None))
            return {"params": state.params, "opt_state": state.opt_state}

        abstract = jax.eval_shape(fresh)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        # Orbax hands back arrays committed to a device; uncommitted ones, like a fresh run's, keep
        # the compiled train step's cache key (committed inputs would compile it again).
        restored = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), restored)
        return TrainState(params=restored["params"], opt_state=restored["opt_state"], step=step)

    def save_state(self, state: TrainState) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        record = self.path / RUN_FILE
        if not record.exists():
            record.write_text(json.dumps(self._identity(), indent=2) + "\n")
        pytree = {"params": state.params, "opt_state": state.opt_state}
        self.manager.save(state.step, args=ocp.args.StandardSave(pytree), force=True)
        self.manager.wait_until_finished()

    def export(self, state: TrainState, results: dict) -> Path:
        """Write the trained model (config.toml + params/) and the results into run.json."""
        save_checkpoint(self.path, self.cfg, state.params, overwrite=True)
        (self.path / RUN_FILE).write_text(
            json.dumps({**self._identity(), "results": results}, indent=2) + "\n"
        )
        return self.path


def _differences(stored: object, mine: object) -> str:
    """`` (lr: 0.003 there, 0.001 here)`` for the fields two configurations differ in."""
    if not (isinstance(stored, dict) and isinstance(mine, dict)):
        return ""
    fields = sorted(k for k in stored.keys() | mine.keys() if stored.get(k) != mine.get(k))
    return " (" + "; ".join(f"{k}: {stored.get(k)} there, {mine.get(k)} here" for k in fields) + ")"
