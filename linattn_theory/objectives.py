"""Exact finite-n losses and gradients (docs/theory.md, eqs. 6-9).

For client m, with G_m the operator of eq. (5) for (Sigma_m, n),

    L_m(M, V) = 1/2 tr(V^T H_m V) - tr(V^T C_m) + c_m                                 (6)
    H_m = G_m(M^T Sigma_m M),  C_m = G_m(M^T Sigma_m M*_m) V*_m,
    c_m = 1/2 tr(V*_m^T G_m(M*_m^T Sigma_m M*_m) V*_m) + d_y s^2 / 2,
    grad_V L_m = H_m V - C_m                                                          (7)
    grad_M L_m = Sigma_m M G_m(V V^T) - Sigma_m M*_m G_m(V*_m V^T)                    (8)
    grad_{W_Q} = grad_M W_K,  grad_{W_K} = grad_M^T W_Q      (M = W_Q W_K^T)          (9)

and F(M, V) = sum_m p_m L_m + (lambda/2)||V||^2 + (lambda_M/2)||M||^2 (eq. 3).
Every function accepts a shared kernel of shape (d, d) or one per client, (C, d, d); the
same for V with (d, d_y) or (C, d, d_y). All arithmetic is float64.
"""

from __future__ import annotations

import numpy as np

from linattn_theory.moments import fourth_moment
from linattn_theory.problem import Problem


def _per_client(problem: Problem, kernel: np.ndarray, value: np.ndarray):
    c = problem.num_clients
    m = np.asarray(kernel, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    if m.ndim == 2:
        m = np.broadcast_to(m, (c, *m.shape))
    if v.ndim == 2:
        v = np.broadcast_to(v, (c, *v.shape))
    return m, v


def value_quadratic(problem: Problem, kernel: np.ndarray):
    """H_m(M), C_m(M), c_m of eq. (6), without the ridge terms.

    Parameters
    ----------
    problem : Problem
    kernel : ndarray, shape (d, d) or (C, d, d)
        M (shared or per client).

    Returns
    -------
    hessians : ndarray, shape (C, d, d)
    linear : ndarray, shape (C, d, d_y)
    constants : ndarray, shape (C,)
    """
    s, n = problem.covariances, problem.context_length
    m_star, v_star = problem.kernel_teachers, problem.value_teachers
    m = np.asarray(kernel, dtype=np.float64)
    mt = np.swapaxes(m, -1, -2)
    hessians = fourth_moment(mt @ s @ m, s, n)
    linear = fourth_moment(mt @ s @ m_star, s, n) @ v_star
    g_star = fourth_moment(np.swapaxes(m_star, 1, 2) @ s @ m_star, s, n)
    constants = 0.5 * np.einsum("cia,cij,cja->c", v_star, g_star, v_star)
    constants = constants + 0.5 * problem.out_dim * problem.noise**2
    return hessians, linear, constants


def client_losses(problem: Problem, kernel: np.ndarray, value: np.ndarray) -> np.ndarray:
    """L_m(M, V) for every client by eq. (6); shape (C,). No ridge terms."""
    m, v = _per_client(problem, kernel, value)
    h, lin, const = value_quadratic(problem, m)
    quad = np.einsum("cia,cij,cja->c", v, h, v)
    return 0.5 * quad - np.einsum("cia,cia->c", v, lin) + const


def client_gradients(problem: Problem, kernel: np.ndarray, value: np.ndarray):
    """(grad_M L_m, grad_V L_m) by eqs. (8) and (7); shapes (C, d, d) and (C, d, d_y).

    No ridge terms (they belong to F and to the local objectives f_m, see
    :func:`local_gradients`).
    """
    s, n = problem.covariances, problem.context_length
    m_star, v_star = problem.kernel_teachers, problem.value_teachers
    m, v = _per_client(problem, kernel, value)
    mt = np.swapaxes(m, 1, 2)
    h = fourth_moment(mt @ s @ m, s, n)
    lin = fourth_moment(mt @ s @ m_star, s, n) @ v_star
    grad_v = h @ v - lin
    vvt = v @ np.swapaxes(v, 1, 2)
    svvt = v_star @ np.swapaxes(v, 1, 2)
    grad_m = s @ m @ fourth_moment(vvt, s, n) - s @ m_star @ fourth_moment(svvt, s, n)
    return grad_m, grad_v


def local_gradients(problem: Problem, kernel: np.ndarray, value: np.ndarray):
    """Gradients of the local objectives f_m = L_m + (lambda/2)||V||^2 + (lambda_M/2)||M||^2."""
    m, v = _per_client(problem, kernel, value)
    grad_m, grad_v = client_gradients(problem, m, v)
    return grad_m + problem.kernel_ridge * m, grad_v + problem.ridge * v


def global_loss(problem: Problem, kernel: np.ndarray, value: np.ndarray) -> float:
    """F(M, V) of eq. (3) for a shared kernel (d, d) and value (d, d_y)."""
    losses = client_losses(problem, kernel, value)
    ridge = 0.5 * problem.ridge * float(np.sum(np.square(value)))
    kernel_ridge = 0.5 * problem.kernel_ridge * float(np.sum(np.square(kernel)))
    return float(problem.weights @ losses) + ridge + kernel_ridge


def global_gradient(problem: Problem, kernel: np.ndarray, value: np.ndarray):
    """(grad_M F, grad_V F) for a shared (M, V); shapes (d, d) and (d, d_y)."""
    grad_m, grad_v = local_gradients(problem, kernel, value)
    p = problem.weights
    return np.tensordot(p, grad_m, axes=1), np.tensordot(p, grad_v, axes=1)


def factored_gradients(problem: Problem, query: np.ndarray, key: np.ndarray, value: np.ndarray):
    """Local-objective gradients in the factored parametrization M = W_Q W_K^T (eq. 9).

    Parameters
    ----------
    query, key : ndarray, shape (d, r) or (C, d, r)
        W_Q and W_K.
    value : ndarray, shape (d, d_y) or (C, d, d_y)

    Returns
    -------
    grad_query, grad_key : ndarray, shape (C, d, r)
    grad_value : ndarray, shape (C, d, d_y)
    """
    kernel = np.asarray(query) @ np.swapaxes(np.asarray(key), -1, -2)
    grad_m, grad_v = local_gradients(problem, kernel, value)
    c = problem.num_clients
    q = np.broadcast_to(query, (c, *np.shape(query)[-2:]))
    k = np.broadcast_to(key, (c, *np.shape(key)[-2:]))
    return grad_m @ k, np.swapaxes(grad_m, 1, 2) @ q, grad_v
