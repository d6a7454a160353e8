"""A small Hugging Face tokenizer written the way a checkpoint ships one: ``tokenizer.json`` (a
byte-level BPE trained here with the `tokenizers` package), ``tokenizer_config.json`` with a
ChatML chat template and the end-of-sequence token, and ``generation_config.json`` with the
end-of-sequence ids. Built in a fraction of a second, without a download."""

from __future__ import annotations

import json
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML as Qwen writes it; a conversation may not open with the assistant.
CHATML = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation may not open with the assistant') }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The key to the blue door is under the third stone of the garden path.",
    "Prefill as a service ships the state of a hybrid model between datacenters.",
    "Naïve café déjà vu — ünïcödé text, 日本語のテキスト, and emoji 🚀✓ too.",
    "def f(x):\n    return x * 2  # code, with indentation\n",
]


def write_hf_tokenizer(directory: Path, vocab_size: int = 320) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "bos_token": None,
        "chat_template": CHATML,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory
