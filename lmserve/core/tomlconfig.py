"""TOML config files, read alike by lm-train and lm-serve: one :class:`ConfigError`, errors that name the file and
the key (or the line, for a file that is not TOML), and the ``--set section.key=value`` syntax.

Each part keeps its own sections and the checks that combine keys; here is what every key needs on its own: to be
known, and of the type its dataclass field (or the part's table of kinds) says.
"""

from __future__ import annotations

import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the file and key."""


def read_toml(path: str | Path) -> dict:
    """The file's tables as written; an unreadable file or bad TOML is an error naming the file (and the line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: config file not found") from e
    except (OSError, UnicodeDecodeError) as e:  # a folder (an empty argument is "."), unreadable, not text
        raise ConfigError(f"{path or repr(path)}: cannot read it as a TOML config file ({e})") from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = re.search(r"\(at line (\d+), column \d+\)$", str(e))
        raise ConfigError(f"{path}{':' + line[1] if line else ''}: not valid TOML: {e}") from e


def parse_override(text: str) -> tuple[str, str, object]:
    """``section.key=value`` (``--set``) -> (section, key, value); the value is read as TOML and falls back to a bare
    string."""
    name, sep, raw = text.partition("=")
    keys = name.strip().split(".")
    if not sep or len(keys) != 2 or not all(keys):
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return keys[0], keys[1], value


def check_keys(table: Mapping, known: typing.Iterable[str], source: object, section: str = "") -> None:
    """Every key of ``table`` (the TOML table ``section``; "" for the file's top level) is one of ``known``."""
    known = list(known)
    for key, value in table.items():
        if key not in known:
            what = f"key {key}" if not section else f"key {section}.{key}"
            if not section and isinstance(value, dict):
                what = f"section [{key}]"
            raise ConfigError(f"{source}: unknown {what}; expected one of {', '.join(known)}")


def check_value(value: object, kind: object, where: str):
    """``value`` as ``kind`` (bool, int, float, str, list[KIND] or dict[str, KIND]) wants it, an integer read as a
    float where a number is expected; otherwise an error ``WHERE = VALUE: expected KIND``."""
    origin = typing.get_origin(kind)
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise ConfigError(f"{where} = {value!r}: expected a list")
        return [check_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(kind)
        if not isinstance(value, dict):
            raise ConfigError(f"{where} = {value!r}: expected a table")
        return {k: check_value(v, item, f"{where}.{k}") for k, v in value.items()}
    if kind not in _KINDS:
        raise TypeError(f"unsupported config type {kind} at {where}")
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = type(value) is kind  # true is not an integer, nor 1 true
    if not ok:
        raise ConfigError(f"{where} = {value!r}: expected {_KINDS[kind]}")
    return float(value) if kind is float else value


def check_table(
    table: object, kinds: Mapping[str, object], source: object, section: str, required: typing.Iterable[str] = ()
) -> dict:
    """The keys of ``table`` (the TOML table ``section``), each checked against its kind in ``kinds``; a key not
    there is an error naming the keys expected, one of ``required`` left out an error naming it."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{section}] must be a table of keys, got {table!r}")
    check_keys(table, kinds, source, section)
    for key in required:
        if key not in table:
            raise ConfigError(f"{source}: {section}.{key} is missing")
    return {key: check_value(value, kinds[key], f"{source}: {section}.{key}") for key, value in table.items()}


def read_section(cls: type, table: object, source: object, section: str):
    """``cls`` (a dataclass) from the TOML table ``section``: its fields are the keys, their types the kinds, their
    defaults what a key left out takes."""
    hints = typing.get_type_hints(cls)
    return cls(**check_table(table, {f.name: hints[f.name] for f in fields(cls)}, source, section))
