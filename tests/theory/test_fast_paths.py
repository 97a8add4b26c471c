"""The batched and exact evaluations behind the fast probe, against plain references.

``estimate_constants`` and ``population_dynamics`` evaluate the closed forms rearranged for
speed (pooled client sums as stacked products, a Cholesky form of H_m, the frozen-stage maps as
matrix polynomials, several path points per call) and take Hessian-vector products from the
exact Hessian of F (and of Phi, eq. 23a), not from central differences. Each piece is checked
here against a straightforward version written from the per-client functions:

- pooled H(M), C(M), c(M), F and grad F against weighted sums of ``value_quadratic`` /
  ``local_gradients`` (rel. 1e-12);
- the exact Hessian of F against central differences of the closed-form gradient (eqs. 7-8),
  d_y = 1 and 2, and the Hessian of Phi against central differences of grad Phi (eq. 11)
  (rel. 1e-6; the differences' own truncation error is ~1e-10);
- ``hessian_power`` / ``profile_hessian_norm`` against the finite-difference definition: the
  same power iteration (same start vectors, same iteration counts) with central-difference
  products (rel. 1e-7) -- the iteration budget is the same, only the products differ;
- ``local_value_maps`` (matrix polynomial, binary powering for K > 8) against the eigenvalue
  formula of eq. (13) (rel. 1e-11), also with lambda = 0;
- ``frozen_stages`` on a stack against ``frozen_stage`` point by point, and ``one_round`` on a
  stack against single rounds (rel. 1e-12);
- ``estimate_constants``: its drift error (which reuses path points instead of re-running
  rounds) equals max_t ||FedAvg round - reference round|| / (eta K) recomputed with
  ``one_round`` from the path (rel. 1e-12), and fast-mode L, L_Phi from power iteration stay
  below and within 2% of the exact largest eigenvalues at the same points.
"""

from __future__ import annotations

import numpy as np
import pytest

from linattn_theory.constants import (
    estimate_constants,
    hessian_matrix,
    hessian_power,
    profile_hessian_matrix,
    profile_hessian_norm,
)
from linattn_theory.dynamics import initial_point, one_round, warmup_paths
from linattn_theory.errors import ParameterError
from linattn_theory.frozen import frozen_stage, frozen_stages, local_value_maps
from linattn_theory.objectives import (
    client_losses,
    global_gradient,
    global_losses,
    local_gradients,
    pooled_gradients,
    pooled_terms,
    value_quadratic,
)
from linattn_theory.problem import make_problem
from linattn_theory.profile import profile_gradient, profile_values

PROBLEMS = {
    "dy1": dict(dim=5, num_clients=4, context_length=3, covariate_shift=0.6,
                weights="random", seed=3),
    "dy2": dict(dim=4, num_clients=3, out_dim=2, context_length=5, covariate_shift=0.4,
                kernel_heterogeneity=0.9, value_heterogeneity=0.9, seed=1),
}


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _point(problem, seed=0):
    rng = np.random.default_rng(seed)
    d, dy = problem.dim, problem.out_dim
    return rng.standard_normal((d, d)) / np.sqrt(d), rng.standard_normal((d, dy)) / np.sqrt(d)


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_pooled_forms_match_client_sums(name):
    problem = make_problem(**PROBLEMS[name])
    p, d = problem.weights, problem.dim
    kernels = np.stack([_point(problem, s)[0] for s in range(3)])
    values = np.stack([_point(problem, s)[1] for s in range(3)])
    hessian, linear, constant = pooled_terms(problem, kernels)
    for i in range(3):
        h, lin, const = value_quadratic(problem, kernels[i])
        assert _rel(hessian[i], np.tensordot(p, h, axes=1) + problem.ridge * np.eye(d)) < 1e-12
        assert _rel(linear[i], np.tensordot(p, lin, axes=1)) < 1e-12
        ridge = 0.5 * problem.kernel_ridge * np.sum(kernels[i] ** 2)
        assert _rel(constant[i], p @ const + ridge) < 1e-12
        gm, gv = local_gradients(problem, kernels[i], values[i])
        pooled_m, pooled_v = pooled_gradients(problem, kernels[i], values[i])
        assert _rel(pooled_m, np.tensordot(p, gm, axes=1)) < 1e-12
        assert _rel(pooled_v, np.tensordot(p, gv, axes=1)) < 1e-12
    batched_m, batched_v = pooled_gradients(problem, kernels, values)
    for i in range(3):
        gm, gv = global_gradient(problem, kernels[i], values[i])
        assert _rel(batched_m[i], gm) < 1e-12 and _rel(batched_v[i], gv) < 1e-12
    losses = global_losses(problem, kernels, values)
    for i in range(3):
        f = (p @ client_losses(problem, kernels[i], values[i])
             + 0.5 * problem.ridge * np.sum(values[i] ** 2)
             + 0.5 * problem.kernel_ridge * np.sum(kernels[i] ** 2))
        assert _rel(losses[i], f) < 1e-12


def _fd_hessian(problem, kernel, value, step=1e-5):
    d, dy = problem.dim, problem.out_dim

    def grad(x):
        gm, gv = global_gradient(problem, x[: d * d].reshape(d, d), x[d * d:].reshape(d, dy))
        return np.concatenate([gm.ravel(), gv.ravel()])

    x0 = np.concatenate([kernel.ravel(), value.ravel()])
    return np.array([(grad(x0 + step * e) - grad(x0 - step * e)) / (2 * step)
                     for e in np.eye(x0.size)])


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_exact_hessians_match_central_differences(name):
    problem = make_problem(**PROBLEMS[name])
    kernel, value = _point(problem)
    exact = hessian_matrix(problem, kernel, value)
    assert np.array_equal(exact, exact.T)
    assert _rel(exact, _fd_hessian(problem, kernel, value)) < 1e-6
    # V = 0 (the default start): F_MM = lambda_M I exactly
    at_zero = hessian_matrix(problem, kernel, np.zeros_like(value))
    assert _rel(at_zero, _fd_hessian(problem, kernel, np.zeros_like(value))) < 1e-6
    # stacked points give the stacked matrices
    stacked = hessian_matrix(problem, np.stack([kernel, 2 * kernel]),
                             np.stack([value, -value]))
    assert _rel(stacked[1], hessian_matrix(problem, 2 * kernel, -value)) < 1e-14
    d, step = problem.dim, 1e-5

    def pgrad(x):
        return profile_gradient(problem, x.reshape(d, d)).ravel()

    fd = np.array([(pgrad(kernel.ravel() + step * e) - pgrad(kernel.ravel() - step * e))
                   / (2 * step) for e in np.eye(d * d)])
    profile = profile_hessian_matrix(problem, kernel)
    assert _rel(profile, fd) < 1e-6
    # eq. (23a): grad^2 Phi is a Schur complement of F's Hessian at (M, V*(M)), so its
    # largest eigenvalue is at most that of F there
    v_star = np.linalg.solve(*pooled_terms(problem, kernel)[:2])
    top_f = np.max(np.linalg.eigvalsh(hessian_matrix(problem, kernel, v_star)))
    assert np.max(np.linalg.eigvalsh(profile)) <= top_f * (1 + 1e-12)


def _fd_power(hvp, start, iterations, shift=0.0):
    v = start / np.linalg.norm(start)
    estimate = 0.0
    for _ in range(iterations):
        hv = hvp(v) + shift * v
        estimate = float(np.linalg.norm(hv))
        v = hv / estimate
    return estimate


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_power_iterations_match_the_finite_difference_definition(name):
    """Same starts and iteration counts as the finite-difference definition; exact products."""
    problem = make_problem(**PROBLEMS[name])
    kernel, value = _point(problem)
    d, dy, step = problem.dim, problem.out_dim, 1e-5

    def grad(x):
        gm, gv = global_gradient(problem, x[: d * d].reshape(d, d), x[d * d:].reshape(d, dy))
        return np.concatenate([gm.ravel(), gv.ravel()])

    x0 = np.concatenate([kernel.ravel(), value.ravel()])

    def hvp(v):
        return (grad(x0 + step * v) - grad(x0 - step * v)) / (2 * step)

    rng = np.random.default_rng(0)
    norm = _fd_power(hvp, rng.standard_normal(x0.size), 20)
    largest = _fd_power(hvp, rng.standard_normal(x0.size), 20, norm) - norm
    exact_norm, exact_largest = hessian_power(problem, kernel, value)
    assert _rel(exact_norm, norm) < 1e-7 and _rel(exact_largest, largest) < 1e-7

    def phvp(v):
        dv = v.reshape(d, d)
        return ((profile_gradient(problem, kernel + step * dv)
                 - profile_gradient(problem, kernel - step * dv)) / (2 * step)).ravel()

    start = np.random.default_rng(0).standard_normal((d, d)).ravel()
    assert _rel(profile_hessian_norm(problem, kernel, iterations=15),
                _fd_power(phvp, start, 15)) < 1e-7


@pytest.mark.parametrize("ridge", [1e-2, 0.0])
@pytest.mark.parametrize("local_steps", [1, 2, 5, 8, 9, 13, 32])
def test_local_value_maps_match_the_eigenvalue_formula(local_steps, ridge):
    problem = make_problem(dim=4, num_clients=3, covariate_shift=0.5, ridge=1e-2, seed=2)
    h, _, _ = value_quadratic(problem, np.eye(4) + 0.3 * _point(problem)[0])
    lr = 0.5 / np.max(np.linalg.eigvalsh(h + ridge * np.eye(4)))
    a, b = local_value_maps(h, lr, local_steps, ridge)
    eig, vec = np.linalg.eigh(h + ridge * np.eye(4))
    a_eig = (1 - lr * eig) ** local_steps
    b_eig = np.array([lr * sum((1 - lr * e) ** k for k in range(local_steps)) for e in
                      eig.ravel()]).reshape(eig.shape)
    vt = np.swapaxes(vec, -1, -2)
    assert _rel(a, (vec * a_eig[..., None, :]) @ vt) < 1e-11
    assert _rel(b, (vec * b_eig[..., None, :]) @ vt) < 1e-11
    top = float(np.max(eig))
    with pytest.raises(ParameterError, match="stability limit"):
        local_value_maps(h, 2.001 / top, local_steps, ridge)
    local_value_maps(h, 1.999 / top, local_steps, ridge)


def test_stacked_frozen_stages_and_rounds_match_single_points():
    problem = make_problem(**PROBLEMS["dy2"])
    kernels = np.stack([_point(problem, s)[0] for s in range(3)])
    values = np.stack([_point(problem, s)[1] for s in range(3)])
    stages = frozen_stages(problem, kernels, 0.05, 4)
    fedavg, reference = one_round(problem, kernels, values, 0.05, 4)
    for i in range(3):
        single = frozen_stage(problem, kernels[i], 0.05, 4)
        for field in ("transition", "offset", "fixed_point", "optimum", "hessian"):
            assert _rel(getattr(stages, field)[i], getattr(single, field)) < 1e-12
        assert _rel(stages.contraction[i], single.contraction) < 1e-12
        assert abs(stages.floor[i] - single.floor) <= 1e-12 * max(single.floor, 1e-12)
        fed_i, ref_i = one_round(problem, kernels[i], values[i], 0.05, 4)
        for x, y in zip(fedavg + reference, fed_i + ref_i):
            assert _rel(x[i], y) < 1e-12


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_probe_constants_against_direct_recomputation(name):
    problem = make_problem(**PROBLEMS[name])
    lr, local_steps, total = 0.05, 3, 40
    start = initial_point(problem, seed=2)
    consts = estimate_constants(problem, lr, local_steps, total, start=start, fast=True)
    rounds = consts.probe_rounds
    kernels, values, ref_kernels = warmup_paths(problem, start, lr, local_steps, rounds)
    idx = np.unique(np.linspace(0, rounds, 5).astype(int))
    drift = max(np.linalg.norm(f[0] - r[0]) for f, r in
                (one_round(problem, kernels[i], values[i], lr, local_steps) for i in idx))
    assert _rel(consts.drift_error, drift / (lr * local_steps)) < 1e-12
    delta0 = profile_values(problem, kernels[:1])[0] - consts.phi_star
    assert _rel(consts.delta0, delta0) < 1e-12
    # power iteration is a lower estimate of the exact largest |eigenvalue|, and close to it
    points = np.unique(idx[[0, -1]])
    exact = max(np.max(np.abs(np.linalg.eigvalsh(hessian_matrix(problem, kernels[i],
                                                                 values[i]))))
                for i in points)
    assert exact * 0.98 <= consts.smoothness <= exact * (1 + 1e-12)
    exact_phi = max(np.max(np.abs(np.linalg.eigvalsh(profile_hessian_matrix(
        problem, ref_kernels[i])))) for i in points)
    assert exact_phi * 0.98 <= consts.profile_smoothness <= exact_phi * (1 + 1e-12)
