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
    return hessians, linear, problem.teacher_products.constants


def client_losses(problem: Problem, kernel: np.ndarray, value: np.ndarray) -> np.ndarray:
    """L_m(M, V) for every client by eq. (6); shape (C,). No ridge terms."""
    m, v = _per_client(problem, kernel, value)
    h_v, lin, _, _, _ = _value_terms(problem, m, v)
    quad = np.einsum("cia,cia->c", v, h_v)
    return 0.5 * quad - np.einsum("cia,cia->c", v, lin) + problem.teacher_products.constants


def _value_terms(problem: Problem, m: np.ndarray, v: np.ndarray):
    """H_m V, C_m and the shared products u = S V, P = S M, P S (see client_gradients).

    ``m`` and ``v`` have shapes (..., C, d, d) and (..., C, d, d_y): leading axes batch.
    """
    s, n = problem.covariances, problem.context_length
    t = problem.teacher_products
    mt = np.swapaxes(m, -1, -2)
    u = s @ v                                   # S V            (C, d, dy)
    ps = s @ m                                  # P = S M        (C, d, d)
    pss = ps @ s                                # P S
    tr_a = np.einsum("...ij,...ij->...", m, pss)      # tr(M^T S M S)
    h_v = (1 + 1 / n) * (s @ (mt @ (ps @ u))) + (tr_a / n)[..., None, None] * u
    tr_b = np.einsum("...ij,...ij->...", m, t.smss)   # tr(M^T S M* S)
    lin = (s @ (mt @ t.smsw) + (t.smts @ (m @ t.sw)) / n
           + (tr_b / n)[..., None, None] * t.sw)
    return h_v, lin, u, ps, pss


def global_losses(problem: Problem, kernels: np.ndarray, values: np.ndarray) -> np.ndarray:
    """F(M_i, V_i) of eq. (3) for stacked points: (N, d, d), (N, d, d_y) -> (N,)."""
    m = np.asarray(kernels, dtype=np.float64)[:, None]
    v = np.asarray(values, dtype=np.float64)[:, None]
    c = problem.num_clients
    m = np.broadcast_to(m, (m.shape[0], c, *m.shape[2:]))
    v = np.broadcast_to(v, (v.shape[0], c, *v.shape[2:]))
    h_v, lin, _, _, _ = _value_terms(problem, m, v)
    losses = (0.5 * np.einsum("ncia,ncia->nc", v, h_v) - np.einsum("ncia,ncia->nc", v, lin)
              + problem.teacher_products.constants)
    ridge = 0.5 * problem.ridge * np.sum(np.square(values), axis=(1, 2))
    kernel_ridge = 0.5 * problem.kernel_ridge * np.sum(np.square(kernels), axis=(1, 2))
    return losses @ problem.weights + ridge + kernel_ridge


def client_gradients(problem: Problem, kernel: np.ndarray, value: np.ndarray):
    """(grad_M L_m, grad_V L_m) by eqs. (8) and (7); shapes (C, d, d) and (C, d, d_y).

    No ridge terms (they belong to F and to the local objectives f_m, see
    :func:`local_gradients`). Evaluated without forming H_m or G_m(V V^T): with u = S V,
    w = S V*, P = S M and the teacher-only products cached on the problem,

        H_m V   = (1 + 1/n) S M^T S M u + tr(M^T S M S)/n u,
        C_m     = S M^T (S M* w) + (1/n) (S M*^T S) M w + tr(M^T S M* S)/n w,
        S M G(V V^T)   = (1 + 1/n) (P u) u^T + tr(V^T u)/n P S,
        S M* G(V* V^T) = (S M* w) u^T + (1/n) ((S M* u) w^T + tr(V^T w) S M* S),

    which is eq. (4) applied to the symmetric M^T S M and V V^T and to the rank-d_y products.
    """
    n = problem.context_length
    m, v = _per_client(problem, kernel, value)
    t = problem.teacher_products
    h_v, lin, u, ps, pss = _value_terms(problem, m, v)
    grad_v = h_v - lin
    ut = np.swapaxes(u, 1, 2)
    tr_vv = np.einsum("cia,cia->c", v, u)       # tr(V V^T S)
    grad_m = (1 + 1 / n) * ((ps @ u) @ ut) + (tr_vv / n)[:, None, None] * pss
    tr_sv = np.einsum("cia,cia->c", v, t.sw)    # tr(V* V^T S)
    grad_m -= (t.smsw @ ut + ((t.sms @ u) @ np.swapaxes(t.sw, 1, 2)) / n
               + (tr_sv / n)[:, None, None] * t.smss)
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
