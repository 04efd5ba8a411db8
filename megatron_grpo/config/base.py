"""Strict loading of typed config dataclasses from plain dicts (parsed YAML).

Every config section is a ``@dataclass(kw_only=True)`` whose fields carry an attribute
docstring (a string literal right below the field, torchtitan style). This module:

* builds a section from a dict, rejecting unknown keys (with a "did you mean"), wrong types
  and the ``ValueError``s raised by a section's ``__post_init__``;
* reports every problem as ONE line naming the dotted key (``ConfigError``), to which the
  loader adds the file name;
* never changes a value: an int is accepted where a float is declared (YAML writes ``1`` for
  ``1.0``), and that is the only conversion;
* refuses a non-finite float (``.inf``, ``.nan``) in every float field: a learning rate,
  temperature, timeout or coefficient is never meaningfully infinite, and a field whose limit
  can be switched off takes ``null``;
* reads the field docstrings back (``field_docs``) for the generated reference.

Sections signal a bad value with ``raise ConfigValueError("key", "message")`` (or a plain
``ValueError`` whose text starts with ``"key: "``) so the error names the key exactly.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import pathlib
import textwrap
import types
import typing
from functools import lru_cache
from typing import Any, Literal, Union


class ConfigError(ValueError):
    """A user mistake in a config: ``where`` is the dotted key, ``message`` what is wrong."""

    def __init__(self, where: str, message: str, source: str | None = None):
        self.where = where
        self.message = message
        self.source = source
        super().__init__(self.one_line())

    def one_line(self) -> str:
        head = f"{self.source}: " if self.source else ""
        key = f"{self.where}: " if self.where else ""
        return f"{head}{key}{self.message}"

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.where, self.message, source)

    def with_prefix(self, prefix: str) -> "ConfigError":
        where = f"{prefix}.{self.where}" if self.where else prefix
        return ConfigError(where, self.message, self.source)


class ConfigValueError(ValueError):
    """Raised by a section's ``__post_init__``: names the field inside the section."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) if a is not None else "null" for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def type_name(tp: Any) -> str:
    """Human-readable name of a field type, as used in errors and the reference."""
    return _type_name(tp)


def check_value(value: Any, tp: Any, where: str) -> Any:
    """Validate ``value`` against type ``tp``; returns the value (or a built dataclass)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            raise ConfigError(where, f"got {value!r}, expected one of {_type_name(tp)}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(where, f"must not be null (expected {_type_name(tp)})")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_value(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(where, f"got {value!r}, expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(where, f"expected a mapping of keys, got {type(value).__name__} {value!r}")
        return build_section(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(where, f"expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [check_value(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(where, f"expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if value is None:
        raise ConfigError(where, f"must not be null (expected {_type_name(tp)})")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(where, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, f"expected an integer, got {type(value).__name__} {value!r}")
        if not -(2**63) <= value < 2**63:  # torch and numpy overflow past int64
            raise ConfigError(where, f"{value} does not fit a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(where, f"expected a number, got {type(value).__name__} {value!r}")
        if isinstance(value, int) and abs(value) >= 2**63 or not math.isfinite(value):
            # no field means "unbounded" by inf: those take null
            raise ConfigError(where, f"expected a finite number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(where, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {where}")  # a schema bug, not a user error


@lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=False)
    return {k: (v.type if isinstance(v, dataclasses.InitVar) else v) for k, v in hints.items()}


def unknown_key(where: str, key: str, names: list[str]) -> ConfigError:
    """The error of ``key`` (at dotted ``where``), which is none of ``names``: the closest name
    ("did you mean"), or every name when none is close."""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
    return ConfigError(where, f"unknown key{hint}")


def build_section(cls: type, raw: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``raw``; unknown keys, wrong types and bad values raise ConfigError.

    ``where`` is the dotted prefix of this section (``"algorithm"``) used in errors.
    """
    prefix = f"{where}." if where else ""
    hints = field_types(cls)
    names = list(inspect.signature(cls).parameters)  # fields and InitVars (deprecated aliases)
    kwargs = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}{key}", "keys must be strings")
        if key not in names:
            raise unknown_key(f"{prefix}{key}", key, names)
        kwargs[key] = check_value(value, hints[key], f"{prefix}{key}")
    for name, param in inspect.signature(cls).parameters.items():
        if param.default is inspect.Parameter.empty and name not in kwargs:
            raise ConfigError(f"{prefix}{name}", "is required but missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.with_prefix(where) if where else e
    except ConfigValueError as e:
        raise ConfigError(f"{prefix}{e.key}", e.message) from None
    except ValueError as e:
        raise ConfigError(where, str(e)) from None


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (YAML-serialisable), in field order."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: ``{field_name: doc}`` read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def missing_file(path: str, what: str = "") -> "str | None":
    """``"<what> file <absolute path> not found (...)"`` when ``path`` (a relative one resolved
    against the current directory, as every ``path/to/file.py:attr`` spec is) is no file; None
    when it is one. The one wording of the plug-in specs' missing file."""
    resolved = pathlib.Path(path).expanduser().resolve()
    if resolved.is_file():
        return None
    return (f"{what + ' ' if what else ''}file {resolved} not found (a relative path is resolved against the "
            "current directory)")


def check(cond: bool, key: str, message: str) -> None:
    """Raise ConfigValueError(key, message) unless ``cond``: the one-liner sections use."""
    if not cond:
        raise ConfigValueError(key, message)
