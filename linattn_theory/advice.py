"""The warm-up length for a problem instance: the exact optimum, the bound that explains it and
the probe estimate a run without the problem would get (docs/theory.md, eqs. 21, 31-36).

``recommend_warmup(problem, ...)`` (Python) and ``linattn warmup --problem FILE`` (command line)
both return :func:`advise_warmup`'s numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from linattn_theory.dynamics import InitialPoint, initial_point
from linattn_theory.errors import require
from linattn_theory.frozen import check_steps
from linattn_theory.problem import Problem
from linattn_theory.profile import solve_profile
from linattn_theory.sampled import probe_run
from linattn_theory.warmup_path import WarmupPath, warmup_path

__all__ = ["WarmupAdvice", "advise_warmup", "PROBE_DEFAULTS"]

PROBE_DEFAULTS = {"batch_size": 256, "samples_per_client": 4096, "validation_fraction": 0.25,
                  "probe_rounds": 10, "patience": 4, "max_rate": 1.0, "margin": 1.0,
                  "window": 4}


@dataclass(frozen=True)
class WarmupAdvice:
    """What :func:`advise_warmup` returns.

    Attributes
    ----------
    warmup_rounds : int
        The headline T0: argmin over T0 in 0..T of the exact R(T0) (eq. 21).
    closed_form : int
        The path-local bound's T0* (argmin of E(T0), eq. 35).
    probe_estimate : int or None
        The probe estimator's T0 on the problem's finite-sample simulator (eq. 36).
    never_freeze_error, recommended_error : float
        R(T) and R(warmup_rounds), exact.
    probe_error : float or None
        R(probe_estimate), exact.
    probe_compute : dict or None
        Rounds the probe run computed (``linattn_theory.sampled.ProbeRun.rounds_computed``).
    path : WarmupPath
        R(T0), the bound and their terms on T0 = 0..T.
    lr, local_steps, total_rounds : float, int, int
    """

    warmup_rounds: int
    closed_form: int
    probe_estimate: int | None
    never_freeze_error: float
    recommended_error: float
    probe_error: float | None
    probe_compute: dict | None
    path: WarmupPath
    lr: float
    local_steps: int
    total_rounds: int

    def explanation(self) -> str:
        p, t0 = self.path, self.warmup_rounds
        gain = 1 - self.recommended_error / self.never_freeze_error \
            if self.never_freeze_error > 0 else 0.0
        lines = [
            f"T0 = {t0} of T = {self.total_rounds} rounds (exact optimum of the population "
            f"dynamics): R(T0) = {self.recommended_error:.4g}, never freezing R(T) = "
            f"{self.never_freeze_error:.4g} ({100 * gain:.1f}% lower)",
            f"  bound (eq. 35) T0* = {self.closed_form}; at T0: bias {p.bound_bias[t0]:.4g} + "
            f"drift bound {p.bound_drift[t0]:.4g} + value bound {p.bound_value[t0]:.4g} = "
            f"{p.bound[t0]:.4g} (bound / R = {p.bound[t0] / max(p.final_error[t0], 1e-300):.3g})",
            f"  kernel deviation at T0: {p.kernel_deviation[t0]:.4g} (bound from one-round "
            f"gaps and the reference's contraction {p.deviation_bound[t0]:.4g})",
        ]
        if self.probe_estimate is not None:
            lines.append(f"  probe estimate (finite-sample run, freeze-now forks): T0 = "
                         f"{self.probe_estimate}, R = {self.probe_error:.4g}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"warmup_rounds": self.warmup_rounds, "closed_form": self.closed_form,
                "probe_estimate": self.probe_estimate,
                "never_freeze_error": self.never_freeze_error,
                "recommended_error": self.recommended_error, "probe_error": self.probe_error,
                "probe_compute": self.probe_compute, "lr": self.lr,
                "local_steps": self.local_steps, "total_rounds": self.total_rounds,
                "phi_star": self.path.phi_star}


def advise_warmup(problem: Problem, lr: float, local_steps: int, total_rounds: int,
                  start: InitialPoint | None = None, phi_star: float | None = None,
                  probe: bool = True, probe_seed: int = 0) -> WarmupAdvice:
    """The exact optimal T0, the bound's T0* and the probe estimate for one problem.

    Parameters
    ----------
    problem : Problem
    lr, local_steps, total_rounds : float, int, int
        eta (finite, > 0), K >= 1, T >= 1.
    start : InitialPoint, optional
        (M_0, V_0); defaults to ``initial_point(problem)``.
    phi_star : float, optional
        Phi*; solved for (one L-BFGS start from the mean teacher kernel) if absent.
    probe, probe_seed : bool, int
        Run the probe estimator (:func:`linattn_theory.sampled.probe_run`, settings
        :data:`PROBE_DEFAULTS`) with this seed.

    Raises
    ------
    ParameterError
        A bad lr, K or T, or dynamics that diverge for this problem and lr (names ``lr``).
    """
    require(isinstance(lr, int | float | np.floating) and math.isfinite(lr) and lr > 0, "lr", lr,
            "a finite step size eta > 0")
    check_steps(lr, local_steps)
    require(isinstance(total_rounds, int | np.integer) and total_rounds >= 1, "total_rounds",
            total_rounds, "an integer T >= 1 (T = 0 trains nothing)")
    start = initial_point(problem) if start is None else start
    if phi_star is None:
        phi_star = solve_profile(problem, restarts=1).value
    path = warmup_path(problem, start, float(lr), int(local_steps), int(total_rounds), phi_star)
    best = path.best_warmup
    estimate = error = compute = None
    if probe:
        # the choice and its cost are what the advice reports: no frozen continuation
        run = probe_run(problem, start, float(lr), int(local_steps), int(total_rounds),
                        seed=probe_seed, finish=False, **PROBE_DEFAULTS)
        estimate = run.choice.warmup_rounds
        error = float(path.final_error[estimate])
        compute = dict(run.rounds_computed)
    return WarmupAdvice(warmup_rounds=best, closed_form=path.bound_warmup,
                        probe_estimate=estimate, never_freeze_error=float(path.final_error[-1]),
                        recommended_error=float(path.final_error[best]), probe_error=error,
                        probe_compute=compute, path=path, lr=float(lr),
                        local_steps=int(local_steps), total_rounds=int(total_rounds))
