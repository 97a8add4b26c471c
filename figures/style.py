"""Shared plotting conventions: greyscale-readable lines, PNG + PDF written atomically.

Every figure script draws with :func:`new_figure` and saves with :func:`save`; series are told
apart by line style and marker as well as grey level, so the figures read in greyscale.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "out"

# (colour, line style, marker) cycled per series; distinguishable without colour
SERIES = [
    ("0.0", "-", "o"),
    ("0.35", "--", "s"),
    ("0.55", "-.", "^"),
    ("0.2", ":", "D"),
    ("0.7", "-", "v"),
    ("0.45", (0, (5, 1, 1, 1)), "P"),
]


def series_style(i: int) -> dict:
    color, ls, marker = SERIES[i % len(SERIES)]
    return {"color": color, "linestyle": ls, "marker": marker}


def new_figure(ncols: int = 1, width: float = 4.6, height: float = 3.4):
    plt.rcParams.update({"font.size": 9, "axes.grid": True, "grid.color": "0.9",
                         "legend.frameon": False, "savefig.dpi": 150})
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def save(fig, name: str, out_dir: Path | None = None) -> list[Path]:
    """Write ``name.png`` and ``name.pdf`` into ``out_dir`` (default figures/out/) atomically."""
    out = Path(out_dir) if out_dir is not None else OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    paths = []
    for ext in ("png", "pdf"):
        target = out / f"{name}.{ext}"
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=f".{ext}")
        os.close(fd)
        try:
            fig.savefig(tmp, format=ext)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        paths.append(target)
    plt.close(fig)
    return paths
