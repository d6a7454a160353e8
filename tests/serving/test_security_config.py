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
