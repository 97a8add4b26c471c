"""``report.md``: each prediction, its criterion, the numbers and PASS or FAIL, with the figures.

Every number in the P1-P6 table is printed from the validation dict that was written to
``validation/validation.json`` beside the report (4 significant digits, as ``validation.md``);
a refuted prediction is reported as FAIL.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from figures.common import FigureOutput
from linattn.fileio import atomic_write_text
from simulations.report import format_value

# THEORY.md section 4, the predictions the simulator must confirm or refute
PREDICTIONS = {
    "P1": "bias(T0) decreases and drift(T0) increases in T0, and the simulated curves match "
          "the population dynamics within Monte Carlo error",
    "P2": "with heterogeneity, R(T0) is U-shaped and the empirical argmin is within a factor 2 "
          "of the population T0* on >= 90% of the grid",
    "P3": "T0* decreases as zeta, K or eta grow; at zeta = 0 freezing buys nothing (T0* = T or "
          "a flat curve)",
    "P4": "the frozen stage's measured floor equals D_frozen(M) (+ the minibatch noise term) "
          "within Monte Carlo error",
    "P5": "the path-local bound (eq. 35) is never below the exact R(T0) of the population "
          "dynamics (validity 100%); report the tightness bound / R and where its T0* lies",
    "P6": "factored vs merged parametrization: report how far T0* and the curves move",
}
TITLES = {1: "Bias and drift versus T0 (P1)", 2: "Final error versus T0 (P2)",
          3: "Optimal warm-up versus zeta, K, eta (P3)", 4: "Frozen-stage floor versus K (P4)",
          5: "Path-local bound versus exact and measured error (P5)",
          6: "Gradient-norm jumps after aggregation", 7: "Real data",
          8: "Partitions: label mix per client",
          9: "Step-size decay and freezing (exact dynamics)",
          10: "Where freezing pays: covariate shift x teacher heterogeneity",
          11: "When to freeze on real data: accuracy against T0, each rule's choice",
          12: "P3 on real networks: the chosen T0 along K and the step size",
          13: "P3 on real networks: test accuracy against T0, and is it the kernel?",
          14: "The kernel profile on real networks: Phi, bias and drift against T0 (P1)"}


def verdict(check: dict) -> str:
    return {True: "**PASS**", False: "**FAIL**", None: "report"}[check["pass"]]


def _cell(text: str) -> str:
    """Text for a markdown table cell (a literal | would end the cell)."""
    return text.replace("|", "\\|")


def checks_table(result: dict) -> str:
    lines = ["| check | prediction | criterion | measured | result |", "|---|---|---|---|---|"]
    for name, check in result["checks"].items():
        measured = "; ".join(f"{k} = {format_value(v)}" for k, v in check["measured"].items())
        lines.append(f"| {name} | {_cell(PREDICTIONS.get(name, ''))} | "
                     f"{_cell(check['criterion'])} | {measured} | {verdict(check)} |")
    return "\n".join(lines)


def _code_version() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_report(out_dir: Path, result: dict, grid, figures: list[FigureOutput],
                 timing: dict, quick: bool, command: str) -> Path:
    """Write ``out_dir/report.md``; returns its path."""
    import torch

    from simulations.report import points_table

    out_dir = Path(out_dir)
    checks = result["checks"]
    decided = {k: c for k, c in checks.items() if c["pass"] is not None}
    failed = [k for k, c in decided.items() if not c["pass"]]
    summary = ", ".join(f"{k} {verdict(c).strip('*')}" for k, c in checks.items())
    grid_line = ("the quick grid (`Grid.quick()`: a smoke test; its numbers are not the "
                 "validation's)" if quick else "the default validation grid "
                 "(`simulations.validate.Grid()`, the grid of docs/results/validation.md)")
    load = timing.get("load_average", {})
    parts = [
        "# linattn: the reproduce report", "",
        f"Made by `{command}` on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, code version "
        f"`{_code_version()}`, on {platform.platform()} ({os.cpu_count()} CPUs, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, no GPU used). "
        f"Wall time {timing['wall_s']:.1f} s, CPU time {timing['cpu_s']:.1f} s; load average "
        f"(1 min) {load.get('start', float('nan')):.2f} at the start, "
        f"{load.get('end', float('nan')):.2f} at the end.", "",
        f"Grid: {grid_line}; T = {grid.total_rounds} rounds, {grid.seeds} seeds, "
        f"T0 grid {list(grid.warmup_grid)}.", "",
        f"**Summary: {len(decided) - len(failed)} of {len(decided)} checks pass; "
        f"{summary}.**" + (f" Refuted: {', '.join(failed)} (see "
                           "docs/results/validation.md, 'Failures and diagnoses')."
                           if failed else ""), "",
        "## Predictions P1-P6", "",
        "Every number below is printed from the dict written to "
        "[`validation/validation.json`](validation/validation.json) by the simulator's own "
        "writer (`simulations.report.write_validation`; also "
        "[`validation/validation.md`](validation/validation.md)).", "",
        checks_table(result), "",
        "### Per grid point (P2, P3)", "",
        points_table(checks["P2"], ["predicted_T0", "closed_form_T0", "bound_argmin_T0",
                                    "empirical_T0", "factor", "u_shaped"]), "",
        "### Frozen floor (P4)", "",
        points_table(checks["P4"], ["measured_floor", "measured_se", "D_frozen", "noise_term",
                                    "predicted", "ratio_measured_to_predicted", "within"]), "",
        "## Figures", "",
    ]
    for fig in sorted(figures, key=lambda f: f.number):
        png = next(p for p in fig.paths if p.suffix == ".png")
        pdf = next((p for p in fig.paths if p.suffix == ".pdf"), None)
        rel = os.path.relpath(png, out_dir)
        parts += [f"### Figure {fig.number}. {TITLES[fig.number]}", "",
                  f"![Figure {fig.number}]({rel})", "",
                  f"*Figure {fig.number}.* {fig.caption}"
                  + (f" ([PDF]({os.path.relpath(pdf, out_dir)}))" if pdf else ""), ""]
        if fig.extra:
            parts += [fig.extra, ""]
    if 7 not in {f.number for f in figures}:
        parts += ["Figure 7 (real data) is drawn from existing run directories: "
                  "`linattn reproduce --real-data RUNS_DIR`.", ""]
    parts += ["## Timing", "", "| step | seconds | from cache |", "|---|---|---|"]
    for step in timing["steps"]:
        parts.append(f"| {step['name']} | {step['seconds']:.1f} | {step['cache']} |")
    parts += ["", f"Cached intermediate results: `{timing['cache_dir']}` (keyed by a hash of "
              "their configuration and of the theory and simulator sources).", ""]
    path = out_dir / "report.md"
    atomic_write_text(path, "\n".join(parts))
    return path
