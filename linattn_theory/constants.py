"""Constants of the bias-drift bound for a problem instance (docs/theory.md, eq. 23).

All of them come from the closed forms, measured along the exact paths of eqs. (19)-(20):

- L: the largest |eigenvalue| of the Hessian of F in (M, V), assembled from central
  differences of the closed-form gradient (eqs. 7-8) at three points of the FedAvg path; the
  maximum is kept (``curvature_max`` is the largest signed eigenvalue). Stability of eta is
  verified on the path itself: ``warmup_paths`` fails if the exact warm-up diverges and
  ``frozen_stage`` if a local value map expands; so the measured constants carry
  ``stability_limit = inf`` rather than the worst-case 2/L.
- mu: the effective PL constant of the warm-up, min(mu_grad, mu_rate). mu_grad is the local
  PL constant of Phi along the reference path, min_t ||grad Phi(M_bar_t)||^2 / (2 (Phi - Phi*));
  mu_rate is the slowest observed linear rate of the reference's gap,
  min_t ln(gap_t / gap_{t+1}) / (eta K). PL theory gives the rate mu_grad only for exact GD on
  Phi with step eta K <= 1/L_Phi; the joint (M, V) dynamics track V*(M) with a lag, which
  mu_rate accounts for. Points with a gap below ``gap_floor * Delta_0`` are ignored.
- L_Phi: the largest |eigenvalue| of the Hessian of Phi (finite differences of eq. 11).
- zeta: max_t sqrt(sum_m p_m ||grad f_m - grad F||^2) at FedAvg's (M_t, V_t), in (M, V).
- G: max_t ||grad Phi(M_bar_t)||; Delta_0 = Phi(M_0) - Phi*; D_0 = min(||M_0 -+ M_*||_F).
- e: the local-drift error measured exactly, max_t ||M^FedAvg_{t+1} - M^ref_{t+1}|| / (eta K)
  for one round of each from the same (M_t, V_t) (eq. 22); the heuristic (K-1) eta L zeta / 2
  is an upper estimate of it and is what the closed-form monotonicity (eq. 30) is stated for.
- D_frozen, rho, E_0^inf and cond(H): the largest frozen floor, contraction, distance
  1/2 ||V_t - V_inf(M_t)||_H^2 and condition number of H(M_t) along FedAvg's path (the bound
  takes the worst freeze point; eq. 27a).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from linattn_theory.dynamics import InitialPoint, initial_point, one_round, warmup_paths
from linattn_theory.frozen import frozen_stage
from linattn_theory.objectives import global_gradient, local_gradients
from linattn_theory.problem import Problem
from linattn_theory.profile import (
    profile_gradient,
    profile_values,
    solve_profile,
)
from linattn_theory.warmup import WarmupConstants


@dataclass(frozen=True)
class ProblemConstants:
    """Measured constants of one problem instance and schedule (eq. 23)."""

    smoothness: float
    curvature_max: float
    pl_constant: float
    gradient_pl_constant: float
    profile_smoothness: float
    heterogeneity: float
    grad_bound: float
    delta0: float
    kernel_distance: float
    phi_star: float
    frozen_floor: float
    frozen_contraction: float
    value_error0: float
    hessian_condition: float
    drift_error: float
    lr: float
    local_steps: int
    total_rounds: int
    probe_rounds: int

    def warmup_constants(self) -> WarmupConstants:
        """The subset the stylized bound needs."""
        return WarmupConstants(
            delta0=self.delta0,
            pl_constant=self.pl_constant,
            smoothness=self.smoothness,
            heterogeneity=self.heterogeneity,
            grad_bound=self.grad_bound,
            lr=self.lr,
            local_steps=self.local_steps,
            total_rounds=self.total_rounds,
            kernel_distance=self.kernel_distance,
            frozen_floor=self.frozen_floor,
            frozen_contraction=min(self.frozen_contraction, 1.0 - 1e-12),
            value_error0=self.value_error0,
            hessian_condition=max(self.hessian_condition, 1.0),
            measured_drift_error=self.drift_error,
            profile_smoothness=self.profile_smoothness,
            stability_limit=math.inf,  # verified on the path, see estimate_constants
        )

    def to_dict(self) -> dict:
        return {k: float(v) for k, v in asdict(self).items()}


def hessian_spectrum(problem: Problem, kernel: np.ndarray, value: np.ndarray,
                     step: float = 1e-5) -> tuple[float, float]:
    """(largest |eigenvalue|, largest eigenvalue) of the Hessian of F in (M, V).

    The Hessian is assembled column by column from central differences of the closed-form
    gradient (eqs. 7-8), symmetrised, and diagonalised: 2 (d^2 + d d_y) gradient calls.
    """
    d, dy = problem.dim, problem.out_dim
    size = d * d + d * dy

    def grad(x):
        gm, gv = global_gradient(problem, x[: d * d].reshape(d, d), x[d * d:].reshape(d, dy))
        return np.concatenate([gm.ravel(), gv.ravel()])

    x0 = np.concatenate([kernel.ravel(), value.ravel()])
    eye = np.eye(size)
    columns = [(grad(x0 + step * e) - grad(x0 - step * e)) / (2 * step) for e in eye]
    hess = np.array(columns)
    eig = np.linalg.eigvalsh(0.5 * (hess + hess.T))
    return float(np.max(np.abs(eig))), float(np.max(eig))


def hessian_power(problem: Problem, kernel: np.ndarray, value: np.ndarray, iterations: int = 20,
                  step: float = 1e-5, seed: int = 0) -> tuple[float, float]:
    """(largest |eigenvalue|, largest eigenvalue) of the Hessian of F by power iteration.

    Central-difference Hessian-vector products of the closed-form gradient; the largest
    eigenvalue comes from a second power iteration on H + L I (all its eigenvalues >= 0).
    Cheaper than :func:`hessian_spectrum` (4 * iterations gradient calls), and a lower estimate.
    """
    d, dy = problem.dim, problem.out_dim

    def hvp(x0, v):
        def grad(x):
            gm, gv = global_gradient(problem, x[: d * d].reshape(d, d),
                                     x[d * d:].reshape(d, dy))
            return np.concatenate([gm.ravel(), gv.ravel()])

        return (grad(x0 + step * v) - grad(x0 - step * v)) / (2 * step)

    x0 = np.concatenate([kernel.ravel(), value.ravel()])
    rng = np.random.default_rng(seed)

    def power(shift):
        v = rng.standard_normal(x0.size)
        v /= np.linalg.norm(v)
        est = 0.0
        for _ in range(iterations):
            hv = hvp(x0, v) + shift * v
            est = float(np.linalg.norm(hv))
            if est == 0.0:
                return 0.0
            v = hv / est
        return est

    norm = power(0.0)
    return norm, power(norm) - norm


def profile_hessian_norm(problem: Problem, kernel: np.ndarray, iterations: int = 30,
                         step: float = 1e-5, seed: int = 0) -> float:
    """Largest |eigenvalue| of the Hessian of Phi at M (power iteration, eq. 11 differenced)."""
    d = problem.dim
    v = np.random.default_rng(seed).standard_normal((d, d))
    v /= np.linalg.norm(v)
    estimate = 0.0
    for _ in range(iterations):
        hv = (profile_gradient(problem, kernel + step * v)
              - profile_gradient(problem, kernel - step * v)) / (2 * step)
        estimate = float(np.linalg.norm(hv))
        if estimate == 0.0:
            return 0.0
        v = hv / estimate
    return estimate


def estimate_constants(problem: Problem, lr: float, local_steps: int, total_rounds: int,
                       start: InitialPoint | None = None, phi_star: float | None = None,
                       probe_rounds: int | None = None, points: int = 25,
                       gap_floor: float = 1e-3, fast: bool = False) -> ProblemConstants:
    """Measure L, mu, zeta, G, Delta_0, D_0 and the frozen-stage constants (eq. 23).

    Parameters
    ----------
    problem : Problem
    lr, local_steps, total_rounds : float, int, int
        eta, K, T of the schedule the recommendation is for.
    start : InitialPoint, optional
        (M_0, V_0); defaults to ``initial_point(problem)``.
    phi_star : float, optional
        Phi*; solved for if absent.
    probe_rounds : int, optional
        Length of the measured path; defaults to T.
    points : int
        Number of path points at which the constants are evaluated (evenly spaced).
    gap_floor : float
        mu ignores points whose gap Phi - Phi* is below ``gap_floor * Delta_0``.
    fast : bool
        A probe, as for a real network: the path defaults to min(T, 20) rounds, 5 points,
        Hessian norms by power iteration (:func:`hessian_power`, 20 and 15 iterations) at two
        points, and Phi* from one L-BFGS start. About 50 ms for d = 16 and 20 clients.
    """
    start = initial_point(problem) if start is None else start
    solution = None
    if phi_star is None:
        solution = solve_profile(problem, restarts=1 if fast else 4)
        phi_star = solution.value
    if fast:
        probe_rounds = min(total_rounds, 20) if probe_rounds is None else probe_rounds
        points = min(points, 5)
    rounds = int(total_rounds if probe_rounds is None else probe_rounds)
    kernels, values, ref_kernels = warmup_paths(problem, start, lr, local_steps, rounds)
    idx = np.unique(np.linspace(0, rounds, min(points, rounds + 1)).astype(int))

    delta0 = float(profile_values(problem, kernels[:1])[0] - phi_star)
    ref_phi = profile_values(problem, ref_kernels[idx])
    grads = np.array([profile_gradient(problem, m) for m in ref_kernels[idx]])
    grad_sq = np.sum(grads.reshape(idx.size, -1) ** 2, axis=1)
    gap = ref_phi - phi_star
    usable = gap > gap_floor * max(delta0, 1e-300)
    pl_grad = float(np.min(grad_sq[usable] / (2 * gap[usable]))) if np.any(usable) else 0.0
    ref_gap = profile_values(problem, ref_kernels) - phi_star
    keep = ref_gap > gap_floor * max(delta0, 1e-300)
    keep = keep[:-1] & keep[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        rates = np.log(ref_gap[:-1] / ref_gap[1:]) / (lr * local_steps)
    pl_rate = float(np.min(rates[keep])) if np.any(keep) else pl_grad
    pl = max(min(pl_grad, pl_rate), 0.0)

    het, floors, contractions, value_errs, drift_errs, conds = [], [], [], [], [], []
    smooth = 0.0
    p = problem.weights
    for i in idx:
        m, v = kernels[i], values[i]
        gm, gv = local_gradients(problem, m, v)
        dm = gm - np.tensordot(p, gm, axes=1)
        dv = gv - np.tensordot(p, gv, axes=1)
        het.append(float(np.sqrt(p @ (np.sum(dm**2, axis=(1, 2)) + np.sum(dv**2, axis=(1, 2))))))
        stage = frozen_stage(problem, m, lr, local_steps)
        floors.append(stage.floor)
        contractions.append(stage.contraction)
        gapv = v - stage.fixed_point
        value_errs.append(0.5 * float(np.sum(gapv * (stage.hessian @ gapv))))
        conds.append(float(np.linalg.cond(stage.hessian)))
        fedavg, reference = one_round(problem, m, v, lr, local_steps)
        drift_errs.append(float(np.linalg.norm(fedavg[0] - reference[0])) / (lr * local_steps))
    top = 0.0
    hess_points = np.unique(idx[[0, -1]] if fast else idx[[0, idx.size // 2, -1]])
    for i in hess_points:
        if fast:
            norm, largest = hessian_power(problem, kernels[i], values[i])
        else:
            norm, largest = hessian_spectrum(problem, kernels[i], values[i])
        smooth, top = max(smooth, norm), max(top, largest)

    profile_smooth = 0.0
    for i in hess_points:
        profile_smooth = max(profile_smooth, profile_hessian_norm(
            problem, ref_kernels[i], iterations=15 if fast else 30))
    if solution is None:
        solution = solve_profile(problem, restarts=1)
    m_star = solution.kernel
    m0 = kernels[0]
    distance = float(min(np.linalg.norm(m0 - m_star), np.linalg.norm(m0 + m_star)))
    return ProblemConstants(
        smoothness=float(smooth),
        curvature_max=float(top),
        pl_constant=pl,
        gradient_pl_constant=pl_grad,
        profile_smoothness=float(profile_smooth),
        heterogeneity=float(max(het)),
        grad_bound=float(np.sqrt(np.max(grad_sq))),
        delta0=max(delta0, 1e-300),
        kernel_distance=distance,
        phi_star=float(phi_star),
        frozen_floor=float(max(floors)),
        frozen_contraction=float(max(contractions)),
        value_error0=float(max(value_errs)),
        hessian_condition=float(max(conds)),
        drift_error=float(max(drift_errs)),
        lr=float(lr),
        local_steps=int(local_steps),
        total_rounds=int(total_rounds),
        probe_rounds=rounds,
    )
