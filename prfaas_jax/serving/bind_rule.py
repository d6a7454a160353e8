"""The rule every server of a cluster keeps beyond loopback: `bind_refusal`, `is_loopback` and
`PLAINTEXT_FIX`, the fix a refused server's error names.

On loopback a server may speak plaintext; anywhere else it speaks TLS and knows its callers,
unless the config accepts plaintext (`SecuritySection.check_bind`, serving/cluster_sections.py).
"""

from __future__ import annotations

import ipaddress

# What a refused plaintext server's error tells the user to do.
PLAINTEXT_FIX = (
    "make credentials with `prfaas certs --config CONFIG --out DIR` and set [security] "
    "ca_cert, cert, key and token_file (or allow_plaintext = true to accept it)"
)


def is_loopback(host: str) -> bool:
    """`host` is this machine's loopback: an address in 127.0.0.0/8 or ::1, or `localhost`.
    Any other name counts as reachable from the network (it may resolve anywhere)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(host: str, what: str, *, tls: bool) -> str | None:
    """The rule for every server of the cluster: beyond loopback it speaks TLS and knows its
    callers (worker ports: mutual TLS; the router's client port, its metrics endpoint and
    the OpenAI front door: TLS and a bearer token or a CA-signed client certificate, which
    `tls` implies). None when `what` on `host` keeps it; else what is wrong, in one line."""
    if tls or is_loopback(host):
        return None
    return f"{what} would listen on {host} in plaintext, with no client authentication"
