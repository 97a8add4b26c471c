"""YAML reading and dotted ``key=value`` overrides, shared by every config in the toolkit.

YAML 1.1 (PyYAML's default) reads ``1e-3`` as a string because it wants a dot in a float; a
learning rate written that way is a float to us, so :func:`load_yaml` resolves the YAML 1.2
float forms too (``1e-3``, ``5E+2``, ``.5``, ``1_000.0`` stays as PyYAML reads it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from linattn.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3``-style numbers as floats."""


_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def parse_yaml(text: str, source: str = "input") -> Any:
    """Parse YAML ``text``; a syntax error names ``source``."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({exc})") from None


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file; a missing, unreadable, non-UTF-8 or malformed file names itself."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc}); check the path") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    return parse_yaml(text, str(path))


def parse_overrides(items: list[str], example: str = "train.lr=0.05") -> list[tuple[str, Any]]:
    """``["a.b=0.1", ...]`` -> ``[("a.b", 0.1), ...]``, each value read as YAML."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. {example})")
        out.append((key, parse_yaml(raw, f"override {key}") if raw.strip() else None))
    return out


def set_dotted(data: dict, key: str, value: Any) -> dict:
    """A copy of the nested mapping ``data`` with the dotted ``key`` set to ``value``."""
    parts = key.split(".")
    out = dict(data)
    node = out
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part} is not a section")
        child = dict(child)
        node[part] = child
        node = child
    node[parts[-1]] = value
    return out
