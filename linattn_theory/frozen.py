"""The frozen stage, exactly (docs/theory.md, eqs. 13-18).

With M fixed, client m runs K full-batch GD steps (step eta) on the quadratic
f_m(V) = L_m(M, V) + (lambda/2)||V||^2 with Hessian H'_m = H_m + lambda I:

    V -> A_m V + B_m C_m,  A_m = (I - eta H'_m)^K,  B_m = eta sum_{k<K} (I - eta H'_m)^k   (13)
    FedAvg:  V -> Abar V + b,  Abar = sum_m p_m A_m,  b = sum_m p_m B_m C_m                (14)
    V_inf(M) = (I - Abar)^{-1} b                                                            (15)
    contraction = spectral radius of Abar                                                   (16)
    D_frozen(M) = F(M, V_inf) - Phi(M) = 1/2 tr((V_inf - V*)^T H (V_inf - V*)) >= 0         (17)

and with minibatch noise the stationary excess 1/2 tr((I kron H) P), P the solution of a
discrete Lyapunov equation (18).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.errors import ParameterError, require
from linattn_theory.objectives import value_quadratic
from linattn_theory.problem import Problem


def check_steps(lr: float, local_steps: int) -> None:
    require(np.isfinite(lr) and lr > 0, "lr", lr, "a positive step size eta")
    require(isinstance(local_steps, int | np.integer) and local_steps >= 1, "local_steps",
            local_steps, "an integer K >= 1")


def local_value_maps(hessians: np.ndarray, lr: float, local_steps: int, ridge: float):
    """A_m and B_m of eq. (13) for a batch of Hessians H_m (without ridge), shape (..., d, d).

    With X = I - eta H'_m: A_m = X^K and B_m = eta sum_{k<K} X^k (the geometric sum, which
    equals (I - A_m) H'_m^{-1} without dividing by H'_m), by K - 1 matrix products (binary
    powering for large K). Raises :class:`ParameterError` when eta >= 2 / lambda_max(H'_m)
    for some client (the local GD map would expand); the check is a Cholesky factorisation
    of 2/eta I - H'_m, with the eigenvalues computed only for the error message.
    """
    check_steps(lr, local_steps)
    d = hessians.shape[-1]
    eye = np.eye(d)
    shifted = hessians + ridge * eye
    try:
        np.linalg.cholesky((2.0 / lr) * eye - shifted)
    except np.linalg.LinAlgError:
        top = float(np.max(np.linalg.eigvalsh(shifted)))
        limit = 2.0 / top if top > 0 else np.inf
        if lr >= limit:
            raise ParameterError(
                f"lr={lr:g} is above the stability limit 2/lambda_max(H'_m) = {limit:.4g} of "
                f"the local value problem; lr must be in (0, {limit:.4g})"
            ) from None
    step = eye - lr * shifted                      # I - eta H'_m
    return _power_and_sum(step, int(local_steps), lr)


def _power_and_sum(step: np.ndarray, count: int, lr: float):
    """(X^K, eta sum_{k<K} X^k) for a batch of matrices X (they commute with each other)."""
    eye = np.eye(step.shape[-1])
    if count <= 8:
        power, total = step, eye + step if count > 1 else np.broadcast_to(eye, step.shape)
        for _ in range(count - 2):
            power = power @ step
            total = total + power
        return (power @ step if count > 1 else step), lr * total
    # binary powering: (X^a, S_a) and (X^b, S_b) combine to (X^(a+b), S_a + X^a S_b)
    result_power, result_sum = None, None
    base_power, base_sum = step, np.broadcast_to(eye, step.shape)
    while count:
        if count & 1:
            if result_power is None:
                result_power, result_sum = base_power, base_sum
            else:
                result_sum = result_sum + result_power @ base_sum
                result_power = result_power @ base_power
        count >>= 1
        if count:
            base_sum = base_sum + base_power @ base_sum
            base_power = base_power @ base_power
    return result_power, lr * result_sum


@dataclass(frozen=True)
class FrozenStage:
    """The frozen-stage FedAvg map and its fixed point for one kernel M (eqs. 14-17).

    Attributes
    ----------
    transition : ndarray, shape (d, d)
        Abar.
    offset : ndarray, shape (d, d_y)
        b.
    fixed_point : ndarray, shape (d, d_y)
        V_inf(M).
    optimum : ndarray, shape (d, d_y)
        V*(M).
    contraction : float
        Spectral radius of Abar.
    floor : float
        D_frozen(M).
    hessian : ndarray, shape (d, d)
        H(M) = sum_m p_m H_m + lambda I.

    :func:`frozen_stages` returns the same fields for a stack of kernels, each with a leading
    axis (``contraction`` and ``floor`` as arrays).
    """

    transition: np.ndarray
    offset: np.ndarray
    fixed_point: np.ndarray
    optimum: np.ndarray
    contraction: float | np.ndarray
    floor: float | np.ndarray
    hessian: np.ndarray


def frozen_stages(problem: Problem, kernels: np.ndarray, lr: float, local_steps: int,
                  hessian: np.ndarray | None = None,
                  optimum: np.ndarray | None = None) -> FrozenStage:
    """The maps of eq. (14) and fixed points of eq. (15) for a stack of kernels (N, d, d).

    ``hessian`` and ``optimum`` (H(M) and V*(M), shapes (N, d, d), (N, d, d_y)) are used
    when the caller has them already. Ābar is symmetric (each A_m is a polynomial in the
    symmetric H'_m), so its spectral radius is the largest |eigenvalue| from eigvalsh.
    """
    m = np.asarray(kernels, dtype=np.float64)
    n, d = m.shape[0], problem.dim
    c, p = problem.num_clients, problem.weights
    h, lin, _ = value_quadratic(problem, m[:, None])
    a, b = local_value_maps(h, lr, local_steps, problem.ridge)
    transition = (p @ a.reshape(n, c, d * d)).reshape(n, d, d)
    offset = (p @ (b @ lin).reshape(n, c, -1)).reshape(n, d, -1)
    eye = np.eye(d)
    fixed_point = np.linalg.solve(eye - transition, offset)
    if hessian is None:
        hessian = (p @ h.reshape(n, c, d * d)).reshape(n, d, d) + problem.ridge * eye
    if optimum is None:
        optimum = np.linalg.solve(hessian, (p @ lin.reshape(n, c, -1)).reshape(n, d, -1))
    gap = fixed_point - optimum
    floor = 0.5 * np.sum(gap * (hessian @ gap), axis=(1, 2))
    contraction = np.max(np.abs(np.linalg.eigvalsh(transition)), axis=-1)
    return FrozenStage(transition=transition, offset=offset, fixed_point=fixed_point,
                       optimum=optimum, contraction=contraction,
                       floor=np.maximum(floor, 0.0), hessian=hessian)


def frozen_stage(problem: Problem, kernel: np.ndarray, lr: float, local_steps: int) -> FrozenStage:
    """Build the exact frozen-stage map of eq. (14) and its fixed point (eq. 15) for kernel M."""
    stage = frozen_stages(problem, np.asarray(kernel, dtype=np.float64)[None], lr, local_steps)
    return FrozenStage(
        transition=stage.transition[0],
        offset=stage.offset[0],
        fixed_point=stage.fixed_point[0],
        optimum=stage.optimum[0],
        contraction=float(stage.contraction[0]),
        floor=float(stage.floor[0]),
        hessian=stage.hessian[0],
    )


def frozen_fixed_point(problem: Problem, kernel: np.ndarray, lr: float, local_steps: int):
    """V_inf(M) of eq. (15)."""
    return frozen_stage(problem, kernel, lr, local_steps).fixed_point


def frozen_floor(problem: Problem, kernel: np.ndarray, lr: float, local_steps: int) -> float:
    """D_frozen(M) of eq. (17)."""
    return frozen_stage(problem, kernel, lr, local_steps).floor


def sample_gradient_covariance(problem: Problem, kernel: np.ndarray, value: np.ndarray,
                               rng: np.random.Generator, samples: int = 20000) -> np.ndarray:
    """Covariance Q_m of one sequence's gradient in vec(V) (column-major), by Monte Carlo.

    One sequence's gradient is g = Sigma_hat M^T x_q (yhat - y)^T (plus lambda V, which has
    no variance). Returns shape (C, d d_y, d d_y).
    """
    require(isinstance(samples, int | np.integer) and samples >= 2, "samples", samples,
            "an integer >= 2")
    d, dy, n = problem.dim, problem.out_dim, problem.context_length
    out = np.empty((problem.num_clients, d * dy, d * dy))
    for c in range(problem.num_clients):
        chol = np.linalg.cholesky(problem.covariances[c])
        x = rng.standard_normal((samples, n + 1, d)) @ chol.T
        xq, ctx = x[:, 0], x[:, 1:]
        sig = np.einsum("bni,bnj->bij", ctx, ctx) / n
        feat = np.einsum("bij,kj,bk->bi", sig, kernel, xq)  # Sigma_hat M^T x_q
        teacher = np.einsum("bij,kj,bk->bi", sig, problem.kernel_teachers[c], xq)
        resid = feat @ value - teacher @ problem.value_teachers[c]
        resid = resid - problem.noise * rng.standard_normal((samples, dy))
        grad = np.einsum("bi,ba->bai", feat, resid).reshape(samples, d * dy)  # column-major
        out[c] = np.cov(grad, rowvar=False)
    return out


def noise_stationary_term(problem: Problem, kernel: np.ndarray, lr: float, local_steps: int,
                          batch_size: int, gradient_covariance: np.ndarray | None = None,
                          rng: np.random.Generator | None = None, samples: int = 20000) -> float:
    """Stationary excess added by minibatch noise in the frozen stage (eq. 18).

    Linearised at V_inf: V_{r+1} - V_inf = Abar (V_r - V_inf) + xi_r with
    xi_r = -eta sum_m p_m sum_{k<K} (I - eta H'_m)^{K-1-k} eps_{m,k}, Cov(eps) = Q_m / B.
    P = Abar P Abar^T + Cov(xi) (on column-major vec V) and the term is 1/2 tr((I kron H) P).
    First order: Q_m is evaluated at V_inf and held fixed along the local path.

    Parameters
    ----------
    batch_size : int
        B, sequences per local step.
    gradient_covariance : ndarray, shape (C, d d_y, d d_y), optional
        Q_m; estimated with :func:`sample_gradient_covariance` (``rng`` required) if absent.
    """
    require(isinstance(batch_size, int | np.integer) and batch_size >= 1, "batch_size",
            batch_size, "an integer >= 1")
    stage = frozen_stage(problem, kernel, lr, local_steps)
    d, dy = problem.dim, problem.out_dim
    if gradient_covariance is None:
        if rng is None:
            raise ParameterError("rng is required when gradient_covariance is not given")
        gradient_covariance = sample_gradient_covariance(problem, kernel, stage.fixed_point, rng,
                                                         samples)
    q = np.asarray(gradient_covariance, dtype=np.float64)
    require(q.shape == (problem.num_clients, d * dy, d * dy), "gradient_covariance", q.shape,
            f"shape ({problem.num_clients}, {d * dy}, {d * dy})")
    h, _, _ = value_quadratic(problem, kernel)
    step = np.eye(d)[None] - lr * (h + problem.ridge * np.eye(d))
    eye_y = np.eye(dy)
    cov_xi = np.zeros((d * dy, d * dy))
    for c, weight in enumerate(problem.weights):
        power = np.eye(d)
        for _ in range(local_steps):  # sum over k of P^{K-1-k} Q P^{K-1-k}^T, any order
            big = np.kron(eye_y, power)
            cov_xi += weight**2 * lr**2 * big @ q[c] @ big.T / batch_size
            power = step[c] @ power
    big_a = np.kron(eye_y, stage.transition)
    from scipy.linalg import solve_discrete_lyapunov  # on use: see make_problem

    cov_v = solve_discrete_lyapunov(big_a, cov_xi)
    return 0.5 * float(np.trace(np.kron(eye_y, stage.hessian) @ cov_v))
