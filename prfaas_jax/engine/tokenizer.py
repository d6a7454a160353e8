"""Byte-level tokenizer for toy presets: token ``i`` < 256 is the byte ``i``."""

from __future__ import annotations

from prfaas_jax.errors import UserError


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        """UTF-8 text of the bytes; a token ≥ 256 (possible when the model's vocabulary is
        larger) and every invalid byte sequence print as U+FFFD."""
        text, run = [], bytearray()
        for t in token_ids:
            if t < 256:
                run.append(t)
                continue
            text.append(run.decode("utf-8", errors="replace") + "\N{REPLACEMENT CHARACTER}")
            run.clear()
        text.append(run.decode("utf-8", errors="replace"))
        return "".join(text)


def check_byte_vocab(vocab_size: int) -> None:
    if vocab_size < ByteTokenizer.vocab_size:
        raise UserError(
            f"--prompt needs a vocabulary of at least 256 (byte-level); this model has "
            f"{vocab_size}: pass --prompt-ids instead"
        )
