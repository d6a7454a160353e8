"""Certificates for a cluster: `make_ca`, `make_node_cert`, `write_cluster_credentials` (what
`prfaas certs` writes for one box, and a `--netns` launcher for its namespaces) and
`write_host_credentials` (`prfaas certs --config`: one folder per machine of `[hosts]`).

One CA signs the node certificates. A node certificate is valid for TLS servers and clients
alike (extended key usage serverAuth + clientAuth) and names its hosts as subject alternative
names, always with the loopback host as both IP 127.0.0.1 and DNS localhost, the two ways a
process dials its own machine. On one box every process shares one; across machines each
machine has its own, naming its `[hosts]` address, from the same CA; the `[security]` section
takes any such pair (docs/serving.md, "Security"). Keys are ECDSA P-256: quick to make in a
test, and every TLS stack gRPC builds on takes them.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _builder(
    subject: str,
    issuer: x509.Name,
    public_key: object,
    days: float,
    valid_from: datetime.datetime | None,
) -> x509.CertificateBuilder:
    """Valid for `days` days from `valid_from` (default: now)."""
    start = valid_from or datetime.datetime.now(datetime.UTC)
    # Backdated a minute, so a clock a little behind the issuer's still accepts it.
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(minutes=1))
        .not_valid_after(start + datetime.timedelta(days=days))
    )


def make_ca(
    common_name: str = "prfaas toy cluster CA",
    *,
    days: float = 365,
    valid_from: datetime.datetime | None = None,
) -> Issued:
    """A self-signed CA that may sign end-entity certificates only (path length 0), valid for
    `days` days from `valid_from` (default: now)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key.public_key(), days, valid_from)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def make_node_cert(
    ca: Issued,
    common_name: str = "prfaas node",
    *,
    dns_names: tuple[str, ...] = LOOPBACK_NAMES,
    ip_addresses: tuple[str, ...] = LOOPBACK_IPS,
    days: float = 365,
    valid_from: datetime.datetime | None = None,
) -> Issued:
    """A certificate signed by `ca` for both ends of a TLS connection, naming the given hosts
    as subject alternative names (what a TLS client checks the address it dialled against),
    valid for `days` days from `valid_from` (default: now; a past start makes a certificate
    that has already expired, a future one a certificate not yet valid)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    cert = (
        _builder(common_name, ca_cert.subject, key.public_key(), days, valid_from)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write_private(path: Path, data: bytes) -> None:
    """Create `path` readable by its owner only (0600) before any secret byte is in it."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _alt_names(hosts: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """`make_node_cert`'s `dns_names` and `ip_addresses` for ``hosts`` (addresses or names),
    the loopback ones always among them: a process also dials its own machine there."""
    ips, names = list(LOOPBACK_IPS), list(LOOPBACK_NAMES)
    for host in hosts:
        try:
            ip = str(ipaddress.ip_address(host.strip("[]")))
        except ValueError:
            names += [host] if host not in names else []
        else:
            ips += [ip] if ip not in ips else []
    return {"dns_names": tuple(names), "ip_addresses": tuple(ips)}


def _write_node(
    out: Path, ca: Issued, token: bytes, hosts: Sequence[str], days: float
) -> dict[str, Path]:
    """What one machine needs in ``out``: ca.pem, node.pem (signed by ``ca`` for ``hosts``),
    node-key.pem and router.token, the key and the token mode 0600."""
    out.mkdir(parents=True, exist_ok=True)
    node = make_node_cert(ca, days=days, **_alt_names(hosts))
    paths = {
        "ca_cert": out / "ca.pem",
        "cert": out / "node.pem",
        "key": out / "node-key.pem",
        "token_file": out / "router.token",
    }
    paths["ca_cert"].write_bytes(ca.cert_pem)
    paths["cert"].write_bytes(node.cert_pem)
    _write_private(paths["key"], node.key_pem)
    _write_private(paths["token_file"], token)
    return paths


def _new_token() -> bytes:
    return (secrets.token_urlsafe(32) + "\n").encode()


def write_cluster_credentials(
    out_dir: str | os.PathLike[str], *, days: float = 365, hosts: Sequence[str] = ()
) -> dict[str, Path]:
    """Write ca.pem, node.pem (naming loopback and ``hosts``), node-key.pem and router.token (a
    random bearer token) into `out_dir`; the key and the token are mode 0600. The CA's own key
    is not written: nothing here issues more certificates later, and a key that is never
    stored cannot leak."""
    ca = make_ca(days=days)
    return _write_node(Path(out_dir), ca, _new_token(), hosts, days)


def write_host_credentials(
    out_dir: str | os.PathLike[str], hosts: Sequence[str], *, days: float = 365
) -> dict[str, dict[str, Path]]:
    """A cluster over several machines: one CA and one router token, and for each host a
    folder `out_dir/<host>/` holding everything that machine needs (ca.pem, its own node.pem
    naming that host and loopback, node-key.pem, router.token). Copied to each machine as the
    same folder, one `[security]` section serves them all. Returns {host: {key: path}}."""
    ca, token = make_ca(days=days), _new_token()
    return {host: _write_node(Path(out_dir) / host, ca, token, [host], days) for host in hosts}
