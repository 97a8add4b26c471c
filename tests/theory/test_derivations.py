"""Symbolic checks of docs/theory.md and their agreement with the numeric code.

Two kinds of test:

- the sympy re-derivations in ``linattn_theory.derivations`` hold: every residual simplifies to
  exactly 0 (sign and positivity facts are decided by sympy from the symbols' assumptions);
- the lambdified sympy results equal the numeric functions of ``linattn_theory`` at random
  inputs to 1e-10 relative.

Equation numbers are those of docs/theory.md.
"""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest
import sympy as sp

from linattn_theory.derivations import frozen as dfrozen
from linattn_theory.derivations import loss as dloss
from linattn_theory.derivations import moments as dmoments
from linattn_theory.derivations import profile as dprofile
from linattn_theory.derivations import tradeoff as dtradeoff

RTOL = 1e-10


def _lead(module: str):
    """Import a numeric module of linattn_theory (an import error fails the test)."""
    return importlib.import_module(f"linattn_theory.{module}")


def _close(actual, expected, rtol=RTOL):
    """Relative agreement, with the absolute floor scaled to the largest entry."""
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def _is_zero(x) -> bool:
    if isinstance(x, sp.MatrixBase):
        return all(sp.simplify(e) == 0 for e in x)
    return sp.simplify(x) == 0


def _spd(rng: np.random.Generator, dim: int) -> np.ndarray:
    root = rng.standard_normal((dim, dim))
    return root @ root.T + 0.5 * np.eye(dim)


# ---------------------------------------------------------------- (4): Gaussian moments


def test_isserlis_from_moment_generating_function():
    assert all(r == 0 for r in dmoments.isserlis_residuals(2))


def test_single_vector_fourth_moment():
    """E[x x^T A x x^T] = S A S + S A^T S + tr(A S) S (the n = 1 case of eq. 4)."""
    assert dmoments.single_vector_residual(2).is_zero_matrix


@pytest.mark.parametrize("dim", [2, 3])
def test_sample_fourth_moment_symbolic_n(dim):
    """Eq. (4) for symbolic n, S, A."""
    assert dmoments.fourth_moment_residual(dim).is_zero_matrix


@pytest.mark.parametrize("context_length", [1, 2, 3])
def test_sample_fourth_moment_joint_expectation(context_length):
    """Eq. (4) at n = 1, 2, 3 from the joint MGF of all tokens, no split of the double sum."""
    assert dmoments.explicit_fourth_moment_residual(2, context_length).is_zero_matrix


def test_operator_g_transpose_and_self_adjoint():
    transpose, adjoint = dmoments.operator_symmetry_residuals(2)
    assert transpose.is_zero_matrix
    assert adjoint == 0


def test_fourth_moment_matches_numeric():
    moments = _lead("moments")
    derived = dmoments.fourth_moment_numeric(2)
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 64):
        a, s = rng.standard_normal((2, 2)), _spd(rng, 2)
        _close(moments.fourth_moment(a, s, n), derived(a, s, n))
    batch_a = rng.standard_normal((3, 2, 2))
    batch_s = np.stack([_spd(rng, 2) for _ in range(3)])
    batched = moments.fourth_moment(batch_a, batch_s, 5)
    for i in range(3):
        _close(batched[i], derived(batch_a[i], batch_s[i], 5))


# ---------------------------------------------------------- (6)-(9): loss and gradients


@pytest.mark.parametrize("out_dim", [1, 2])
def test_closed_form_loss(out_dim):
    """Eq. (6): the MGF-derived 1/2 E||yhat - y||^2 equals the closed form, symbolic n."""
    assert dloss.loss_residual(2, out_dim) == 0


@pytest.mark.parametrize(("out_dim", "context_length", "seed"),
                         [(1, 1, 0), (1, 2, 1), (2, 1, 2)])
def test_closed_form_loss_joint_expectation(out_dim, context_length, seed):
    """Eq. (6) at rational points from one joint expectation over (x_q, x_1..x_n, eps)."""
    assert dloss.explicit_loss_residual(2, out_dim, context_length, seed) == 0


def test_gradients():
    """Eqs. (7), (8): sympy derivatives of the derived loss (d_y = 2: numerically, below)."""
    res_m, res_v = dloss.gradient_residuals(2, 1)
    assert res_m.is_zero_matrix
    assert res_v.is_zero_matrix


def test_transposed_teacher_term_in_eq8_is_wrong():
    """Negative control: G(V V*^T) in place of G(V* V^T) in eq. (8) leaves a residual."""
    sym = dloss.model_symbols(2, 1)
    s, m = sp.Matrix(sym.covariance), sp.Matrix(sym.kernel)
    v, mt, vt = sp.Matrix(sym.value), sp.Matrix(sym.kernel_teacher), sp.Matrix(sym.value_teacher)
    wrong = s * m * dmoments.operator_g(v * v.T, s) - s * mt * dmoments.operator_g(v * vt.T, s)
    derivative = sp.Matrix(dloss.loss_derivatives(2, 1)[0])
    assert not (derivative - wrong).expand().is_zero_matrix


def test_scale_invariance_and_euler_identity():
    """Eq. (8b): L(cM, V/c) = L(M, V) and <grad_M L, M> = <grad_V L, V>."""
    invariance, euler = dloss.scaling_residuals(2, 1)
    assert invariance == 0
    assert euler == 0


@pytest.mark.parametrize(("rank", "out_dim"), [(1, 1), (2, 2)])
def test_factored_gradients(rank, out_dim):
    """Eq. (9): grad_WQ = grad_M W_K, grad_WK = grad_M^T W_Q."""
    res_q, res_k = dloss.factored_residuals(2, rank, out_dim)
    assert res_q.is_zero_matrix
    assert res_k.is_zero_matrix


def _problem(out_dim=1, seed=0):
    problem_mod = _lead("problem")
    return problem_mod.make_problem(dim=2, num_clients=3, out_dim=out_dim, context_length=5,
                                    kernel_heterogeneity=0.7, value_heterogeneity=0.6,
                                    covariate_shift=0.8, noise=0.3, seed=seed)


def _client_args(problem, c, kernel, value):
    return (problem.covariances[c], kernel, value, problem.kernel_teachers[c],
            problem.value_teachers[c], problem.context_length, problem.noise)


@pytest.mark.parametrize("seed", [0, 1])
def test_value_quadratic_matches_numeric(seed):
    objectives = _lead("objectives")
    problem = _problem(seed=seed)
    derived = dloss.loss_numeric(2, 1)
    kernel = np.random.default_rng(seed + 10).standard_normal((2, 2))
    hess, lin, const = objectives.value_quadratic(problem, kernel)
    assert hess.shape == (3, 2, 2) and lin.shape == (3, 2, 1) and const.shape == (3,)
    for c in range(problem.num_clients):
        ref = derived(*_client_args(problem, c, kernel, np.zeros((2, 1))))
        _close(hess[c], ref["hessian"])
        _close(lin[c], ref["linear"])
        _close(const[c], ref["constant"])


@pytest.mark.parametrize("out_dim", [1, 2])
def test_losses_and_gradients_match_numeric(out_dim):
    objectives = _lead("objectives")
    problem = _problem(out_dim=out_dim, seed=3)
    derived = dloss.loss_numeric(2, out_dim)
    rng = np.random.default_rng(4)
    for _ in range(3):
        kernel, value = rng.standard_normal((2, 2)), rng.standard_normal((2, out_dim))
        losses = objectives.client_losses(problem, kernel, value)
        grad_m, grad_v = objectives.client_gradients(problem, kernel, value)
        assert losses.shape == (3,)
        assert grad_m.shape == (3, 2, 2) and grad_v.shape == (3, 2, out_dim)
        for c in range(problem.num_clients):
            ref = derived(*_client_args(problem, c, kernel, value))
            _close(losses[c], ref["loss"])
            _close(grad_m[c], ref["grad_kernel"])
            _close(grad_v[c], ref["grad_value"])


# ----------------------------------------------------- (10)-(12): profile and envelope


def test_value_minimiser_and_completed_square():
    """V* = H^{-1} C is stationary and F(V) = Phi + 1/2 ||V - V*||_H^2 (eqs. 10, 17)."""
    grad, completed = dprofile.value_minimiser_residuals(2, 2)
    assert grad.is_zero_matrix
    assert completed == 0


def test_envelope_theorem_generic():
    """Eq. (11) for generic smooth H(theta), C(theta), k(theta)."""
    assert dprofile.envelope_residual_generic(2) == 0


@pytest.mark.parametrize("key", ["envelope", "parity", "stationary_at_zero", "hessian_at_zero",
                                 "schur", "scale", "ridge_slope"])
def test_scalar_profile_facts(key):
    """Eqs. (11), (12), (12a), (12b), (23a) in the fully symbolic d = 1 model."""
    assert dprofile.scalar_profile_residuals()[key] == 0


def test_unregularised_limit():
    """Eq. (12): Phi_lambda(cM) -> Phi_0(M) as c -> infinity when lambda_M = 0."""
    assert dprofile.scalar_unregularised_limit() == 0


def test_envelope_and_hessian_at_zero_in_model():
    """Eqs. (11), (12b) for d = 2, two clients, at exact rational points."""
    assert all(r == 0 for r in dprofile.model_line_residuals(directions=2))


def test_zero_kernel_and_sign_flip():
    """H(0) = lambda I, C(0) = 0, grad_M L(0, 0) = 0, H even and C odd in M."""
    for key, residual in dprofile.zero_kernel_residuals(2, 1).items():
        assert residual.is_zero_matrix, key


def test_balance_at_profile_minimiser():
    """Eq. (12c): lambda ||V*||^2 = lambda_M ||M_*||^2 at a minimiser of Phi."""
    profile = _lead("profile")
    problem = _problem(seed=5)
    sol = profile.solve_profile(problem, restarts=2, seed=0)
    lhs = problem.ridge * float(np.sum(sol.value_block**2))
    rhs = problem.kernel_ridge * float(np.sum(sol.kernel**2))
    assert abs(lhs - rhs) <= 1e-6 * max(lhs, rhs)


# ------------------------------------------------------------- (13)-(18): frozen stage


@pytest.mark.parametrize("local_steps", [1, 2, 3])
def test_local_maps_unrolled(local_steps):
    """Eq. (13) and the noise term of eq. (18) from K symbolic GD steps; B = (I - A) H'^{-1}."""
    unrolled, geometric = dfrozen.local_map_residuals(2, local_steps, 2)
    assert unrolled.is_zero_matrix
    assert geometric.is_zero_matrix


def test_floor_zero_cases():
    """D_frozen = 0 for K = 1, for equal H'_m (any K) and for a common client optimum."""
    assert dfrozen.one_step_floor_residual(2).is_zero_matrix
    for k in (2, 3):
        assert dfrozen.equal_hessian_floor_residual(2, k).is_zero_matrix
    assert dfrozen.common_optimum_floor_residual(2, 2).is_zero_matrix


def test_scalar_floor_and_small_step_expansion():
    """Eqs. (17a), (17b): the d = 1 floor is >= 0, zero iff h_0 = h_1 or u_0 = u_1, O(eta^2)."""
    out = dfrozen.scalar_floor(2)
    h0, h1 = sp.symbols("h0:2", positive=True)
    u0, u1 = sp.symbols("u0:2", real=True)
    p0, p1 = sp.symbols("p0:2", positive=True)
    gap = out["gap"]
    assert gap.subs(h1, h0) == 0 and gap.subs(u1, u0) == 0
    point = {h0: 1, h1: 2, u0: 0, u1: 1, p0: sp.Rational(1, 2), p1: sp.Rational(1, 2),
             dfrozen.LR: sp.Rational(1, 10)}
    assert gap.subs(point) != 0 and out["floor"].subs(point) > 0
    assert out["leading"].is_nonnegative
    assert dfrozen.scalar_floor_leading_general_k() == 0


def test_noise_covariance():
    """Eq. (18a): Cov(xi) = eta^2 sum_m p_m^2 sum_k P_mk Q_m P_mk^T / B, column-major vec."""
    assert dfrozen.noise_covariance_residual(2, 2, 2, 2).is_zero_matrix


def test_mean_follows_noiseless_map():
    """Eq. (18b): with unbiased sampled (H, C), E[V] follows eq. (14) exactly."""
    assert dfrozen.mean_recursion_residual(2) == 0


def test_additive_transient_is_not_a_bound():
    """Eq. (27a): D_frozen + rho^{2s} E_0 can be below the exact value error (d = 1)."""
    out = dfrozen.transient_gap()
    assert out["example"] == sp.Rational(19, 8)
    assert out["corrected_slack"] == 0


def test_local_value_maps_match_numeric():
    """Eq. (13): local_value_maps against A, B read off the unrolled recursion."""
    frozen = _lead("frozen")
    rng = np.random.default_rng(7)
    hess = np.stack([_spd(rng, 2) for _ in range(3)])
    ridge = 0.05
    lr = 0.9 / (np.linalg.eigvalsh(hess).max() + ridge)
    for local_steps in (1, 3):
        unrolled = dfrozen.local_maps_numeric(local_steps, 2)
        a, b = frozen.local_value_maps(hess, lr, local_steps, ridge)
        for c in range(3):
            a_ref, b_ref = unrolled(hess[c] + ridge * np.eye(2), lr)
            _close(a[c], a_ref)
            _close(b[c], b_ref)


def test_frozen_floor_zero_without_covariate_shift():
    """Numeric: equal Sigma_m give equal H'_m, so D_frozen = 0 despite teacher heterogeneity."""
    frozen, problem_mod = _lead("frozen"), _lead("problem")
    problem = problem_mod.make_problem(dim=3, num_clients=4, kernel_heterogeneity=1.0,
                                       value_heterogeneity=1.0, covariate_shift=0.0, seed=2)
    objectives = _lead("objectives")
    kernel = 0.5 * np.random.default_rng(0).standard_normal((3, 3))
    shifted = problem_mod.make_problem(dim=3, num_clients=4, covariate_shift=1.0, seed=2)
    curvature = max(np.linalg.eigvalsh(objectives.value_quadratic(p, kernel)[0]).max()
                    + p.ridge for p in (problem, shifted))
    lr = 0.5 / curvature
    stage = frozen.frozen_stage(problem, kernel, lr=lr, local_steps=5)
    assert stage.floor <= 1e-12 * (1.0 + float(np.sum(stage.optimum**2)))
    assert frozen.frozen_stage(shifted, kernel, lr=lr, local_steps=5).floor > 1e-8
    assert frozen.frozen_stage(shifted, kernel, lr=lr, local_steps=1).floor <= 1e-12


# ------------------------------------------------------- (24)-(30): bound and T0*


def test_stationarity_and_second_order():
    out = dtradeoff.stationarity()
    assert out["pl_first"] == 0 and out["nc_first"] == 0
    for key in ("pl_second", "nc_second", "pl_convex", "nc_convex"):
        assert out[key].is_positive, key


@pytest.mark.parametrize("key", [f"{r}_d{v}" for r, v in itertools.product(
    ("pl", "nc"), ("zeta", "K", "eta"))])
def test_monotonicity_signs(key):
    """Eq. (30): dT0*/dzeta, dT0*/dK, dT0*/deta < 0 (interior T0*)."""
    _, negative = dtradeoff.monotonicity()[key]
    assert negative


def test_no_drift_limits():
    assert all(v == sp.oo for v in dtradeoff.limits().values())


def test_capped_nonconvex_bound_kink():
    """Eq. (29a): the capped bound's argmin is 0 once S > Delta_0^2 / (4 A)."""
    out = dtradeoff.nonconvex_kink()
    assert out["value_at_optimum"] == 0
    assert out["cap_active"].is_positive
    assert sp.simplify(out["threshold"] - dtradeoff.DELTA0**2 / (4 * dtradeoff.AREA)) == 0


def test_quadratic_drift_term_moves_optimum_down():
    """Eq. (28a): the full PL bound's slope at T0*_PL is L e^2 tau* > 0; Lambert-W argmin."""
    out = dtradeoff.quadratic_drift_correction()
    assert out["pl_slope_at_closed_form"] == 0
    assert out["lambert_residual"] == 0
    assert dtradeoff.lambert_numeric_residual(seed=1) < 1e-30


def _constants(rng, **overrides):
    values = dict(delta0=rng.uniform(0.5, 5.0), pl_constant=rng.uniform(0.05, 1.0),
                  smoothness=rng.uniform(1.0, 10.0), heterogeneity=rng.uniform(0.01, 0.5),
                  grad_bound=rng.uniform(0.1, 2.0), local_steps=int(rng.integers(2, 20)),
                  total_rounds=10_000, kernel_distance=rng.uniform(0.5, 3.0))
    values.update(overrides)
    values.setdefault("lr", rng.uniform(0.01, 0.5) / values["smoothness"])
    return values


_SYMBOLS = {"delta0": dtradeoff.DELTA0, "pl_constant": dtradeoff.MU, "smoothness": dtradeoff.SMOOTH,
            "heterogeneity": dtradeoff.ZETA, "grad_bound": dtradeoff.GRAD, "lr": dtradeoff.LR,
            "local_steps": dtradeoff.K}


def _lambdified(expr, extra=()):
    names = [*_SYMBOLS, *(name for name, _ in extra)]
    syms = [*_SYMBOLS.values(), *(s for _, s in extra)]
    fn = sp.lambdify(syms, expr, "math")
    return lambda values: float(fn(*(values[n] for n in names)))


def test_optimal_warmup_pl_matches_closed_form():
    warmup = _lead("warmup")
    closed = _lambdified(dtradeoff.pl_optimum())
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(200):
        values = _constants(rng)
        expected = closed(values)
        if not 0 < expected < values["total_rounds"]:
            continue
        got = warmup.optimal_warmup_pl(warmup.WarmupConstants(**values))
        _close(got, expected)
        _close(got, dtradeoff.optimal_warmup_pl_numeric(
            **{k: values[k] for k in (*_SYMBOLS, "total_rounds")}))
        checked += 1
    assert checked >= 50


def test_optimal_warmup_pl_clipping():
    warmup = _lead("warmup")
    rng = np.random.default_rng(12)
    no_drift = _constants(rng, heterogeneity=0.0)
    assert warmup.optimal_warmup_pl(warmup.WarmupConstants(**no_drift)) == no_drift["total_rounds"]
    one_step = _constants(rng, local_steps=1)
    assert warmup.optimal_warmup_pl(warmup.WarmupConstants(**one_step)) == one_step["total_rounds"]
    strong_drift = _constants(rng, delta0=1e-6, heterogeneity=0.5)
    assert warmup.optimal_warmup_pl(warmup.WarmupConstants(**strong_drift)) == 0.0
    short = _constants(rng, heterogeneity=1e-6, total_rounds=3)
    assert warmup.optimal_warmup_pl(warmup.WarmupConstants(**short)) == 3.0


def test_optimal_warmup_nonconvex_matches_closed_form():
    """Interior case 4 A S < Delta_0^2, where the cap of eq. (25) does not bind."""
    warmup = _lead("warmup")
    closed = _lambdified(dtradeoff.nonconvex_optimum(), extra=[("area", dtradeoff.AREA)])
    rng = np.random.default_rng(13)
    checked = 0
    for _ in range(200):
        values = _constants(rng)
        area = values["kernel_distance"] ** 2 / 2
        slope = values["grad_bound"] * (values["local_steps"] - 1) * values["lr"] * \
            values["smoothness"] * values["heterogeneity"] / 2
        expected = closed({**values, "area": area})
        if not (4 * area * slope < values["delta0"] ** 2 and expected < values["total_rounds"]):
            continue
        got = warmup.optimal_warmup_nonconvex(warmup.WarmupConstants(**values))
        _close(got, expected)
        _close(got, dtradeoff.optimal_warmup_nonconvex_numeric(
            values["delta0"], values["kernel_distance"], values["smoothness"],
            values["heterogeneity"], values["grad_bound"], values["lr"], values["local_steps"],
            values["total_rounds"]))
        checked += 1
    assert checked >= 20


def test_optimal_warmup_nonconvex_cap():
    warmup = _lead("warmup")
    values = dict(delta0=1.0, pl_constant=0.0, smoothness=1.0, heterogeneity=1.0,
                  grad_bound=1.0, lr=0.5, local_steps=2, total_rounds=100, kernel_distance=2.0)
    # A = 2, S = 1/4: 4 A S = 2 > Delta_0^2 = 1, and sqrt(A/S) = 2.83 > A/Delta_0 = 2
    expected = dtradeoff.optimal_warmup_nonconvex_numeric(
        1.0, 2.0, 1.0, 1.0, 1.0, 0.5, 2, 100)
    assert expected == 0.0
    assert warmup.optimal_warmup_nonconvex(warmup.WarmupConstants(**values)) == expected


@pytest.mark.parametrize("name", ["heterogeneity", "local_steps", "lr"])
def test_optimal_warmup_non_increasing(name):
    """Eq. (30) on the numeric code: T0* is non-increasing in zeta, K and eta."""
    warmup = _lead("warmup")
    rng = np.random.default_rng(14)
    grids = {"heterogeneity": np.linspace(0.0, 1.0, 21), "local_steps": np.arange(1, 30),
             "lr": np.linspace(0.001, 0.09, 21)}
    for _ in range(10):
        base = _constants(rng, smoothness=10.0, total_rounds=500)
        for fn in (warmup.optimal_warmup_pl, warmup.optimal_warmup_nonconvex):
            values = [fn(warmup.WarmupConstants(**{**base, name: type(base[name])(x)}))
                      for x in grids[name]]
            assert np.all(np.diff(values) <= 1e-9 * max(values)), (fn.__name__, values)
