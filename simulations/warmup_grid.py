"""The warm-up grid: the path-local bound (eqs. 31-35) and the probe estimator (eq. 36) on
settings that differ from the validation grid (:mod:`simulations.grid`) in every factor.

28 + 8 (+ 12 + 24 + 24 + 24) settings of a fractional design over dimension d, clients C, context
length n, covariate shift rho, heterogeneity zeta (kernel and value), local steps K, step size eta,
horizon T and the problem seed; no level is one of the validation grid's. Each factor's levels
appear equally often, in an order shuffled per factor by a fixed generator
(:func:`warmup_settings`).
Settings 20..27 are the held-out part (the bound was fixed before they were run) and 28..35
the fresh part, a second design run only after the probe estimator was fixed; every part is
reported. Settings 36..47 (fresh2, a third design, ``count=48``) ran once, after the adaptive
probe length of :func:`linattn_theory.probe.probe_length` was fixed on the development part;
settings 48..71 (fresh3, a fourth design of 24, ``count=72``) ran once, after the probe of
T / 10 rounds (``probe_fraction=0.1``) was fixed on settings 0..47; settings 72..95 (fresh4, a
fifth design of 24, ``count=96``) ran once, after the finite-sample oracle ceiling
(:mod:`simulations.probe_ceiling`) was measured on settings 0..71; settings 96..119 (fresh5, a
sixth design of 24, ``count=120``) ran once, after the probe's tie-break among equal smoothed
predictions (``tie_break="own"``) was measured on settings 0..95.

Measured per setting (exact population dynamics for every T0 in 0..T):
- validity: E(T0) >= R(T0) at every T0;
- tightness: E / R at the exact best T0;
- agreement: the bound's argmin within a factor 2 of the exact argmin (T0 = 0 counted as 1);
- the probe estimator's T0 (finite-sample numpy run, fixed seed): its excess R(T0_probe) / R*
  - 1 and R(T0_probe) / R(T).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.advice import PROBE_DEFAULTS
from linattn_theory.dynamics import initial_point
from linattn_theory.errors import ParameterError
from linattn_theory.problem import make_problem
from linattn_theory.profile import solve_profile
from linattn_theory.sampled import probe_run
from linattn_theory.warmup_path import warmup_path

SETTINGS = 28
HELD_OUT = 8
LEVELS = {
    "dim": (4, 5, 10),
    "num_clients": (6, 12, 20),
    "context_length": (12, 24),
    "covariate_shift": (0.0, 0.25, 0.75),
    "heterogeneity": (0.3, 0.8, 1.5),
    "local_steps": (3, 4, 7),
    "lr": (0.03, 0.04, 0.07),
    "total_rounds": (80, 150, 300),
}
NOISE, RIDGE = 0.2, 0.02
FRESH = 8
FRESH2 = 12
FRESH3 = 24
FRESH4 = 24
FRESH5 = 24
PARTS = ("development", "held_out", "fresh", "fresh2", "fresh3", "fresh4",
         "fresh5")


@dataclass(frozen=True)
class WarmupSetting:
    """One point of the warm-up grid."""

    index: int
    dim: int
    num_clients: int
    context_length: int
    covariate_shift: float
    heterogeneity: float
    local_steps: int
    lr: float
    total_rounds: int

    @property
    def label(self) -> str:
        return (f"d={self.dim},C={self.num_clients},n={self.context_length},"
                f"rho={self.covariate_shift:g},zeta={self.heterogeneity:g},"
                f"K={self.local_steps},lr={self.lr:g},T={self.total_rounds}")

    @property
    def part(self) -> str:
        """``development`` (0..19), ``held_out`` (20..27), ``fresh`` (28..35), ``fresh2``
        (36..47), ``fresh3`` (48..71), ``fresh4`` (72..95) or ``fresh5`` (96..119)."""
        if self.index >= SETTINGS + FRESH + FRESH2 + FRESH3 + FRESH4:
            return "fresh5"
        if self.index >= SETTINGS + FRESH + FRESH2 + FRESH3:
            return "fresh4"
        if self.index >= SETTINGS + FRESH + FRESH2:
            return "fresh3"
        if self.index >= SETTINGS + FRESH:
            return "fresh2"
        if self.index >= SETTINGS:
            return "fresh"
        return "held_out" if self.index >= SETTINGS - HELD_OUT else "development"

    @property
    def held_out(self) -> bool:
        return self.part != "development"

    def problem(self):
        return make_problem(dim=self.dim, num_clients=self.num_clients,
                            context_length=self.context_length,
                            kernel_heterogeneity=self.heterogeneity,
                            value_heterogeneity=self.heterogeneity,
                            covariate_shift=self.covariate_shift, ridge=RIDGE, noise=NOISE,
                            seed=100 + self.index)


def _design(count: int, offset: int, first: int) -> list[WarmupSetting]:
    columns = {}
    for f, (name, levels) in enumerate(LEVELS.items()):
        column = np.resize(np.arange(len(levels)), count)
        np.random.default_rng(offset + f).shuffle(column)
        columns[name] = [levels[j] for j in column]
    return [WarmupSetting(index=first + i, **{k: v[i] for k, v in columns.items()})
            for i in range(count)]


def warmup_settings(count: int = SETTINGS + FRESH) -> list[WarmupSetting]:
    """The design: each factor's levels repeated to 28 entries and shuffled by a generator
    seeded with the factor's position (balanced levels, fixed design); the fresh part is a
    second such design of 8 (generators seeded 100 + position), the fresh2 part a third of 12
    (generators seeded 200 + position), the fresh3 part a fourth of 24 (generators seeded
    300 + position), the fresh4 part a fifth of 24 (generators seeded 400 + position) and the
    fresh5 part a sixth of 24 (generators seeded 500 + position), evaluated only when asked
    for: the first ``count`` (36 by default, 48 with fresh2, 72 with fresh3, 96 with fresh4,
    120 with fresh5)."""
    settings = (_design(SETTINGS, 0, 0) + _design(FRESH, 100, SETTINGS)
                + _design(FRESH2, 200, SETTINGS + FRESH)
                + _design(FRESH3, 300, SETTINGS + FRESH + FRESH2)
                + _design(FRESH4, 400, SETTINGS + FRESH + FRESH2 + FRESH3)
                + _design(FRESH5, 500, SETTINGS + FRESH + FRESH2 + FRESH3 + FRESH4))
    return settings[:count]


def _factor(a: int, b: int) -> float:
    a, b = max(a, 1), max(b, 1)
    return max(a, b) / min(a, b)


def evaluate_setting(st: WarmupSetting, probe: bool = True, seed: int = 0,
                     probe_options: dict | None = None) -> dict:
    """Bound and probe numbers of one setting (see the module docstring); ``probe_options``
    replace entries of :data:`~linattn_theory.advice.PROBE_DEFAULTS`."""
    problem = st.problem()
    start = initial_point(problem)
    star = solve_profile(problem).value
    path = warmup_path(problem, start, st.lr, st.local_steps, st.total_rounds, star)
    r = path.final_error
    best, bound_t0 = path.best_warmup, path.bound_warmup
    norm_t0 = int(np.argmin(path.norm_bound))
    row = {"setting": st.label, "part": st.part, "held_out": st.held_out, "exact_T0": best,
           "R_min": float(r[best]), "R_never": float(r[-1]), "R_zero": float(r[0]),
           "bound_T0": bound_t0, "valid": bool(np.all(path.bound >= r)),
           "violations": int(np.sum(path.bound < r)),
           "tightness": float(path.bound[best] / r[best]),
           "factor": _factor(bound_t0, best), "within_factor_2": _factor(bound_t0, best) <= 2,
           "norm_bound_valid": bool(np.all(path.norm_bound >= r)),
           "norm_bound_tightness": float(path.norm_bound[best] / r[best]),
           "norm_bound_T0": norm_t0, "norm_within_factor_2": _factor(norm_t0, best) <= 2}
    if probe:
        try:
            run = probe_run(problem, start, st.lr, st.local_steps, st.total_rounds, seed=seed,
                            **{**PROBE_DEFAULTS, **(probe_options or {})})
        except ParameterError as exc:   # the finite-sample run diverged: a miss, not a skip
            row.update({"probe_T0": None, "probe_excess": float("inf"),
                        "probe_vs_never": float("inf"), "probe_within_10pct": False,
                        "probe_not_worse_5pct": False, "probe_compute": float("nan"),
                        "probe_error": str(exc)})
            return row
        t0 = run.choice.warmup_rounds
        row.update({"probe_T0": t0, "probe_excess": float(r[t0] / r[best] - 1),
                    "probe_vs_never": float(r[t0] / r[-1]),
                    "probe_within_10pct": bool(r[t0] <= 1.1 * r[best]),
                    "probe_not_worse_5pct": bool(r[t0] <= 1.05 * r[-1]),
                    "probe_compute": run.rounds_computed["fedavg_equivalent"]})
    return row


def _summary(rows: list[dict]) -> dict:
    if not rows:
        return {}
    out = {"settings": len(rows),
           "validity_rate": float(np.mean([r["valid"] for r in rows])),
           "median_tightness": float(np.median([r["tightness"] for r in rows])),
           "max_tightness": float(np.max([r["tightness"] for r in rows])),
           "within_factor_2_rate": float(np.mean([r["within_factor_2"] for r in rows])),
           "norm_bound_validity_rate": float(np.mean([r["norm_bound_valid"] for r in rows])),
           "norm_bound_median_tightness": float(np.median(
               [r["norm_bound_tightness"] for r in rows])),
           "norm_bound_within_factor_2_rate": float(np.mean(
               [r["norm_within_factor_2"] for r in rows]))}
    if "probe_T0" in rows[0]:
        out.update({"probe_within_10pct_rate": float(np.mean(
                        [r["probe_within_10pct"] for r in rows])),
                    "probe_not_worse_5pct_rate": float(np.mean(
                        [r["probe_not_worse_5pct"] for r in rows])),
                    "probe_median_excess": float(np.median([r["probe_excess"] for r in rows])),
                    "probe_max_vs_never": float(np.max([r["probe_vs_never"] for r in rows])),
                    "probe_median_compute": float(np.nanmedian(
                        [r["probe_compute"] for r in rows])),
                    "probe_diverged": int(sum("probe_error" in r for r in rows))})
    return out


def run_warmup_grid(count: int = SETTINGS + FRESH, probe: bool = True,
                    part: str = "all", quick: bool = False,
                    probe_options: dict | None = None) -> dict:
    """Evaluate the first ``count`` settings of the grid; ``part`` is one of :data:`PARTS` or
    ``all``; ``quick`` keeps the 4 cheapest of them (smallest T, then d C; for tests);
    ``probe_options`` replace entries of the probe's defaults (:func:`evaluate_setting`).

    Returns ``points`` (one row per setting; a setting whose exact dynamics diverge has
    ``error`` and is left out of the summaries) and ``summary`` per part and for all.
    """
    rows = []
    settings = warmup_settings(count)
    if quick:
        settings = sorted(settings, key=lambda x: (x.total_rounds, x.dim * x.num_clients))[:4]
    for st in settings:
        if part != "all" and st.part != part:
            continue
        try:
            rows.append(evaluate_setting(st, probe, probe_options=probe_options))
        except ParameterError as exc:
            rows.append({"setting": st.label, "part": st.part, "held_out": st.held_out,
                         "error": str(exc)})
    ok = [r for r in rows if "error" not in r]
    summary = {"all": _summary(ok)}
    summary.update({name: _summary([r for r in ok if r["part"] == name]) for name in PARTS})
    return {"points": rows, "summary": summary,
            "unstable": [r["setting"] for r in rows if "error" in r]}
