"""`ChildProcess`: one process the launcher started (its own session, a log file, an address
file). What each child does for itself (parent death, stop signals, its address file) is in
serving/transport/lifecycle.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


class ChildProcess:
    """One process the launcher started, in its own session (so `signal_group` reaches
    anything it forked), its output in `log_path`; `info` holds its address file once read."""

    def __init__(self, name: str, role: str, argv: list[str], log_path: Path) -> None:
        self.name, self.role, self.log_path = name, role, log_path
        self.address_file = log_path.with_suffix(".json")
        self.address_file.unlink(missing_ok=True)  # a reused log dir must not feed stale ports
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.info: dict = {}

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)
