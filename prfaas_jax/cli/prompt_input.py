"""Prompts too long for a command line: `read_prompt_ids` and `read_prompt_text` read a file
(``-``: stdin), and `prompt_digest` names a prompt in ``--json`` output without echoing it.

A token-id file is either integers separated by commas and/or whitespace (any line layout), or
a ``.npy`` file holding a 1-D integer array (``numpy.save``). A text file is UTF-8, encoded by
the caller's tokenizer. Every problem with a file is one `UserError` line naming it.
"""

from __future__ import annotations

import hashlib
import re
import sys

import numpy as np

from prfaas_jax.errors import UserError

STDIN = "-"
_SEPARATORS = re.compile(r"[\s,]+")


def _read_bytes(path: str) -> bytes:
    if path == STDIN:
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise UserError(f"cannot read prompt file {path}: {err.strerror or err}") from None


def _from_npy(path: str) -> list[int]:
    try:
        array = np.load(path, allow_pickle=False)
    except OSError as err:
        raise UserError(f"cannot read prompt file {path}: {err.strerror or err}") from None
    except ValueError as err:  # not an .npy file, or one that needs pickle
        raise UserError(f"prompt file {path} is not a numpy .npy array: {err}") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise UserError(
            f"prompt file {path} must hold a 1-D integer array of token ids, got "
            f"{array.dtype} of shape {array.shape}"
        )
    return array.tolist()


def read_prompt_ids(path: str) -> list[int]:
    """Token ids from ``path`` (``-``: stdin): separated integers, or a ``.npy`` array."""
    if path != STDIN and path.endswith(".npy"):
        ids = _from_npy(path)
    else:
        try:
            text = _read_bytes(path).decode("ascii")
        except UnicodeDecodeError:
            raise UserError(
                f"prompt file {path} is not a list of token ids (expected integers separated by "
                "commas or whitespace, or a .npy array); use --prompt-file for text"
            ) from None
        try:
            ids = [int(part) for part in _SEPARATORS.split(text) if part]
        except ValueError as err:
            bad = str(err).rpartition(": ")[2]
            raise UserError(
                f"prompt file {path}: {bad} is not a token id (expected integers separated by "
                "commas or whitespace); use --prompt-file for text"
            ) from None
    if not ids:
        raise UserError(f"prompt file {path} holds no token ids")
    return ids


def read_prompt_text(path: str) -> str:
    """UTF-8 text from ``path`` (``-``: stdin), kept exactly (trailing newline included)."""
    try:
        text = _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"prompt file {path} is not UTF-8 text ({err.reason})") from None
    if not text:
        raise UserError(f"prompt file {path} is empty")
    return text


def prompt_digest(ids: list[int]) -> str:
    """SHA-256 of the ids as little-endian int32 (hex): the same for the same prompt however it
    was given, so two runs can be matched without printing either prompt."""
    return hashlib.sha256(np.asarray(ids, "<i4").tobytes()).hexdigest()


def prompt_from_args(args) -> tuple[list[int] | None, str | None]:
    """(token ids, text) from `add_prompt_flags`' flags, at most one of them set; (None, None)
    when no prompt was given (the command's default prompt then applies)."""
    if args.prompt_ids_file is not None:
        return read_prompt_ids(args.prompt_ids_file), None
    if args.prompt_file is not None:
        return None, read_prompt_text(args.prompt_file)
    return args.prompt_ids, args.prompt
