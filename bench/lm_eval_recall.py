"""The recall task through `lm-eval` (`lm_eval --model local-completions`) against `prfaas serve`,
once per wire precision, beside the same task scored in one process.

The task ships in ``bench/lm_eval/recall/``: held-out retrieval prompts of the task
``recall-tiny`` was trained on (train/tasks.py ``recall_prompt``; its ``run.json``), written by
``--write-task``. Each prompt ends with an asked key; its answer is that key's two-token value.
Three lm-eval tasks read them:

- ``recall_mc`` (multiple choice, log-likelihood): the four values of the prompt's facts, the
  asked one correct: accuracy;
- ``recall_ll`` (log-likelihood of the answer): its perplexity (mean log-likelihood =
  −ln perplexity) and whether it is the greedy continuation;
- ``recall_gen`` (generation, 2 tokens): exact match of the generated text with the answer — the
  value's two units as the served tokenizer writes them (recall-tiny's printable one,
  engine/unit_tokenizer.py: ``⟨v203⟩⟨v150⟩``) — on the prompts whose answer bytes are one UTF-8
  character (the set chosen when the front door's text was byte-level; kept, so the runs
  compare).

Token ids reach lm-eval as text through the tokenizer shipped beside the task
(``tokenizer/``, a Hugging Face ``tokenizer.json``): id i is the character U+0100 + i, so every
prompt is printable text and lm-eval sends the exact ids (``tokenized_requests``). The
log-likelihood tasks read the prompt's log-probabilities (``echo`` + ``logprobs``), which the
prefill worker computes before any state crosses the link, so they cannot depend on the wire
precision; the generated answer's second token is decoded after the state crossed it.

The cluster is ``configs/clusters/toy.toml`` with every request routed to PrfaaS (threshold 16,
controller off), so each generation's state crosses the inter-cluster link in the precision
under test; beside lm-eval's metrics, the mean log-probability of each generation's second token
as the decode worker scores it (``logprobs``), the finest view of what the link changed. The
same documents are also scored with the engines in this process (`PrefillEngine.score`,
`generate`): the numbers a cluster with an exact link must equal.

    python bench/lm_eval_recall.py [--precisions native,bf16,fp8_e4m3,int8] [--json]
    python bench/lm_eval_recall.py --write-task     # regenerate the task's JSONL files

Needs the ``eval`` extra (``pip install -e .[eval]``: lm-eval).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent / "lm_eval" / "recall"
MODEL = "recall-tiny"
HELD_OUT_SEED = 20260  # not a training key: training draws from fold_in(PRNGKey(0), step)
DOCS = 200  # multiple-choice and log-likelihood documents
GEN_POOL = 1200  # prompts drawn to find the generation documents among
TEXT_BASE = 0x100  # token id i is the character U+0100 + i
TASKS = ("recall_mc", "recall_ll", "recall_gen")


def as_text(ids: list[int]) -> str:
    return "".join(chr(TEXT_BASE + t) for t in ids)


def one_character(pair: tuple[int, int]) -> str | None:
    """The text of two bytes when they are one UTF-8 character (a lead byte, then one more)."""
    try:
        text = bytes(pair).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if len(text) == 1 else None


def served_text(ids: list[int]) -> str:
    """The text the front door answers ``ids`` with: the served model's tokenizer's."""
    from prfaas_jax.config import load_model_config
    from prfaas_jax.engine.tokenizer import load_tokenizer

    return load_tokenizer(MODEL, load_model_config(MODEL).vocab_size).decode(ids)


def documents() -> tuple[list[dict], list[dict]]:
    """The multiple-choice documents and the generation ones (module docstring)."""
    import jax

    from prfaas_jax.serving.loadgen.demo import recall_task
    from prfaas_jax.train.tasks import recall_prompt

    spec = recall_task(MODEL)
    assert spec is not None, f"{MODEL} has no retrieval task"
    key = jax.random.PRNGKey(HELD_OUT_SEED)
    mc, gen = [], []
    for i in range(GEN_POOL):
        prompt, answer = recall_prompt(jax.random.fold_in(key, i), spec)
        facts = [prompt[3 * f : 3 * f + 3] for f in range(spec.num_pairs)]
        gold = next(f for f, fact in enumerate(facts) if fact[0] == prompt[-1])
        assert facts[gold][2] == answer
        pairs = [(v, w) for _, v, w in facts]
        doc = {
            "ids": prompt,
            "context": as_text(prompt),
            "choices": [as_text(list(pair)) for pair in pairs],
            "gold": gold,
            "target": as_text(list(pairs[gold])),
        }
        if len(mc) < DOCS:
            mc.append(doc)
        if one_character(pairs[gold]) is not None:
            answer = served_text(list(pairs[gold]))
            gen.append({"ids": prompt, "context": doc["context"], "answer": answer})
    return mc, gen


def write_task() -> None:
    mc, gen = documents()
    for name, docs in (("recall.jsonl", mc), ("recall_gen.jsonl", gen)):
        lines = [json.dumps(doc, ensure_ascii=False) for doc in docs]
        (TASK_DIR / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(mc)} documents, {len(gen)} for generation, in {TASK_DIR}")


def read_docs(name: str) -> list[dict]:
    text = (TASK_DIR / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line]


def one_process() -> dict[str, float]:
    """The three tasks' metrics with the engines in this process: log-probabilities from one
    prefill over the whole sequence, the answer from a prefill and a one-slot decode."""
    from prfaas_jax.engine.generate import generate
    from prfaas_jax.engine.prefill import PrefillEngine
    from prfaas_jax.engine.sampling_params import GREEDY
    from prfaas_jax.model.weights import load_model

    cfg, params = load_model(MODEL)
    engine = PrefillEngine(cfg, params, buckets=(32, 128), chunk_len=128)

    def continuation(ids: list[int], more: list[int]) -> tuple[float, bool]:
        scored = engine.score(ids + more, top=1)[-len(more) :]
        greedy = all(s.logprob == s.top[0][1] for s in scored)
        return sum(s.logprob for s in scored), greedy

    correct, lls, greedy = 0, [], 0
    for doc in read_docs("recall.jsonl"):
        choices = [[ord(c) - TEXT_BASE for c in choice] for choice in doc["choices"]]
        scores = [continuation(doc["ids"], choice)[0] for choice in choices]
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["gold"]
        ll, is_greedy = continuation(doc["ids"], choices[doc["gold"]])
        lls.append(ll)
        greedy += is_greedy
    gen = read_docs("recall_gen.jsonl")
    matched, second = 0, []
    for doc in gen:
        tokens = generate(params, cfg, doc["ids"], 2, GREEDY)[0]
        matched += served_text(tokens) == doc["answer"]
        second.append(engine.score(doc["ids"] + tokens)[-1].logprob)
    return {
        "recall_mc acc": correct / len(lls),
        "recall_ll mean log-likelihood": sum(lls) / len(lls),
        "recall_ll acc": greedy / len(lls),
        "recall_gen exact_match": matched / len(gen),
        "recall_gen second-token log-prob": sum(second) / len(second),
    }


def cluster_config(precision: str, directory: Path) -> Path:
    """The toy cluster, every request on PrfaaS, its link carrying ``precision``."""
    toy = (Path(__file__).resolve().parents[1] / "configs" / "clusters" / "toy.toml").read_text()
    lines = []
    for line in toy.splitlines():
        lines.append(line)
        if line.startswith("[link]"):
            lines.append(f'precision = "{precision}"')
    text = "\n".join(lines).replace("threshold = 64", "threshold = 16")
    text += "\n[controller]\nenabled = false\n" if "[controller]" not in text else ""
    text = text.replace("[controller]\n", "[controller]\nenabled = false\n", 1)
    path = directory / f"cluster-{precision}.toml"
    path.write_text(text)
    return path


def lm_eval_command(base_url: str, output: Path) -> list[str]:
    """What the README runs: lm-eval's OpenAI-compatible completions model against the door."""
    args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={base_url}/completions",
            "tokenizer=tokenizer",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "num_concurrent=4",
            "max_retries=1",
        ]
    )
    return [
        "lm_eval", "--model", "local-completions", "--tasks", ",".join(TASKS),
        "--include_path", ".", "--model_args", args, "--output_path", str(output),
    ]  # fmt: skip


def through_the_cluster(precision: str, directory: Path) -> dict[str, float]:
    ready = directory / f"ready-{precision}.json"
    serve = subprocess.Popen(
        [sys.executable, "-m", "prfaas_jax.cli", "serve", "--config",
         str(cluster_config(precision, directory)), "--openai-port", "0",
         "--ready-file", str(ready), "--log-dir", str(directory / f"logs-{precision}")],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"prfaas serve did not start ({precision})")
            time.sleep(0.5)
        door = json.loads(ready.read_text())["openai"]
        output = directory / f"results-{precision}"
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        # lm-eval's own log and table go to stderr: stdout is this script's table.
        command = lm_eval_command(door, output)
        subprocess.run(command, cwd=TASK_DIR, env=env, check=True, stdout=sys.stderr)
        second = second_token_logprob(door)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
    (found,) = output.rglob("results_*.json")
    row = metrics(json.loads(found.read_text())["results"])
    return row | {"recall_gen second-token log-prob": second}


def metrics(results: dict) -> dict[str, float]:
    """lm-eval's results as the table's columns."""
    return {
        "recall_mc acc": results["recall_mc"]["acc,none"],
        "recall_ll mean log-likelihood": -math.log(results["recall_ll"]["perplexity,none"]),
        "recall_ll acc": results["recall_ll"]["acc,none"],
        "recall_gen exact_match": results["recall_gen"]["exact_match,none"],
    }


def second_token_logprob(base_url: str) -> float:
    """The mean log-probability of the second generated token of each generation document, as
    the decode worker scores it from the state that crossed the link (``logprobs``; greedy)."""
    total, docs = 0.0, read_docs("recall_gen.jsonl")
    for doc in docs:
        body = {"model": MODEL, "prompt": doc["ids"], "max_tokens": 2, "temperature": 0}
        request = urllib.request.Request(
            f"{base_url}/completions",
            data=json.dumps(body | {"logprobs": 0}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            total += json.load(reply)["choices"][0]["logprobs"]["token_logprobs"][1]
    return total / len(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="native,bf16,fp8_e4m3,int8")
    parser.add_argument("--write-task", action="store_true", help="regenerate the JSONL files")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.write_task:
        write_task()
        return 0
    rows = {"one process": one_process()}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            rows[f"cluster, {precision}"] = through_the_cluster(precision, Path(tmp))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = list(rows["one process"])
    print("| run | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.4f}" for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
