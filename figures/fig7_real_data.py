"""Figure 7: real data, read from run directories (``linattn run``/``sweep``/``study`` outputs).

A run directory holds ``config.yaml``, ``metrics.csv`` (long format: round, client, metric,
value; client ``global`` or an id) and ``summary.json``. Every run directory under RUNS_DIR is
read (a study's ``out_dir`` works as is). Runs are grouped into conditions (a study's
``<sweep>/alpha=<a>`` or ``<sweep>/natural``, else data set and partition) and arms (a study's
arm name, else the algorithm), and seeds are averaged (mean +- std). One row of panels per
condition:

1. global test accuracy per round, one curve per arm (for a FedFrozen T0 sweep: the T0 closest
   to the recommended one, else the best);
2. the T0 sweep: final test error 1 - accuracy against T0 (a U-curve when an interior T0 is
   best), the other arms as horizontal lines, the recommended T0 (``algorithm.warmup=auto``
   runs: the T0 their probe chose) as a vertical line, and each online freeze rule
   (``algorithm.warmup=<rule>``) as a point at the mean T0 it chose and its mean final error;
3. stability: the gradient-norm jump after aggregation per round;
4. stability: the relative dispersion of the client updates per round.

    python -m figures.fig7_real_data RUNS_DIR [--out DIR]
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from figures.common import FigureError, FigureOutput, fmt, run_folder_standalone
from figures.style import new_figure, save, series_style
from linattn.configio import load_yaml

NAME = "fig7_real_data"
# a study run's key: <arm>[-T0=<t>]/(alpha=<a> | natural)/seed=<s> (real_data.study._key)
STUDY_KEY = re.compile(r"^(?P<arm>[^/]+?)(-T0=(?P<t0>\d+))?/"
                       r"(alpha=(?P<alpha>[^/]+)|(?P<natural>natural))/seed=\d+$")
LAST_ROUNDS = 10


@dataclass
class Run:
    """One run directory: its config, summary and global metric series (round -> value)."""

    path: Path
    config: dict
    summary: dict
    series: dict[str, dict[int, float]]
    condition: str = ""
    arm: str = ""
    warmup_rounds: int | None = None  # T0 of a fixed-T0 FedFrozen run
    recommended: int | None = None  # T0 chosen by an auto run's probe
    decided: int | None = None  # T0 an online freeze rule chose (T: it never fired)

    def curve(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        values = self.series.get(metric, {})
        rounds = np.array(sorted(values), dtype=int)
        return rounds, np.array([values[r] for r in rounds], dtype=float)

    def final(self, metric: str) -> float:
        _, values = self.curve(metric)
        return float(values[-1]) if values.size else np.nan


@dataclass
class Arm:
    name: str
    runs_by_t0: dict = field(default_factory=dict)  # T0 (None if no sweep) -> [Run]

    @property
    def is_sweep(self) -> bool:
        return any(t0 is not None for t0 in self.runs_by_t0)


def find_runs(root: Path) -> tuple[list[Run], list[str]]:
    """Every completed run directory under ``root``; returns (runs, notes on skipped ones)."""
    root = Path(root)
    if not root.is_dir():
        raise FigureError(f"--real-data {root}: no such folder; give a folder of run "
                          "directories (e.g. a study's out_dir)")
    runs, notes = [], []
    for metrics in sorted(root.rglob("metrics.csv")):
        folder = metrics.parent
        if "checkpoints" in folder.parts or not (folder / "config.yaml").is_file():
            continue
        with open(metrics, newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or "client" not in reader.fieldnames:
                notes.append(f"{folder}: not a real-data run (no client column), skipped")
                continue
            series: dict[str, dict[int, float]] = {}
            for row in reader:
                if row["client"] == "global":
                    series.setdefault(row["metric"], {})[int(row["round"])] = float(row["value"])
        summary_path = folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        if summary.get("status") != "completed":
            notes.append(f"{folder}: status {summary.get('status', 'unknown')}, skipped")
            continue
        if not series.get("test_acc"):  # a tuning run reads the validation split only
            notes.append(f"{folder}: no test accuracy (eval.test=false: a tuning run), skipped")
            continue
        run = Run(folder, load_yaml(folder / "config.yaml") or {}, summary,
                  series)
        _label(run, folder.relative_to(root) if folder != root else Path(folder.name))
        runs.append(run)
    if not runs:
        raise FigureError(f"--real-data {root}: no completed run directory (config.yaml, "
                          "metrics.csv, summary.json with status completed) found under it")
    return runs, notes


def _label(run: Run, rel: Path) -> None:
    """Condition, arm and T0 of a run, from a study's layout if it has one, else its config."""
    cfg = run.config
    algo = cfg.get("algorithm", {})
    part = cfg.get("partition", {})
    if algo.get("name") == "fedfrozen":
        if algo.get("warmup") == "auto":
            chosen = run.summary.get("warmup", {}).get("warmup_rounds")
            if chosen is None:
                chosen = run.final("warmup_rounds_recommended")
            run.recommended = None if chosen is None or np.isnan(chosen) else int(chosen)
        elif algo.get("warmup", "fixed") != "fixed":  # an online freeze rule
            chosen = (run.summary.get("warmup") or {}).get("warmup_rounds")
            run.decided = None if chosen is None else int(chosen)
        else:
            run.warmup_rounds = algo.get("warmup_rounds")
    parts = rel.as_posix().split("/")
    match = STUDY_KEY.match("/".join(parts[-3:])) if len(parts) >= 4 else None
    if match:
        split = "natural" if match["natural"] else f"alpha={match['alpha']}"
        run.condition = f"{'/'.join(parts[:-3])}, {split}"
        run.arm = match["arm"]
        return
    data = cfg.get("data", {}).get("name", "?")
    scheme = part.get("scheme", "?")
    run.condition = data + (f", alpha={part.get('alpha')}" if scheme == "dirichlet"
                            else f", {scheme}")
    name = algo.get("name", "?")
    if name == "fedfrozen":
        name += f"-{algo.get('train', '')}" + ("-auto" if run.recommended is not None else "")
    if part.get("num_clients") == 1:
        name = "reference (1 client)"
    run.arm = name


def group(runs: list[Run]) -> dict[str, dict[str, Arm]]:
    """condition -> arm name -> Arm (runs by T0)."""
    out: dict[str, dict[str, Arm]] = {}
    for run in runs:
        arm = out.setdefault(run.condition, {}).setdefault(run.arm, Arm(run.arm))
        arm.runs_by_t0.setdefault(run.warmup_rounds, []).append(run)
    return out


def recommended_t0(arms: dict[str, Arm]) -> float | None:
    """Mean over the auto runs' seeds of the T0 their probe chose (None without auto runs)."""
    chosen = [r.recommended for a in arms.values() for rs in a.runs_by_t0.values() for r in rs
              if r.recommended is not None]
    return float(np.mean(chosen)) if chosen else None


def _mean_curve(runs: list[Run], metric: str):
    curves = [r.curve(metric) for r in runs]
    curves = [c for c in curves if c[0].size]
    if not curves:
        return None
    length = min(c[0].size for c in curves)
    values = np.stack([c[1][:length] for c in curves])
    return curves[0][0][:length], values.mean(axis=0), values.std(axis=0)


def _shown_t0(arm: Arm, rec: float | None):
    """The T0 drawn as the sweep's curve: closest to the recommendation, else the best."""
    t0s = sorted(t for t in arm.runs_by_t0 if t is not None)
    if rec is not None:
        return min(t0s, key=lambda t: abs(t - rec))
    return max(t0s, key=lambda t: np.mean([r.final("test_acc") for r in arm.runs_by_t0[t]]))


def make(runs_dir: Path, out_dir=None) -> FigureOutput:
    runs, notes = find_runs(runs_dir)
    conditions = group(runs)
    names = sorted({a for arms in conditions.values() for a in arms})
    fig, axes = new_figure(ncols=4, width=3.3, height=3.0, nrows=len(conditions))
    axes = np.atleast_2d(axes)
    for row, (condition, arms) in zip(axes, conditions.items()):
        rec = recommended_t0(arms)
        _accuracy_panel(row[0], arms, names, rec)
        _sweep_panel(row[1], arms, names, rec)
        for ax, metric, label in ((row[2], "grad_norm_jump", "gradient-norm jump after aggr."),
                                  (row[3], "update_dispersion_rel",
                                   "client-update dispersion (relative)")):
            _metric_panel(ax, arms, names, rec, metric, label)
        for ax in row:
            ax.set_title(f"{condition}", fontsize=8)
    # one row of 4 panels per condition: at the default 150 dpi the full study's 8 rows made
    # a 2.4 MB PNG; 100 dpi keeps it small enough for git
    paths = save(fig, NAME, out_dir, dpi=100)
    return FigureOutput(7, NAME, tuple(paths), caption(conditions, runs, runs_dir),
                        extra=table(conditions) + ("\n\n" + "\n".join(f"- {n}" for n in notes)
                                                   if notes else ""))


def _arm_curves(arms, rec):
    for name, arm in arms.items():
        if arm.is_sweep:
            t0 = _shown_t0(arm, rec)
            yield f"{name} (T0={t0})", name, arm.runs_by_t0[t0]
        else:
            yield name, name, [r for rs in arm.runs_by_t0.values() for r in rs]


def _accuracy_panel(ax, arms, names, rec):
    for label, name, runs in _arm_curves(arms, rec):
        curve = _mean_curve(runs, "test_acc")
        if curve is None:
            continue
        style = series_style(names.index(name))
        ax.plot(curve[0], curve[1], ms=3, markevery=max(1, len(curve[0]) // 10), label=label,
                **style)
        ax.fill_between(curve[0], curve[1] - curve[2], curve[1] + curve[2],
                        color=style["color"], alpha=0.15, lw=0)
    ax.set_xlabel("round")
    ax.set_ylabel("global test accuracy")
    ax.legend(fontsize=6, loc="lower right")


def _sweep_panel(ax, arms, names, rec):
    drew = False
    for name, arm in arms.items():
        style = series_style(names.index(name))
        if arm.is_sweep:
            t0s = sorted(t for t in arm.runs_by_t0 if t is not None)
            err = [[1 - r.final("test_acc") for r in arm.runs_by_t0[t]] for t in t0s]
            mean = np.array([np.mean(e) for e in err])
            ax.errorbar(t0s, mean, yerr=[np.std(e) for e in err], capsize=2, ms=4,
                        mfc="white", label=f"{name}: final error vs T0", **style)
            best = t0s[int(np.argmin(mean))]
            ax.plot([best], [mean.min()], "*", ms=11, color="0.4", mec="black",
                    label=f"{name}: best T0 = {best}")
            drew = True
        else:
            runs = [r for rs in arm.runs_by_t0.values() for r in rs]
            chose = [r.decided for r in runs if r.decided is not None]
            err = [1 - r.final("test_acc") for r in runs]
            if chose:  # an online rule: its mean choice, at its mean final error
                ax.errorbar([np.mean(chose)], [np.mean(err)], xerr=[np.std(chose)],
                            yerr=[np.std(err)], fmt="D", ms=5, capsize=2,
                            color=style["color"],
                            label=f"{name}: chose T0 = {np.mean(chose):.0f}")
                drew = True
            else:
                ax.axhline(np.mean(err), lw=1, color=style["color"],
                           linestyle=style["linestyle"], label=name)
    if rec is not None:
        ax.axvline(rec, color="0.2", ls=":", lw=1.2, label=f"recommended T0 = {rec:g}")
    if not drew:
        ax.text(0.5, 0.5, "no T0 sweep in these runs", transform=ax.transAxes, ha="center",
                fontsize=8)
    ax.set_xlabel(r"warm-up rounds $T_0$")
    ax.set_ylabel("final test error (1 - accuracy)")
    ax.legend(fontsize=6, loc="best")


def _metric_panel(ax, arms, names, rec, metric, ylabel):
    drew = False
    for label, name, runs in _arm_curves(arms, rec):
        curve = _mean_curve(runs, metric)
        if curve is None:
            continue
        ax.plot(curve[0], curve[1], ms=3, markevery=max(1, len(curve[0]) // 10), label=label,
                **series_style(names.index(name)))
        drew = True
    if not drew:
        ax.text(0.5, 0.5, f"{metric} not recorded", transform=ax.transAxes, ha="center",
                fontsize=8)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=6, loc="best")


def table(conditions) -> str:
    """Per condition, arm and T0: seeds, final and best accuracy, stability metrics."""
    lines = ["| condition | arm | T0 | seeds | final acc | best acc | acc std (last "
             f"{LAST_ROUNDS}) | worst-10% local acc | mean grad-norm jump | MB up |",
             "|" + "---|" * 10]
    for condition, arms in conditions.items():
        for name, arm in arms.items():
            for t0 in sorted(arm.runs_by_t0, key=lambda t: -1 if t is None else t):
                runs = arm.runs_by_t0[t0]
                cells = [_stat(runs, fn) for fn in (
                    lambda r: r.final("test_acc"),
                    lambda r: np.max(r.curve("test_acc")[1]),
                    lambda r: np.std(r.curve("test_acc")[1][-LAST_ROUNDS:]),
                    lambda r: r.final("local_acc_worst10"),
                    lambda r: _nanmean(r.curve("grad_norm_jump")[1]),
                    lambda r: np.sum(r.curve("bytes_up")[1]) / 1e6)]
                lines.append(f"| {condition} | {name} | {'' if t0 is None else t0} | "
                             f"{len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _nanmean(values: np.ndarray) -> float:
    return float(np.nanmean(values)) if np.any(np.isfinite(values)) else np.nan


def _stat(runs: list[Run], fn) -> str:
    """mean +- std over the seeds of ``fn(run)``, or - when no run has it."""
    v = np.array([fn(r) for r in runs], dtype=float)
    if not np.any(np.isfinite(v)):
        return "-"
    return f"{np.nanmean(v):.4f} +- {np.nanstd(v):.4f}"


def caption(conditions, runs, runs_dir) -> str:
    parts = []
    for condition, arms in conditions.items():
        rec = recommended_t0(arms)
        sweeps = [a for a in arms.values() if a.is_sweep]
        best = []
        for arm in sweeps:
            t0s = sorted(t for t in arm.runs_by_t0 if t is not None)
            acc = [np.mean([r.final("test_acc") for r in arm.runs_by_t0[t]]) for t in t0s]
            best.append(f"{arm.name} best T0 = {t0s[int(np.argmax(acc))]} "
                        f"(final acc {fmt(float(max(acc)))})")
        parts.append(f"{condition}: " + (", ".join(best) if best else "no T0 sweep")
                     + (f", recommended T0 = {rec:g}" if rec is not None else
                        ", no recommended T0 (no warmup=auto run)"))
    return (f"Real data from {len(runs)} completed runs under {runs_dir}: test accuracy per "
            f"round (mean +- std over seeds), final test error against T0, gradient-norm jump "
            f"and client-update dispersion per round. " + "; ".join(parts) + ".")


def main(argv=None) -> int:
    return run_folder_standalone(make, __doc__, "a folder of run directories (or a study's)",
                                 argv)


if __name__ == "__main__":
    raise SystemExit(main())
