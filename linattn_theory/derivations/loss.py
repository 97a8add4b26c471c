"""The closed-form population loss (6) and its gradients (7), (8), (9), re-derived.

One client, symbolic S (covariance), M, V, M*, V*, noise s and context length n. The loss
1/2 E||yhat - y||^2 with yhat = V^T Sigma_hat M^T x_q and y = V*^T Sigma_hat M*^T x_q + eps is
taken in two stages, as in docs/theory.md:

1. over (x_q, eps) ~ N(0, diag(S, s^2 I)) given Sigma_hat (x_q and eps are independent of the
   context), by the MGF moments of :mod:`.moments`;
2. over Sigma_hat, replacing every product Sigma_hat_ab Sigma_hat_cd by its expectation
   n^-2 [n E(x_a x_b x_c x_d) + n (n - 1) S_ab S_cd], the fourth moment again from the MGF.

The result is compared with eq. (6) written through the operator G, and sympy's derivatives of
it with eqs. (7), (8), (9). :func:`explicit_loss_residual` repeats the whole expectation at a
concrete n in one step, over the joint Gaussian (x_q, x_1..x_n, eps), at exact rational
parameter values.
"""

from __future__ import annotations

import random
from functools import cache
from typing import NamedTuple

import numpy as np
import sympy as sp

from linattn_theory.derivations.moments import (
    N,
    gaussian_expectation,
    matrix_symbols,
    moment_table,
    operator_g,
    symmetric_symbols,
    unique_entries,
)

NOISE = sp.Symbol("sigma_eps", positive=True)


class ModelSymbols(NamedTuple):
    """The symbolic parameters of one client: S, M, V, M*, V* (sympy matrices)."""

    covariance: sp.ImmutableMatrix
    kernel: sp.ImmutableMatrix
    value: sp.ImmutableMatrix
    kernel_teacher: sp.ImmutableMatrix
    value_teacher: sp.ImmutableMatrix


@cache
def model_symbols(dim: int = 2, out_dim: int = 1) -> ModelSymbols:
    """Symbols for S (symmetric), M, V, M*, V* at the given sizes."""
    return ModelSymbols(
        covariance=symmetric_symbols("s", dim),
        kernel=matrix_symbols("m", dim, dim),
        value=matrix_symbols("v", dim, out_dim),
        kernel_teacher=matrix_symbols("mt", dim, dim),
        value_teacher=matrix_symbols("vt", dim, out_dim),
    )


def _inner(x: sp.MatrixBase, y: sp.MatrixBase) -> sp.Expr:
    """<X, Y> = tr(X^T Y)."""
    return sp.expand((sp.Matrix(x).T * sp.Matrix(y)).trace())


def _sample_covariance_expectation(expr: sp.Expr, hat: sp.MatrixBase, cov: sp.MatrixBase,
                                   context_length=N) -> sp.Expr:
    """E over Sigma_hat of a polynomial of degree <= 2 in the entries of ``hat``."""
    dim = cov.shape[0]
    gens = unique_entries(hat)
    index = {}
    for i in range(dim):
        for j in range(i, dim):
            index[hat[i, j]] = (i, j)
    fourth = moment_table(sp.ImmutableMatrix(cov), 4)

    def single_moment(idx):
        alpha = [0] * dim
        for i in idx:
            alpha[i] += 1
        return fourth[tuple(alpha)]

    poly = sp.Poly(sp.expand(expr), *gens)
    total = sp.Integer(0)
    for alpha, coeff in poly.terms():
        factors = [g for g, power in zip(gens, alpha) for _ in range(power)]
        if len(factors) == 0:
            moment = sp.Integer(1)
        elif len(factors) == 1:
            moment = cov[index[factors[0]]]
        elif len(factors) == 2:
            (a, b), (c, d) = index[factors[0]], index[factors[1]]
            n = context_length
            moment = (n * single_moment((a, b, c, d)) + n * (n - 1) * cov[a, b] * cov[c, d]) / n**2
        else:
            raise ValueError("the loss is quadratic in Sigma_hat")
        total += coeff * moment
    return sp.expand(total)


@cache
def population_loss(dim: int = 2, out_dim: int = 1) -> sp.Expr:
    """1/2 E||yhat - y||^2 for one client, derived from the MGF (symbolic n, s, S, M, V, M*, V*)."""
    sym = model_symbols(dim, out_dim)
    xq = sp.Matrix(sp.symbols(f"q0:{dim}"))
    eps = sp.Matrix(sp.symbols(f"e0:{out_dim}"))
    hat = sp.Matrix(symmetric_symbols("h", dim))
    m, v = sp.Matrix(sym.kernel), sp.Matrix(sym.value)
    mt, vt = sp.Matrix(sym.kernel_teacher), sp.Matrix(sym.value_teacher)
    resid = v.T * hat * m.T * xq - vt.T * hat * mt.T * xq - eps  # yhat - y, shape (d_y, 1)
    half_sq = sp.expand((resid.T * resid)[0, 0] / 2)
    joint = sp.diag(sp.Matrix(sym.covariance), NOISE**2 * sp.eye(out_dim))
    given_context = gaussian_expectation(half_sq, [*xq, *eps], joint)
    return _sample_covariance_expectation(given_context, hat, sp.Matrix(sym.covariance))


def quadratic_pieces(sym: ModelSymbols, context_length=N, noise=NOISE):
    """H, C, c of eq. (6) written through G: (H (d, d), C (d, d_y), c scalar)."""
    s = sp.Matrix(sym.covariance)
    m, mt, vt = sp.Matrix(sym.kernel), sp.Matrix(sym.kernel_teacher), sp.Matrix(sym.value_teacher)
    hess = operator_g(m.T * s * m, s, context_length)
    lin = operator_g(m.T * s * mt, s, context_length) * vt
    g_star = operator_g(mt.T * s * mt, s, context_length)
    const = (vt.T * g_star * vt).trace() / 2 + vt.shape[1] * noise**2 / 2
    return hess, lin, const


def formula_loss(sym: ModelSymbols, context_length=N, noise=NOISE) -> sp.Expr:
    """Eq. (6): 1/2 tr(V^T H V) - tr(V^T C) + c."""
    hess, lin, const = quadratic_pieces(sym, context_length, noise)
    v = sp.Matrix(sym.value)
    return sp.expand((v.T * hess * v).trace() / 2 - (v.T * lin).trace() + const)


def formula_gradients(sym: ModelSymbols, context_length=N):
    """Eqs. (8) and (7): (S M G(V V^T) - S M* G(V* V^T), H V - C)."""
    s = sp.Matrix(sym.covariance)
    m, v = sp.Matrix(sym.kernel), sp.Matrix(sym.value)
    mt, vt = sp.Matrix(sym.kernel_teacher), sp.Matrix(sym.value_teacher)
    hess, lin, _ = quadratic_pieces(sym, context_length)
    n = context_length
    grad_m = s * m * operator_g(v * v.T, s, n) - s * mt * operator_g(vt * v.T, s, n)
    return grad_m.expand(), (hess * v - lin).expand()


def _derivative(expr: sp.Expr, matrix: sp.MatrixBase) -> sp.Matrix:
    return sp.Matrix(matrix.shape[0], matrix.shape[1], lambda i, j: sp.diff(expr, matrix[i, j]))


@cache
def loss_derivatives(dim: int = 2, out_dim: int = 1):
    """(dL/dM, dL/dV) of the MGF-derived loss, by sympy differentiation (as polynomials)."""
    sym = model_symbols(dim, out_dim)
    gens = [*sym.kernel, *sym.value]
    poly = sp.Poly(population_loss(dim, out_dim), *gens)
    grads = {g: sp.expand(poly.diff(g).as_expr()) for g in gens}

    def block(mat):
        return sp.ImmutableMatrix(mat.shape[0], mat.shape[1], lambda i, j: grads[mat[i, j]])

    return block(sym.kernel), block(sym.value)


@cache
def loss_residual(dim: int = 2, out_dim: int = 1) -> sp.Expr:
    """Derived loss minus eq. (6); must expand to 0."""
    return sp.expand(population_loss(dim, out_dim) - formula_loss(model_symbols(dim, out_dim)))


@cache
def gradient_residuals(dim: int = 2, out_dim: int = 1):
    """(d L / d M - eq. (8), d L / d V - eq. (7)) with L the derived loss; both zero matrices."""
    derived_m, derived_v = loss_derivatives(dim, out_dim)
    grad_m, grad_v = formula_gradients(model_symbols(dim, out_dim))
    res_m = (sp.Matrix(derived_m) - grad_m).expand()
    res_v = (sp.Matrix(derived_v) - grad_v).expand()
    return sp.ImmutableMatrix(res_m), sp.ImmutableMatrix(res_v)


@cache
def scaling_residuals(dim: int = 2, out_dim: int = 1):
    """Eq. (8b): L(cM, V/c) - L(M, V) and <grad_M L, M> - <grad_V L, V>; both must be 0.

    yhat depends on (M, V) only through M Sigma_hat V, so the loss is invariant under
    (M, V) -> (cM, V/c); differentiating at c = 1 gives the Euler-type identity.
    """
    sym = model_symbols(dim, out_dim)
    c = sp.Symbol("c", positive=True)
    loss = population_loss(dim, out_dim)
    subs = {e: c * e for e in sym.kernel}
    subs.update({e: e / c for e in sym.value})
    invariance = sp.expand(loss.xreplace(subs) - loss)
    grad_m, grad_v = formula_gradients(sym)
    euler = sp.expand(_inner(grad_m, sym.kernel) - _inner(grad_v, sym.value))
    return invariance, euler


@cache
def factored_residuals(dim: int = 2, rank: int = 1, out_dim: int = 1, seed: int = 0):
    """Eq. (9): d L(W_Q W_K^T)/d W_Q - grad_M W_K and d/d W_K - grad_M^T W_Q; zero matrices.

    W_Q and W_K stay symbolic; S, V, M*, V*, n and s are exact random rationals (seeded), which
    keeps the expansion small. The residuals are polynomials in W_Q, W_K that must vanish.
    """
    sym = model_symbols(dim, out_dim)
    values = _rational_values(random.Random(seed), sym, with_kernel=False)
    wq, wk = matrix_symbols("wq", dim, rank), matrix_symbols("wk", dim, rank)
    concrete = ModelSymbols(*(sp.ImmutableMatrix(sp.Matrix(mat).xreplace(values)) for mat in sym))
    concrete = concrete._replace(kernel=sp.ImmutableMatrix(sp.Matrix(wq) * sp.Matrix(wk).T))
    n, noise = values[N], values[NOISE]
    loss = formula_loss(concrete, n, noise)
    grad_m = formula_gradients(concrete, n)[0]
    res_q = (_derivative(loss, wq) - grad_m * sp.Matrix(wk)).expand()
    res_k = (_derivative(loss, wk) - grad_m.T * sp.Matrix(wq)).expand()
    return sp.ImmutableMatrix(res_q), sp.ImmutableMatrix(res_k)


def _rational_values(rng: random.Random, sym: ModelSymbols, with_kernel: bool = True) -> dict:
    """Exact random rationals for every symbol of ``sym`` (S positive definite), n and s."""
    dim = sym.covariance.shape[0]
    root = _rational_matrix(rng, dim, dim)
    cov = root * root.T + sp.eye(dim)
    values = {sym.covariance[i, j]: cov[i, j] for i in range(dim) for j in range(dim)}
    mats = [sym.value, sym.kernel_teacher, sym.value_teacher]
    if with_kernel:
        mats.append(sym.kernel)
    for mat in mats:
        val = _rational_matrix(rng, *mat.shape)
        values.update({mat[i, j]: val[i, j] for i in range(mat.shape[0])
                       for j in range(mat.shape[1])})
    values.update({N: sp.Integer(rng.randint(1, 6)), NOISE: sp.Rational(rng.randint(1, 9), 7)})
    return values


def _rational_matrix(rng: random.Random, rows: int, cols: int) -> sp.Matrix:
    return sp.Matrix(rows, cols, lambda i, j: sp.Rational(rng.randint(-9, 9), rng.randint(1, 5)))


def explicit_loss_residual(dim: int = 2, out_dim: int = 1, context_length: int = 2,
                           seed: int = 0) -> sp.Expr:
    """Eq. (6) at exact rational parameters and a concrete n, from one joint expectation.

    (x_q, x_1..x_n, eps) is one Gaussian vector; 1/2 ||yhat - y||^2 is a degree-6 polynomial in
    it and its expectation is taken monomial by monomial from the MGF, with no conditioning and
    no use of eq. (4). Returns derived minus formula, an exact rational that must be 0.
    """
    rng = random.Random(seed)
    root = _rational_matrix(rng, dim, dim)
    cov = root * root.T + sp.eye(dim)
    m, v = _rational_matrix(rng, dim, dim), _rational_matrix(rng, dim, out_dim)
    mt, vt = _rational_matrix(rng, dim, dim), _rational_matrix(rng, dim, out_dim)
    noise = sp.Rational(rng.randint(1, 9), 7)
    n = context_length
    tokens = [sp.Matrix(sp.symbols(f"x{j}_0:{dim}")) for j in range(n + 1)]
    eps = sp.Matrix(sp.symbols(f"e0:{out_dim}"))
    xq, context = tokens[0], tokens[1:]
    hat = sum((t * t.T for t in context), sp.zeros(dim, dim)) / n
    resid = v.T * hat * m.T * xq - vt.T * hat * mt.T * xq - eps
    half_sq = (resid.T * resid)[0, 0] / 2
    variables = [*[c for t in tokens for c in t], *eps]
    joint = sp.diag(*([cov] * (n + 1)), noise**2 * sp.eye(out_dim))
    derived = gaussian_expectation(half_sq, variables, joint)
    sym = model_symbols(dim, out_dim)
    values = dict(zip(unique_entries(sym.covariance), [cov[i, j] for i in range(dim)
                                                       for j in range(i, dim)]))
    for sym_mat, val in ((sym.kernel, m), (sym.value, v), (sym.kernel_teacher, mt),
                         (sym.value_teacher, vt)):
        values.update({sym_mat[i, j]: val[i, j] for i in range(sym_mat.shape[0])
                       for j in range(sym_mat.shape[1])})
    values.update({N: sp.Integer(n), NOISE: noise})
    return sp.nsimplify(derived - formula_loss(sym).xreplace(values))


def _flat_args(sym: ModelSymbols):
    return [*unique_entries(sym.covariance), *sym.kernel, *sym.value, *sym.kernel_teacher,
            *sym.value_teacher, N, NOISE]


def _flat_values(covariance, kernel, value, kernel_teacher, value_teacher, context_length, noise):
    cov = np.asarray(covariance, dtype=np.float64)
    dim = cov.shape[0]
    out = [cov[i, j] for i in range(dim) for j in range(i, dim)]
    for x in (kernel, value, kernel_teacher, value_teacher):
        out.extend(np.asarray(x, dtype=np.float64).ravel())
    return [*out, float(context_length), float(noise)]


@cache
def loss_numeric(dim: int = 2, out_dim: int = 1):
    """Lambdified derived loss and its sympy gradients and quadratic pieces, for numeric tests.

    Returns a function ``f(covariance, kernel, value, kernel_teacher, value_teacher,
    context_length, noise)`` giving a dict with ``loss`` (float), ``grad_kernel`` (d, d),
    ``grad_value`` (d, d_y), ``hessian`` (d, d), ``linear`` (d, d_y) and ``constant`` (float).
    The pieces come from differentiating the MGF-derived loss (H = d^2 L / dV_{:,0}^2,
    C = -dL/dV at V = 0, c = L at V = 0), not from eq. (6).
    """
    sym = model_symbols(dim, out_dim)
    loss = population_loss(dim, out_dim)
    at_zero = {e: 0 for e in sym.value}
    grad_m, grad_v = loss_derivatives(dim, out_dim)
    column = [sym.value[i, 0] for i in range(dim)]
    hess = sp.Matrix(dim, dim, lambda i, j: sp.diff(grad_v[i, 0], column[j]))
    lin = -grad_v.xreplace(at_zero)
    const = loss.xreplace(at_zero)
    args = _flat_args(sym)
    fns = {name: sp.lambdify(args, expr, modules="numpy") for name, expr in (
        ("loss", loss), ("grad_kernel", grad_m), ("grad_value", grad_v), ("hessian", hess),
        ("linear", lin), ("constant", const))}

    def evaluate(covariance, kernel, value, kernel_teacher, value_teacher, context_length,
                 noise):
        flat = _flat_values(covariance, kernel, value, kernel_teacher, value_teacher,
                            context_length, noise)
        return {name: np.asarray(fn(*flat), dtype=np.float64) for name, fn in fns.items()}

    return evaluate
