"""A minimal TOML writer for the configuration files afl writes (server.toml, client.toml).

Python 3.11 reads TOML with the standard library's ``tomllib`` but cannot write it; this module
emits the small subset afl needs, so no dependency is added: tables of (possibly nested) tables
whose values are str, int, float, bool or lists of those. Keys other than bare ones
([A-Za-z0-9_-]+) are quoted, so a site id with '.' never splits into sub-tables. Output round-trips through ``tomllib.loads``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence

__all__ = ["TomlValue", "TomlWriteError", "dumps"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")

TomlScalar = str | int | float | bool
TomlValue = TomlScalar | Sequence[TomlScalar] | Mapping[str, "TomlValue"]


class TomlWriteError(ValueError):
    """A value of a type this writer does not support (e.g. None, nested lists, bytes)."""


def _key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise TomlWriteError(f"TOML keys must be non-empty str, got {key!r}")
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(value: str) -> str:
    # A JSON string literal is a valid TOML basic string (same escapes, \\uXXXX included),
    # except that TOML also forbids a raw DEL (U+007F).
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TomlWriteError("TOML strings must be valid Unicode (no lone surrogates)") from exc
    return str(json.dumps(value, ensure_ascii=False)).replace("\x7f", "\\u007f")


def _scalar(value: object, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    raise TomlWriteError(f"{where}: unsupported TOML value type {type(value).__name__}")


def _value(value: object, where: str) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_scalar(v, where) for v in value) + "]"
    return _scalar(value, where)


def _table(path: list[str], table: Mapping[str, TomlValue], out: list[str]) -> None:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    if path and (scalars or not tables):
        out.append("[" + ".".join(_key(p) for p in path) + "]")
    for key, value in scalars:
        out.append(f"{_key(key)} = {_value(value, '.'.join([*path, key]))}")
    if path and (scalars or not tables):
        out.append("")
    for key, sub in tables:
        assert isinstance(sub, Mapping)
        _table([*path, key], sub, out)


def dumps(document: Mapping[str, TomlValue], *, header: str = "") -> str:
    """TOML text for ``document``; ``header`` lines become ``#`` comments at the top."""
    out = [f"# {line}".rstrip() for line in header.splitlines()]
    if out:
        out.append("")
    top_scalars = {k: v for k, v in document.items() if not isinstance(v, Mapping)}
    if top_scalars:
        _table([], top_scalars, out)
        out.append("")
    _table([], {k: v for k, v in document.items() if isinstance(v, Mapping)}, out)
    return "\n".join(out).rstrip("\n") + "\n"
