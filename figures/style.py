"""Shared plotting conventions: greyscale-readable lines, PNG + PDF written atomically.

Every figure script draws with :func:`new_figure` and saves with :func:`save`; series are told
apart by line style and marker as well as grey level, so the figures read in greyscale.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from linattn.fileio import atomic_path

# relative, so resolved against the current directory when written: an installed package
# never writes into its own folder
OUT_DIR = Path("figures") / "out"

# (colour, line style, marker) cycled per series; distinguishable without colour
SERIES = [
    ("0.0", "-", "o"),
    ("0.35", "--", "s"),
    ("0.55", "-.", "^"),
    ("0.2", ":", "D"),
    ("0.7", "-", "v"),
    ("0.45", (0, (5, 1, 1, 1)), "P"),
]


def series_style(i: int, marker: bool = True) -> dict:
    """Colour, line style and (unless ``marker=False``) marker of series ``i``."""
    color, ls, mark = SERIES[i % len(SERIES)]
    style = {"color": color, "linestyle": ls}
    if marker:
        style["marker"] = mark
    return style


def new_figure(ncols: int = 1, width: float = 4.6, height: float = 3.4, nrows: int = 1,
               constrained: bool = False):
    """A figure of ``nrows`` x ``ncols`` panels, each ``width`` x ``height`` inches.

    Returns ``(fig, axes)``: axes is 1-D (one row) when ``nrows == 1``, else 2-D. With
    ``constrained`` matplotlib's constrained layout places the panels (then save with
    ``tight=False``).
    """
    plt.rcParams.update({"font.size": 9, "axes.grid": True, "grid.color": "0.9",
                         "legend.frameon": False, "savefig.dpi": 150})
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows),
                             squeeze=False, layout="constrained" if constrained else None)
    return fig, (axes[0] if nrows == 1 else axes)


def save(fig, name: str, out_dir: Path | None = None, tight: bool = True,
         dpi: float | None = None) -> list[Path]:
    """Write ``name.png`` and ``name.pdf`` into ``out_dir`` atomically (mode 0644).

    The default folder is ``figures/out/`` under the current directory.

    ``tight=False`` skips ``tight_layout`` (figures with a colour bar spanning panels);
    ``dpi`` overrides the PNG resolution (default 150).
    """
    out = Path(out_dir) if out_dir is not None else OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    paths = []
    for ext in ("png", "pdf"):
        target = out / f"{name}.{ext}"
        with atomic_path(target) as tmp:
            fig.savefig(tmp, format=ext, **({"dpi": dpi} if dpi and ext == "png" else {}))
        paths.append(target)
    plt.close(fig)
    return paths
