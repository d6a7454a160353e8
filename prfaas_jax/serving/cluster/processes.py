"""`ChildProcess`: one process the launcher started (its own session, a log file, an address
file), with the followers of a multi-process instance; `ClusterError`, `free_port` and
`pid_alive`. What each child does for itself (parent death, stop signals, its address file) is
in serving/transport/lifecycle.py."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from pathlib import Path

from prfaas_jax.errors import UserError


class ClusterError(UserError):
    """A cluster process failed to start; the message names it and quotes its log."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (a launcher whose namespaces or cgroups may be stale)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the caller's child binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
        # Processes 1… of a multi-process instance this child leads: they live and die with it.
        self.followers: list[ChildProcess] = []

    def group(self) -> list[ChildProcess]:
        return [self, *self.followers]

    def exited(self) -> tuple[ChildProcess, int] | None:
        """The first process of this child's group that exited, with its status."""
        for child in self.group():
            code = child.popen.poll()
            if code is not None:
                return child, code
        return None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)
