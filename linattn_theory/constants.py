"""Constants of the bias-drift bound for a problem instance (docs/theory.md, eq. 23).

All of them come from the closed forms, measured along the exact paths of eqs. (19)-(20):

- L: the largest |eigenvalue| of the Hessian of F in (M, V) at three points of the FedAvg
  path, from the exact Hessian (:func:`hessian_matrix`, closed-form second derivatives of
  eqs. 6-8); the maximum is kept (``curvature_max`` is the largest signed eigenvalue).
  Stability of eta is verified on the path itself: ``warmup_paths`` fails if the exact
  warm-up diverges and ``frozen_stage`` if a local value map expands; so the measured
  constants carry ``stability_limit = inf`` rather than the worst-case 2/L.
- mu: the effective PL constant of the warm-up, min(mu_grad, mu_rate). mu_grad is the local
  PL constant of Phi along the reference path, min_t ||grad Phi(M_bar_t)||^2 / (2 (Phi - Phi*));
  mu_rate is the slowest observed linear rate of the reference's gap,
  min_t ln(gap_t / gap_{t+1}) / (eta K). PL theory gives the rate mu_grad only for exact GD on
  Phi with step eta K <= 1/L_Phi; the joint (M, V) dynamics track V*(M) with a lag, which
  mu_rate accounts for. Points with a gap below ``gap_floor * Delta_0`` are ignored.
- L_Phi: the largest |eigenvalue| of the exact Hessian of Phi (the Schur complement of
  eq. 23a, :func:`profile_hessian_matrix`).
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

from linattn_theory.dynamics import InitialPoint, initial_point, round_maps, warmup_paths_full
from linattn_theory.frozen import frozen_stages
from linattn_theory.objectives import local_gradients, pooled_kernel_gradient, pooled_terms
from linattn_theory.problem import Problem
from linattn_theory.profile import solve_profile
from linattn_theory.warmup_constants import WarmupConstants


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


def hessian_matrix(problem: Problem, kernel: np.ndarray, value: np.ndarray) -> np.ndarray:
    """The Hessian of F in (M, V) at a shared point, exactly, on x = (M.ravel(), V.ravel()).

    F is a polynomial, so the blocks are closed forms (u_m = S_m V, w_m = S_m M S_m V,
    B_m = S_m M S_m, t_m = tr(V^T S_m V), and row-major vec, so (A kron B)[(i,j),(k,l)] =
    A_ik B_jl):

        F_MM = sum_m p_m S_m kron ((1 + 1/n) u_m u_m^T + t_m/n S_m) + lambda_M I,
        F_MV[(i,j),(k,a)] = sum_m p_m [(1 + 1/n) (S_m[j,k] w_m[i,a] + B_m[i,k] u_m[j,a])
                                       + (2/n) B_m[i,j] u_m[k,a]] - Lambda[(k,a),(i,j)],
        F_VV = H(M) kron I_{d_y},

    with Lambda the pooled teacher map M -> C(M) (``teacher_products.linear_map``). These are
    the second derivatives of 1/2 tr(V^T H_m V) = (1 + 1/n)/2 <M u, S M u> + tr(M^T S M S)
    t_m / (2n) and of -tr(V^T C(M)); ``tests/theory`` checks them against central differences
    of the closed-form gradient (eqs. 7-8). Stacked points (B, d, d), (B, d, d_y) give
    stacked Hessians (B, size, size).
    """
    m = np.asarray(kernel, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    d, dy = problem.dim, problem.out_dim
    dd, dv = d * d, d * dy
    out = np.empty((*m.shape[:-2], dd + dv, dd + dv))
    hessians = pooled_terms(problem, m)[0]
    for point in np.ndindex(m.shape[:-2]):             # one point at a time, into ``out``
        block = out[point]
        f_mv = _hessian_blocks(problem, m[point], v[point], block[:dd, :dd])
        block[:dd, dd:] = f_mv
        block[dd:, :dd] = f_mv.T
        block[dd:, dd:].reshape(d, dy, d, dy)[...] = (hessians[point][:, None, :, None]
                                                      * np.eye(dy)[:, None, :])
    return out


def _hessian_blocks(problem: Problem, m: np.ndarray, v: np.ndarray,
                    f_mm: np.ndarray) -> np.ndarray:
    """Write F_MM of :func:`hessian_matrix` into ``f_mm`` (a (d^2, d^2) view); return F_MV."""
    d, dy, c = problem.dim, problem.out_dim, problem.num_clients
    s, n, p = problem.covariances, problem.context_length, problem.weights
    t = problem.teacher_products
    c1, inv, dd, dv = 1 + 1 / n, 1 / n, d * d, d * dy
    u = s @ v                                            # (C, d, dy)
    sms = (s @ m) @ s                                    # S M S
    w = sms @ v                                          # S M S V
    trace = u.reshape(c, dv) @ v.ravel()
    weighted_s = np.ascontiguousarray((p[:, None] * s.reshape(c, dd)).T)    # [(i,k), m]
    if np.any(v):
        q = c1 * (u @ u.mT) + (trace * inv)[:, None, None] * s
        # sum_m p_m S_m[i,k] Q_m[j,l] comes out as [(i,k), (j,l)]; F_MM is [(i,j), (k,l)]
        f_mm.reshape(d, d, d, d)[...] = (weighted_s @ q.reshape(c, dd)).reshape(
            d, d, d, d).transpose(0, 2, 1, 3)
    else:                                                # V = 0 (a start): Q_m = 0 exactly
        f_mm[...] = 0.0
    diagonal = np.arange(dd)
    f_mm[diagonal, diagonal] += problem.kernel_ridge
    first = (weighted_s @ w.reshape(c, dv)).reshape(d, d, d, dy)          # [j, k, i, a]
    second = ((p[:, None] * sms.reshape(c, dd)).T @ u.reshape(c, dv)).reshape(d, d, d, dy)
    f_mv = (c1 * (first.transpose(2, 0, 1, 3) + second.transpose(0, 2, 1, 3))
            + 2 * inv * second).reshape(dd, dv)
    return f_mv - t.linear_map.T


def profile_hessian_matrix(problem: Problem, kernel: np.ndarray) -> np.ndarray:
    """The Hessian of Phi at M, exactly: the Schur complement of eq. (23a) at V = V*(M).

    Phi(M) = F(M, V*(M)) and dV*/dM = -F_VV^{-1} F_VM, so
    grad^2 Phi = F_MM - F_MV F_VV^{-1} F_VM (blocks of :func:`hessian_matrix`); on row-major
    vec(M), shape (d^2, d^2) (stacked kernels (B, d, d) give (B, d^2, d^2)).
    """
    m = np.asarray(kernel, dtype=np.float64)
    d, dy = problem.dim, problem.out_dim
    dd = d * d
    hessians, linear, _ = pooled_terms(problem, m)
    v_stars = np.linalg.solve(hessians, linear)
    out = np.empty((*m.shape[:-2], dd, dd))
    for point in np.ndindex(m.shape[:-2]):             # one point at a time, into ``out``
        f_mm, hessian = out[point], hessians[point]
        f_mv = _hessian_blocks(problem, m[point], v_stars[point], f_mm)
        # F_VV = H kron I: solve with H on the first index of vec(V) = (k, a)
        solved = np.linalg.solve(hessian, f_mv.T.reshape(d, dy * dd)).reshape(d * dy, dd)
        f_mm -= f_mv @ solved
    return out


def hessian_spectrum(problem: Problem, kernel: np.ndarray,
                     value: np.ndarray) -> tuple[float, float]:
    """(largest |eigenvalue|, largest eigenvalue) of the Hessian of F in (M, V).

    The Hessian is the exact :func:`hessian_matrix` (central differences of the gradient agree
    with it to about 1e-9 relative).
    """
    eig = np.linalg.eigvalsh(hessian_matrix(problem, kernel, value))
    return float(np.max(np.abs(eig))), float(np.max(eig))


def _power_iteration(matrices: np.ndarray, start: np.ndarray, iterations: int,
                     shift=0.0) -> np.ndarray:
    """||(A + shift I) v_k|| after ``iterations`` normalised power steps from ``start``.

    ``matrices`` (B, n, n) run in lockstep from the same start (``shift`` scalar or (B,));
    a matrix whose iterate becomes exactly 0 gives 0, as a one-matrix run would.
    """
    shift = np.broadcast_to(np.asarray(shift, dtype=np.float64), matrices.shape[:1])[:, None]
    shifted = bool(np.any(shift))
    v = np.broadcast_to(start / np.linalg.norm(start), (matrices.shape[0], start.size))
    estimate = np.zeros(matrices.shape[0])
    for _ in range(iterations):
        hv = np.matvec(matrices, v)
        if shifted:
            hv += shift * v
        estimate = np.sqrt(np.vecdot(hv, hv))
        if not estimate.all():
            return np.array([float(_power_iteration(a[None], start, iterations, b)[0])
                             if e > 0 else 0.0 for a, b, e in zip(matrices, shift[:, 0],
                                                                 estimate)])
        hv /= estimate[:, None]
        v = hv
    return estimate


def _hessian_powers(problem: Problem, kernels: np.ndarray, values: np.ndarray,
                    iterations: int = 20, seed: int = 0):
    """:func:`hessian_power` at stacked points, in lockstep; two arrays of shape (B,)."""
    hess = hessian_matrix(problem, kernels, values)
    rng = np.random.default_rng(seed)
    size = hess.shape[-1]
    norm = _power_iteration(hess, rng.standard_normal(size), iterations)
    shifted = _power_iteration(hess, rng.standard_normal(size), iterations, norm)
    return norm, np.where(norm > 0, shifted - norm, 0.0)


def hessian_power(problem: Problem, kernel: np.ndarray, value: np.ndarray, iterations: int = 20,
                  seed: int = 0) -> tuple[float, float]:
    """(largest |eigenvalue|, largest eigenvalue) of the Hessian of F by power iteration.

    ``iterations`` normalised steps with the exact :func:`hessian_matrix` from a random start
    (Generator seeded with ``seed``); the largest eigenvalue comes from a second power
    iteration on H + L I (all its eigenvalues >= 0). A lower estimate of
    :func:`hessian_spectrum`'s values, which the fast probe uses (the iteration count, not the
    cost of a product, is what makes it an estimate).
    """
    norm, largest = _hessian_powers(problem, np.asarray(kernel)[None], np.asarray(value)[None],
                                    iterations, seed)
    return float(norm[0]), float(largest[0])


def profile_hessian_norm(problem: Problem, kernel: np.ndarray, iterations: int = 30,
                         seed: int = 0) -> float:
    """Largest |eigenvalue| of the Hessian of Phi at M (power iteration on the exact
    :func:`profile_hessian_matrix`, eq. 23a). Stacked kernels (B, d, d) give an array (B,)."""
    m = np.asarray(kernel, dtype=np.float64)
    d = problem.dim
    start = np.random.default_rng(seed).standard_normal((d, d)).ravel()
    hess = profile_hessian_matrix(problem, m.reshape(-1, d, d))
    norms = _power_iteration(hess, start, iterations)
    return float(norms[0]) if m.ndim == 2 else norms


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
        Hessian norms by power iteration (:func:`hessian_power`, 20 and 15 iterations, on the
        exact Hessians) at two points, and Phi* from one L-BFGS start. About 20 ms for d = 8
        and 10 clients, 40 ms for d = 16 and 20 clients, on one core (benchmarks/).
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
    kernels, values, ref_kernels, _, (ref_hess, ref_lin, ref_const) = warmup_paths_full(
        problem, start, lr, local_steps, rounds)
    idx = np.unique(np.linspace(0, rounds, min(points, rounds + 1)).astype(int))

    # Phi along the reference (eq. 10) from the pooled quadratic the path check built;
    # M_bar_0 = M_0, so Delta_0 is its first entry
    ref_opt = np.linalg.solve(ref_hess, ref_lin)
    ref_phi_all = ref_const - 0.5 * np.sum(ref_lin * ref_opt, axis=(1, 2))
    delta0 = float(ref_phi_all[0] - phi_star)
    ref_phi = ref_phi_all[idx]
    grads = pooled_kernel_gradient(problem, ref_kernels[idx], ref_opt[idx])
    grad_sq = np.sum(grads.reshape(idx.size, -1) ** 2, axis=1)
    gap = ref_phi - phi_star
    usable = gap > gap_floor * max(delta0, 1e-300)
    pl_grad = float(np.min(grad_sq[usable] / (2 * gap[usable]))) if np.any(usable) else 0.0
    ref_gap = ref_phi_all - phi_star
    keep = ref_gap > gap_floor * max(delta0, 1e-300)
    keep = keep[:-1] & keep[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        rates = np.log(ref_gap[:-1] / ref_gap[1:]) / (lr * local_steps)
    pl_rate = float(np.min(rates[keep])) if np.any(keep) else pl_grad
    pl = max(min(pl_grad, pl_rate), 0.0)

    # FedAvg's path points, all at once: zeta, frozen stage (eqs. 14-17, 27a), drift error
    p = problem.weights
    m, v = kernels[idx], values[idx]
    gm, gv = local_gradients(problem, m[:, None], v[:, None])
    dm = gm - np.tensordot(p, gm, axes=(0, 1))[:, None]
    dv = gv - np.tensordot(p, gv, axes=(0, 1))[:, None]
    het = np.sqrt((np.sum(dm**2, axis=(2, 3)) + np.sum(dv**2, axis=(2, 3))) @ p)
    stage = frozen_stages(problem, m, lr, local_steps)
    gapv = v - stage.fixed_point
    value_errs = 0.5 * np.sum(gapv * (stage.hessian @ gapv), axis=(1, 2))
    eig = np.linalg.eigvalsh(stage.hessian)             # H(M) is symmetric positive definite
    conds = eig[:, -1] / eig[:, 0]
    # one FedAvg round from (M_t, V_t) is the path's next point (t < T_probe), and one
    # reference round from (M_0, V_0) = (M_bar_0, V_bar_0) is the reference's first point;
    # the other rounds run as one batch
    fed_new, ref_new = idx >= rounds, (idx > 0) | (rounds == 0)
    fedavg, reference = round_maps(problem, (m[fed_new], v[fed_new]), (m[ref_new], v[ref_new]),
                                lr, local_steps)
    fed_kernels, ref_round = kernels[np.minimum(idx + 1, rounds)], ref_kernels[np.minimum(
        idx + 1, rounds)]
    fed_kernels[fed_new], ref_round[ref_new] = fedavg[0], reference[0]
    drift_errs = (np.linalg.norm((fed_kernels - ref_round).reshape(idx.size, -1), axis=1)
                  / (lr * local_steps))
    hess_points = np.unique(idx[[0, -1]] if fast else idx[[0, idx.size // 2, -1]])
    if fast:
        norms, largest = _hessian_powers(problem, kernels[hess_points], values[hess_points])
    else:
        eig = np.linalg.eigvalsh(hessian_matrix(problem, kernels[hess_points],
                                                values[hess_points]))
        norms, largest = np.max(np.abs(eig), axis=-1), eig[:, -1]
    smooth, top = max(float(np.max(norms)), 0.0), max(float(np.max(largest)), 0.0)
    profile_smooth = max(float(np.max(profile_hessian_norm(
        problem, ref_kernels[hess_points], iterations=15 if fast else 30))), 0.0)
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
        heterogeneity=float(np.max(het)),
        grad_bound=float(np.sqrt(np.max(grad_sq))),
        delta0=max(delta0, 1e-300),
        kernel_distance=distance,
        phi_star=float(phi_star),
        frozen_floor=float(np.max(stage.floor)),
        frozen_contraction=float(np.max(stage.contraction)),
        value_error0=float(np.max(value_errs)),
        hessian_condition=float(np.max(conds)),
        drift_error=float(np.max(drift_errs)),
        lr=float(lr),
        local_steps=int(local_steps),
        total_rounds=int(total_rounds),
        probe_rounds=rounds,
    )
