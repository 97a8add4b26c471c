"""Intermediate results cached by a hash of their configuration.

``cached(name, config, compute)`` returns ``compute()``'s JSON-serialisable result, stored in
``<cache_dir>/<name>-<hash>.json`` with hash = sha256(config + theory/simulator sources)[:16];
a second call with the same configuration and code reads the file instead of recomputing.
The default cache_dir is ``figures/out/.cache`` under the current directory. Files are written
atomically (mode 0644), so a killed run leaves no half-written entry; integer counts stay
integers.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np

from linattn.fileio import atomic_write_json

# beside the default figures (figures.style.OUT_DIR); relative, so under the current directory
CACHE_DIR = Path("figures") / "out" / ".cache"
_ROOT = Path(__file__).resolve().parent.parent  # the sources fingerprinted, read only


@cache
def code_fingerprint() -> str:
    """sha256 over the sources whose results are cached (theory and simulator)."""
    digest = hashlib.sha256()
    for part in ("linattn_theory", "simulations"):
        for path in sorted((_ROOT / part).rglob("*.py")):
            digest.update(path.relative_to(_ROOT).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def source_digest(*files) -> str:
    """sha256[:16] of source files (a figure passes its own ``__file__``).

    A figure puts this in the configuration of what it caches, so editing the code that
    computes a cached result invalidates it.
    """
    digest = hashlib.sha256()
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def jsonable(x):
    """``x`` with numpy arrays and scalars, tuples and non-str keys turned into JSON types.

    Non-finite floats become None, as in the simulator's ``validation.json``.
    """
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def config_hash(config: dict) -> str:
    blob = json.dumps({"config": config, "code": code_fingerprint()}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached(name: str, config: dict, compute: Callable[[], dict],
           cache_dir: Path | None = None) -> tuple[dict, bool]:
    """Return ``(result, hit)``; ``hit`` tells whether it came from the cache."""
    folder = Path(cache_dir) if cache_dir is not None else CACHE_DIR
    path = folder / f"{name}-{config_hash(config)}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), True
        except json.JSONDecodeError:
            path.unlink()  # a corrupt entry is recomputed
    result = compute()
    atomic_write_json(path, result, indent=None)
    return result, False
