"""Strict reading of TOML config files: `resolve`, `read`, `build`, `convert`, `value`, `split`,
`keys_of`, `toml_key`, `located`, `Where`, `config_dir` and `presets`; `dumps` writes one.

Every config kind (models, hardware, plans, simulations, clusters) is a TOML file read into
frozen dataclasses. `build(cls, table, where)` makes one from a TOML table: each key names a
field (or the field whose metadata is `toml_key(key)`), the field's annotation is the type its
value must have, and the field's default is what an omitted key gets. The types it reads:

    bool             true or false                  int     an integer, not a boolean
    float            a finite number (an integer is read as a float)
    str              a string                       dict    a table, left unread
    enum.Enum        a member's value ("chunk" for Impl.CHUNK)
    tuple[X, ...]    a list of X                    tuple[X, Y]   a list of exactly an X and a Y
    a dataclass      a table, read by `build`       X | None      an X (None is the default)

Every mistake is a one-line `ConfigError` naming the file and the dotted key:

    configs/clusters/toy.toml: router.control_period_s: expected a number, got "x"

A dataclass checks its values in `__post_init__`. A `ConfigError` raised there names its own key
("engine.max_len: must be ≥ 2") and gets the file put in front; any other `ValueError` gets the
file and the table's key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from prfaas_jax.errors import ConfigError

T = TypeVar("T")
REQUIRED: Any = dataclasses.MISSING  # `value`'s default: the key must be there


@dataclass(frozen=True)
class Where:
    """A place in a config: the file and a dotted key ("" for the file's top level)."""

    file: str
    key: str = ""

    def at(self, key: str) -> Where:
        return Where(self.file, f"{self.key}.{key}" if self.key else key)

    def item(self, index: int) -> Where:
        return Where(self.file, f"{self.key}[{index}]")

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self}: {message}")

    def __str__(self) -> str:
        return f"{self.file}: {self.key}" if self.key else self.file


def config_dir() -> Path:
    """The ``configs/`` folder: ``$PRFAAS_CONFIG_DIR`` or the one beside the package."""
    override = os.environ.get("PRFAAS_CONFIG_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[1] / "configs"


def presets(kind: str) -> list[str]:
    """The preset names of one config kind: the files in ``configs/<kind>/``, and the folders
    there that hold a ``config.toml`` (model checkpoints shipped as presets)."""
    folder = config_dir() / kind
    files = [p.stem for p in folder.glob("*.toml")]
    return sorted(files + [p.parent.name for p in folder.glob("*/config.toml")])


def resolve(kind: str, name_or_path: str | os.PathLike[str]) -> Path:
    """A config file: ``name_or_path`` itself when it names a ``.toml`` file or anything that
    exists, else the preset ``configs/<kind>/<name>.toml`` or the preset folder
    ``configs/<kind>/<name>/`` (a checkpoint: its ``config.toml`` beside the weights)."""
    path = Path(name_or_path)
    # Preset names may contain dots ("qwen3.5-397b"), so only ".toml" marks a path; a missing
    # .toml file is left for `read` to report.
    if path.suffix == ".toml" or path.exists():
        return path
    preset = config_dir() / kind / f"{name_or_path}.toml"
    if preset.exists():
        return preset
    folder = config_dir() / kind / str(name_or_path)
    if (folder / "config.toml").is_file():
        return folder
    names = ", ".join(presets(kind)) or "(none)"
    raise ConfigError(
        f"{str(name_or_path)!r} is neither a file nor a preset in {config_dir() / kind}; "
        f"presets: {names}"
    )


def read(path: Path, what: str) -> dict[str, Any]:
    """The TOML document at ``path``; ``what`` ("cluster config") names it when it is missing."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def toml_key(key: str) -> dict[str, str]:
    """Field metadata naming the TOML key of a field whose name differs from it."""
    return {"key": key}


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _key_of(field: dataclasses.Field) -> str:
    return field.metadata.get("key", field.name)


def keys_of(cls: type, *without: str) -> tuple[str, ...]:
    """The TOML keys of the dataclass ``cls``, less the fields named in ``without``."""
    return tuple(_key_of(f) for f in _init_fields(cls) if f.name not in without)


def _show(raw: object) -> str:
    """A value as TOML writes it, for error messages."""
    if isinstance(raw, dict):
        return "a table"
    if isinstance(raw, bool):
        return "true" if raw else "false"
    if isinstance(raw, str):
        return json.dumps(raw, ensure_ascii=False)
    if isinstance(raw, list | tuple):
        return "[" + ", ".join(_show(item) for item in raw) + "]"
    return repr(raw)


def _table(raw: object, where: Where) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise where.error(f"expected a table, got {_show(raw)}")
    return raw


def _unknown(key: str, known: list[str] | tuple[str, ...], where: Where) -> ConfigError:
    return where.at(key).error(f"unknown key (expected one of: {', '.join(known)})")


def build(cls: type[T], table: object, where: Where, **given: object) -> T:
    """The dataclass ``cls`` from a TOML table (module docstring); ``given`` holds the values of
    fields the caller computes, which are not keys of the table."""
    table = _table(table, where)
    hints = typing.get_type_hints(cls)
    fields = {_key_of(f): f for f in _init_fields(cls) if f.name not in given}
    for key in table:
        if key not in fields:
            raise _unknown(key, list(fields), where)
    values = dict(given)
    for key, field in fields.items():
        if key in table:
            values[field.name] = convert(table[key], hints[field.name], where.at(key))
        elif field.default is REQUIRED and field.default_factory is REQUIRED:
            raise where.at(key).error("missing key")
    try:
        return cls(**values)
    except ConfigError as err:  # names its own key
        raise ConfigError(f"{where.file}: {err}") from None
    except ValueError as err:
        raise where.error(str(err)) from None


def _expected(what: str, raw: object, where: Where) -> ConfigError:
    return where.error(f"expected {what}, got {_show(raw)}")


def convert(raw: object, hint: Any, where: Where) -> Any:
    """``raw`` read as the type ``hint`` (module docstring)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{where}: no TOML reading for {hint}")
        return convert(raw, options[0], where)
    if hint is bool:
        if not isinstance(raw, bool):
            raise _expected("true or false", raw, where)
        return raw
    if hint is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise _expected("an integer", raw, where)
        return raw
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise _expected("a number", raw, where)
        if not math.isfinite(raw):
            raise _expected("a finite number", raw, where)
        return float(raw)
    if hint is str:
        if not isinstance(raw, str):
            raise _expected("a string", raw, where)
        return raw
    if hint is dict:
        return _table(raw, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw)
        except ValueError:
            choices = ", ".join(_show(m.value) for m in hint)
            raise _expected(f"one of {choices}", raw, where) from None
    if origin is tuple:
        if not isinstance(raw, list | tuple):
            raise _expected("a list", raw, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(item, args[0], where.item(i)) for i, item in enumerate(raw))
        if len(raw) != len(args):
            raise _expected(f"a list of {len(args)} items", raw, where)
        pairs = enumerate(zip(raw, args, strict=True))
        return tuple(convert(item, arg, where.item(i)) for i, (item, arg) in pairs)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, raw, where)
    raise TypeError(f"{where}: no TOML reading for {hint}")


def value(
    table: Mapping[str, object], key: str, hint: Any, where: Where, default: Any = REQUIRED
) -> Any:
    """``table[key]`` read as ``hint`` (``where`` is the table's place); ``default`` when the key
    is absent, which is an error when there is no default."""
    if key in table:
        return convert(table[key], hint, where.at(key))
    if default is REQUIRED:
        raise where.at(key).error("missing key")
    return default


def split(table: object, where: Where, *key_sets: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """The table cut into one part per key set (a key outside every set is an error): for a
    table whose keys feed several dataclasses, such as a section and the policy it holds."""
    table = _table(table, where)
    parts: tuple[dict[str, Any], ...] = tuple({} for _ in key_sets)
    for key, raw in table.items():
        for keys, part in zip(key_sets, parts, strict=True):
            if key in keys:
                part[key] = raw
                break
        else:
            raise _unknown(key, [k for keys in key_sets for k in keys], where)
    return parts


@contextlib.contextmanager
def located(where: Where) -> Iterator[None]:
    """A ``ValueError`` raised inside (a value a policy object refuses) becomes a `ConfigError`
    naming ``where``; a `ConfigError` passes through, since it already says where."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise where.error(str(err)) from None


def dumps(doc: Mapping[str, object]) -> str:
    """A TOML document from ``doc``: top-level values first, then each table (a nested dict)
    as ``[a.b]``; values are numbers, booleans, strings and lists of them, a dict in a list an
    inline table (``options = [{ precision = "int8", … }]``). For the configs a command writes
    for another to read (an experiment's plan, simulation and cluster files)."""

    def key(raw: str) -> str:
        return raw if re.fullmatch(r"[A-Za-z0-9_-]+", raw) else json.dumps(raw)

    def scalar(raw: object) -> str:
        if isinstance(raw, float) and not math.isfinite(raw):
            raise ValueError(f"TOML has no {raw!r} here")
        if isinstance(raw, list | tuple):
            return "[" + ", ".join(scalar(item) for item in raw) + "]"
        if isinstance(raw, Mapping):
            return "{ " + ", ".join(f"{key(k)} = {scalar(v)}" for k, v in raw.items()) + " }"
        return json.dumps(raw)  # a number, a boolean or a basic string: TOML's spelling too

    def table(name: str, body: Mapping[str, object]) -> list[str]:
        plain = [f"{key(k)} = {scalar(v)}" for k, v in body.items() if not isinstance(v, dict)]
        lines = [f"[{name}]", *plain, ""] if plain and name else [*plain, ""] if plain else []
        for k, sub in body.items():
            if isinstance(sub, dict):
                lines += table(f"{name}.{key(k)}" if name else key(k), sub)
        return lines

    return "\n".join(table("", doc))
