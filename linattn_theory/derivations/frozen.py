"""The frozen stage: local maps (13), fixed point (15), drift floor (17), noise (18).

Everything starts from the local recursion itself, V_{k+1} = V_k - eta (H'_m V_k - C_m + eps_k),
unrolled symbolically; the closed forms of docs/theory.md are then compared with the unrolled
result. Generic symmetric H'_m (symbols) stand in for the model's H_m(M) + lambda I: the
frozen-stage algebra uses nothing about H'_m beyond symmetry (and invertibility).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import sympy as sp

from linattn_theory.derivations.moments import (
    gaussian_expectation,
    matrix_symbols,
    symmetric_symbols,
    unique_entries,
)

LR = sp.Symbol("eta", positive=True)


def _client_symbols(index: int, dim: int, out_dim: int = 1):
    return (sp.Matrix(symmetric_symbols(f"H{index}_", dim)),
            sp.Matrix(matrix_symbols(f"C{index}_", dim, out_dim)))


def _local_maps(hess: sp.Matrix, local_steps: int):
    step = sp.eye(hess.shape[0]) - LR * hess
    a = step**local_steps
    b = LR * sum((step**k for k in range(local_steps)), sp.zeros(*hess.shape))
    return a, b


@cache
def local_map_residuals(dim: int = 2, local_steps: int = 3, out_dim: int = 1):
    """Eq. (13) and the noise unrolling behind eq. (18), from K symbolic local GD steps.

    Returns ``(unrolled, geometric)``:

    - unrolled: V_K - [A V_0 + B C - eta sum_k (I - eta H')^{K-1-k} eps_k] for the recursion
      V_{k+1} = V_k - eta (H' V_k - C + eps_k); a zero matrix;
    - geometric: H' B - (I - A), i.e. B = (I - A) H'^{-1}; a zero matrix.
    """
    hess, lin = _client_symbols(0, dim, out_dim)
    v = sp.Matrix(matrix_symbols("V", dim, out_dim))
    noises = [sp.Matrix(matrix_symbols(f"eps{k}_", dim, out_dim)) for k in range(local_steps)]
    current = v
    for noise in noises:
        current = current - LR * (hess * current - lin + noise)
    a, b = _local_maps(hess, local_steps)
    step = sp.eye(dim) - LR * hess
    noise_part = sum((step ** (local_steps - 1 - k) * noises[k] for k in range(local_steps)),
                     sp.zeros(dim, out_dim))
    unrolled = (current - (a * v + b * lin - LR * noise_part)).expand()
    geometric = (hess * b - (sp.eye(dim) - a)).expand()
    return sp.ImmutableMatrix(unrolled), sp.ImmutableMatrix(geometric)


@cache
def local_maps_numeric(local_steps: int, dim: int = 2):
    """A_m and B_m read off the unrolled local recursion, lambdified (eq. 13).

    K symbolic GD steps V <- V - eta (H' V - C) from symbolic V_0 and C; A is the Jacobian of the
    result in V_0 and B its Jacobian in C (no closed form used). Returns
    ``f(hessian, lr) -> (A, B)`` for a symmetric (d, d) H' (ridge included) and a step eta.
    """
    hess = sp.Matrix(symmetric_symbols("H", dim))
    v0, lin = sp.Matrix(sp.symbols(f"v0:{dim}")), sp.Matrix(sp.symbols(f"c0:{dim}"))
    current = v0
    for _ in range(local_steps):
        current = current - LR * (hess * current - lin)
    args = [*unique_entries(hess), LR]
    fn_a = sp.lambdify(args, current.jacobian(v0), "numpy")
    fn_b = sp.lambdify(args, current.jacobian(lin), "numpy")

    def evaluate(hessian, lr):
        hessian = np.asarray(hessian, dtype=np.float64)
        flat = [hessian[i, j] for i in range(dim) for j in range(i, dim)]
        return (np.asarray(fn_a(*flat, lr), dtype=np.float64),
                np.asarray(fn_b(*flat, lr), dtype=np.float64))

    return evaluate


def _fixed_point_gap(hessians, linears, weights, local_steps):
    """(I - Abar) adj(H) C - det(H) b for client data (eqs. 10, 14, 15).

    V_inf = V* iff (I - Abar) V* = b; multiplying by det(H) keeps the check polynomial:
    the returned matrix is zero exactly when V_inf = V* (H = sum_m p_m H'_m invertible).
    """
    dim = hessians[0].shape[0]
    transition = sp.zeros(dim, dim)
    offset = sp.zeros(*linears[0].shape)
    for p, h, c in zip(weights, hessians, linears):
        a, b = _local_maps(h, local_steps)
        transition += p * a
        offset += p * b * c
    pooled_h = sum((p * h for p, h in zip(weights, hessians)), sp.zeros(dim, dim))
    pooled_c = sum((p * c for p, c in zip(weights, linears)), sp.zeros(*linears[0].shape))
    gap = (sp.eye(dim) - transition) * pooled_h.adjugate() * pooled_c - pooled_h.det() * offset
    return gap.expand()


def _two_weights():
    p = sp.Symbol("p", positive=True)
    return [p, 1 - p]


@cache
def one_step_floor_residual(dim: int = 2) -> sp.ImmutableMatrix:
    """K = 1: V_inf - V* for two clients with generic H'_m, C_m; a zero matrix (D_frozen = 0).

    Here I - Abar = eta sum_m p_m H'_m = eta H and b = eta C.
    """
    data = [_client_symbols(i, dim) for i in range(2)]
    return sp.ImmutableMatrix(_fixed_point_gap([h for h, _ in data], [c for _, c in data],
                                               _two_weights(), 1))


@cache
def equal_hessian_floor_residual(dim: int = 2, local_steps: int = 2) -> sp.ImmutableMatrix:
    """All H'_m equal (same Sigma_m), C_m different: V_inf - V* is a zero matrix for any K.

    In the model H'_m = G_m(M^T Sigma_m M) + lambda I depends on client m only through Sigma_m,
    so without covariate shift D_frozen = 0 however different the teachers are.
    """
    hess, _ = _client_symbols(0, dim)
    linears = [_client_symbols(i, dim)[1] for i in range(2)]
    return sp.ImmutableMatrix(_fixed_point_gap([hess, hess], linears, _two_weights(),
                                               local_steps))


@cache
def common_optimum_floor_residual(dim: int = 2, local_steps: int = 2) -> sp.ImmutableMatrix:
    """All V_m^opt = H'_m^{-1} C_m equal to one U, H'_m different: V_inf - V* is zero."""
    u = sp.Matrix(matrix_symbols("U", dim, 1))
    hessians = [_client_symbols(i, dim)[0] for i in range(2)]
    return sp.ImmutableMatrix(_fixed_point_gap(hessians, [h * u for h in hessians],
                                               _two_weights(), local_steps))


@cache
def scalar_floor(local_steps: int = 2) -> dict:
    """d = d_y = 1, two clients: weights p_m, curvatures h_m = H'_m, optima u_m = C_m / h_m.

    The weights are left unnormalised (p_0, p_1 > 0): V_inf and V* do not change when both
    are rescaled, and leaving out p_0 + p_1 = 1 lets sympy see every factor's sign.
    Returns ``gap`` (V_inf - V*, factored), ``floor`` (D_frozen = H gap^2 / 2, factored) and
    ``leading`` (the eta^2 coefficient of D_frozen's expansion at eta = 0 for this K).
    """
    weights = sp.symbols("p0:2", positive=True)
    h = sp.symbols("h0:2", positive=True)
    u = sp.symbols("u0:2", real=True)
    shrink = [1 - (1 - LR * x) ** local_steps for x in h]  # I - A_m
    v_inf = sum(w * r * y for w, r, y in zip(weights, shrink, u)) / sum(
        w * r for w, r in zip(weights, shrink))
    v_star = sum(w * x * y for w, x, y in zip(weights, h, u)) / sum(
        w * x for w, x in zip(weights, h))
    gap = sp.factor(sp.cancel(v_inf - v_star))
    pooled = sum(w * x for w, x in zip(weights, h))
    floor = sp.factor(pooled * gap**2 / 2)
    leading = sp.factor(sp.series(floor, LR, 0, 3).removeO().coeff(LR, 2))
    return {"gap": gap, "floor": floor, "leading": leading}


@cache
def scalar_floor_leading_general_k() -> sp.Expr:
    """Leading small-eta term of V_inf - V* in d = 1 for symbolic K, minus the prediction.

    Prediction (17b): V_inf - V* = -eta (K - 1)/2 [<h^2 u> <h> - <h^2> <h u>] / <h>^2 + O(eta^2),
    with <x> = sum_m p_m x_m. Must simplify to 0.
    """
    k = sp.Symbol("K", positive=True, integer=True)
    p = sp.Symbol("p", positive=True)
    h = sp.symbols("h0:2", positive=True)
    u = sp.symbols("u0:2", real=True)
    w = [p, 1 - p]
    # (1 - (1 - eta h)^K) / (K eta) = h (1 - (K - 1) eta h / 2) + O(eta^2): enough for the
    # eta^1 term of the ratio V_inf.
    shrink = [x * (1 - (k - 1) * LR * x / 2) for x in h]
    v_inf = sum(wi * s * ui for wi, s, ui in zip(w, shrink, u)) / sum(
        wi * s for wi, s in zip(w, shrink))
    v_star = sum(wi * x * ui for wi, x, ui in zip(w, h, u)) / sum(wi * x for wi, x in zip(w, h))
    slope = sp.diff(v_inf, LR).subs(LR, 0)

    def avg(f):
        return sum(wi * f(x, ui) for wi, x, ui in zip(w, h, u))

    predicted = -(k - 1) / 2 * (avg(lambda x, y: x**2 * y) * avg(lambda x, y: x)
                                - avg(lambda x, y: x**2) * avg(lambda x, y: x * y)) \
        / avg(lambda x, y: x) ** 2
    return sp.simplify(slope - predicted) + sp.simplify(v_inf.subs(LR, 0) - v_star)


@cache
def noise_covariance_residual(dim: int = 2, out_dim: int = 2, local_steps: int = 2,
                              clients: int = 2) -> sp.ImmutableMatrix:
    """Eq. (18a): Cov(xi) from unrolling noisy local steps, minus the closed form.

    Client m's K steps carry independent noises eps_{m,k} with Cov(vec eps) = Q_m / B
    (column-major vec, generic symmetric Q_m); clients are independent. xi is the averaged
    noise part of the round. Closed form: eta^2 sum_m p_m^2 sum_k P_mk Q_m P_mk^T / B with
    P_mk = I_{d_y} kron (I - eta H'_m)^{K-1-k}. Returns a zero matrix.
    """
    batch = sp.Symbol("B", positive=True)
    weights = sp.symbols(f"p0:{clients}", positive=True)
    size = dim * out_dim
    xi = sp.zeros(size, 1)
    variables, blocks, closed = [], [], sp.zeros(size, size)
    for m in range(clients):
        hess = sp.Matrix(symmetric_symbols(f"H{m}_", dim))
        q = sp.Matrix(symmetric_symbols(f"Q{m}_", size))
        noisy = sp.zeros(dim, out_dim)
        for k in range(local_steps):
            eps = sp.Matrix(matrix_symbols(f"e{m}_{k}_", dim, out_dim))
            noisy = noisy - LR * (hess * noisy + eps)  # noise part only: the map is affine
            variables.extend(eps.T.reshape(size, 1))  # column-major vec
            blocks.append(q / batch)
            power = (sp.eye(dim) - LR * hess) ** (local_steps - 1 - k)
            big = sp.kronecker_product(sp.eye(out_dim), power)
            closed += weights[m] ** 2 * LR**2 * big * q * big.T / batch
        xi += weights[m] * noisy.T.reshape(size, 1)
    # xi is linear in the noises: Cov(xi) = J Cov(eps) J^T with J its Jacobian
    jac = xi.jacobian(variables)
    cov = jac * sp.diag(*blocks) * jac.T
    return sp.ImmutableMatrix((cov - closed).expand())


@cache
def mean_recursion_residual(local_steps: int = 2) -> sp.Expr:
    """The mean of V follows the noiseless map exactly, despite multiplicative noise (d = 1).

    Each local step uses sampled curvature h + a_k and linear term c + b_k, (a_k, b_k) zero-mean
    Gaussian with any covariance, independent across steps and of V_0 = v0 + z. Returns
    E[V_K] - (A E[V_0] + B c); must be 0.
    """
    h, c, v0, eta = sp.symbols("h c v0 eta")
    z = sp.Symbol("z")
    noise = [sp.symbols(f"a{k} b{k}") for k in range(local_steps)]
    current = v0 + z
    variables, blocks = [z], [sp.Matrix([[sp.Symbol("var_z", positive=True)]])]
    for k, (a, b) in enumerate(noise):
        current = current - eta * ((h + a) * current - (c + b))
        variables.extend([a, b])
        blocks.append(sp.Matrix(symmetric_symbols(f"R{k}_", 2)))
    mean = gaussian_expectation(sp.expand(current), variables, sp.diag(*blocks))
    step = 1 - eta * h
    predicted = step**local_steps * v0 + eta * sum(step**k for k in range(local_steps)) * c
    return sp.expand(mean - predicted)


@cache
def transient_gap() -> dict:
    """d = 1: the exact value error against the additive bound D_frozen + rho^{2s} E_0.

    With delta = V_inf - V*, err = V_T0 - V_inf, a = Abar (scalar), s frozen rounds:
    value_error = H (delta + a^s err)^2 / 2,
    additive = H delta^2 / 2 + a^{2s} H (delta + err)^2 / 2,
    corrected = (sqrt(D_frozen) + |a|^s sqrt(H err^2 / 2))^2 >= value_error.

    Returns ``excess`` (value_error - additive, factored: positive whenever
    delta err > 0 and |err| is large enough, so the additive form is not a bound),
    ``example`` (the excess at H = 1, a = 1/2, s = 1, delta = 1, err = 10: 19/8) and
    ``corrected_slack`` (corrected - value_error at the same symbols, factored: >= 0).
    """
    hh, a = sp.symbols("H a", positive=True)
    delta, err = sp.symbols("delta err", positive=True)
    s = sp.Symbol("s", positive=True, integer=True)
    value_error = hh * (delta + a**s * err) ** 2 / 2
    additive = hh * delta**2 / 2 + a ** (2 * s) * hh * (delta + err) ** 2 / 2
    corrected = (sp.sqrt(hh * delta**2 / 2) + a**s * sp.sqrt(hh * err**2 / 2)) ** 2
    excess = sp.factor(sp.expand(value_error - additive))
    example = excess.subs({hh: 1, a: sp.Rational(1, 2), s: 1, delta: 1, err: 10})
    return {"excess": excess, "example": sp.nsimplify(example),
            "corrected_slack": sp.simplify(sp.expand(corrected - value_error))}

