"""The kernel-profile objective Phi_lambda (docs/theory.md, eqs. 10-12).

For fixed M, F is a strongly convex quadratic in V (lambda > 0 or H(M) > 0):

    F(M, V) = 1/2 tr(V^T H V) - tr(V^T C) + c(M),   H = sum_m p_m H_m + lambda I,
    V*(M) = H^{-1} C,  Phi(M) = c(M) - 1/2 tr(C^T H^{-1} C),                       (10)
    grad Phi(M) = grad_M F(M, V*(M))   (envelope theorem),                            (11)

with c(M) = sum_m p_m c_m + (lambda_M/2)||M||^2. With lambda_M = 0 and lambda > 0 the
infimum of Phi is approached only as ||M|| -> infinity (eq. 12), so the toolkit's default
is lambda_M = lambda > 0, which makes Phi coercive and Phi* attained.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.errors import ParameterError
from linattn_theory.objectives import pooled_kernel_gradient, pooled_terms, whiten
from linattn_theory.problem import Problem


def pooled_quadratic(problem: Problem, kernel: np.ndarray):
    """H(M) (with lambda), C(M) and c(M) (with the kernel ridge) of eq. (10).

    Returns
    -------
    hessian : ndarray, shape (d, d)
    linear : ndarray, shape (d, d_y)
    constant : float
    """
    hessian, linear, constant = pooled_terms(problem, kernel)
    return hessian, linear, float(constant)


def _solve_spd(hessian: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """H^{-1} C for one symmetric positive definite H (Cholesky; LU if that fails)."""
    from scipy.linalg import lapack  # on use: see make_problem

    factor, solution, info = lapack.dposv(hessian, rhs)
    return solution if info == 0 else np.linalg.solve(hessian, rhs)


def profile_values(problem: Problem, kernels: np.ndarray) -> np.ndarray:
    """Phi(M) for a stack of kernels, shape (N, d, d) -> (N,), in one batched evaluation."""
    hessian, linear, constant = pooled_terms(problem, kernels)
    return constant - 0.5 * np.sum(linear * np.linalg.solve(hessian, linear), axis=(-2, -1))


def optimal_value(problem: Problem, kernel: np.ndarray) -> np.ndarray:
    """V*(M) = H(M)^{-1} C(M) (eq. 10); shape (d, d_y)."""
    hessian, linear, _ = pooled_terms(problem, kernel)
    return _solve_spd(hessian, linear)


def kernel_profile(problem: Problem, kernel: np.ndarray) -> float:
    """Phi_lambda(M) = min_V F(M, V) (eq. 10)."""
    hessian, linear, constant = pooled_terms(problem, kernel)
    return float(constant) - 0.5 * float(np.sum(linear * _solve_spd(hessian, linear)))


def profile_gradient(problem: Problem, kernel: np.ndarray) -> np.ndarray:
    """grad Phi(M) = grad_M F(M, V*(M)) (eq. 11); shape (d, d)."""
    return profile_and_gradient(problem, kernel)[1]


def profile_gradients(problem: Problem, kernels: np.ndarray):
    """(Phi(M_i), grad Phi(M_i), V*(M_i)) for a stack of kernels (..., d, d), batched."""
    m = np.asarray(kernels, dtype=np.float64)
    whitened = whiten(problem, m)
    hessian, linear, constant = pooled_terms(problem, m, whitened)
    v_star = np.linalg.solve(hessian, linear)
    values = constant - 0.5 * np.sum(linear * v_star, axis=(-2, -1))
    return values, pooled_kernel_gradient(problem, m, v_star, whitened), v_star


def profile_and_gradient(problem: Problem, kernel: np.ndarray):
    """(Phi(M), grad Phi(M)) sharing one solve."""
    m = np.asarray(kernel, dtype=np.float64)
    whitened = whiten(problem, m)
    hessian, linear, constant = pooled_terms(problem, m, whitened)
    v_star = _solve_spd(hessian, linear)
    value = float(constant) - 0.5 * float(np.vecdot(linear.ravel(), v_star.ravel()))
    return value, pooled_kernel_gradient(problem, m, v_star, whitened)


@dataclass(frozen=True)
class ProfileSolution:
    """Phi* = min_M Phi(M) and a minimiser (one of the pair +-M_*, Phi(M) = Phi(-M)).

    Attributes
    ----------
    value : float
        Phi*.
    kernel : ndarray, shape (d, d)
        M_* (the restart with the lowest Phi).
    value_block : ndarray, shape (d, d_y)
        V*(M_*).
    gradient_norm : float
        ||grad Phi(M_*)||_F, the optimality residual.
    restart_values : tuple of float
        Phi at the end of every restart (spread shows how many basins were found).
    """

    value: float
    kernel: np.ndarray
    value_block: np.ndarray
    gradient_norm: float
    restart_values: tuple[float, ...]


def solve_profile(
    problem: Problem,
    restarts: int = 4,
    seed: int = 0,
    tolerance: float = 1e-12,
    max_iterations: int = 5000,
) -> ProfileSolution:
    """Minimise Phi over M with L-BFGS on the closed-form gradient (eq. 11).

    Starts: the weighted teacher kernel sum_m p_m M*_m, and ``restarts - 1`` random
    kernels (entries N(0, 1/d), Generator seeded with ``seed``). The lowest end point wins.
    """
    if problem.kernel_ridge <= 0 and problem.ridge > 0:
        raise ParameterError(
            "kernel_ridge=0 with ridge>0: Phi has no minimiser (eq. 12, the infimum is "
            "approached as ||M|| -> infinity); use kernel_ridge > 0"
        )
    d = problem.dim
    rng = np.random.default_rng(seed)
    starts = [np.tensordot(problem.weights, problem.kernel_teachers, axes=1)]
    starts += [rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(max(restarts - 1, 0))]

    def fun(x):
        value, grad = profile_and_gradient(problem, x.reshape(d, d))
        return value, grad.ravel()

    from scipy.optimize import minimize  # on use: see make_problem

    best, ends = None, []
    for start in starts:
        res = minimize(fun, start.ravel(), jac=True, method="L-BFGS-B",
                       options={"maxiter": max_iterations, "ftol": tolerance, "gtol": 1e-11,
                                "maxcor": 30})
        ends.append(float(res.fun))
        if best is None or res.fun < best.fun:
            best = res
    kernel = best.x.reshape(d, d)
    _, grad, v_star = profile_gradients(problem, kernel)
    return ProfileSolution(
        value=float(best.fun),
        kernel=kernel,
        value_block=v_star,
        gradient_norm=float(np.linalg.norm(grad)),
        restart_values=tuple(ends),
    )
