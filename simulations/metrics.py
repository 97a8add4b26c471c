"""Exact population metrics of simulated trajectories (THEORY.md, sections 2-3).

The simulator trains on finite data; every quantity below is evaluated on the *population*
objective with the closed forms of ``linattn_theory`` (eqs. 6, 10, 14-17), so the simulator's
numbers and the population dynamics' numbers are the same functions of (M, V):

- kernel error Phi(M_t) - Phi*, reference error Phi(M_bar_t) - Phi*,
- bias(T0) = Phi(M_bar_T0) - Phi*, drift(T0) = Phi(M_T0) - Phi(M_bar_T0),
  kernel deviation ||M_T0 - M_bar_T0||_F,
- error curves F(M_t, V_t) - Phi* and R(T0) = F(M_T0, V_T) - Phi*,
- D_frozen(M_T0), the exact frozen floor at the run's own kernel,
- the gradient-norm jump after aggregation, grad_first[t+1] / grad_last[t].

For the softmax student the Phi-based metrics are NaN (Phi is the linear model's profile);
only the test losses are reported. A diverged run (:mod:`simulations.divergence`) gets NaN for
every metric of its diverged rounds; the healthy rounds and runs keep their values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.dynamics import DynamicsResult, population_dynamics
from linattn_theory.errors import ParameterError
from linattn_theory.frozen import local_value_maps
from linattn_theory.objectives import value_quadratic
from linattn_theory.problem import Problem
from linattn_theory.profile import solve_profile
from simulations.divergence import healthy
from simulations.engine import SimResult

_PROFILE_CACHE: dict[int, tuple[Problem, float]] = {}


def phi_star(problem: Problem) -> float:
    """Phi* of ``problem`` (``solve_profile``), cached per problem object."""
    hit = _PROFILE_CACHE.get(id(problem))
    if hit is None or hit[0] is not problem:
        hit = (problem, solve_profile(problem).value)
        _PROFILE_CACHE[id(problem)] = hit
    return hit[1]


def profile_parts(problem: Problem, kernels: np.ndarray):
    """Phi(M), H(M) (with lambda), V*(M) and the per-client (H_m, C_m) for kernels (N, d, d)."""
    h, lin, const = value_quadratic(problem, kernels[:, None])  # (N, C, ...)
    p = problem.weights
    hess = np.einsum("c,ncij->nij", p, h) + problem.ridge * np.eye(problem.dim)
    linear = np.einsum("c,ncia->nia", p, lin)
    optimum = _solve(hess, linear)
    ridge = 0.5 * problem.kernel_ridge * np.sum(kernels**2, axis=(1, 2))
    phi = p @ const + ridge - 0.5 * np.sum(linear * optimum, axis=(1, 2))
    return phi, hess, optimum, h, lin


def excess(hessian, optimum, value):
    """1/2 tr((V - V*)^T H (V - V*)) = F(M, V) - Phi(M), batched."""
    gap = value - optimum
    return 0.5 * np.einsum("...ia,...ij,...ja->...", gap, hessian, gap)


def frozen_floors(problem: Problem, h, lin, hess, optimum, lr: float, local_steps: int):
    """D_frozen(M) (eq. 17) for stacks of per-client (H_m, C_m); returns (floor, V_inf)."""
    a, b = local_value_maps(h, lr, local_steps, problem.ridge)
    p = problem.weights
    transition = np.einsum("c,...cij->...ij", p, a)
    offset = np.einsum("c,...cij,...cja->...ia", p, b, lin)
    fixed = _solve(np.eye(problem.dim) - transition, offset)
    return np.maximum(excess(hess, optimum, fixed), 0.0), fixed


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.linalg.solve`` for a stack; a singular member gets its least-squares solution."""
    try:
        return np.linalg.solve(a, b)
    except np.linalg.LinAlgError:
        return np.linalg.pinv(a) @ b


@dataclass(frozen=True)
class SimMetrics:
    """Exact metrics of one setting's runs; S seeds, J T0 values, H = max T0, T rounds."""

    warmup_rounds: np.ndarray
    phi_star: float
    kernel_error_path: np.ndarray  # (S, H+1)
    reference_error_path: np.ndarray  # (S, H+1)
    drift_path: np.ndarray  # (S, H+1)
    deviation_path: np.ndarray  # (S, H+1)
    excess_path: np.ndarray  # (S, H+1) F(M_t, V_t) - Phi* along the warm-up
    bias: np.ndarray  # (S, J)
    drift: np.ndarray  # (S, J)
    kernel_deviation: np.ndarray  # (S, J)
    error_curves: np.ndarray  # (S, J, T+1)
    final_error: np.ndarray  # (S, J)
    value_error: np.ndarray  # (S, J)
    frozen_floor: np.ndarray  # (S, J)
    gradient_jump: np.ndarray  # (S, H-1)
    test_loss: np.ndarray  # (S, H+1)
    final_test_loss: np.ndarray  # (S, J)


def compute_metrics(result: SimResult, star: float | None = None) -> SimMetrics:
    """Evaluate the exact metrics of a :class:`SimResult`."""
    st = result.setting
    prob = st.problem
    t0s = np.asarray(st.warmup_rounds)
    s_count, h1 = result.kernels.shape[:2]
    jumps = result.grad_first[:, 1:] / np.maximum(result.grad_last[:, :-1], 1e-300)
    if st.attention != "linear":
        nan_path = np.full((s_count, h1), np.nan)
        nan_j = np.full((s_count, t0s.size), np.nan)
        return SimMetrics(t0s, np.nan, nan_path, nan_path, nan_path, nan_path, nan_path, nan_j,
                          nan_j, nan_j, np.full((s_count, t0s.size, st.total_rounds + 1), np.nan),
                          nan_j, nan_j, nan_j, jumps, result.test_loss, result.frozen_test_loss)
    star = phi_star(prob) if star is None else star
    d = prob.dim
    # diverged rounds are evaluated at the run's start (always healthy) and reported as NaN
    warm = healthy(result.kernels) & healthy(result.values)  # (S, H+1)
    ref_ok = healthy(result.reference_kernels)
    kernels = np.where(warm[..., None, None], result.kernels, result.kernels[:, :1])
    values = np.where(warm[..., None, None], result.values, result.values[:, :1])
    ref_kernels = np.where(ref_ok[..., None, None], result.reference_kernels,
                           result.reference_kernels[:, :1])
    frozen_values = np.where(healthy(result.frozen_values)[..., None, None],
                             result.frozen_values, np.nan)
    phi, hess, opt, h, lin = profile_parts(prob, kernels.reshape(-1, d, d))
    ref_phi = profile_parts(prob, ref_kernels.reshape(-1, d, d))[0]
    phi, ref_phi = phi.reshape(s_count, h1), ref_phi.reshape(s_count, h1)
    phi[~warm], ref_phi[~ref_ok] = np.nan, np.nan
    hess = hess.reshape(s_count, h1, d, d)
    opt = opt.reshape(s_count, h1, d, -1)
    h = h.reshape(s_count, h1, *h.shape[1:])
    lin = lin.reshape(s_count, h1, *lin.shape[1:])
    dev = np.linalg.norm((kernels - ref_kernels).reshape(s_count, h1, -1), axis=-1)
    dev[~(warm & ref_ok)] = np.nan
    excess_path = phi - star + excess(hess, opt, values)
    # frozen runs: kernel M_T0, value path V_t for t >= T0
    hj, oj = hess[:, t0s], opt[:, t0s]  # (S, J, ...)
    curves = (phi[:, t0s] - star)[..., None] + excess(hj[:, :, None], oj[:, :, None],
                                                     frozen_values)
    for j, t0 in enumerate(t0s):
        curves[:, j, :t0] = excess_path[:, :t0]
    value_err = excess(hj, oj, frozen_values[:, :, -1])
    try:
        floor, _ = frozen_floors(prob, h[:, t0s], lin[:, t0s], hj, oj, st.lr, st.local_steps)
    except ParameterError:  # eta beyond the local value problem's stability limit: no floor
        floor = np.full(hj.shape[:2], np.nan)
    floor[~warm[:, t0s]] = np.nan
    return SimMetrics(
        warmup_rounds=t0s, phi_star=float(star),
        kernel_error_path=phi - star, reference_error_path=ref_phi - star,
        drift_path=phi - ref_phi, deviation_path=dev, excess_path=excess_path,
        bias=ref_phi[:, t0s] - star, drift=(phi - ref_phi)[:, t0s],
        kernel_deviation=dev[:, t0s], error_curves=curves,
        final_error=phi[:, t0s] - star + value_err, value_error=value_err,
        frozen_floor=floor, gradient_jump=jumps, test_loss=result.test_loss,
        final_test_loss=result.frozen_test_loss)


def population(setting, star: float | None = None) -> DynamicsResult:
    """The exact population dynamics of a setting (``linattn_theory.population_dynamics``)."""
    star = phi_star(setting.problem) if star is None else star
    return population_dynamics(setting.problem, setting.start(), setting.lr, setting.local_steps,
                               setting.total_rounds, list(setting.warmup_rounds), star,
                               lr_schedule=setting.lr_schedule)


def mean_se(x: np.ndarray, axis: int = 0):
    """Mean and standard error over the seed axis."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[axis]
    se = np.std(x, axis=axis, ddof=1) / np.sqrt(n) if n > 1 else np.zeros_like(x.mean(axis))
    return x.mean(axis=axis), se
