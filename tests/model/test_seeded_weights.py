"""The seeded-weights cache (model/seeded_weights.py): what it returns is bit for bit what
`init_params` draws, the second process reads instead of drawing, any damaged file is drawn
again (never served), and the key changes with everything that decides the values."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.model import seeded_weights
from prfaas_jax.model.hybrid import init_params
from prfaas_jax.model.seeded_weights import (
    cache_key,
    seeded_params,
    use_weights_cache,
    weights_cache_dir,
)

CFG = load_model_config("tiny")
SEED = 3


@pytest.fixture
def cache(tmp_path):
    """A fresh cache directory for this test; the session's is restored after."""
    before = weights_cache_dir()
    use_weights_cache(tmp_path)
    yield tmp_path
    use_weights_cache(before)


@pytest.fixture(scope="module")
def drawn():
    """The oracle: the weights the jitted initialiser draws, no cache involved."""
    return init_params(jax.random.PRNGKey(SEED), CFG)


def assert_bit_equal(got, want) -> None:
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def no_drawing(monkeypatch) -> None:
    def refuse(*_):
        raise AssertionError("drew the weights instead of reading them")

    monkeypatch.setattr(seeded_weights, "init_params", refuse)


def test_a_cached_draw_is_read_back_bit_for_bit(cache, drawn, monkeypatch):
    assert_bit_equal(seeded_params(CFG, SEED), drawn)
    [stored] = cache.glob("*.npz")
    assert stored.name == f"{cache_key(CFG, SEED)}.npz"
    no_drawing(monkeypatch)
    assert_bit_equal(seeded_params(CFG, SEED), drawn)


def test_without_a_cache_nothing_is_written(tmp_path, drawn):
    before = weights_cache_dir()
    use_weights_cache(None)
    try:
        assert_bit_equal(seeded_params(CFG, SEED), drawn)
    finally:
        use_weights_cache(before)
    assert list(tmp_path.iterdir()) == []


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _other_model(path):
    other = load_model_config("tiny-gdn")
    seeded_weights.write_params(path, init_params(jax.random.PRNGKey(0), other))


def _plain_npy(path):
    with path.open("wb") as file:
        np.save(file, np.zeros(4, np.uint8))


def _garbage(path):
    path.write_bytes(b"not a zip at all")


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate, _other_model, _plain_npy, _garbage])
def test_a_damaged_file_is_drawn_again_and_replaced(cache, drawn, damage, caplog, monkeypatch):
    seeded_params(CFG, SEED)
    [stored] = cache.glob("*.npz")
    damage(stored)
    with caplog.at_level(logging.WARNING, logger="prfaas.weights"):
        assert_bit_equal(seeded_params(CFG, SEED), drawn)
    assert "drawing the weights again" in caplog.text and stored.name in caplog.text
    no_drawing(monkeypatch)  # the redrawn weights replaced the damaged file
    assert_bit_equal(seeded_params(CFG, SEED), drawn)


def test_an_unwritable_cache_still_returns_the_weights(tmp_path, drawn, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would be")
    before = weights_cache_dir()
    use_weights_cache(blocked / "weights")
    try:
        with caplog.at_level(logging.WARNING, logger="prfaas.weights"):
            assert_bit_equal(seeded_params(CFG, SEED), drawn)
    finally:
        use_weights_cache(before)
    assert "not cached" in caplog.text


def test_the_key_names_everything_that_decides_the_values(monkeypatch):
    key = cache_key(CFG, SEED)
    assert cache_key(load_model_config("tiny"), SEED) == key  # stable across calls
    assert cache_key(CFG, SEED + 1) != key
    assert cache_key(load_model_config("tiny-gdn"), SEED) != key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
    assert cache_key(CFG, SEED) != key
    monkeypatch.undo()
    monkeypatch.setattr(seeded_weights, "_source_digest", lambda: b"edited model code")
    assert cache_key(CFG, SEED) != key
