"""The kernel profile Phi (docs/theory.md, eqs. 10-12) and its solver.

Checks: grad Phi (eq. 11) against central finite differences of Phi (rel. 1e-6); V*(M) solves
H V* = C and zeroes grad_V F; Phi(M) = Phi(-M) and V*(-M) = -V*(M) (rel. 1e-12);
solve_profile ends at ||grad Phi|| < 1e-5 with Phi* below Phi at random kernels and at the
teachers; kernel_ridge = 0 with ridge > 0 is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from linattn_theory.errors import ParameterError
from linattn_theory.objectives import global_gradient, global_loss
from linattn_theory.problem import make_problem
from linattn_theory.profile import (
    kernel_profile,
    optimal_value,
    pooled_quadratic,
    profile_gradient,
    solve_profile,
)

PROBLEMS = [
    dict(dim=2, num_clients=2, context_length=1, out_dim=1, covariate_shift=0.0, seed=0),
    dict(dim=3, num_clients=3, context_length=4, out_dim=2, covariate_shift=0.5, seed=1),
    dict(dim=5, num_clients=4, context_length=10, out_dim=2, covariate_shift=0.8, seed=2,
         weights="random"),
]


def _problem(kw):
    return make_problem(kernel_heterogeneity=0.6, value_heterogeneity=0.6, **kw)


@pytest.mark.parametrize("kw", PROBLEMS)
def test_profile_gradient_matches_central_differences(kw):
    """Every entry of grad Phi vs (Phi(M + h E_ij) - Phi(M - h E_ij)) / 2h, h = 1e-5."""
    problem = _problem(kw)
    rng = np.random.default_rng(3)
    d, h = problem.dim, 1e-5
    for _ in range(2):
        kernel = rng.standard_normal((d, d)) / np.sqrt(d)
        fd = np.zeros((d, d))
        for i in range(d):
            for j in range(d):
                step = np.zeros((d, d))
                step[i, j] = h
                fd[i, j] = (kernel_profile(problem, kernel + step)
                            - kernel_profile(problem, kernel - step)) / (2 * h)
        grad = profile_gradient(problem, kernel)
        rel = np.linalg.norm(grad - fd) / np.linalg.norm(grad)
        assert rel < 1e-6, rel


@pytest.mark.parametrize("kw", PROBLEMS)
def test_optimal_value_solves_normal_equations(kw):
    """H V* = C (eq. 10), grad_V F(M, V*) = 0 and F(M, V*) = Phi(M) (to 1e-12 relative)."""
    problem = _problem(kw)
    kernel = np.random.default_rng(4).standard_normal((problem.dim, problem.dim))
    hessian, linear, _ = pooled_quadratic(problem, kernel)
    v_opt = optimal_value(problem, kernel)
    assert np.linalg.norm(hessian @ v_opt - linear) <= 1e-12 * np.linalg.norm(linear)
    _, grad_v = global_gradient(problem, kernel, v_opt)
    assert np.linalg.norm(grad_v) <= 1e-12 * np.linalg.norm(linear)
    phi = kernel_profile(problem, kernel)
    assert abs(global_loss(problem, kernel, v_opt) - phi) <= 1e-12 * abs(phi)
    # V* is a minimum: any perturbation raises F
    for delta in np.random.default_rng(5).standard_normal((5, *v_opt.shape)) * 1e-2:
        assert global_loss(problem, kernel, v_opt + delta) > phi


@pytest.mark.parametrize("kw", PROBLEMS)
def test_profile_is_even_in_the_kernel(kw):
    """Phi(M) = Phi(-M), V*(-M) = -V*(M), grad Phi(-M) = -grad Phi(M) (rel. 1e-12)."""
    problem = _problem(kw)
    for kernel in np.random.default_rng(6).standard_normal((3, problem.dim, problem.dim)):
        phi = kernel_profile(problem, kernel)
        assert abs(kernel_profile(problem, -kernel) - phi) <= 1e-12 * abs(phi)
        np.testing.assert_allclose(optimal_value(problem, -kernel),
                                   -optimal_value(problem, kernel), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(profile_gradient(problem, -kernel),
                                   -profile_gradient(problem, kernel), rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("kw", PROBLEMS)
def test_solve_profile_reaches_a_stationary_minimum(kw):
    problem = _problem(kw)
    sol = solve_profile(problem)
    d = problem.dim
    assert sol.gradient_norm < 1e-5
    assert np.linalg.norm(profile_gradient(problem, sol.kernel)) < 1e-5
    assert abs(kernel_profile(problem, sol.kernel) - sol.value) <= 1e-12 * abs(sol.value)
    np.testing.assert_allclose(sol.value_block, optimal_value(problem, sol.kernel), rtol=1e-12)
    assert len(sol.restart_values) == 4 and sol.value == min(sol.restart_values)
    # below Phi at random kernels, at every teacher, at their average and at M = 0
    rng = np.random.default_rng(7)
    candidates = [*(rng.standard_normal((50, d, d)) / np.sqrt(d)),
                  *problem.kernel_teachers,
                  np.tensordot(problem.weights, problem.kernel_teachers, axes=1),
                  np.zeros((d, d))]
    values = np.array([kernel_profile(problem, m) for m in candidates])
    assert np.all(values >= sol.value - 1e-12), values.min() - sol.value
    # and the mirror image is a minimiser as well
    assert abs(kernel_profile(problem, -sol.kernel) - sol.value) <= 1e-12 * abs(sol.value)


def test_solve_profile_refuses_kernel_ridge_zero():
    problem = make_problem(dim=3, num_clients=2, ridge=0.01, kernel_ridge=0.0, seed=0)
    with pytest.raises(ParameterError, match="kernel_ridge"):
        solve_profile(problem)


def test_profile_infimum_is_at_infinity_without_kernel_ridge():
    """Eq. (12): with lambda_M = 0 and lambda > 0, Phi(s M) keeps decreasing as s grows, so
    refusing kernel_ridge = 0 is justified (strictly decreasing along s = 1, 2, 4, ..., 64)."""
    problem = make_problem(dim=3, num_clients=2, ridge=0.05, kernel_ridge=0.0, seed=0)
    kernel = solve_profile(make_problem(dim=3, num_clients=2, ridge=0.05, kernel_ridge=0.05,
                                        seed=0)).kernel
    values = [kernel_profile(problem, s * kernel) for s in 2.0 ** np.arange(7)]
    assert np.all(np.diff(values) < 0), values
