"""Byte-level tokenizer for toy presets: token ``i`` < 256 is the byte ``i``."""

from __future__ import annotations

from prfaas_jax.errors import UserError


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        """Bytes ≥ 256 (possible when the model's vocabulary is larger) print as U+FFFD."""
        data = bytes(t if t < 256 else ord("?") for t in token_ids)
        return data.decode("utf-8", errors="replace")


def check_byte_vocab(vocab_size: int) -> None:
    if vocab_size < ByteTokenizer.vocab_size:
        raise UserError(
            f"--prompt needs a vocabulary of at least 256 (byte-level); this model has "
            f"{vocab_size}: pass --prompt-ids instead"
        )
