"""The `[security]` config section (paths resolved against the config file, mistakes named by
file and key, an empty token file refused without echoing it) and the client flags of
serving/transport/security.py. The cluster that runs with them: tests/cluster/test_security.py."""

from __future__ import annotations

import pytest

from prfaas_jax.errors import ConfigError
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.transport import security


def write(tmp_path, security_text: str):
    path = tmp_path / "cluster.toml"
    path.write_text('[model]\npreset = "tiny"\n[security]\n' + security_text)
    return path


def test_section_resolves_relative_paths(tmp_path):
    for name in ("ca.pem", "node.pem", "node-key.pem", "token"):
        (tmp_path / name).write_text("x")
    text = 'ca_cert = "ca.pem"\ncert = "node.pem"\nkey = "node-key.pem"\ntoken_file = "token"\n'
    config = load_cluster_config(write(tmp_path, text))
    assert config.security.tls and config.security.key == str(tmp_path / "node-key.pem")
    assert config.security.token_file == str(tmp_path / "token")
    plain = load_cluster_config(write(tmp_path, ""))
    assert not plain.security.tls and plain.security.token_file == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('cert = "node.pem"\nkey = "node-key.pem"\n', "security.ca_cert: missing"),
        ('ca_cert = "ca.pem"\ncert = "node.pem"\n', "security.key: missing"),
        ('ca_cert = "ca.pem"\n', "security.cert: missing"),
        (
            'ca_cert = "ca.pem"\ncert = "node.pem"\nkey = "gone.pem"\n',
            "security.key: no such file",
        ),
        ('token_file = "gone.token"\n', "security.token_file: no such file"),
        ('certificate = "node.pem"\n', "security.certificate: unknown key"),
        ("client_tls = true\n", "security.client_tls: unknown key"),
    ],
)
def test_section_mistakes(tmp_path, text, message):
    for name in ("ca.pem", "node.pem", "node-key.pem"):
        (tmp_path / name).write_text("x")
    with pytest.raises(ConfigError) as err:
        load_cluster_config(write(tmp_path, text))
    assert str(tmp_path / "cluster.toml") in str(err.value) and message in str(err.value)


def test_empty_token_file_is_an_error_without_echoing(tmp_path):
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        security.read_token(SecuritySection(token_file=str(tmp_path / "token")))


def test_client_flags(tmp_path):
    (tmp_path / "ca.pem").write_text("x")
    assert security.client_section() is None
    assert security.client_section(ca_cert=str(tmp_path / "ca.pem")).ca_cert.endswith("ca.pem")
    with pytest.raises(ConfigError, match="--cert and --key go together"):
        security.client_section(ca_cert=str(tmp_path / "ca.pem"), cert=str(tmp_path / "ca.pem"))
    with pytest.raises(ConfigError, match="--token-file: no such file"):
        security.client_section(token_file=str(tmp_path / "none"))


def test_certs_for_a_config_make_one_folder_per_host(tmp_path, capsys):
    """`prfaas certs --config`: one CA and token, and for each host of `[hosts]` a folder with a
    certificate naming that host (and loopback) only, signed by the CA; the `[security]` the
    command prints, relative to the config, then loads on each machine and passes the rule."""
    from cryptography import x509

    from prfaas_jax.cli import main as prfaas
    from prfaas_jax.serving.cluster_config import check_binds

    hosts = '[hosts]\nrouter = "10.0.0.2:50050"\nprfaas = "10.0.0.1:50100"\npd = "10.0.0.2:50200"\n'
    config = tmp_path / "two-machines.toml"
    config.write_text('[model]\npreset = "tiny"\n' + hosts)
    assert prfaas(["certs", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    section = printed[printed.index("[security]") :]
    ca = (tmp_path / "out" / "10.0.0.1" / "ca.pem").read_bytes()
    token = (tmp_path / "out" / "10.0.0.1" / "router.token").read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["10.0.0.1", "10.0.0.2"]
    for host, other in (("10.0.0.1", "10.0.0.2"), ("10.0.0.2", "10.0.0.1")):
        folder = tmp_path / "out" / host
        assert (folder / "ca.pem").read_bytes() == ca
        assert (folder / "router.token").read_bytes() == token
        for secret in ("node-key.pem", "router.token"):
            assert (folder / secret).stat().st_mode & 0o777 == 0o600
        cert = x509.load_pem_x509_certificate((folder / "node.pem").read_bytes())
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        assert ips == {host, "127.0.0.1"} and other not in ips
        # That machine: the config beside its folder, as certs/.
        machine = tmp_path / f"machine-{host}"
        (machine).mkdir()
        (folder).rename(machine / "certs")
        (machine / "two-machines.toml").write_text(config.read_text() + section)
        loaded = load_cluster_config(machine / "two-machines.toml")
        assert loaded.security.cert == str(machine / "certs" / "node.pem")
        assert check_binds(loaded) == []
