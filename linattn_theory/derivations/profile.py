"""The value minimiser, the profile (10), the envelope theorem (11) and the degeneracy (12).

Three levels of generality:

- generic quadratics (any symmetric H, any C): V* = H^{-1} C is the stationary point, and
  completing the square gives F(V) = Phi + 1/2 tr((V - V*)^T H (V - V*)) (used again in (17));
- generic smooth coefficients H(theta), C(theta), k(theta): the envelope theorem (11);
- the model itself: in d = 1 everything is symbolic (profile parity, M = 0 stationary, the
  Hessian at 0, the scale identity Phi_lambda(cM) = Phi_{lambda/c^2}(M) for lambda_M = 0, the
  Schur-complement curvature), and in d = 2 with two clients the envelope theorem and the
  Hessian at 0 are checked exactly at rational points along random lines.
"""

from __future__ import annotations

import random
from functools import cache
from typing import NamedTuple

import sympy as sp

from linattn_theory.derivations.loss import ModelSymbols, formula_gradients, quadratic_pieces
from linattn_theory.derivations.moments import N, matrix_symbols, symmetric_symbols

RIDGE = sp.Symbol("lambda", positive=True)
KERNEL_RIDGE = sp.Symbol("lambda_M", nonnegative=True)


def _trace_form(x: sp.MatrixBase, h: sp.MatrixBase, y: sp.MatrixBase) -> sp.Expr:
    return (sp.Matrix(x).T * sp.Matrix(h) * sp.Matrix(y)).trace()


@cache
def value_minimiser_residuals(dim: int = 2, out_dim: int = 2):
    """Stationarity of V* = H^{-1} C and the completed square, for a generic quadratic.

    Returns ``(gradient_at_minimiser, completed_square)``: H V* - C (a zero matrix) and
    F(V) - [c - 1/2 tr(C^T H^{-1} C)] - 1/2 tr((V - V*)^T H (V - V*)) (zero for every V).
    """
    h = sp.Matrix(symmetric_symbols("H", dim))
    c = sp.Matrix(matrix_symbols("C", dim, out_dim))
    v = sp.Matrix(matrix_symbols("V", dim, out_dim))
    const = sp.Symbol("c0")
    v_star = h.inv() * c
    objective = _trace_form(v, h, v) / 2 - (v.T * c).trace() + const
    profile = const - (c.T * v_star).trace() / 2
    gap = v - v_star
    completed = objective - profile - _trace_form(gap, h, gap) / 2
    grad = (h * v_star - c).applyfunc(sp.simplify)
    return sp.ImmutableMatrix(grad), sp.simplify(sp.together(completed))


@cache
def envelope_residual_generic(dim: int = 2) -> sp.Expr:
    """Eq. (11) for F = 1/2 V^T H(theta) V - V^T C(theta) + k(theta), generic smooth H, C, k.

    Returns d/dtheta Phi(theta) - dF/dtheta (theta, V*(theta)), which must simplify to 0.
    """
    theta = sp.Symbol("theta")
    h = sp.Matrix(dim, dim, lambda i, j: sp.Function(f"h{min(i, j)}{max(i, j)}")(theta))
    c = sp.Matrix(dim, 1, lambda i, _: sp.Function(f"c{i}")(theta))
    k = sp.Function("k")(theta)
    v = sp.Matrix(sp.symbols(f"V0:{dim}"))
    objective = _trace_form(v, h, v) / 2 - (v.T * c)[0, 0] + k
    v_star = h.adjugate() * c / h.det()
    at_star = dict(zip(v, v_star))
    profile = objective.xreplace(at_star)
    partial = sp.diff(objective, theta).xreplace(at_star)
    return sp.cancel(sp.together(sp.diff(profile, theta) - partial))


class ScalarModel(NamedTuple):
    """The d = d_y = 1 model with two clients: symbols and the profile Phi(M)."""

    kernel: sp.Symbol
    profile: sp.Expr
    objective: sp.Expr
    value: sp.Symbol
    value_star: sp.Expr
    linear_slope: sp.Expr


@cache
def scalar_model(clients: int = 2) -> ScalarModel:
    """F(M, V) and Phi(M) for d = d_y = 1 with ``clients`` clients, fully symbolic.

    With d = 1, G(a) = (1 + 2/n) s^2 a, so H_m = (1 + 2/n) s_m^3 M^2 and
    C_m = (1 + 2/n) s_m^3 M M*_m V*_m.
    """
    m, v = sp.symbols("M V", real=True)
    n = N
    weights = sp.symbols(f"p0:{clients}", positive=True)
    covs = sp.symbols(f"s0:{clients}", positive=True)
    mts = sp.symbols(f"mt0:{clients}", real=True)
    vts = sp.symbols(f"vt0:{clients}", real=True)
    noise = sp.Symbol("sigma_eps", positive=True)
    hess, lin, const = 0, 0, 0
    for p, s, mt, vt in zip(weights, covs, mts, vts):
        sym = ModelSymbols(*(sp.ImmutableMatrix([[x]]) for x in (s, m, sp.Integer(0), mt, vt)))
        h, c, k = quadratic_pieces(sym, n, noise)
        hess += p * h[0, 0]
        lin += p * c[0, 0]
        const += p * k
    hess += RIDGE
    const += KERNEL_RIDGE * m**2 / 2
    objective = hess * v**2 / 2 - lin * v + const
    v_star = lin / hess
    profile = const - lin**2 / (2 * hess)
    return ScalarModel(m, profile, objective, v, v_star, sp.diff(lin, m))


@cache
def scalar_profile_residuals() -> dict:
    """The d = 1 facts of eqs. (10)-(12), each a residual that must simplify to 0.

    Keys
    ----
    envelope : Phi'(M) - dF/dM (M, V*(M))                                  (11)
    parity : Phi(-M) - Phi(M)
    stationary_at_zero : Phi'(0)
    hessian_at_zero : Phi''(0) - (lambda_M - J^2 / lambda), J = dC/dM      (12b)
    schur : Phi''(M) - [F_MM - F_MV^2 / F_VV] at V*(M)                     (23a)
    scale : Phi_lambda(cM) - Phi_{lambda/c^2}(M) at lambda_M = 0           (12)
    ridge_slope : d Phi_lambda / d lambda - V*^2 / 2                       (12a)
    """
    model = scalar_model()
    m, v, phi, obj = model.kernel, model.value, model.profile, model.objective
    c = sp.Symbol("c", positive=True)
    at_star = {v: model.value_star}
    no_kernel_ridge = phi.subs(KERNEL_RIDGE, 0)
    out = {
        "envelope": sp.diff(phi, m) - sp.diff(obj, m).xreplace(at_star),
        "parity": phi.subs(m, -m) - phi,
        "stationary_at_zero": sp.diff(phi, m).subs(m, 0),
        "hessian_at_zero": sp.diff(phi, m, 2).subs(m, 0)
        - (KERNEL_RIDGE - model.linear_slope**2 / RIDGE),
        "schur": sp.diff(phi, m, 2) - (sp.diff(obj, m, 2) - sp.diff(obj, m, v) ** 2
                                       / sp.diff(obj, v, 2)).xreplace(at_star),
        "scale": no_kernel_ridge.subs(m, c * m)
        - no_kernel_ridge.subs(RIDGE, RIDGE / c**2),
        "ridge_slope": sp.diff(phi, RIDGE) - model.value_star**2 / 2,
    }
    return {key: sp.simplify(sp.together(expr)) for key, expr in out.items()}


@cache
def scalar_unregularised_limit() -> sp.Expr:
    """lim_{c -> inf} Phi_lambda(cM) at lambda_M = 0, minus the unregularised profile Phi_0(M).

    Phi_0(M) = sum_m p_m c_m - C(M)^2 / (2 H_0(M)) with H_0 the ridge-free Hessian. Must be 0.
    """
    model = scalar_model()
    m, c = model.kernel, sp.Symbol("c", positive=True)
    phi = model.profile.subs(KERNEL_RIDGE, 0)
    limit = sp.limit(phi.subs(m, c * m), c, sp.oo)
    return sp.simplify(limit - phi.subs(RIDGE, 0))


def _rational(rng: random.Random, lo: int = -6, hi: int = 6, den: int = 4) -> sp.Rational:
    return sp.Rational(rng.randint(lo, hi), rng.randint(1, den))


def _rational_problem(rng: random.Random, dim: int, out_dim: int, clients: int):
    """Rational client data: weights, (S_m, M*_m, V*_m), n, s, lambda, lambda_M."""
    raw = [sp.Integer(rng.randint(1, 4)) for _ in range(clients)]
    weights = [r / sum(raw) for r in raw]
    data = []
    for _ in range(clients):
        root = sp.Matrix(dim, dim, lambda i, j: _rational(rng))
        cov = root * root.T + sp.eye(dim)
        data.append((cov, sp.Matrix(dim, dim, lambda i, j: _rational(rng)),
                     sp.Matrix(dim, out_dim, lambda i, j: _rational(rng))))
    return weights, data, sp.Integer(rng.randint(1, 5)), sp.Rational(1, 3), \
        sp.Rational(rng.randint(1, 4), 5), sp.Rational(rng.randint(1, 4), 7)


def model_line_residuals(dim: int = 2, out_dim: int = 1, clients: int = 2, seed: int = 0,
                         directions: int = 3) -> list:
    """Envelope (11) and Hessian at 0 (12b) for the model at exact rational points.

    For random rational problem data, kernel M_0 and direction D, Phi(M_0 + t D) is an exact
    rational function of t. Returned residuals (exact rationals, all must be 0):

    - d/dt Phi(M_0 + t D) at t = 0 minus <grad_M F(M_0, V*(M_0)), D> (eqs. 8, 11);
    - d^2/dt^2 Phi(t D) at t = 0 minus (lambda_M ||D||^2 - ||C(D)||_{1/lambda}^2), where C(D) is
      the pooled linear term at kernel D (eq. 12b: M = 0 is a local minimum iff this is > 0
      for every D).
    """
    rng = random.Random(seed)
    weights, data, n, noise, ridge, kernel_ridge = _rational_problem(rng, dim, out_dim, clients)
    t = sp.Symbol("t")

    def pooled(kernel):
        hess, lin, const = sp.zeros(dim, dim), sp.zeros(dim, out_dim), sp.Integer(0)
        for p, (cov, mt, vt) in zip(weights, data):
            sym = ModelSymbols(*(sp.ImmutableMatrix(x) for x in (cov, kernel,
                                                                  sp.zeros(dim, out_dim), mt, vt)))
            h, c, k = quadratic_pieces(sym, n, noise)
            hess += p * h
            lin += p * c
            const += p * k
        hess += ridge * sp.eye(dim)
        const += kernel_ridge * sum(e**2 for e in kernel) / 2
        return hess, lin, const

    def profile_derivative(kernel, order):
        """d^order/dt^order Phi(kernel(t)) at t = 0 (order <= 2), exact.

        Phi = k - num / (2 det H) with num = tr(C^T adj(H) C); num, det H and k are polynomials
        in t, so the Taylor coefficients of the ratio follow from power-series division.
        """
        hess, lin, const = pooled(kernel)
        hess, lin = hess.applyfunc(sp.expand), lin.applyfunc(sp.expand)
        num = sp.Poly((lin.T * hess.adjugate() * lin).trace(), t).all_coeffs()[::-1]
        den = sp.Poly(hess.det(), t).all_coeffs()[::-1]
        kc = sp.Poly(sp.expand(const), t).all_coeffs()[::-1]

        def coeff(seq, i):
            return seq[i] if i < len(seq) else 0

        ratio = []
        for i in range(order + 1):
            acc = coeff(num, i) - sum(ratio[j] * coeff(den, i - j) for j in range(i))
            ratio.append(acc / den[0])
        return sp.factorial(order) * (coeff(kc, order) - ratio[order] / 2)

    out = []
    for _ in range(directions):
        m0 = sp.Matrix(dim, dim, lambda i, j: _rational(rng))
        direction = sp.Matrix(dim, dim, lambda i, j: _rational(rng))
        slope = profile_derivative(m0 + t * direction, 1)
        hess, lin, _ = pooled(m0)
        v_star = hess.LUsolve(lin)
        grad = kernel_ridge * m0
        for p, (cov, mt, vt) in zip(weights, data):
            sym = ModelSymbols(*(sp.ImmutableMatrix(x) for x in (cov, m0, v_star, mt, vt)))
            grad += p * formula_gradients(sym, n)[0]
        out.append(sp.nsimplify(slope - (grad.T * direction).trace()))
        curvature = profile_derivative(t * direction, 2)
        _, lin_d, _ = pooled(direction)
        predicted = kernel_ridge * sum(e**2 for e in direction) - sum(e**2 for e in lin_d) / ridge
        out.append(sp.nsimplify(curvature - predicted))
    return out


@cache
def zero_kernel_residuals(dim: int = 2, out_dim: int = 1) -> dict:
    """M = 0 and the sign flip M -> -M in the model (symbolic S, M*, V*, n).

    Keys: ``hessian_at_zero`` H_m(0) (zero: so H(0) = lambda I), ``linear_at_zero`` C_m(0)
    (zero: so V*(0) = 0), ``kernel_gradient_at_zero`` grad_M L_m(0, 0), ``hessian_even``
    H_m(-M) - H_m(M), ``linear_odd`` C_m(-M) + C_m(M). All zero matrices.
    """
    s = symmetric_symbols("s", dim)
    m = matrix_symbols("m", dim, dim)
    mt, vt = matrix_symbols("mt", dim, dim), matrix_symbols("vt", dim, out_dim)
    zero_v = sp.ImmutableMatrix(sp.zeros(dim, out_dim))
    zero_m = sp.ImmutableMatrix(sp.zeros(dim, dim))
    at_zero = ModelSymbols(s, zero_m, zero_v, mt, vt)
    general = ModelSymbols(s, m, zero_v, mt, vt)
    flipped = ModelSymbols(s, sp.ImmutableMatrix(-sp.Matrix(m)), zero_v, mt, vt)
    h0, c0, _ = quadratic_pieces(at_zero)
    h, c, _ = quadratic_pieces(general)
    hf, cf, _ = quadratic_pieces(flipped)
    return {
        "hessian_at_zero": sp.ImmutableMatrix(h0.expand()),
        "linear_at_zero": sp.ImmutableMatrix(c0.expand()),
        "kernel_gradient_at_zero": sp.ImmutableMatrix(formula_gradients(at_zero)[0]),
        "hessian_even": sp.ImmutableMatrix((hf - h).expand()),
        "linear_odd": sp.ImmutableMatrix((cf + c).expand()),
    }
