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

Evaluation (the same formulas, arranged for few numpy calls on small matrices): with
Sigma = R R^T (Cholesky, cached on the problem), Z = R^T M and W = Z Sigma,

    Sigma A Sigma = W^T W  and  tr(A Sigma) = <Z, W>   for A = M^T Sigma M,

so H_m takes three small matrix products instead of the six of the generic eq. (4); C_m is
linear in M and, pooled over clients, is one matrix-vector product with the map cached in
``problem.teacher_products.linear_map`` (whose transpose gives the teacher part of grad_M F).
"""

from __future__ import annotations

import numpy as np

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


def _inner(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """<A, B> = tr(A^T B) over the last two axes, batched over the leading ones."""
    return np.sum(a * b, axis=(-2, -1))


def _client_hessians(problem: Problem, m: np.ndarray) -> np.ndarray:
    """H_m(M) = G_m(M^T S_m M) (eq. 6) for kernels broadcast against the clients.

    Eq. (4) for the symmetric A = M^T S M: G(A) = (1 + 1/n) S A S + tr(A S)/n S, with
    S A S = W^T W and tr(A S) = <Z, W> for Z = R^T M, W = Z S (S = R R^T).
    """
    s, n = problem.covariances, problem.context_length
    z = problem.teacher_products.chol_t @ m
    w = z @ s
    trace = _inner(z, w)
    return (1 + 1 / n) * (np.swapaxes(w, -1, -2) @ w) + (trace / n)[..., None, None] * s


def _client_linear(problem: Problem, m: np.ndarray) -> np.ndarray:
    """C_m(M) = G_m(M^T S M*) V* (eq. 6) for kernels broadcast against the clients.

    = S M^T (S M* S V*) + (1/n) (S M*^T S) M (S V*) + <M, S M* S>/n S V*.
    """
    s, n = problem.covariances, problem.context_length
    t = problem.teacher_products
    mt = np.swapaxes(m, -1, -2)
    trace = _inner(m, t.smss)
    return s @ (mt @ t.smsw) + (t.smts @ (m @ t.sw) + trace[..., None, None] * t.sw) / n


def value_quadratic(problem: Problem, kernel: np.ndarray):
    """H_m(M), C_m(M), c_m of eq. (6), without the ridge terms.

    Parameters
    ----------
    problem : Problem
    kernel : ndarray, shape (d, d) or (C, d, d)
        M (shared or per client); more leading axes batch, e.g. (N, 1, d, d).

    Returns
    -------
    hessians : ndarray, shape (C, d, d)
    linear : ndarray, shape (C, d, d_y)
    constants : ndarray, shape (C,)
    """
    m = np.asarray(kernel, dtype=np.float64)
    return _client_hessians(problem, m), _client_linear(problem, m), \
        problem.teacher_products.constants


def whiten(problem: Problem, m: np.ndarray):
    """Z_m = R_m^T M and W_m = Z_m S_m (S_m = R_m R_m^T) for kernels (..., d, d) shared by
    the clients; shapes (..., C, d, d). Then S_m M^T S_m M S_m = W_m^T W_m,
    tr(M^T S_m M S_m) = <Z_m, W_m> and S_m M S_m = R_m W_m."""
    c, d = problem.num_clients, problem.dim
    z = (problem.teacher_products.chol_t.reshape(c * d, d) @ m).reshape(*m.shape[:-2], c, d, d)
    return z, z @ problem.covariances


def pooled_terms(problem: Problem, kernels: np.ndarray, whitened=None):
    """H(M) = sum_m p_m H_m + lambda I, C(M) and c(M) of eq. (10) for a stack of kernels.

    Parameters
    ----------
    kernels : ndarray, shape (..., d, d)
    whitened : tuple, optional
        :func:`whiten` of ``kernels`` when the caller has it.

    Returns
    -------
    hessian : ndarray, shape (..., d, d)
    linear : ndarray, shape (..., d, d_y)
    constant : ndarray, shape (...)
        sum_m p_m c_m + (lambda_M/2)||M||^2.
    """
    m = np.asarray(kernels, dtype=np.float64)
    lead = m.shape[:-2]
    d, dy, c = problem.dim, problem.out_dim, problem.num_clients
    s, n, p = problem.covariances, problem.context_length, problem.weights
    t = problem.teacher_products
    z, w = whiten(problem, m) if whitened is None else whitened
    trace = np.vecdot(z.reshape(*lead, c, d * d), w.reshape(*lead, c, d * d))   # (..., C)
    # sum_m p_m W_m^T W_m as one product over the stacked (client, row) axis
    wp = (np.sqrt(p)[:, None, None] * w).reshape(*lead, c * d, d)
    hessian = wp.mT @ wp
    hessian *= 1 + 1 / n
    trace *= p / n
    hessian += (trace @ s.reshape(c, d * d)).reshape(*lead, d, d)
    diagonal = hessian.reshape(*lead, d * d)[..., :: d + 1]
    diagonal += problem.ridge
    flat = m.reshape(*lead, d * d)
    linear = (flat @ t.linear_map.T).reshape(*lead, d, dy)
    constant = t.base + 0.5 * problem.kernel_ridge * np.vecdot(flat, flat)
    return hessian, linear, constant


def _value_terms(problem: Problem, m: np.ndarray, v: np.ndarray):
    """H_m V - C_m (without ridge) and the products the kernel gradient reuses.

    ``m`` and ``v`` have shapes (..., C, d, d) and (..., C, d, d_y): leading axes batch.
    """
    return gradient_kernel(problem.covariances, problem.teacher_products,
                            problem.context_length, m, v)


def gradient_kernel(s, t, n: int, m: np.ndarray, v: np.ndarray, scale: float = 1.0):
    """(grad_M L_m, grad_V L_m, u = S V) without ridges, for per-client (M_m, V_m).

    Both gradients come multiplied by ``scale`` (a step size, saving a pass over them).

    With u = S V, P = S M, q = (1 + 1/n) P u - S M* S V* (client index dropped):

        grad_V L = S M^T q + (tr(M^T S M S) u - tr(M^T S M* S) S V* - (S M*^T S) M S V*)/n,
        grad_M L = q u^T - (S M* u)(S V*)^T/n + (tr(V^T S V) S M S - tr(V^T S V*) S M* S)/n,

    which is eqs. (7)-(8) with eq. (4) applied to the symmetric M^T S M and V V^T and to the
    rank-d_y products. ``s`` and ``t`` are the covariances (C, d, d) and TeacherProducts;
    leading axes of ``m`` (..., C, d, d) and ``v`` (..., C, d, d_y) batch (or broadcast).
    The rank-d_y terms and the two trace-weighted matrices are formed as two small stacked
    products (fewer passes over the (..., C, d, d) arrays than one product per term).
    """
    inv = 1.0 / n
    d, dy = m.shape[-1], v.shape[-1]
    inv_scaled = inv * scale
    u = s @ v
    sm = s @ m
    # S M S and S M* S stacked, so that tr(V^T S V) S M S - tr(V^T S V*) S M* S is one product
    pair = np.empty((*sm.shape[:-2], 2, d, d))
    pss = pair[..., 0, :, :]
    np.matmul(sm, s, out=pss)                           # S M S
    pair[..., 1, :, :] = t.smss
    lead = max(sm.shape[:-2], u.shape[:-2], key=len)
    # [q, -(S M* u)/n] and [u, S V*]^T, so that q u^T - (S M* u)(S V*)^T/n is one product
    left = np.empty((*lead, d, 2 * dy))
    right = np.empty((*lead, 2 * dy, d))
    q = pss @ v
    q *= (1 + inv) * scale
    q -= scale * t.smsw                                 # scale ((1 + 1/n) P u - S M* S V*)
    left[..., :dy] = q
    flat_m = m.reshape(*m.shape[:-2], d * d)
    tr_a = np.vecdot(flat_m, pss.reshape(*pss.shape[:-2], d * d))[..., None, None]
    tr_b = np.vecdot(flat_m, t.smss.reshape(-1, d * d))[..., None, None]
    grad_v = tr_a * u                                   # full batch shape: u and tr_a carry C
    grad_v -= tr_b * t.sw
    grad_v -= t.smts @ (m @ t.sw)
    grad_v *= inv_scaled
    grad_v += s @ (m.mT @ q)
    flat_v = v.reshape(*v.shape[:-2], -1)
    coefficients = np.empty((*lead, 1, 2))
    coefficients[..., 0, 0] = np.vecdot(flat_v, u.reshape(*u.shape[:-2], -1))
    coefficients[..., 0, 1] = np.vecdot(flat_v, t.sw.reshape(t.sw.shape[0], -1))
    coefficients *= (inv_scaled, -inv_scaled)
    grad_m = (coefficients @ pair.reshape(*pair.shape[:-2], d * d)).reshape(*lead, d, d)
    smsu = t.sms @ u
    smsu *= -inv_scaled
    left[..., dy:] = smsu
    right[..., :dy, :] = u.mT
    right[..., dy:, :] = t.sw_t
    grad_m += left @ right
    return grad_m, grad_v, u


def client_losses(problem: Problem, kernel: np.ndarray, value: np.ndarray) -> np.ndarray:
    """L_m(M, V) for every client by eq. (6); shape (C,). No ridge terms."""
    m, v = _per_client(problem, kernel, value)
    h_v = _client_hessians(problem, m) @ v
    lin = _client_linear(problem, m)
    quad = np.sum(v * h_v, axis=(-2, -1))
    return 0.5 * quad - np.sum(v * lin, axis=(-2, -1)) + problem.teacher_products.constants


def global_losses(problem: Problem, kernels: np.ndarray, values: np.ndarray) -> np.ndarray:
    """F(M_i, V_i) of eq. (3) for stacked points: (N, d, d), (N, d, d_y) -> (N,).

    F = 1/2 tr(V^T H V) - tr(V^T C) + c with the pooled H(M), C(M), c(M) of eq. (10).
    """
    v = np.asarray(values, dtype=np.float64)
    hessian, linear, constant = pooled_terms(problem, kernels)
    return (0.5 * np.sum(v * (hessian @ v), axis=(-2, -1)) - np.sum(v * linear, axis=(-2, -1))
            + constant)


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
    m, v = _per_client(problem, kernel, value)
    grad_m, grad_v, _ = _value_terms(problem, m, v)
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


def pooled_gradients(problem: Problem, kernels: np.ndarray, values: np.ndarray):
    """(grad_M F, grad_V F) at shared points, batched: (..., d, d), (..., d, d_y).

    With u_m = S_m V, the pooled forms of eqs. (7)-(8):

        grad_V F = H(M) V - C(M),
        grad_M F = sum_m p_m [(1 + 1/n) (S M u_m) u_m^T + tr(V^T u_m)/n S M S]
                   - (teacher map)^T V + lambda_M M,

    H and C from :func:`pooled_terms`, the teacher part of grad_M by adjointness of M -> C(M).
    """
    m = np.asarray(kernels, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    hessian, linear, _ = pooled_terms(problem, m)
    return pooled_kernel_gradient(problem, m, v), hessian @ v - linear


def pooled_kernel_gradient(problem: Problem, m: np.ndarray, v: np.ndarray,
                            whitened=None) -> np.ndarray:
    """grad_M F at shared points (see :func:`pooled_gradients`); leading axes batch.

    With W_m of :func:`whiten` (S_m M S_m = R_m W_m, S_m M u_m = R_m W_m V) the client sum
    is one product over the stacked (client, row) axis:
    sum_m p_m [(1 + 1/n) (S M u_m) u_m^T + tr(V^T u_m)/n S M S] = sum_m R_m Y_m with
    Y_m = p_m [(1 + 1/n) (W_m V) u_m^T + tr(V^T u_m)/n W_m].
    """
    lead = m.shape[:-2]
    d, dy, c = problem.dim, problem.out_dim, problem.num_clients
    s, n, p = problem.covariances, problem.context_length, problem.weights
    t = problem.teacher_products
    w = (whiten(problem, m) if whitened is None else whitened)[1]
    u = (s.reshape(c * d, d) @ v).reshape(*lead, c, d, dy)     # S_m V
    wv = (w.reshape(*lead, c * d, d) @ v).reshape(*lead, c, d, dy)
    wv *= ((1 + 1 / n) * p)[:, None, None]
    weight = np.vecdot(u.reshape(*lead, c, d * dy), v.reshape(*lead, 1, d * dy))
    weight *= p / n                                            # p_m tr(V^T S_m V) / n
    y = weight[..., None, None] * w
    y += wv * u.mT if dy == 1 else wv @ u.mT
    grad = t.chol_t.reshape(c * d, d).T @ y.reshape(*lead, c * d, d)
    grad -= (v.reshape(*lead, d * dy) @ t.linear_map).reshape(*lead, d, d)
    grad += problem.kernel_ridge * m
    return grad


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
