"""A minimal streaming client of an OpenAI completions endpoint, read as benchmark clients read
it (`prfaas bench --openai URL`).

`stream_completion` posts one streamed completion (token ids or text as the prompt, greedy,
``ignore_eos`` unless told not to, ``stream_options.include_usage``) and yields
``(arrival time, chunk)`` for every server-sent event: the body is split on blank lines,
``data: `` stripped, comment lines (``:``) skipped, and the stream ends at ``data: [DONE]`` —
the parsing of `vllm bench serve`; a stream closed before it raises `HTTPError` (cut short),
unless ``until_done=False`` (`transformers serve` closes its streams without it). A reply other
than 200 raises `HTTPError` with the server's error message.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator

from prfaas_jax.errors import UserError


class HTTPError(Exception):
    pass


def parse_base_url(url: str) -> tuple[str, int, str]:
    """``http://host:port/v1`` → (host, port, path prefix); UserError for anything else."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise UserError(f"an OpenAI base URL is http://HOST:PORT/v1, got {url!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise UserError(f"bad port in {url!r}") from None
    return parts.hostname, port, parts.path.rstrip("/")


def stream_completion(
    url: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    *,
    token: str | None = None,
    timeout_s: float = 300.0,
    ignore_eos: bool = True,
    until_done: bool = True,
) -> Iterator[tuple[float, dict]]:
    """``ignore_eos=False`` leaves the field out: servers that follow OpenAI's schema strictly
    (`transformers serve`) refuse a body with a field OpenAI does not define."""
    host, port, prefix = parse_base_url(url)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        connection.request("POST", f"{prefix}/completions", json.dumps(body), headers)
        reply = connection.getresponse()
        if reply.status != 200:
            text = reply.read().decode("utf-8", errors="replace")
            try:
                message = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = text[:200]
            raise HTTPError(f"HTTP {reply.status}: {message}")
        event: list[str] = []
        while line := reply.readline():
            now = time.perf_counter()
            text = line.decode("utf-8").rstrip("\r\n")
            if text:
                if not text.startswith(":"):
                    event.append(text.removeprefix("data: "))
                continue
            data, event = "\n".join(event), []
            if data == "[DONE]":
                return
            if data:
                yield now, json.loads(data)
        if until_done:
            raise HTTPError("the stream ended without data: [DONE]")
        if data := "\n".join(event):  # the last event, if no blank line closed it
            yield time.perf_counter(), json.loads(data)
    finally:
        connection.close()
