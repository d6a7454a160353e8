"""Tokenizers: the byte-level one of the presets and a Hugging Face checkpoint's own.

`ByteTokenizer` (the presets and the models trained here): token ``i`` < 256 is the byte ``i``;
text is UTF-8, and a token ≥ 256 or an invalid byte sequence prints as U+FFFD. It has no
end-of-sequence token, and its chat template writes each message as ``<|role|>\\n`` then its
content and ``\\n``, then ``<|assistant|>\\n`` to open the reply.

`HFTokenizer` (a checkpoint directory with ``tokenizer.json``, as Hugging Face ships one and
`prfaas convert-hf` copies it): the `tokenizers` package encodes and decodes; the chat template
of ``tokenizer_config.json`` (or ``chat_template.jinja``) is rendered as `transformers` renders
it — a sandboxed Jinja environment with ``trim_blocks`` / ``lstrip_blocks``, the special tokens
as variables, ``add_generation_prompt`` — and the rendered text is encoded without adding
special tokens again (the template writes them). End-of-sequence ids: ``eos_token`` of
``tokenizer_config.json`` and ``eos_token_id`` of ``generation_config.json``.

Both stream ids into text (`detokenizer`): each ``push`` returns the text that is final so far,
and all pieces plus ``finish()`` equal ``decode`` of all the ids. `load_tokenizer` picks the one
of a model: the directory's own where it has ``tokenizer.json`` (a preset folder too: the
trained ``recall-tiny`` ships the printable one of engine/unit_tokenizer.py), the byte-level one
otherwise.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from prfaas_jax.errors import UserError
from prfaas_jax.toml_config import config_dir

REPLACEMENT = "\N{REPLACEMENT CHARACTER}"
TOKENIZER_FILE = "tokenizer.json"


class Detokenizer(Protocol):
    def push(self, token_ids: Sequence[int]) -> str: ...
    def finish(self) -> str: ...


class Tokenizer(Protocol):
    vocab_size: int
    eos_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...
    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]: ...
    def detokenizer(self) -> Detokenizer: ...


# --- byte level -------------------------------------------------------------------------------


def byte_chat_text(messages: Sequence[dict[str, str]]) -> str:
    """The byte tokenizer's chat template (module docstring), with the reply opened."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n"


class ByteDetokenizer:
    """Holds back an unfinished UTF-8 sequence until it completes (or ``finish`` replaces it)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        out, run = [], bytearray()
        for t in token_ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            out.append(self._decoder.decode(bytes(run), final=True) + REPLACEMENT)
            self._decoder.reset()
            run.clear()
        out.append(self._decoder.decode(bytes(run)))
        return "".join(out)

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    vocab_size = 256
    eos_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """UTF-8 text of the bytes; a token ≥ 256 (possible when the model's vocabulary is
        larger) and every invalid byte sequence print as U+FFFD."""
        stream = ByteDetokenizer()
        return stream.push(token_ids) + stream.finish()

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(byte_chat_text(messages))

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()


def check_byte_vocab(vocab_size: int) -> None:
    if vocab_size < ByteTokenizer.vocab_size:
        raise UserError(
            f"--prompt needs a vocabulary of at least 256 (byte-level); this model has "
            f"{vocab_size}: pass --prompt-ids instead"
        )


# --- a Hugging Face checkpoint's own ------------------------------------------------------------


def _token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object")
    return data


class HFDetokenizer:
    """`tokenizers`' `DecodeStream` (it holds back ids until their text is final); ``finish``
    adds what a one-shot decode of all the ids has beyond the pieces (an unfinished character)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._sent: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        pieces = []
        for t in token_ids:
            self._ids.append(t)
            piece = self._stream.step(self._tokenizer.backend, t)
            if piece:
                pieces.append(piece)
        text = "".join(pieces)
        self._sent.append(text)
        return text

    def finish(self) -> str:
        whole, sent = self._tokenizer.decode(self._ids), "".join(self._sent)
        return whole[len(sent) :] if whole.startswith(sent) else ""


class HFTokenizer:
    """The tokenizer of a checkpoint directory (module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as Backend

        self.directory = Path(directory)
        path = self.directory / TOKENIZER_FILE
        try:
            self.backend = Backend.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for a bad file
            raise UserError(f"cannot load the tokenizer {path}: {err}") from None
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        config = _read_json(self.directory / "tokenizer_config.json")
        self.special_tokens = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        eos = {self.backend.token_to_id(self.special_tokens.get("eos_token", ""))}
        generation = _read_json(self.directory / "generation_config.json").get("eos_token_id")
        eos.update(generation if isinstance(generation, list) else [generation])
        self.eos_ids = frozenset(t for t in eos if isinstance(t, int))
        self.chat_template = self._chat_template(config)
        self._template = self._compile(self.chat_template)

    def _chat_template(self, config: dict[str, Any]) -> str | None:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = self.directory / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return template if isinstance(template, str) else None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=True)

    def _compile(self, source: str | None) -> Any:
        """The chat template as a sandboxed Jinja template (checked once, at load)."""
        if source is None:
            return None
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(source)
        except jinja2.TemplateError as err:
            raise UserError(f"the chat template in {self.directory} is not valid: {err}") from None

    def chat_text(self, messages: Sequence[dict[str, str]]) -> str:
        import jinja2

        if self._template is None:
            raise UserError(f"the tokenizer in {self.directory} has no chat template")
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=True, **self.special_tokens
            )
        except jinja2.TemplateError as err:  # raise_exception, an undefined name, the sandbox
            raise UserError(f"the chat template refuses these messages: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as err:  # the template's code
            raise UserError(f"the chat template fails on these messages: {err}") from None

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.backend.encode(self.chat_text(messages), add_special_tokens=False).ids

    def detokenizer(self) -> HFDetokenizer:
        return HFDetokenizer(self)


def tokenizer_dir(model: str | Path | None) -> Path | None:
    """The directory of ``model`` that holds a ``tokenizer.json``, if it is one: a path, or a
    preset name whose folder ``configs/models/<name>/`` ships one (``recall-tiny``'s printable
    tokenizer, engine/unit_tokenizer.py)."""
    if model is None:
        return None
    path = Path(model)
    if not path.exists() and path.name == str(model):  # a bare name: a preset folder?
        path = config_dir() / "models" / str(model)
    return path if (path / TOKENIZER_FILE).is_file() else None


def load_tokenizer(
    model: str | Path | None, vocab_size: int, *, override: str | Path | None = None
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of ``model`` (a preset name, a checkpoint or HF directory) whose vocabulary
    has ``vocab_size`` ids: the directory's own, else the byte-level one. ``override`` (a
    ``--tokenizer DIR``) names a directory that must hold one."""
    if override is not None and tokenizer_dir(override) is None:
        raise UserError(f"--tokenizer {override}: no {TOKENIZER_FILE} there")
    directory = tokenizer_dir(override if override is not None else model)
    if directory is None:
        check_byte_vocab(vocab_size)
        return ByteTokenizer()
    tokenizer = HFTokenizer(directory)
    if tokenizer.vocab_size > vocab_size:
        raise UserError(
            f"the tokenizer in {directory} has {tokenizer.vocab_size:,} ids, more than the "
            f"model's vocabulary of {vocab_size:,}"
        )
    return tokenizer
