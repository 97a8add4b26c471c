"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

Every file is written to a temporary name in its own folder, flushed to disk, given mode 0644
(the temporary files of :func:`tempfile.mkstemp` are 0600) and renamed over the target; on any
error the temporary file is removed and the previous file stays as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

FILE_MODE = 0o644


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise an ``OSError`` without a file name, or about a temporary file beside ``path``,
    as one about ``path`` (the file the user knows; the temporary one is gone by then)."""
    path = Path(path)
    try:
        yield
    except OSError as exc:
        if exc.filename is None or Path(exc.filename).name.startswith(f".{path.name}."):
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path``.

    For writers that need a file name (``savefig``, ``torch.save``). The temporary name keeps
    the target's suffix, so writers that infer a format from it still do. An ``OSError`` (disk
    full, read-only folder) names ``path``, not the temporary file.
    """
    path = Path(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                    suffix=path.suffix)
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (mode 0644)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (mode 0644)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def plain_json(value):
    """``value`` with numpy scalars and arrays as Python numbers and lists.

    Integer counts stay integers (``10``, not ``10.0``); floats stay floats, non-finite ones
    included (written as ``NaN``/``Infinity``, which Python's and most JSON readers accept).
    """
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_json(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return plain_json(value.tolist())
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def atomic_write_json(path: str | os.PathLike, data, *, indent: int = 2) -> None:
    """Write ``data`` as JSON atomically, through :func:`plain_json`."""
    atomic_write_text(path, json.dumps(plain_json(data), indent=indent) + "\n")
