"""The certificates a `--netns` cluster makes for itself: `netns_credentials`,
`make_netns_credentials`, `credentials_folders`, `remove_stale_credentials` and `SECURITY_FILE`.

Its workers bind the namespaces' addresses, beyond loopback, so each run makes a CA and a node
certificate naming them (and loopback), valid `NETNS_CREDENTIALS_DAYS`, in a temporary folder
named after the launcher's pid; the launcher removes it at stop, and the next start removes the
folders of launchers that are gone (killed before they could).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from prfaas_jax.serving.cluster.processes import pid_alive
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.transport.certs import write_cluster_credentials
from prfaas_jax.toml_config import dumps

NETNS_CREDENTIALS_DAYS = 7  # the certificates a --netns run makes (removed when it stops)
CREDENTIALS_PREFIX = "prfaas-netns-credentials-"  # + the launcher's pid
SECURITY_FILE = "security.toml"  # the folder's `[security]` section, for every child


def _owner(folder: Path) -> int:
    """The pid of the launcher that made a folder of `credentials_folders` (-1: not one)."""
    owner = folder.name.removeprefix(CREDENTIALS_PREFIX).split("-", 1)[0]
    return int(owner) if owner.isdigit() else -1


def credentials_folders(pid: int | None = None) -> list[Path]:
    """The folders of certificates `--netns` launchers made (launcher ``pid``'s only, if
    given), in the temporary directory."""
    found = Path(tempfile.gettempdir()).glob(f"{CREDENTIALS_PREFIX}*")
    return [f for f in found if _owner(f) >= 0 and pid in (None, _owner(f))]


def remove_stale_credentials() -> list[Path]:
    """Delete the certificates of `--netns` launchers that are gone; returns their folders."""
    stale = [f for f in credentials_folders() if not pid_alive(_owner(f))]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


def make_netns_credentials(hosts: list[str]) -> Path:
    """A new folder of this launcher's with a CA, a node certificate naming ``hosts`` and its
    key, and `SECURITY_FILE` pointing at them (no token: the router's port stays as the config
    has it). A killed launcher's folders go first."""
    remove_stale_credentials()
    folder = Path(tempfile.mkdtemp(prefix=f"{CREDENTIALS_PREFIX}{os.getpid()}-"))
    paths = write_cluster_credentials(folder, days=NETNS_CREDENTIALS_DAYS, hosts=hosts)
    paths.pop("token_file").unlink()
    section = {"security": {k: str(v) for k, v in paths.items()}}
    (folder / SECURITY_FILE).write_text(dumps(section))
    return folder


def netns_credentials(security: SecuritySection, hosts: dict[str, str]) -> Path | None:
    """The rule beyond loopback for a `--netns` run's workers (``hosts``: which workers → their
    namespace's address): a folder of `make_netns_credentials` made now, for this run only;
    None when the config allows plaintext (then one warning per cluster on stderr)."""
    if not security.allow_plaintext:
        return make_netns_credentials(list(hosts.values()))
    for what, host in hosts.items():
        warning = security.check_bind(host, f"the {what} workers")
        print(f"prfaas serve: {warning}", file=sys.stderr, flush=True)
    return None
