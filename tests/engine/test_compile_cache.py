"""The persistent compilation cache's directory: the configured one wins, else the XDG default."""

import jax

from prfaas_jax.cli import build_parser
from prfaas_jax.engine.compile_cache import default_compile_cache_dir, enable_compile_cache


def test_the_default_lives_under_the_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compile_cache_dir() == tmp_path / "prfaas_jax" / "xla"


def test_a_configured_directory_is_kept():
    configured = jax.config.jax_compilation_cache_dir  # the test session's (tests/conftest.py)
    assert configured
    enable_compile_cache()
    assert jax.config.jax_compilation_cache_dir == configured


def test_train_and_codesign_compile_through_the_cache_unless_told_not_to():
    parser = build_parser()
    assert parser.parse_args(["train"]).compile_cache is True
    assert parser.parse_args(["train", "--no-compile-cache"]).compile_cache is False
    args = parser.parse_args(["codesign", "--config", "x.toml", "--no-compile-cache"])
    assert args.compile_cache is False
