"""Figure 11: when to freeze on real data: accuracy against the fixed T0, each rule's choice marked.

Drawn from a freeze-rule study's exported tables alone (no run directories): ``choices.json``
(the tuning stage's validation score of every fixed T0 of the grid, tuning seed) and
``rule_regret.json`` (:mod:`real_data.study.rule_report`: every final run's T0, validation and
test score). One row per setting (sweep and alpha), two panels:

- left, validation accuracy (mean of the last 5 evaluations) against T0: the grid's fixed T0
  values on the tuning seed (line, the chosen T0 starred), and on the final seeds every method
  at the T0 it ran with (never freezing at T): the mean over seeds, with bars from the
  smallest to the largest T0 a rule chose and +- one standard deviation of the score;
- right, test accuracy of the same final runs: the methods at their T0, the target (the best
  fixed T0, never freezing included) as a horizontal line, so a point's drop below it is its
  regret.

    linattn figure 11 --real-data docs/study/freeze_rules
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from figures.common import FigureError, FigureOutput, run_folder_standalone
from figures.style import new_figure, save, series_style

NAME = "fig11_freeze_timing"


def _find(folder: Path, name: str) -> Path | None:
    for path in (folder / name, folder / "tables" / name):
        if path.is_file():
            return path
    return None


def has_report(folder: Path) -> bool:
    """``folder`` (or its ``tables/``) holds a freeze-rule report to draw."""
    return Path(folder).is_dir() and _find(Path(folder), "rule_regret.json") is not None


def load(folder: Path) -> tuple[dict, dict | None]:
    """(the rule report, the tuning choices or None) of a study's export folder or out_dir."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FigureError(f"--real-data {folder}: no such folder; give a freeze-rule study's "
                          "export folder (e.g. docs/study/freeze_rules) or its out_dir")
    report_path = _find(folder, "rule_regret.json")
    if report_path is None:
        raise FigureError(f"--real-data {folder}: no rule_regret.json in it or in its tables/; "
                          "run `linattn study --plan PLAN --stage final --aggregate-only "
                          "--export DIR` for a plan with online freeze rules first")
    try:
        report = json.loads(report_path.read_text())
        choices_path = _find(folder, "choices.json")
        choices = json.loads(choices_path.read_text()) if choices_path else None
    except (OSError, ValueError) as exc:
        raise FigureError(f"--real-data {folder}: cannot read its tables ({exc})") from None
    if not isinstance(report, dict) or "settings" not in report:
        raise FigureError(f"{report_path}: not a rule report (no 'settings' key)")
    return report, choices


def grid_curve(choices: dict | None, sweep: str, alpha, arm: str) -> list[tuple[int, float]]:
    """(T0, validation score) of every candidate of ``arm``'s tuning, by T0."""
    if not choices:
        return []
    for c in choices.get("choices", []):
        if c.get("sweep") == sweep and c.get("alpha") == alpha and c.get("arm") == arm:
            return sorted((k["warmup_rounds"], k["score"]) for k in c.get("candidates", [])
                          if k.get("warmup_rounds") is not None and k.get("score") is not None)
    return []


def _point(ax, m, key, style, label):
    seeds = [p for p in m["per_seed"] if p.get(key) is not None and np.isfinite(p[key])]
    if not seeds:
        return
    t0 = np.array([p["t0"] for p in seeds], dtype=float)
    y = np.array([p[key] for p in seeds], dtype=float)
    x = float(t0.mean())
    ax.errorbar([x], [y.mean()], yerr=[[y.std()], [y.std()]],
                xerr=[[x - t0.min()], [t0.max() - x]], fmt=style.get("marker", "o"),
                color=style["color"], ms=5, capsize=2, label=label)


def make(folder: Path, out_dir=None) -> FigureOutput:
    report, choices = load(folder)
    settings = [s for s in report["settings"] if s.get("methods")]
    if not settings:
        raise FigureError(f"--real-data {folder}: its rule report has no setting with "
                          "finished runs to draw")
    fig, axes = new_figure(ncols=2, width=4.6, height=3.3, nrows=len(settings))
    axes = np.atleast_2d(axes)
    names = [m["method"] for m in settings[0]["methods"]]
    lines = []
    for row, st in zip(axes, settings):
        alpha = "natural" if st["alpha"] is None else f"alpha={st['alpha']}"
        fixed = next((m["method"] for m in st["methods"] if m["kind"] == "fixed T0"), None)
        curve = grid_curve(choices, st["sweep"], st["alpha"], fixed) if fixed else []
        val_ax, test_ax = row
        if curve:
            val_ax.plot([c[0] for c in curve], [c[1] for c in curve], color="0.6", lw=1.2,
                        marker=".", label="fixed T0 grid (tuning seed)")
            if st.get("chosen_grid_t0") is not None:
                best = dict(curve).get(st["chosen_grid_t0"])
                if best is not None:
                    val_ax.plot([st["chosen_grid_t0"]], [best], "*", color="0.3", ms=10,
                                label=f"grid choice T0 = {st['chosen_grid_t0']}")
        for m in st["methods"]:
            style = series_style(names.index(m["method"]) if m["method"] in names else 0)
            if m["kind"] == "online":
                style = dict(style, marker="os^Dv<>"[names.index(m["method"]) % 7])
            t0s = sorted(set(m["t0_per_seed"]))
            label = f"{m['method']} (T0 {', '.join(str(t) for t in t0s)})"
            _point(val_ax, m, "val_score", style, label)
            _point(test_ax, m, "score", style, label)
        target = st.get("target")
        tm = next((m for m in st["methods"] if m["method"] == target), None)
        if tm is not None and tm["score_mean"] is not None:
            test_ax.axhline(tm["score_mean"], color="0.2", lw=0.8, ls="--",
                            label=f"target: {target} (T0 = {st['target_t0']})")
        for ax, what in ((val_ax, "validation"), (test_ax, "test")):
            ax.axvline(st["rounds"], color="0.8", lw=0.8, ls=":")
            ax.set_xlabel("warm-up rounds T0 (T: never frozen)")
            ax.set_ylabel(f"{what} accuracy (last 5 evals)")
            ax.set_title(f"{st['sweep']}, {alpha}: {what}", fontsize=8)
        test_ax.legend(fontsize=5.5, loc="lower right")
        val_ax.legend(fontsize=5.5, loc="lower right")
        best = sorted((m for m in st["methods"] if m["kind"] == "online"
                       and m["regret_pts"] is not None), key=lambda m: m["regret_pts"])
        if best:
            lines.append(f"{st['sweep']} {alpha}: target T0 = {st['target_t0']}, lowest "
                         f"regret {best[0]['method']} ({best[0]['regret_pts']:+.2f} pts)")
    paths = save(fig, NAME, out_dir, dpi=100)
    caption = ("Freeze timing on real data: validation accuracy against T0 (the fixed-T0 grid "
               "on the tuning seed; every method on the final seeds at the T0 it ran with) and "
               "the final runs' test accuracy against the target; " + "; ".join(lines) + ".")
    return FigureOutput(11, NAME, tuple(paths), caption)


def main(argv=None) -> int:
    return run_folder_standalone(make, __doc__, "a freeze-rule study's export folder or "
                                 "out_dir", argv)


if __name__ == "__main__":
    raise SystemExit(main())
