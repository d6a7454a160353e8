"""`prfaas train`: train a hybrid layout on a synthetic recall task (`add_train`).

The flow (train/loop.py) is jitted end to end and deterministic from ``--seed``; with ``--out`` the
run checkpoints every ``--checkpoint-every`` steps and resumes from its latest checkpoint when
started again with the same flags, and the trained model is written as a model checkpoint that
`prfaas generate/prefill/decode/serve/demo` load (``--model DIR``). Progress — loss, batch
accuracy, held-out accuracy, tokens/s — goes to stderr (cli/progress.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from prfaas_jax.cli.flags import (
    add_compile_cache_flag,
    add_json_flag,
    print_json,
    use_compile_cache,
)
from prfaas_jax.cli.progress import progress
from prfaas_jax.errors import UserError


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model layout on a synthetic recall task (MQAR or long-context retrieval)",
        description="Train a hybrid layout with optax AdamW (warm-up + cosine, global-norm "
        "clipping) on multi-query associative recall (mqar) or long-context retrieval (retrieval), "
        "evaluating on held-out examples. The model is the one the engines serve: its prefill "
        "with the chunk ops. With --out the run checkpoints, resumes, and ends as a model "
        "checkpoint that generate, prefill, decode, serve and demo load.",
        epilog="example: prfaas train --model tiny --task mqar --vocab-size 256 --seq-len 64 "
        "--num-pairs 4 --steps 1000 --out runs/mqar",
    )
    p.add_argument("--model", default="tiny", help="preset name or model TOML (default: tiny)")
    p.add_argument("--task", default="mqar", choices=["mqar", "retrieval"], help="(default: mqar)")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="task vocabulary; the model's embedding is resized to it (default: the model's)",
    )
    p.add_argument("--seq-len", type=int, default=64, help="tokens per example (default: 64)")
    p.add_argument("--num-pairs", type=int, default=4, help="key-value pairs (default: 4)")
    p.add_argument(
        "--num-queries", type=int, default=2, help="retrieval: questions per example (default: 2)"
    )
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: 1000)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per step (default: 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up (default: 50)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (default: 0.1)")
    p.add_argument("--seed", type=int, default=0, help="weights, data and evaluation (default: 0)")
    p.add_argument(
        "--eval-every", type=int, default=100, help="steps between evaluations (default: 100)"
    )
    p.add_argument(
        "--eval-examples", type=int, default=512, help="held-out examples (default: 512)"
    )
    p.add_argument(
        "--init-from",
        metavar="CHECKPOINT",
        help="start from this model checkpoint (an earlier run's --out) instead of random weights",
    )
    p.add_argument("--out", metavar="DIR", help="checkpoint here, resume from here")
    p.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between checkpoints (default: 100)"
    )
    p.add_argument(
        "--impl",
        choices=["chunk", "reference", "pallas"],
        help="op implementation: reference (token scans; the default on a CPU, where they are "
        "faster) or chunk (the default on an accelerator); pallas is refused (its kernels have "
        "no backward pass)",
    )
    p.add_argument("--plot", metavar="PNG", help="save loss and accuracy curves (needs matplotlib)")
    add_compile_cache_flag(p)
    add_json_flag(p, help="print a JSON summary (eval_accuracy, steps, tokens_per_s, seconds)")
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    import dataclasses

    from prfaas_jax.config import load_model_config
    from prfaas_jax.model.checkpoint import is_checkpoint
    from prfaas_jax.train.checkpoints import RunDir
    from prfaas_jax.train.loop import StepReport, TrainConfig, Trainer, initial_state
    from prfaas_jax.train.report import draw_curves, format_summary, summary
    from prfaas_jax.train.tasks import TaskSpec

    use_compile_cache(args)
    cfg = load_model_config(args.model)
    vocab = cfg.vocab_size if args.vocab_size is None else args.vocab_size
    spec = TaskSpec(
        task=args.task,
        vocab_size=vocab,
        seq_len=args.seq_len,
        num_pairs=args.num_pairs,
        num_queries=args.num_queries,
    )
    if vocab != cfg.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        seed=args.seed,
        eval_examples=args.eval_examples,
        eval_every=args.eval_every,
        impl=args.impl,
        init_from=None if args.init_from is None else str(Path(args.init_from).resolve()),
    )
    if config.init_from is not None and not is_checkpoint(config.init_from):
        raise UserError(f"--init-from {args.init_from}: not a model checkpoint (no config.toml)")
    if args.checkpoint_every < 1:
        raise UserError("--checkpoint-every must be at least 1")
    run_dir = RunDir(args.out, cfg, spec, config) if args.out else None
    state = run_dir.resume() if run_dir else None
    resumed_from = 0 if state is None else state.step
    if state is None:
        state = initial_state(cfg, config)
    trainer = Trainer(cfg, spec, config)
    tokens_per_step = config.batch_size * spec.seq_len
    start = time.perf_counter()
    timed: list[float] = []
    best_eval: list[float] = []

    with progress(
        f"training {cfg.name} on {spec.task.value}",
        total=config.steps,
        unit="steps",
        quiet=args.json,
    ) as bar:
        bar.update(completed=state.step)
        last = [time.perf_counter()]

        def on_step(report: StepReport) -> None:
            now = time.perf_counter()
            if report.step > resumed_from + 1:  # the first step of a process compiles
                timed.append(now - last[0])
            last[0] = now
            if report.eval_accuracy is not None:
                best_eval.append(report.eval_accuracy)
            held_out = f" held-out {100 * best_eval[-1]:.1f}%" if best_eval else ""
            bar.update(
                completed=report.step,
                description=f"loss {report.loss:.3f} acc {100 * report.accuracy:.0f}%{held_out} "
                f"{report.tokens_per_s:,.0f} tok/s",
            )

        state = trainer.run(
            state,
            on_step=on_step,
            on_checkpoint=run_dir.save_state if run_dir else None,
            checkpoint_every=args.checkpoint_every,
        )
    seconds = time.perf_counter() - start
    rate = tokens_per_step * len(timed) / sum(timed) if timed else 0.0
    payload = summary(
        cfg,
        spec,
        config,
        trainer.history,
        seconds=seconds,
        tokens_per_s=rate,
        resumed_from=resumed_from,
        out=str(run_dir.path) if run_dir else None,
    )
    if run_dir:
        run_dir.export(state, payload)
    if args.plot:
        if not trainer.history:
            raise UserError("--plot: this run had no steps left to plot (it was already complete)")
        draw_curves(trainer.history, args.plot)
    if args.json:
        print_json(payload)
    else:
        print(format_summary(payload))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
