"""The strict TOML loader: dataclasses from tables, one-line errors naming file and dotted key,
enums by value, and preset names against paths."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prfaas_jax.errors import ConfigError
from prfaas_jax.toml_config import (
    Where,
    build,
    config_dir,
    located,
    presets,
    read,
    resolve,
    split,
    toml_key,
    value,
)


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    rate: float
    tags: tuple[str, ...] = ()
    pairs: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner
    color: Color = Color.RED
    count: int = 1
    enabled: bool = False
    limit: int | None = None
    num_items: int = field(default=0, metadata=toml_key("items"))

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count must be ≥ 0")
        if self.num_items > 9:
            raise ConfigError("items: must be at most 9")


def load(tmp_path: Path, text: str) -> Outer:
    path = tmp_path / "x.toml"
    path.write_text(text)
    return build(Outer, read(path, "test config"), Where(str(path)))


def error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_values_types_and_defaults(tmp_path):
    outer = load(
        tmp_path,
        'name = "a"\ncolor = "blue"\nitems = 3\n'
        '[inner]\nrate = 2\ntags = ["p", "q"]\npairs = [[0, 1.5], [2, 3]]\n',
    )
    inner = Inner(2.0, ("p", "q"), ((0.0, 1.5), (2.0, 3.0)))
    assert outer == Outer("a", inner, Color.BLUE, num_items=3)  # "items" is num_items' key
    assert outer.count == 1 and outer.limit is None and not outer.enabled  # the defaults
    assert type(outer.inner.rate) is float  # an integer is read as a float where one is due
    assert outer.color is Color.BLUE  # the enum member, from its value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "a"\nbogus = 1\n[inner]\nrate = 1.0\n', "bogus: unknown key (expected one of:"),
        (
            'name = "a"\n[inner]\nrate = 1.0\nrat = 2\n',
            "inner.rat: unknown key (expected one of: rate, tags, pairs)",
        ),
        ('name = "a"\nnum_items = 1\n[inner]\nrate = 1.0\n', "num_items: unknown key"),
    ],
)
def test_unknown_keys_are_named_with_the_known_ones(tmp_path, text, message):
    got = error(tmp_path, text)
    assert got.startswith(f"{tmp_path / 'x.toml'}: ") and message in got


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[inner]\nrate = "x"', 'inner.rate: expected a number, got "x"'),
        ("[inner]\nrate = nan", "inner.rate: expected a finite number, got nan"),
        ("[inner]\nrate = true", "inner.rate: expected a number, got true"),
        ('[inner]\nrate = 1\ntags = ["a", 2]', "inner.tags[1]: expected a string, got 2"),
        ('[inner]\nrate = 1\ntags = "a"', 'inner.tags: expected a list, got "a"'),
        (
            "[inner]\nrate = 1\npairs = [[1, 2, 3]]",
            "inner.pairs[0]: expected a list of 2 items, got [1, 2, 3]",
        ),
        ("inner = 3", "inner: expected a table, got 3"),
        ("count = 1.5\n[inner]\nrate = 1", "count: expected an integer, got 1.5"),
        ("count = true\n[inner]\nrate = 1", "count: expected an integer, got true"),
        ("enabled = 1\n[inner]\nrate = 1", "enabled: expected true or false, got 1"),
        ("limit = 'no'\n[inner]\nrate = 1", 'limit: expected an integer, got "no"'),
    ],
)
def test_wrong_types_name_the_dotted_key(tmp_path, text, message):
    assert error(tmp_path, 'name = "a"\n' + text) == f"{tmp_path / 'x.toml'}: {message}"


def test_enum_by_value_and_a_bad_value_lists_the_choices(tmp_path):
    assert load(tmp_path, 'name = "a"\ncolor = "red"\n[inner]\nrate = 1').color is Color.RED
    message = error(tmp_path, 'name = "a"\ncolor = "green"\n[inner]\nrate = 1')
    assert message.endswith('color: expected one of "red", "blue", got "green"')


def test_missing_keys(tmp_path):
    assert error(tmp_path, "[inner]\nrate = 1").endswith(": name: missing key")
    assert error(tmp_path, 'name = "a"\n[inner]').endswith(": inner.rate: missing key")
    assert error(tmp_path, 'name = "a"').endswith(": inner: missing key")


def test_invalid_values_are_located(tmp_path):
    path = tmp_path / "x.toml"
    # A ValueError from __post_init__ gets the file and the table; a ConfigError names its key.
    assert error(tmp_path, 'name = "a"\ncount = -1\n[inner]\nrate = 1') == (
        f"{path}: count must be ≥ 0"
    )
    assert error(tmp_path, 'name = "a"\nitems = 10\n[inner]\nrate = 1') == (
        f"{path}: items: must be at most 9"
    )
    with (
        pytest.raises(ConfigError, match=re.escape(f"{path}: inner: no good")),
        located(Where(str(path), "inner")),
    ):
        raise ValueError("no good")


def test_split_and_value():
    where = Where("x.toml", "section")
    own, policy = split({"a": 1, "b": 2.5}, where, ("a",), ("b", "c"))
    assert (own, policy) == ({"a": 1}, {"b": 2.5})
    with pytest.raises(ConfigError, match=re.escape("section.d: unknown key (expected one of: a")):
        split({"d": 1}, where, ("a",), ("b", "c"))
    assert value(policy, "b", float, where) == 2.5
    assert value(policy, "c", int, where, default=7) == 7
    with pytest.raises(ConfigError, match=re.escape("x.toml: section.c: missing key")):
        value(policy, "c", int, where)


def test_read_names_the_file(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("a = [")
    with pytest.raises(ConfigError, match=re.escape(f"{broken}: invalid TOML")):
        read(broken, "test config")
    with pytest.raises(ConfigError, match=r"cannot read test config .*absent\.toml"):
        read(tmp_path / "absent.toml", "test config")


def test_resolve_names_and_paths(tmp_path, monkeypatch):
    assert resolve("models", "tiny") == config_dir() / "models" / "tiny.toml"
    # Preset names may hold dots; only ".toml" makes a path.
    assert resolve("models", "qwen3.5-397b").name == "qwen3.5-397b.toml"
    own = tmp_path / "mine.toml"
    own.write_text("")
    assert resolve("models", own) == own
    assert resolve("models", str(tmp_path / "absent.toml")) == tmp_path / "absent.toml"
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    assert resolve("models", folder) == folder  # an existing path wins over a preset name
    with pytest.raises(ConfigError, match=r"neither a file nor a preset.*presets: .*tiny"):
        resolve("models", "no-such-model")

    monkeypatch.setenv("PRFAAS_CONFIG_DIR", str(tmp_path))
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "solo.toml").write_text("")
    assert presets("clusters") == ["solo"]
    assert resolve("clusters", "solo") == tmp_path / "clusters" / "solo.toml"
    with pytest.raises(ConfigError, match=r"presets: solo$"):
        resolve("clusters", "toy")


def test_dumps_writes_what_tomllib_reads_back():
    import tomllib

    from prfaas_jax.toml_config import dumps

    doc = {
        "plan": "../plans/x.toml",
        "workload": {"rate": 1.5, "requests": 3, "input_len": {"path": 'a "b".txt'}},
        "node_classes": {"fast": {"cpus": "0-1", "cpu_quota": 0.75}},
        "link": {"schedule": [[0, 0.1], [5.5, 1]], "layerwise": False},
        "deployments": {"a.b": {"threshold": 4096}},
        "wire": {"options": [{"precision": "int8", "byte_ratio": 0.3, "a b": True}]},
    }
    text = dumps(doc)
    assert tomllib.loads(text) == doc
    assert "[node_classes.fast]" in text and '[deployments."a.b"]' in text
    assert 'options = [{ precision = "int8", byte_ratio = 0.3, "a b" = true }]' in text
    with pytest.raises(ValueError, match="TOML has no"):
        dumps({"x": float("inf")})
