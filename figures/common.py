"""What the figure scripts share: the validation grid's problems and settings, the cached
validation result, and the command line of a standalone figure script.

The validation result is ``simulations.validate.run_validation(grid)`` itself (P1-P6 are never
re-implemented here). It is cached by a hash of the grid and of the theory/simulator sources
(:mod:`figures.cache`) and written with the simulator's own writer
(``simulations.report.write_validation``) to ``<out>/validation/validation.json``, the file
whose numbers the report repeats.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from figures.cache import cached, jsonable
from figures.style import OUT_DIR
from linattn_theory.problem import Problem, make_problem
from simulations.engine import Setting
from simulations.validate import Grid


class FigureError(ValueError):
    """Bad input to a figure or to ``linattn reproduce`` (exit status 2)."""

    user_error = True


@dataclass(frozen=True)
class FigureOutput:
    """One drawn figure: its files, the caption line of the report and optional extra lines.

    ``number`` is the figure's number in the issue (1-8); ``cache_hits`` tells which of its
    intermediate results came from the cache.
    """

    number: int
    name: str
    paths: tuple[Path, ...]
    caption: str
    extra: str = ""
    cache_hits: dict = field(default_factory=dict)


def grid_for(quick: bool) -> Grid:
    """The default validation grid, or ``Grid.quick()`` for the smoke version."""
    return Grid.quick() if quick else Grid()


def grid_problem(grid: Grid, heterogeneity: float, context_length: int | None = None,
                 num_clients: int | None = None, covariate_shift: float | None = None) -> Problem:
    """The problem of the validation grid at zeta_K = zeta_V = ``heterogeneity``.

    The same arguments as ``simulations.validate`` passes to ``make_problem``, so the settings
    built here are the validation's settings.
    """
    return make_problem(
        dim=grid.dim, num_clients=num_clients or grid.num_clients,
        context_length=context_length or grid.context_length,
        kernel_heterogeneity=heterogeneity, value_heterogeneity=heterogeneity,
        covariate_shift=grid.covariate_shift if covariate_shift is None else covariate_shift,
        ridge=grid.ridge, noise=grid.noise, seed=grid.problem_seed)


def grid_setting(grid: Grid, heterogeneity: float, local_steps: int, lr: float,
                 problem: Problem | None = None, **overrides) -> Setting:
    """A :class:`Setting` of the validation grid (schedule and data sizes from ``grid``)."""
    args = dict(problem=problem or grid_problem(grid, heterogeneity), lr=lr,
                local_steps=local_steps, batch_size=grid.batch_size,
                total_rounds=grid.total_rounds, warmup_rounds=tuple(grid.warmup_grid),
                samples_per_client=grid.samples_per_client, test_samples=grid.test_samples,
                label=f"zeta={heterogeneity:g},K={local_steps},lr={lr:g}")
    args.update(overrides)
    return Setting(**args)


def cache_config(grid: Grid, **extra) -> dict:
    """The configuration a cached result is keyed by: the grid plus what else it depends on."""
    return {"grid": asdict(grid), **extra}


def validation(grid: Grid, out_dir: Path | None = None, cache_dir: Path | None = None,
               write: bool = True) -> tuple[dict, bool, float]:
    """``run_validation(grid)``, cached; returns ``(result, cache_hit, seconds)``.

    With ``write`` the result is written by ``simulations.report.write_validation`` to
    ``<out_dir>/validation/`` (``validation.json``, ``validation.md``, two figures).
    """
    from simulations.validate import run_validation

    clock = time.perf_counter()
    result, hit = cached("validation", cache_config(grid),
                         lambda: jsonable(run_validation(grid)),
                         cache_dir_for(out_dir, cache_dir))
    if write:
        _write_validation(result, Path(out_dir or OUT_DIR) / "validation")
    return result, hit, time.perf_counter() - clock


def _write_validation(result: dict, folder: Path) -> None:
    """``write_validation`` unless ``folder`` already holds this very result (a cache hit)."""
    import json

    from simulations.report import write_validation

    target = folder / "validation.json"
    if target.is_file() and (folder / "validation.md").is_file():
        try:
            if json.loads(target.read_text()) == json.loads(json.dumps(result)):
                return
        except json.JSONDecodeError:
            pass
    write_validation(result, folder)


def cache_dir_for(out_dir: Path | None, cache_dir: Path | None) -> Path:
    """Where cached results live: ``cache_dir``, else ``<out_dir>/.cache``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(out_dir or OUT_DIR) / ".cache"


def check_points(result: dict, name: str) -> list[dict]:
    return result["checks"][name]["points"]


def p2_rows(result: dict) -> dict[str, dict]:
    """The P2 rows (one per grid setting) by setting label."""
    return {row["setting"]: row for row in check_points(result, "P2")}


def base_rows(result: dict, grid: Grid) -> list[dict]:
    """P2 rows of the base factorial (default n, C and rho)."""
    return [r for r in check_points(result, "P2")
            if r["context_length"] == grid.context_length and r["num_clients"] == grid.num_clients
            and r["covariate_shift"] == grid.covariate_shift]


def finite(values) -> np.ndarray:
    """A float array with None (JSON null for NaN) turned back into NaN."""
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


# --------------------------------------------------------------------- standalone scripts


def parser(description: str, real_data: bool = False) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=description)
    top.add_argument("--quick", action="store_true", help="the small grid (seconds)")
    top.add_argument("--out", type=Path, default=None, help="output folder (default figures/out)")
    top.add_argument("--cache", type=Path, default=None, help="cache folder (default OUT/.cache)")
    top.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    if real_data:
        top.add_argument("runs", type=Path, help="a folder of run directories (or a study's)")
    return top


def set_threads(threads: int) -> None:
    import torch

    if threads < 1:
        raise FigureError(f"--threads={threads} is not allowed; --threads must be >= 1")
    torch.set_num_threads(threads)


def run_standalone(make, description: str, argv=None) -> int:
    """``python -m figures.figN_...``: compute (or read the cache) and draw one figure.

    ``make(result, grid, out_dir, cache_dir)`` draws the figure from a validation result.
    """
    args = parser(description).parse_args(argv)
    set_threads(args.threads)
    grid = grid_for(args.quick)
    result, _, _ = validation(grid, args.out, args.cache, write=False)
    fig = make(result, grid, args.out, cache_dir_for(args.out, args.cache))
    print("\n".join(str(p) for p in fig.paths))
    print(fig.caption)
    return 0


def run_folder_standalone(make, description: str, folder_help: str, argv=None) -> int:
    """``python -m figures.figN_...`` of a figure drawn from a folder of runs or tables:
    ``make(folder, out_dir)``; prints the files written and the caption."""
    top = argparse.ArgumentParser(description=description,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("folder", type=Path, help=folder_help)
    top.add_argument("--out", type=Path, default=None, help="output folder (default figures/out)")
    args = top.parse_args(argv)
    fig = make(args.folder, args.out)
    print("\n".join(str(p) for p in fig.paths))
    print(fig.caption)
    return 0


def fmt(value) -> str:
    """A number as the report prints it: 4 significant digits (as ``validation.md``)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def pct(rate) -> str:
    """A rate in [0, 1] as a percentage (the report's numbers stay those of the JSON)."""
    return "n/a" if rate is None else f"{100 * rate:.4g}%"
