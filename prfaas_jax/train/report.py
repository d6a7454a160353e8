"""What a training run reports: ``summary`` (the ``--json`` payload), ``format_summary`` (the
table) and ``draw_curves`` (``--plot``: loss and accuracy against steps; needs matplotlib)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.tables import key_value
from prfaas_jax.train.loop import StepReport, TrainConfig
from prfaas_jax.train.tasks import TaskSpec


def summary(
    cfg: ModelConfig,
    spec: TaskSpec,
    config: TrainConfig,
    history: list[StepReport],
    *,
    seconds: float,
    tokens_per_s: float,
    resumed_from: int,
    out: str | None,
) -> dict:
    """The run's results; ``eval_accuracy`` is the last evaluation's (None if none ran)."""
    evals = [r for r in history if r.eval_accuracy is not None]
    last = history[-1] if history else None
    return {
        "model": cfg.name,
        "layers": [str(kind) for kind in cfg.layers],
        "task": {k: str(v) for k, v in dataclasses.asdict(spec).items()},
        "steps": config.steps,
        "resumed_from": resumed_from,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "seed": config.seed,
        "final_loss": last.loss if last else None,
        "eval_accuracy": evals[-1].eval_accuracy if evals else None,
        "evals": [{"step": r.step, "accuracy": r.eval_accuracy} for r in evals],
        "tokens_per_s": tokens_per_s,
        "seconds": seconds,
        "out": out,
    }


def format_summary(payload: dict) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f} %"

    task = payload["task"]
    rows = [
        ("model", f"{payload['model']} ({', '.join(payload['layers'])})"),
        (
            "task",
            f"{task['task']}: V={task['vocab_size']}, L={task['seq_len']}, N={task['num_pairs']}",
        ),
        (
            "steps",
            f"{payload['steps']} (resumed from {payload['resumed_from']})"
            if payload["resumed_from"]
            else str(payload["steps"]),
        ),
        (
            "final train loss",
            "-" if payload["final_loss"] is None else f"{payload['final_loss']:.4f}",
        ),
        ("held-out accuracy", pct(payload["eval_accuracy"])),
        ("throughput", f"{payload['tokens_per_s']:,.0f} tokens/s"),
        ("wall time", f"{payload['seconds']:.1f} s"),
    ]
    if payload["out"]:
        rows.append(("checkpoint", payload["out"]))
    return key_value(rows)


def draw_curves(history: list[StepReport], path: str | Path) -> None:
    """Training loss (log scale) and train / held-out accuracy against the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'prfaas_jax[plot]'") from None
    steps = [r.step for r in history]
    evals = [r for r in history if r.eval_accuracy is not None]
    fig = Figure(figsize=(10, 4))
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(steps, [r.loss for r in history], lw=0.8)
    loss_ax.set(xlabel="step", ylabel="train loss", yscale="log", title="loss")
    acc_ax.plot(steps, [r.accuracy for r in history], lw=0.6, alpha=0.6, label="train batch")
    acc_ax.plot([r.step for r in evals], [r.eval_accuracy for r in evals], "o-", label="held-out")
    acc_ax.set(xlabel="step", ylabel="answer accuracy", ylim=(0, 1.02), title="accuracy")
    acc_ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
