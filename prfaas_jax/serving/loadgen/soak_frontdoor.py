"""The HTTP front door of `prfaas soak --netns`: `FrontDoorProcess`, a `prfaas openai` in front of
the soak's router that is restarted whenever it exits (the soak SIGTERMs it with requests in
flight), and `send_http`, one streamed completion through it into a `RequestResult`.

The process runs as `prfaas openai --ready-file … --port 0` would, but dies with the soak
(PR_SET_PDEATHSIG, as the launcher's children): a SIGKILLed soak leaves no front door behind.
The death signal follows the thread that forked, so one keeper thread starts every front door
and lives until `stop`.

A front-door request is judged on its text (serving/loadgen/soak_report.py's oracle on bytes):
`result.tokens` holds the UTF-8 of the streamed text and `result.expected` that of the byte
tokenizer's decode of the expected tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from prfaas_jax.serving.loadgen.openai_client import HTTPError, stream_completion
from prfaas_jax.serving.loadgen.soak_report import RequestResult

START_S = 60.0  # a front door that does not serve this long after its start is given up
MAIN = (
    "import sys\n"
    "from prfaas_jax.serving.transport.lifecycle import die_with_parent\n"
    "die_with_parent(int(sys.argv[1]))\n"
    "from prfaas_jax.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


class FrontDoorProcess(threading.Thread):
    """Starts a front door, waits for it to exit, starts the next, until `stop`; `starts`
    counts them, `exits` holds each one's exit status, `url` is the serving one's base URL."""

    def __init__(self, ready_file: Path, log_dir: Path) -> None:
        super().__init__(name="soak-frontdoor", daemon=True)
        self.ready_file, self.log_dir = ready_file, log_dir
        self.popen: subprocess.Popen | None = None
        self.url: str | None = None
        self.starts = 0
        self.exits: list[int] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    @property
    def pid(self) -> int | None:
        popen = self.popen
        return popen.pid if popen is not None and popen.poll() is None else None

    def run(self) -> None:
        while not self.stopping.is_set():
            popen = self._start()
            while popen.poll() is None and not self.stopping.wait(0.1):
                pass
            if popen.poll() is not None:
                self.exits.append(popen.returncode)
            with self.lock:
                self.url = None
        self._terminate()

    def _start(self) -> subprocess.Popen:
        starts = self.starts + 1
        address_file = self.log_dir / f"frontdoor-{starts}.json"
        argv = [sys.executable, "-c", MAIN, str(os.getpid()), "openai"]
        argv += ["--ready-file", str(self.ready_file), "--port", "0"]
        argv += ["--address-file", str(address_file)]
        with (self.log_dir / f"frontdoor-{starts}.log").open("wb") as log:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        with self.lock:
            self.popen, self.starts = popen, starts
        deadline = time.monotonic() + START_S
        while not address_file.exists():
            if popen.poll() is not None or time.monotonic() > deadline:
                popen.kill()
                return popen
            time.sleep(0.1)
        try:
            url = json.loads(address_file.read_text())["base_url"]
        except (OSError, ValueError, KeyError):
            url = None
        with self.lock:
            self.url = url
        return popen

    def wait_serving(self, after_starts: int, timeout_s: float = START_S) -> bool:
        """Whether a front door started after the first `after_starts` serves in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.starts > after_starts and self.url is not None:
                    return True
            time.sleep(0.1)
        return False

    def wait_exit(self, timeout_s: float) -> int | None:
        popen = self.popen
        if popen is None:
            return None
        try:
            return popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _terminate(self) -> None:
        popen = self.popen
        if popen is not None and popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(30)
        self._terminate()


def send_http(
    frontdoor: FrontDoorProcess, model: str, result: RequestResult, deadline: float
) -> None:
    """Stream one completion through the front door; `result` holds the reply's text as bytes
    and `expected` the expected text's (module docstring)."""
    result.route = "frontdoor"
    with frontdoor.lock:
        url = frontdoor.url
    if url is None:
        result.outcome, result.code, result.end_s = "failed", "NO_FRONT_DOOR", 0.0
        return
    text = []
    try:
        for _, chunk in stream_completion(
            url, model, result.prompt, result.max_new_tokens, timeout_s=deadline
        ):
            piece = "".join(c.get("text", "") for c in chunk.get("choices", []))
            if piece and result.ttft_s is None:
                result.ttft_s = time.monotonic() - result.sent
            text.append(piece)
        result.outcome, result.attempts = "completed", 1
    except TimeoutError:
        result.outcome = "lost" if time.monotonic() - result.sent >= 0.99 * deadline else "failed"
        result.code = "TIMEOUT"
    except (HTTPError, OSError, http.client.HTTPException, ValueError) as err:
        result.outcome, result.code = "failed", type(err).__name__
    result.tokens = list("".join(text).encode())
    result.end_s = time.monotonic() - result.sent
