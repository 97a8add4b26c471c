"""Population dynamics of two-stage FedAvg (docs/theory.md, eqs. 19-21) against plain loops.

The oracle below is written from ``local_gradients`` / ``factored_gradients`` and
``global_loss`` / ``kernel_profile`` only, one T0 at a time, with no batching or shared prefix:
T0 warm-up rounds (every client copies the global parameters, takes K GD steps on its own f_m,
the server averages with p_m) next to the drift-free reference (K GD steps on F per round),
then T - T0 frozen rounds on V with M = M_T0 fixed. Every per-T0 output and every error curve
of ``population_dynamics`` must match it to 1e-10 (relative, with an absolute floor of 1e-12
for quantities that are themselves differences of O(1) numbers).
"""

from __future__ import annotations

import numpy as np
import pytest

from linattn_theory.dynamics import (
    InitialPoint,
    initial_point,
    one_round,
    population_dynamics,
    warmup_paths,
)
from linattn_theory.errors import ParameterError
from linattn_theory.frozen import frozen_stage
from linattn_theory.objectives import (
    factored_gradients,
    global_gradient,
    global_loss,
    local_gradients,
)
from linattn_theory.problem import make_problem
from linattn_theory.profile import kernel_profile, solve_profile

RTOL, ATOL = 1e-10, 1e-12


def _problem(zeta=0.7, rho=0.5, seed=1):
    return make_problem(dim=3, num_clients=3, context_length=4, out_dim=2,
                        kernel_heterogeneity=zeta, value_heterogeneity=zeta,
                        covariate_shift=rho, weights="random", seed=seed)


def _iid_problem():
    """Identical clients, uniform weights (the instance of the two findings below)."""
    return make_problem(dim=3, num_clients=3, context_length=4, out_dim=2,
                        kernel_heterogeneity=0.0, value_heterogeneity=0.0, covariate_shift=0.0,
                        seed=0)


def _kernel_of(params):
    return params[0] if len(params) == 2 else params[0] @ params[1].T


def _client_grads(problem, params):
    if len(params) == 2:
        return local_gradients(problem, *params)
    return factored_gradients(problem, *params)


def _fedavg_round(problem, params, lr, local_steps):
    c, p = problem.num_clients, problem.weights
    local = [np.repeat(x[None], c, axis=0) for x in params]  # (C, ...) per-client copies
    for _ in range(local_steps):
        grads = _client_grads(problem, local)
        local = [x - lr * g for x, g in zip(local, grads)]
    return tuple(np.tensordot(p, x, axes=1) for x in local)


def _reference_round(problem, params, lr, local_steps):
    p = problem.weights
    for _ in range(local_steps):
        grads = _client_grads(problem, params)  # per client at the shared point
        params = tuple(x - lr * np.tensordot(p, g, axes=1) for x, g in zip(params, grads))
    return params


def _frozen_round(problem, kernel, value, lr, local_steps):
    local = np.repeat(value[None], problem.num_clients, axis=0)
    for _ in range(local_steps):
        local = local - lr * local_gradients(problem, kernel, local)[1]
    return np.tensordot(problem.weights, local, axes=1)


def _oracle(problem, start, lr, local_steps, total, t0, phi_star):
    params = ((start.kernel, start.value) if start.query is None
              else (start.query, start.key, start.value))
    ref = params
    curve = [global_loss(problem, _kernel_of(params), params[-1]) - phi_star]
    for _ in range(t0):
        params = _fedavg_round(problem, params, lr, local_steps)
        ref = _reference_round(problem, ref, lr, local_steps)
        curve.append(global_loss(problem, _kernel_of(params), params[-1]) - phi_star)
    kernel, value = _kernel_of(params), params[-1]
    for _ in range(total - t0):
        value = _frozen_round(problem, kernel, value, lr, local_steps)
        curve.append(global_loss(problem, kernel, value) - phi_star)
    phi, phi_ref = kernel_profile(problem, kernel), kernel_profile(problem, _kernel_of(ref))
    stage = frozen_stage(problem, kernel, lr, local_steps)
    return {
        "bias": phi_ref - phi_star,
        "drift": phi - phi_ref,
        "kernel_deviation": np.linalg.norm(kernel - _kernel_of(ref)),
        "value_error": global_loss(problem, kernel, value) - phi,
        "final_error": global_loss(problem, kernel, value) - phi_star,
        "frozen_floor": stage.floor,
        "contraction": stage.contraction,
        "curve": np.array(curve),
    }


@pytest.mark.parametrize("parametrization", ["merged", "factored"])
def test_dynamics_match_per_warmup_loop(parametrization):
    problem = _problem()
    phi_star = solve_profile(problem).value
    start = initial_point(problem, parametrization=parametrization, rank=2, seed=3)
    lr, steps, total = 0.05, 4, 40
    t0s = [0, 1, 7, 25, 40]
    res = population_dynamics(problem, start, lr, steps, total, t0s, phi_star)
    assert res.error_curves.shape == (len(t0s), total + 1)
    assert not np.any(np.isnan(res.error_curves))
    for i, t0 in enumerate(t0s):
        ref = _oracle(problem, start, lr, steps, total, t0, phi_star)
        for name in ("bias", "drift", "kernel_deviation", "value_error", "final_error",
                     "frozen_floor", "contraction"):
            np.testing.assert_allclose(getattr(res, name)[i], ref[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} at T0={t0}")
        np.testing.assert_allclose(res.error_curves[i], ref["curve"], rtol=RTOL, atol=ATOL,
                                   err_msg=f"error curve at T0={t0}")
    # the reported split is exact: final = bias + drift + value error
    np.testing.assert_allclose(res.final_error, res.bias + res.drift + res.value_error,
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(res.final_error, res.error_curves[:, -1], rtol=1e-12, atol=1e-14)
    assert res.best_warmup == t0s[int(np.argmin(res.final_error))]
    # heterogeneous clients, K > 1: drift is switched on after T0 = 0
    assert res.kernel_deviation[0] == 0.0 and res.drift[0] == 0.0
    assert np.all(res.kernel_deviation[1:] > 1e-6)


def test_bias_is_the_reference_error_at_warmup_length():
    problem = _problem()
    phi_star = solve_profile(problem).value
    start = initial_point(problem, seed=4)
    t0s = np.array([0, 3, 10, 30])
    res = population_dynamics(problem, start, 0.05, 3, 30, t0s, phi_star)
    np.testing.assert_array_equal(res.bias, res.reference_error_path[t0s])
    np.testing.assert_array_equal(res.kernel_deviation, res.kernel_deviation_path[t0s])
    np.testing.assert_allclose(res.bias + res.drift, res.kernel_error_path[t0s], rtol=1e-12)
    assert res.drift[0] == 0.0 and res.kernel_deviation[0] == 0.0
    assert res.kernel_error_path[0] == res.reference_error_path[0]


def test_one_round_matches_oracle_round():
    problem = _problem()
    rng = np.random.default_rng(5)
    kernel, value = rng.standard_normal((3, 3)) / 2, rng.standard_normal((3, 2)) / 2
    (mf, vf), (mr, vr) = one_round(problem, kernel, value, 0.05, 4)
    ef = _fedavg_round(problem, (kernel, value), 0.05, 4)
    er = _reference_round(problem, (kernel, value), 0.05, 4)
    for a, b in ((mf, ef[0]), (vf, ef[1]), (mr, er[0]), (vr, er[1])):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("parametrization", ["merged", "factored"])
@pytest.mark.parametrize("local_steps", [1, 5])
def test_no_drift_for_identical_clients(parametrization, local_steps):
    """zeta_K = zeta_V = 0, Sigma_m = I: FedAvg is the reference; drift and deviation <= 1e-10
    at every T0, the frozen floor <= 1e-12."""
    problem = _problem(zeta=0.0, rho=0.0, seed=2)
    phi_star = solve_profile(problem).value
    start = initial_point(problem, parametrization=parametrization, seed=2)
    t0s = np.arange(0, 61, 5)
    res = population_dynamics(problem, start, 0.05, local_steps, 60, t0s, phi_star)
    assert np.max(np.abs(res.drift)) < 1e-10
    assert np.max(res.kernel_deviation) < 1e-10
    assert np.max(res.frozen_floor) < 1e-12


def test_no_drift_for_one_local_step_heterogeneous():
    """K = 1: FedAvg's round is one GD step on F, identical to the reference."""
    problem = _problem()
    res = population_dynamics(problem, initial_point(problem, seed=1), 0.05, 1, 30,
                              [0, 10, 30], solve_profile(problem).value)
    assert np.max(np.abs(res.drift)) < 1e-10 and np.max(res.kernel_deviation) < 1e-10
    assert np.max(res.frozen_floor) < 1e-12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_objective_decreases_and_bounds_the_bias(seed):
    """On a homogeneous problem the reference is GD on F with a small step (eta = 0.05), so
    F(M_bar_t, V_bar_t) is non-increasing; the bias Phi(M_bar_t) - Phi* lies below it
    (Phi <= F) and ends below a tenth of where it starts."""
    problem = _problem(zeta=0.0, rho=0.0, seed=seed)
    phi_star = solve_profile(problem).value
    res = population_dynamics(problem, initial_point(problem, seed=seed), 0.05, 5, 200, [200],
                              phi_star)
    envelope = res.error_curves[0]  # identical clients: FedAvg's path is the reference's
    assert np.all(np.diff(envelope) <= 1e-14)
    assert np.all(res.reference_error_path <= envelope + 1e-14)
    assert np.all(res.reference_error_path >= -1e-10)
    assert res.reference_error_path[-1] < 0.1 * res.reference_error_path[0]


def test_bias_is_not_monotone_in_merged_warmup():
    """A finding, pinned: the design card (THEORY.md, section 3) says bias(T0) =
    Phi(M_bar_T0) - Phi* decreases in T0, but
    with V_0 = 0 the kernel profile along the reference path rises for a few rounds while V
    catches up (here from 0.0661 at round 4 to 0.0814 at round 7, largest one-round rise
    6.4e-3, while F itself decreases in every round)."""
    problem = _iid_problem()
    res = population_dynamics(problem, initial_point(problem, seed=0), 0.05, 5, 30, [30],
                              solve_profile(problem).value)
    rise = np.diff(res.reference_error_path)
    assert rise.max() > 1e-3
    assert np.all(np.diff(res.error_curves[0]) < 0)


def test_warmup_rounds_validation():
    problem = _problem()
    start = initial_point(problem)
    for bad in ([11], [-1], [0, -3], [1.5], np.array([2.0]), [], ["3"]):
        with pytest.raises(ParameterError, match="warmup_rounds") as info:
            population_dynamics(problem, start, 0.05, 2, 10, bad, 0.0)
        assert "integer" in str(info.value)
    with pytest.raises(ParameterError, match=r"warmup_rounds.*\[0, total_rounds=10\]"):
        population_dynamics(problem, start, 0.05, 2, 10, [11], 0.0)
    with pytest.raises(ParameterError, match="total_rounds"):
        population_dynamics(problem, start, 0.05, 2, 0, [0], 0.0)
    with pytest.raises(ParameterError, match="local_steps"):
        population_dynamics(problem, start, 0.05, 0, 10, [0], 0.0)


def test_divergent_lr_is_refused_naming_lr():
    problem = _problem()
    with pytest.raises(ParameterError, match="lr="):
        with np.errstate(all="ignore"):
            population_dynamics(problem, initial_point(problem), 5.0, 5, 50, [50], 0.0)


def _smoothness(problem, kernel, value, h=1e-6):
    """Largest |eigenvalue| of the Hessian of F in (M, V), central differences of grad F."""
    d, dy = problem.dim, problem.out_dim
    x0 = np.concatenate([kernel.ravel(), value.ravel()])

    def grad(x):
        gm, gv = global_gradient(problem, x[: d * d].reshape(d, d), x[d * d:].reshape(d, dy))
        return np.concatenate([gm.ravel(), gv.ravel()])

    cols = [(grad(x0 + h * e) - grad(x0 - h * e)) / (2 * h) for e in np.eye(x0.size)]
    hess = np.array(cols)
    return float(np.max(np.abs(np.linalg.eigvalsh(0.5 * (hess + hess.T)))))


def test_unstable_step_is_refused():
    """eta = 0.5 is above 2/L at Phi's minimiser (L = ||Hessian of F|| there, 4.38): the
    factored warm-up of this i.i.d. problem turns chaotic (FedAvg and the reference separate
    from rounding noise) while staying finite. warmup_paths refuses it, naming lr, because the
    reference's F rises; a stable step on the same problem passes."""
    problem = _iid_problem()
    sol = solve_profile(problem)
    assert 2.0 / _smoothness(problem, sol.kernel, sol.value_block) < 0.5
    start = initial_point(problem, parametrization="factored", seed=0)
    with pytest.raises(ParameterError, match="lr=0.5"):
        warmup_paths(problem, start, 0.5, 2, 300)
    kernels = warmup_paths(problem, start, 0.1, 2, 50)[0]
    assert np.all(np.isfinite(kernels))


def test_identical_clients_never_report_drift():
    """Either the step size is refused (ParameterError naming lr) or, clients being identical,
    drift and kernel deviation vanish (<= 1e-10)."""
    problem = _iid_problem()
    start = initial_point(problem, parametrization="factored", seed=0)
    try:
        res = population_dynamics(problem, start, 0.5, 2, 300, [0, 100, 200, 300], 0.0)
    except ParameterError as exc:
        assert "lr" in str(exc)
        return
    assert np.max(np.abs(res.drift)) < 1e-10, res.drift
    assert np.max(res.kernel_deviation) < 1e-10, res.kernel_deviation


def test_initial_point_contract():
    problem = _problem()
    start = initial_point(problem, parametrization="factored", rank=2, seed=0)
    assert isinstance(start, InitialPoint) and start.parametrization == "factored"
    np.testing.assert_array_equal(start.kernel, start.query @ start.key.T)
    assert start.query.shape == (3, 2) and np.all(start.value == 0)
    with pytest.raises(ParameterError, match="scale"):
        initial_point(problem, scale=0.0)
    with pytest.raises(ParameterError, match="parametrization"):
        initial_point(problem, parametrization="lowrank")
