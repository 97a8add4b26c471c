"""Gaussian moments from the moment generating function; eq. (4) and the operator G.

Nothing here assumes Isserlis' theorem: moments of x ~ N(0, S) are read off the Taylor series
of the moment generating function E[exp(t^T x)] = exp(t^T S t / 2). For |alpha| = 2k the
degree-2k part of that series is (t^T S t / 2)^k / k!, so

    E[x^alpha] = alpha! [t^alpha] (t^T S t / 2)^k / k!,        E[x^alpha] = 0 for |alpha| odd.

From these moments the module rebuilds Isserlis' theorem for fourth moments, the single-vector
identity E[x x^T A x x^T] = S A S + S A^T S + tr(A S) S, the sample identity (4) for a symbolic
context length n, and, with no splitting of the double sum at all, (4) for n = 1, 2, 3 from the
joint moment generating function of all n tokens.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import sympy as sp

N = sp.Symbol("n", positive=True)


def symmetric_symbols(name: str, dim: int) -> sp.ImmutableMatrix:
    """A symmetric dim x dim matrix of symbols name_ij (i <= j)."""
    entries = [[sp.Symbol(f"{name}{min(i, j)}{max(i, j)}") for j in range(dim)]
               for i in range(dim)]
    return sp.ImmutableMatrix(entries)


def matrix_symbols(name: str, rows: int, cols: int) -> sp.ImmutableMatrix:
    """A rows x cols matrix of independent symbols name_ij."""
    return sp.ImmutableMatrix(rows, cols, lambda i, j: sp.Symbol(f"{name}{i}{j}"))


def unique_entries(matrix: sp.MatrixBase) -> list[sp.Symbol]:
    """The distinct symbols of a symbolic matrix, row-major (upper triangle if symmetric)."""
    seen, out = set(), []
    for entry in matrix:
        if entry not in seen:
            seen.add(entry)
            out.append(entry)
    return out


@cache
def moment_table(covariance: sp.ImmutableMatrix, degree: int) -> dict:
    """{alpha: E[x^alpha]} for |alpha| = degree (even), x ~ N(0, covariance), via the MGF."""
    dim = covariance.shape[0]
    t = sp.symbols(f"t0:{dim}")
    k = degree // 2
    quad = sum(covariance[i, j] * t[i] * t[j] for i in range(dim) for j in range(dim)) / 2
    series_term = sp.Poly(sp.expand(quad**k / math.factorial(k)), *t)
    table = {}
    for alpha, coeff in series_term.terms():
        weight = math.prod(math.factorial(a) for a in alpha)
        table[alpha] = sp.expand(coeff * weight)
    return table


def gaussian_expectation(expr: sp.Expr, variables, covariance: sp.MatrixBase) -> sp.Expr:
    """E[expr] for a polynomial ``expr`` in ``variables`` ~ N(0, covariance), from the MGF.

    Parameters
    ----------
    expr : sympy expression, polynomial in ``variables`` (coefficients may hold other symbols)
    variables : sequence of sympy symbols, the Gaussian vector's coordinates
    covariance : sympy matrix, len(variables) x len(variables)
    """
    cov = sp.ImmutableMatrix(covariance)
    poly = sp.Poly(sp.expand(expr), *variables)
    total = sp.Integer(0)
    for alpha, coeff in poly.terms():
        degree = sum(alpha)
        if degree % 2:
            continue
        moment = sp.Integer(1) if degree == 0 else moment_table(cov, degree).get(alpha, 0)
        total += coeff * moment
    return sp.expand(total)


def operator_g(matrix: sp.MatrixBase, covariance: sp.MatrixBase, context_length=N):
    """G(A) = S A S + (1/n)(S A^T S + tr(A S) S), the right-hand side of eq. (4)."""
    a, s = sp.Matrix(matrix), sp.Matrix(covariance)
    return s * a * s + (s * a.T * s + (a * s).trace() * s) / context_length


@cache
def isserlis_residuals(dim: int = 2) -> tuple:
    """E[x_i x_j x_k x_l] (from the MGF) minus S_ij S_kl + S_ik S_jl + S_il S_jk, all i, j, k, l.

    Every entry must be 0: Isserlis' theorem for fourth moments, re-derived.
    """
    s = symmetric_symbols("s", dim)
    x = sp.symbols(f"x0:{dim}")
    out = []
    for i, j, k, m in itertools.product(range(dim), repeat=4):
        moment = gaussian_expectation(x[i] * x[j] * x[k] * x[m], x, s)
        pairing = s[i, j] * s[k, m] + s[i, k] * s[j, m] + s[i, m] * s[j, k]
        out.append(sp.expand(moment - pairing))
    return tuple(out)


@cache
def single_vector_fourth_moment(dim: int = 2) -> sp.ImmutableMatrix:
    """E[x x^T A x x^T] for x ~ N(0, S), symbolic S and A, straight from the MGF."""
    s = symmetric_symbols("s", dim)
    a = matrix_symbols("a", dim, dim)
    x = sp.Matrix(sp.symbols(f"x0:{dim}"))
    inner = (x.T * a * x)[0, 0]
    outer = x * x.T * inner
    return sp.ImmutableMatrix(dim, dim, lambda i, j: gaussian_expectation(outer[i, j], x, s))


@cache
def single_vector_residual(dim: int = 2) -> sp.ImmutableMatrix:
    """E[x x^T A x x^T] - (S A S + S A^T S + tr(A S) S); must be the zero matrix."""
    s = sp.Matrix(symmetric_symbols("s", dim))
    a = sp.Matrix(matrix_symbols("a", dim, dim))
    formula = s * a * s + s * a.T * s + (a * s).trace() * s
    return sp.ImmutableMatrix((sp.Matrix(single_vector_fourth_moment(dim)) - formula).expand())


@cache
def sample_fourth_moment(dim: int = 2) -> sp.ImmutableMatrix:
    """E[Sigma_hat A Sigma_hat] for symbolic n, S, A (eq. 4a in docs/theory.md).

    Sigma_hat A Sigma_hat = n^-2 sum_{j,k} x_j x_j^T A x_k x_k^T. The n diagonal terms j = k each
    have the single-vector fourth moment (from the MGF); the n(n-1) terms j != k factor by
    independence into E[x_j x_j^T] A E[x_k x_k^T] = S A S.
    """
    s = sp.Matrix(symmetric_symbols("s", dim))
    a = sp.Matrix(matrix_symbols("a", dim, dim))
    diagonal = sp.Matrix(single_vector_fourth_moment(dim))
    off_diagonal = s * a * s
    total = (N * diagonal + N * (N - 1) * off_diagonal) / N**2
    return sp.ImmutableMatrix(total.expand())


@cache
def fourth_moment_residual(dim: int = 2) -> sp.ImmutableMatrix:
    """E[Sigma_hat A Sigma_hat] - G(A) for symbolic n (eq. 4); must be the zero matrix."""
    s = symmetric_symbols("s", dim)
    a = matrix_symbols("a", dim, dim)
    diff = sp.Matrix(sample_fourth_moment(dim)) - operator_g(a, s)
    return sp.ImmutableMatrix(diff.expand())


@cache
def explicit_fourth_moment_residual(dim: int, context_length: int) -> sp.ImmutableMatrix:
    """Eq. (4) at a concrete n from the joint MGF of all n tokens (no splitting of the sum).

    The n tokens are one Gaussian vector of length n d with block-diagonal covariance
    diag(S, ..., S); Sigma_hat A Sigma_hat is expanded as a polynomial in its n d coordinates
    and every monomial is replaced by its moment. Must be the zero matrix.
    """
    n = context_length
    s = symmetric_symbols("s", dim)
    a = matrix_symbols("a", dim, dim)
    tokens = [sp.Matrix(sp.symbols(f"x{j}_0:{dim}")) for j in range(n)]
    variables = [c for tok in tokens for c in tok]
    joint = sp.diag(*([sp.Matrix(s)] * n))
    sigma_hat = sum((tok * tok.T for tok in tokens), sp.zeros(dim, dim)) / n
    product = sigma_hat * sp.Matrix(a) * sigma_hat
    moment = sp.Matrix(dim, dim, lambda i, j: gaussian_expectation(product[i, j], variables, joint))
    return sp.ImmutableMatrix((moment - operator_g(a, s, sp.Integer(n))).expand())


@cache
def operator_symmetry_residuals(dim: int = 2) -> tuple:
    """(G(A)^T - G(A^T), <X, G(Y)> - <G(X), Y>) for symbolic S, A, X, Y; both must vanish.

    The second is the self-adjointness of G under <X, Y> = tr(X^T Y), used in eq. (8).
    """
    s = symmetric_symbols("s", dim)
    a = sp.Matrix(matrix_symbols("a", dim, dim))
    x = sp.Matrix(matrix_symbols("u", dim, dim))
    y = sp.Matrix(matrix_symbols("w", dim, dim))
    transpose = (operator_g(a, s).T - operator_g(a.T, s)).expand()
    adjoint = sp.expand((x.T * operator_g(y, s)).trace() - (operator_g(x, s).T * y).trace())
    return sp.ImmutableMatrix(transpose), adjoint


@cache
def fourth_moment_numeric(dim: int = 2):
    """Lambdified MGF-derived E[Sigma_hat A Sigma_hat]: ``f(matrix, covariance, n) -> (d, d)``.

    Built from :func:`sample_fourth_moment` (the MGF route), not from the formula (4), so that
    comparing it with ``linattn_theory.moments.fourth_moment`` tests the numeric code against an
    independent derivation.
    """
    s = symmetric_symbols("s", dim)
    a = matrix_symbols("a", dim, dim)
    expr = sample_fourth_moment(dim)
    args = [*unique_entries(a), *unique_entries(s), N]
    raw = sp.lambdify(args, expr, modules="numpy")

    def evaluate(matrix, covariance, context_length):
        matrix = np.asarray(matrix, dtype=np.float64)
        covariance = np.asarray(covariance, dtype=np.float64)
        sym = [covariance[i, j] for i in range(dim) for j in range(i, dim)]
        return np.asarray(raw(*matrix.ravel(), *sym, float(context_length)), dtype=np.float64)

    return evaluate
