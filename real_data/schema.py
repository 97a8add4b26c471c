"""Type checking of config mappings against frozen dataclasses.

Every value is checked against its field's annotation (``int``, ``float``, ``str``, ``bool``,
``Literal``, unions, tuples); floats must be finite. Errors are
:class:`~linattn.errors.ConfigError` naming the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal

from linattn.errors import ConfigError


def _describe(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp, key: str) -> Any:
    """``value`` if it has the type ``tp`` (a float field takes an int, as a float)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and isinstance(value, type(typing.get_args(tp)[0])):
            return value
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return check_value(value, arg, key)
            except ConfigError:
                continue
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return dict(value)
    elif origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis and isinstance(value, list | tuple):
            return tuple(check_value(v, args[0], key) for v in value)
        if isinstance(value, list | tuple) and len(value) == len(args):
            return tuple(check_value(v, a, key) for v, a in zip(value, args))
    raise ConfigError(f"{key}={value!r} has the wrong type; expected {_describe(tp)}")


def build_dataclass(cls: type, data: dict | None, prefix: str, whose: str = ""):
    """Instantiate ``cls`` from a mapping, checking keys and types; errors name ``prefix.key``
    (``whose``: what the valid keys belong to, said beside ``prefix`` in the unknown-key
    error, e.g. ``algorithm.name=fedavg``)."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key(s) {', '.join(where + k for k in unknown)}; valid keys "
                          f"in {prefix or 'the top level'}{f' ({whose})' if whose else ''}: "
                          f"{', '.join(sorted(fields)) or 'none'}")
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        kwargs[k] = finite(check_value(v, hints[k], key), key)
    return cls(**kwargs)


def finite(value: Any, key: str) -> Any:
    """``value``, unless it is (or holds) a NaN or an infinity: no setting of ours takes one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if isinstance(value, tuple):
        for v in value:
            finite(v, key)
    return value


# a run's name becomes part of a directory name: one path component, no separators
_NAME = re.compile(r"[A-Za-z0-9_.+=-]+")


def check_name(value: str, key: str) -> str:
    """``value`` if it is a plain file name (letters, digits, ``_ . + = -``; not ``.``/``..``)."""
    if not (isinstance(value, str) and _NAME.fullmatch(value) and value not in (".", "..")):
        raise ConfigError(f"{key}={value!r} must be a plain name (letters, digits, _ . + = -; "
                          "no path separators, not . or ..)")
    return value
