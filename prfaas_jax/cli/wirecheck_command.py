"""`prfaas wirecheck`: what each wire precision costs a model (engine/wirecheck.py)."""

from __future__ import annotations

import argparse

from prfaas_jax.cli.flags import add_json_flag, print_json
from prfaas_jax.cli.progress import progress
from prfaas_jax.errors import UserError
from prfaas_jax.wire_precision import WirePrecision

DEFAULT_SETTINGS = ("native", "bf16", "fp8_e4m3", "int8", "state=bf16", "state=int8")


def add_wirecheck(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "wirecheck",
        help="bytes, next-token agreement, KL and recall of a model's state sent in each wire "
        "precision",
        description="Prefill prompts once, send each state through the codec in every wire "
        "precision (docs/wire-format.md), and compare the shipped state with the exact one: "
        "payload bytes, the share of greedy tokens kept and the mean KL of the next-token "
        "distributions over --new-tokens steps of the exact continuation, the state's relative "
        "error, and — for a checkpoint trained on retrieval (`prfaas train --task retrieval`) — "
        "the share of its questions answered right from the shipped state.",
        epilog="example: prfaas wirecheck --model tiny,recall-tiny --settings native bf16 int8 "
        "state=int8,kv=bf16",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="preset, model TOML or checkpoint directory; several, comma-separated, share one "
        "table (default: tiny)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of random weights")
    p.add_argument(
        "--settings",
        nargs="+",
        default=list(DEFAULT_SETTINGS),
        metavar="PRECISION",
        help="precisions to compare: native, bf16, fp8_e4m3, int8, or per kind as "
        f"state=int8,kv=bf16 (default: {' '.join(DEFAULT_SETTINGS)})",
    )
    p.add_argument("--prompts", type=int, default=32, help="prompts to average over (default: 32)")
    p.add_argument(
        "--prompt-len",
        type=int,
        help="tokens per prompt (default: a retrieval checkpoint's longest question, else 64)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=8,
        help="tokens of the exact continuation to compare over; the first (from prefill) is "
        "not scored (default: 8)",
    )
    add_json_flag(p)
    p.set_defaults(run=_run_wirecheck)


def _settings(texts: list[str]) -> list[WirePrecision]:
    settings = []
    for text in texts:
        try:
            settings.append(WirePrecision.parse(text))
        except ValueError as err:
            raise UserError(f"--settings: {err}") from None
    return settings


def _run_wirecheck(args: argparse.Namespace) -> int:
    settings = _settings(args.settings)
    if args.prompts < 1:
        raise UserError(f"--prompts must be ≥ 1, got {args.prompts}")
    if args.new_tokens < 2:
        raise UserError(
            f"--new-tokens must be ≥ 2 (the first comes from prefill), got {args.new_tokens}"
        )
    from prfaas_jax.tables import table

    models = [name for name in args.model.split(",") if name]
    if not models:
        raise UserError("--model names no model")
    results = [_check_model(name, settings, args) for name in models]
    if args.json:
        print_json({"models": results})
        return 0
    recall = any(result["recall_task"] for result in results)
    headers = ["model", "precision", "payload B", "÷ exact", "argmax kept", "mean KL nats"]
    headers += ["state error", "worst tensor"] + (["recall"] if recall else [])
    cells = []
    for result in results:
        for row in result["rows"]:
            cells.append(
                [
                    result["model"],
                    row["setting"],
                    f"{row['payload_bytes']:,}",
                    f"{row['ratio']:.3f}",
                    f"{row['agreement']:.1%}",
                    f"{row['mean_kl']:.2e}",
                    f"{row['state_error']:.2e}",
                    f"{row['max_tensor_error']:.2e}",
                    *([_percent(row["recall"])] if recall else []),
                ]
            )
    described = "; ".join(
        f"{r['model']}: {r['prompts']} prompts of {r['prompt_len']} tokens" for r in results
    )
    print(f"prfaas wirecheck: {described}; {args.new_tokens - 1} scored steps each")
    print(table(cells, headers=headers))
    print(
        "argmax kept: steps whose greedy token is the exact state's; KL(exact ‖ shipped) per "
        "step; state error: ‖shipped − exact‖ / ‖exact‖"
        + ("; recall: questions answered right from the shipped state" if recall else "")
    )
    return 0


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _check_model(
    name: str, settings: list[WirePrecision], args: argparse.Namespace
) -> dict[str, object]:
    """One model's prompts (a retrieval checkpoint's questions, else random tokens) through
    every setting."""
    import jax
    import numpy as np

    from prfaas_jax.engine.wirecheck import wire_check
    from prfaas_jax.model.weights import load_model
    from prfaas_jax.serving.loadgen.demo import recall_task
    from prfaas_jax.train.tasks import recall_prompt, recall_prompt_lengths

    cfg, params = load_model(name, seed=args.seed)
    task = recall_task(name)
    answers = None
    if task is not None:
        _, high = recall_prompt_lengths(task)
        length = high if args.prompt_len is None else args.prompt_len
        key = jax.random.PRNGKey(args.seed)
        asked = [
            recall_prompt(jax.random.fold_in(key, i), task, length) for i in range(args.prompts)
        ]
        prompts, answers = [p for p, _ in asked], [a for _, a in asked]
    else:
        length = 64 if args.prompt_len is None else args.prompt_len
        if length < 1:
            raise UserError(f"--prompt-len must be ≥ 1, got {length}")
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, cfg.vocab_size, length).tolist() for _ in range(args.prompts)]
    if length + args.new_tokens > cfg.max_len:
        raise UserError(
            f"--prompt-len {length} + --new-tokens {args.new_tokens} exceed {cfg.name}'s max_len "
            f"{cfg.max_len}"
        )
    with progress(
        f"wirecheck {cfg.name}", total=len(prompts), unit="prompts", quiet=args.json
    ) as shown:
        rows = wire_check(
            cfg,
            params,
            prompts,
            settings,
            new_tokens=args.new_tokens,
            answers=answers,
            progress=lambda _: shown.update(advance=1),
        )
    return {
        "model": cfg.name,
        "prompts": len(prompts),
        "prompt_len": length,
        "new_tokens": args.new_tokens,
        "recall_task": task is not None,
        "rows": [row.to_json() for row in rows],
    }
