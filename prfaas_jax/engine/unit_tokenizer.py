"""The printable tokenizer of the recall models: `unit_text` (one id's text), `unit_tokenizer`
(the `tokenizers` object) and `write_unit_tokenizer` (``tokenizer.json`` and
``tokenizer_config.json`` into a checkpoint folder, as configs/models/recall-tiny/ ships them).

A recall model (train/tasks.py: keys from ``[1, V/2)``, values from ``[V/2, V)``) answers in ids,
not text, and read byte by byte most of its answer is U+FFFD. Here every id is one printable
unit: printable ASCII (32–126), tab and newline stand for themselves — so ASCII text and the
byte-level chat template encode to the same ids as `ByteTokenizer` does — id 0 is ``⟨unk⟩``
(what text outside the vocabulary encodes to; the recall tasks never use it), and every other id
is ``⟨k17⟩`` (below V/2, a key) or ``⟨v203⟩`` (a value). The brackets are U+27E8 / U+27E9, which
no unit of one character is, so a concatenation of units splits back into the same ids: decode
then encode is the identity on every sequence of ids. One token is one unit, so a client that
counts a reply's tokens by encoding its text with this tokenizer (AIPerf given its folder)
counts exactly.

It is the Hugging Face `tokenizers` format — a WordLevel model, a Split pre-tokenizer (a
bracketed unit or one character), the Fuse decoder — with a ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast`` and the byte-level chat template, so ``AutoTokenizer.from_pretrained``
and engine/tokenizer.py's `HFTokenizer` load the folder alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OPEN, CLOSE = "\N{MATHEMATICAL LEFT ANGLE BRACKET}", "\N{MATHEMATICAL RIGHT ANGLE BRACKET}"
UNK = f"{OPEN}unk{CLOSE}"
UNIT_PATTERN = f"{OPEN}[^{OPEN}{CLOSE}]*{CLOSE}|[\\s\\S]"  # a bracketed unit, or one character
PLAIN = frozenset(range(32, 127)) | {9, 10}  # ids that are their own ASCII character
# The byte-level template of engine/tokenizer.py (`byte_chat_text`), in Jinja.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def unit_text(token_id: int, vocab_size: int) -> str:
    """The printable unit of one id (module docstring)."""
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} outside [0, {vocab_size})")
    if token_id in PLAIN:
        return chr(token_id)
    if token_id == 0:
        return UNK
    kind = "k" if token_id < vocab_size // 2 else "v"
    return f"{OPEN}{kind}{token_id}{CLOSE}"


def unit_tokenizer(vocab_size: int) -> Any:
    """The tokenizer of a vocabulary of `vocab_size` ids, as a `tokenizers.Tokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {unit_text(i, vocab_size): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(UNIT_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def tokenizer_config(max_len: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_unit_tokenizer(directory: str | Path, vocab_size: int, max_len: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of `unit_tokenizer` into `directory`."""
    directory = Path(directory)
    unit_tokenizer(vocab_size).save(str(directory / "tokenizer.json"), pretty=True)
    config = json.dumps(tokenizer_config(max_len), indent=2, ensure_ascii=False)
    (directory / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
