"""The exact final error R(T0) for every T0 in 0..T and the path-local bound (docs/theory.md,
eqs. 21, 31-35).

One warm-up path of FedAvg (eq. 19) and of the drift-free reference (eq. 20) serves every T0:
the run with warm-up T0 freezes FedAvg's kernel M_T0 and then runs the affine frozen stage
(eq. 14) for s = T - T0 rounds. Abar(M) is symmetric (eq. 16), so with Abar = Q diag(a) Q^T

    V_T = V_inf + Q diag(a^s) Q^T (V_T0 - V_inf)                                         (31)

closes the frozen stage for all T0 at once (no round loop); ``tests/theory`` holds it against
:func:`linattn_theory.dynamics.population_dynamics`.

The path-local bound E(T0) >= R(T0) (eq. 35) adds three terms, each a proven inequality:

    bias(T0)   = Phi(M_bar_T0) - Phi*                     (exact, on the reference path)
    D_hat_{t+1} = c_t D_hat_t + gamma_t,  D_hat_0 = 0       (deviation bound, eq. 32)
        gamma_t = ||x_{t+1} - Ref(x_t)||,  c_t = ||Ref(x_t) - Ref(x_bar_t)|| / ||x_t - x_bar_t||
    drift_b(T0) = min(G_T0 D_hat_T0 + (L_MM,T0 / 2) D_hat_T0^2,                        (eq. 33)
                      min_{V in {V*(M_bar_T0), V_T0}} F(M_T0, V) - Phi(M_bar_T0))       (eq. 33b)
        G_T0 = ||grad Phi(M_bar_T0)||,  L_MM,T0 >= lambda_max(F_MM(V*(M_bar_T0)))
    value_b(T0) = (sqrt(D_frozen(M_T0)) + kappa_s sqrt(E_0^inf(T0)))^2,
        kappa_s = ||H^{1/2} Abar^s H^{-1/2}||_2, s = T - T0 (eq. 27a with exact kappa_s; eq. 34)

with x_t = (M_t, V_t) FedAvg's global point, x_bar_t the reference's and Ref one reference
round (K centralized GD steps on F). Its argmin over 0..T is the bound's T0*. ``bound_value``
carries a floating-point allowance of ROUNDOFF (|Phi(M_bar_T0)| + |Phi(M_T0)| + 1), about
1e-12, so that the computed bound stays above the computed R where the inequality is an
equality (T0 = T without covariate shift).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from linattn_theory.dynamics import InitialPoint, round_maps, warmup_paths_full
from linattn_theory.errors import ParameterError, require
from linattn_theory.frozen import FrozenStage, frozen_stages
from linattn_theory.objectives import pooled_kernel_gradient, pooled_terms
from linattn_theory.problem import Problem

__all__ = ["WarmupPath", "warmup_path", "kernel_curvature_bound", "frozen_transient_norms",
           "ROUNDOFF"]

ROUNDOFF = 1e-12

# The stacks over T0 (frozen stages, reference rounds) are evaluated this many kernels at a
# time, so that each call's (chunk, C, d, d) arrays stay in cache; every kernel's numbers are
# those of one call on the whole stack (the computations are per kernel)
_CHUNK = 16


@dataclass(frozen=True)
class WarmupPath:
    """R(T0) exactly and the path-local bound, on T0 = 0..T (every array has shape (T+1,)).

    Attributes
    ----------
    rounds : ndarray of int
        T0 = 0..T.
    final_error : ndarray
        R(T0) = F(M_T0, V_T) - Phi* (eq. 21), exact.
    bias, drift, value_error, kernel_deviation : ndarray
        The exact terms of eq. (21) and ||M_T0 - M_bar_T0||_F.
    bound_bias, bound_drift, bound_value, bound : ndarray
        The terms of eq. (35) and their sum E(T0) >= R(T0); ``bound_drift`` is the smaller
        of the two drift bounds below.
    drift_norm_bound, drift_direction_bound : ndarray
        The drift bounds of eq. (33) from the deviation bound D_hat alone and of eq. (33b)
        from the measured deviation M_T0 - M_bar_T0.
    norm_bound : ndarray
        E(T0) with the norm-only drift bound (33): what gamma_t, c_t, G and L_MM give.
    deviation_bound : ndarray
        D_hat_T0 >= ||x_T0 - x_bar_T0|| (eq. 32).
    one_round_gap, reference_contraction : ndarray
        gamma_t and c_t of eq. (32) for t = 0..T-1 (last entry repeats; c_0 = 0).
    gradient_norm, kernel_curvature : ndarray
        G_T0 and L_MM,T0 of eq. (33).
    frozen_floor, frozen_contraction, value_error0, transient_norm : ndarray
        D_frozen(M_T0), rho(Abar(M_T0)), E_0^inf(T0) and kappa_{T-T0} of eq. (34).
    phi_star : float
    """

    rounds: np.ndarray
    final_error: np.ndarray
    bias: np.ndarray
    drift: np.ndarray
    value_error: np.ndarray
    kernel_deviation: np.ndarray
    bound_bias: np.ndarray
    bound_drift: np.ndarray
    bound_value: np.ndarray
    bound: np.ndarray
    drift_norm_bound: np.ndarray
    drift_direction_bound: np.ndarray
    norm_bound: np.ndarray
    deviation_bound: np.ndarray
    one_round_gap: np.ndarray
    reference_contraction: np.ndarray
    gradient_norm: np.ndarray
    kernel_curvature: np.ndarray
    frozen_floor: np.ndarray
    frozen_contraction: np.ndarray
    value_error0: np.ndarray
    transient_norm: np.ndarray
    phi_star: float

    @property
    def total_rounds(self) -> int:
        return int(self.rounds[-1])

    @property
    def best_warmup(self) -> int:
        """argmin of the exact R(T0) over 0..T (the lowest T0 on ties)."""
        return int(np.argmin(self.final_error))

    @property
    def bound_warmup(self) -> int:
        """argmin of the bound E(T0) over 0..T (the bound's T0*)."""
        return int(np.argmin(self.bound))


def kernel_curvature_bound(problem: Problem, values: np.ndarray) -> np.ndarray:
    """An upper bound on lambda_max(F_MM(V)), the M-Hessian of F at fixed V (eq. 33a).

    For fixed V, F is a quadratic in M with the constant Hessian (row-major vec)
    F_MM(V) = sum_m p_m S_m kron Q_m + lambda_M I, Q_m = (1 + 1/n) u_m u_m^T + t_m/n S_m,
    u_m = S_m V, t_m = tr(V^T S_m V). Every S_m and Q_m is PSD, lambda_max(S kron Q) =
    lambda_max(S) lambda_max(Q) and lambda_max(u u^T) <= ||u||_F^2, so

        lambda_max(F_MM) <= sum_m p_m s_m ((1 + 1/n) ||u_m||_F^2 + t_m s_m / n) + lambda_M,

    with s_m = lambda_max(S_m). ``values`` (..., d, d_y) gives shape (...).
    """
    v = np.asarray(values, dtype=np.float64)
    s, n, p = problem.covariances, problem.context_length, problem.weights
    top = np.linalg.eigvalsh(s)[:, -1]                                # (C,)
    u = np.einsum("cij,...ja->...cia", s, v)                           # (..., C, d, d_y)
    u_sq = np.sum(u * u, axis=(-2, -1))
    t = np.sum(v[..., None, :, :] * u, axis=(-2, -1))                  # tr(V^T S_m V)
    per_client = top * ((1 + 1 / n) * u_sq + t * top / n)
    return per_client @ p + problem.kernel_ridge


def frozen_transient_norms(hessians: np.ndarray, transitions: np.ndarray,
                           steps: np.ndarray) -> np.ndarray:
    """kappa_s = ||H^{1/2} Abar^s H^{-1/2}||_2 for stacks (N, d, d) and steps s (N,) (eq. 34)."""
    a_val, a_vec = np.linalg.eigh(0.5 * (transitions + transitions.mT))
    h_val, h_vec = np.linalg.eigh(hessians)
    root = (h_vec * np.sqrt(h_val)[:, None, :]) @ h_vec.mT
    inv_root = (h_vec / np.sqrt(h_val)[:, None, :]) @ h_vec.mT
    power = (a_vec * (a_val ** steps[:, None])[:, None, :]) @ a_vec.mT
    return np.linalg.norm(root @ power @ inv_root, ord=2, axis=(-2, -1))


def _frozen_stages(problem: Problem, kernels: np.ndarray, lr: float,
                   local_steps: int) -> FrozenStage:
    """:func:`linattn_theory.frozen.frozen_stages` of the stack, in chunks of ``_CHUNK``."""
    try:
        parts = [frozen_stages(problem, kernels[i:i + _CHUNK], lr, local_steps)
                 for i in range(0, len(kernels), _CHUNK)]
    except ParameterError:
        # the message names the stability limit over the whole stack, as one call gives it
        return frozen_stages(problem, kernels, lr, local_steps)
    return FrozenStage(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                          for f in fields(FrozenStage)})


def _reference_rounds(problem: Problem, kernels: np.ndarray, values: np.ndarray, lr: float,
                      local_steps: int):
    """One reference round (eq. 20) from every point, in chunks of ``_CHUNK`` (round_maps
    needs one FedAvg point: each chunk passes its first and discards that round)."""
    parts = [round_maps(problem, (kernels[i:i + 1], values[i:i + 1]),
                        (kernels[i:i + _CHUNK], values[i:i + _CHUNK]), lr, local_steps)[1]
             for i in range(0, len(kernels), _CHUNK)]
    return tuple(np.concatenate(block) for block in zip(*parts))


def _norms(*blocks):
    """Frobenius norm of (M, V) pairs over the last two axes of each block, joined."""
    return np.sqrt(sum(np.sum(b * b, axis=(-2, -1)) for b in blocks))


def warmup_path(problem: Problem, start: InitialPoint, lr: float, local_steps: int,
                total_rounds: int, phi_star: float) -> WarmupPath:
    """R(T0) for every T0 in 0..T (eqs. 21, 31) and the path-local bound (eqs. 32-35).

    Parameters
    ----------
    problem : Problem
    start : InitialPoint
        (M_0, V_0), merged parametrization.
    lr, local_steps, total_rounds : float, int, int
        eta, K, T.
    phi_star : float
        Phi* (:func:`linattn_theory.profile.solve_profile`).

    Raises
    ------
    ParameterError
        T < 1, a factored start, or a step size for which the warm-up diverges or a
        frozen stage expands (rho(Abar) >= 1): the message names ``lr``.
    """
    require(isinstance(total_rounds, int | np.integer) and total_rounds >= 1, "total_rounds",
            total_rounds, "an integer T >= 1")
    if start.parametrization != "merged":
        raise ParameterError("start is factored; warmup_path needs the merged (M, V) start")
    t_total = int(total_rounds)
    kernels, values, ref_kernels, ref_values, (ref_hess, ref_lin, ref_const) = \
        warmup_paths_full(problem, start, lr, local_steps, t_total)

    # 1. Kernel quantities along both paths (eq. 10): Phi, V*(M), H(M)
    ref_opt = np.linalg.solve(ref_hess, ref_lin)
    ref_phi = ref_const - 0.5 * np.sum(ref_lin * ref_opt, axis=(1, 2))
    stage = _frozen_stages(problem, kernels, lr, local_steps)
    hess, opt = stage.hessian, stage.optimum
    _, lin, const = pooled_terms(problem, kernels)
    phi = const - 0.5 * np.sum(lin * opt, axis=(1, 2))
    if not np.all(stage.contraction < 1.0):
        t = int(np.argmax(stage.contraction >= 1.0))
        raise ParameterError(
            f"lr={lr:g} with local_steps={local_steps}: the frozen stage frozen at round {t} "
            f"expands (rho(Abar) = {stage.contraction[t]:.4g} >= 1) and diverges; lower lr")

    # 2. Exact frozen stage for every T0 at once (eq. 31)
    steps = (t_total - np.arange(t_total + 1)).astype(np.float64)
    a_val, a_vec = np.linalg.eigh(0.5 * (stage.transition + stage.transition.mT))
    start_gap = values - stage.fixed_point
    decay = a_vec @ ((a_val ** steps[:, None])[..., None] * (a_vec.mT @ start_gap))
    final_gap = stage.fixed_point + decay - opt
    value_error = 0.5 * np.sum(final_gap * (hess @ final_gap), axis=(1, 2))
    final_error = phi - phi_star + value_error

    # 3. Deviation bound (eq. 32): one reference round from every FedAvg point
    ref_m, ref_v = _reference_rounds(problem, kernels[:-1], values[:-1], lr, local_steps)
    gap = _norms(kernels[1:] - ref_m, values[1:] - ref_v)
    moved = _norms(ref_m - ref_kernels[1:], ref_v - ref_values[1:])
    before = _norms(kernels[:-1] - ref_kernels[:-1], values[:-1] - ref_values[:-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(before > 0, moved / before, 0.0)
    deviation = np.zeros(t_total + 1)
    for t in range(t_total):
        deviation[t + 1] = ratio[t] * deviation[t] + gap[t]

    # 4. Drift bound (eq. 33): Phi(M) <= F(M, V*(M_bar)), a quadratic in M
    grads = pooled_kernel_gradient(problem, ref_kernels, ref_opt)
    grad_norm = np.sqrt(np.sum(grads * grads, axis=(1, 2)))
    curvature = kernel_curvature_bound(problem, ref_opt)
    drift_norm = grad_norm * deviation + 0.5 * curvature * deviation**2
    # (33b) Phi(M_T0) <= F(M_T0, V) for V = V*(M_bar_T0) and V = V_T0, FedAvg's own value
    def objective(v):
        return 0.5 * np.sum(v * (hess @ v), axis=(1, 2)) - np.sum(v * lin, axis=(1, 2)) + const

    drift_dir = np.minimum(objective(ref_opt), objective(values)) - ref_phi
    bound_drift = np.minimum(drift_norm, drift_dir)

    # 5. Value-stage bound (eq. 34)
    kappa = frozen_transient_norms(hess, stage.transition, steps)
    start_err = 0.5 * np.sum(start_gap * (hess @ start_gap), axis=(1, 2))
    bound_value = (np.sqrt(stage.floor) + kappa * np.sqrt(start_err))**2
    bound_bias = ref_phi - phi_star
    # floating-point allowance: where the bound is an equality (T0 = T without covariate
    # shift: s = 0 and D_frozen = 0) rounding may leave it a few ulps below R
    slack = ROUNDOFF * (np.abs(ref_phi) + np.abs(phi) + 1.0)
    bound_value = bound_value + slack
    dev_exact = np.sqrt(np.sum((kernels - ref_kernels)**2, axis=(1, 2)))
    pad = np.append
    return WarmupPath(
        rounds=np.arange(t_total + 1), final_error=final_error, bias=ref_phi - phi_star,
        drift=phi - ref_phi, value_error=value_error, kernel_deviation=dev_exact,
        bound_bias=bound_bias, bound_drift=bound_drift, bound_value=bound_value,
        bound=bound_bias + bound_drift + bound_value, drift_norm_bound=drift_norm,
        drift_direction_bound=drift_dir, norm_bound=bound_bias + drift_norm + bound_value,
        deviation_bound=deviation,
        one_round_gap=pad(gap, gap[-1]), reference_contraction=pad(ratio, ratio[-1]),
        gradient_norm=grad_norm, kernel_curvature=curvature, frozen_floor=stage.floor,
        frozen_contraction=stage.contraction, value_error0=start_err, transient_norm=kappa,
        phi_star=float(phi_star))
