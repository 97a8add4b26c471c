"""The exact R(T0) of every T0 (eq. 31), the path-local bound (eqs. 32-35), the probe
estimator's extrapolation (eq. 36) and the one path shared by recommend_warmup and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from linattn_theory.dynamics import initial_point, population_dynamics
from linattn_theory.errors import ParameterError
from linattn_theory.objectives import global_loss, pooled_kernel_gradient
from linattn_theory.probe import ProbeSelector, extrapolate
from linattn_theory.problem import make_problem
from linattn_theory.profile import solve_profile
from linattn_theory.warmup import recommend_warmup
from linattn_theory.warmup_path import (
    frozen_transient_norms,
    kernel_curvature_bound,
    warmup_path,
)

PROBLEM = dict(dim=3, num_clients=4, context_length=6, kernel_heterogeneity=0.8,
               value_heterogeneity=0.8, covariate_shift=0.4, seed=2)


@pytest.fixture(scope="module")
def setup():
    problem = make_problem(**PROBLEM)
    start = initial_point(problem)
    star = solve_profile(problem).value
    return problem, start, star, warmup_path(problem, start, 0.08, 4, 60, star)


def test_closed_frozen_stage_matches_population_dynamics(setup):
    """Eq. (31) against the round-by-round recursion, every T0 (rel. 1e-9)."""
    problem, start, star, path = setup
    exact = population_dynamics(problem, start, 0.08, 4, 60, np.arange(61), star)
    np.testing.assert_allclose(path.final_error, exact.final_error, rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(path.bias, exact.bias, rtol=1e-9, atol=1e-14)
    assert path.best_warmup == exact.best_warmup


def test_bound_is_valid_and_tight_on_a_path(setup):
    _, _, _, path = setup
    assert np.all(path.bound >= path.final_error)
    assert np.all(path.norm_bound >= path.final_error)
    assert np.all(path.deviation_bound >= path.kernel_deviation - 1e-12)
    assert path.bound[path.best_warmup] / path.final_error[path.best_warmup] < 10


def test_objective_is_quadratic_in_the_kernel_and_curvature_bound_holds():
    """Eq. (33a): F(M + D, V) = F + <grad_M F, D> + 1/2 D F_MM D with F_MM(V) independent of
    M, and the closed-form bound is >= lambda_max(F_MM) (central second differences)."""
    problem = make_problem(**PROBLEM)
    rng = np.random.default_rng(0)
    m, v = rng.standard_normal((3, 3)), rng.standard_normal((3, 1))
    d1, d2 = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    f = [global_loss(problem, m + t * d1, v) for t in (-1.0, 0.0, 1.0, 2.0)]
    assert abs(f[3] - 3 * f[2] + 3 * f[1] - f[0]) < 1e-9 * max(1.0, abs(f[1]))   # cubic part 0
    # the second difference along D does not depend on the base point M
    second = [global_loss(problem, base + d1, v) - 2 * global_loss(problem, base, v)
              + global_loss(problem, base - d1, v) for base in (m, m + d2)]
    assert second[0] == pytest.approx(second[1], rel=1e-9)
    cols = []
    for i in range(9):
        e = np.zeros(9)
        e[i] = 1e-4
        step = e.reshape(3, 3)
        cols.append((pooled_kernel_gradient(problem, m + step, v)
                     - pooled_kernel_gradient(problem, m - step, v)).ravel() / 2e-4)
    top = np.linalg.eigvalsh(0.5 * (np.array(cols) + np.array(cols).T))[-1]
    assert kernel_curvature_bound(problem, v) >= top * (1 - 1e-7)


def test_transient_norm_identity():
    """kappa_0 = 1 and kappa_s <= sqrt(cond H) rho^s (eq. 34 against eq. 27a)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 3))
    h = a @ a.T + np.eye(3)
    q, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    abar = q @ np.diag([0.9, 0.5, -0.2]) @ q.T
    kappa = frozen_transient_norms(np.stack([h] * 3), np.stack([abar] * 3), np.array([0, 1, 5.]))
    eig = np.linalg.eigvalsh(h)
    assert kappa[0] == pytest.approx(1.0, rel=1e-12)
    assert np.all(kappa[1:] <= np.sqrt(eig[-1] / eig[0]) * 0.9 ** np.array([1, 5]) + 1e-12)


def test_extrapolation_recovers_a_geometric_floor():
    s = np.arange(11)
    curves = np.stack([0.3 + 0.2 * 0.7**s, 0.25 + 0.1 * 0.7**s])
    pred, floor, q = extrapolate(curves, np.array([40, 0]))
    assert q == pytest.approx(0.7, abs=0.02)
    np.testing.assert_allclose(floor, [0.3, 0.25], atol=2e-3)
    assert pred[0] == pytest.approx(0.3, abs=2e-3) and pred[1] == pytest.approx(0.35, abs=2e-3)


def test_selector_stops_after_patience_and_compares_with_continuing():
    sel = ProbeSelector(total_rounds=100, patience=2)
    s = np.arange(6)
    floors = [0.5, 0.4, 0.3, 0.35, 0.4, 0.45]
    stops = [sel.add(10 * j, f + 0.1 * 0.5**s) for j, f in enumerate(floors)]
    # smoothed (running median of 3): 0.5, 0.4, 0.35, 0.35, 0.4, 0.45; sigma = 0 here
    assert stops.index(True) == 5
    assert sel.choose(50).warmup_rounds == 20
    assert sel.choose(100, continuing_loss=0.1).warmup_rounds == 100


def test_api_and_cli_agree(tmp_path):
    problem_file = tmp_path / "p.json"
    problem_file.write_text(json.dumps({"make_problem": PROBLEM, "schedule": {
        "lr": 0.08, "local_steps": 4, "total_rounds": 60}}))
    out = tmp_path / "o.json"
    code = subprocess.run([sys.executable, "-m", "linattn", "warmup", "--problem",
                           str(problem_file), "--json", str(out)], capture_output=True,
                          text=True)
    assert code.returncode == 0, code.stderr
    cli = json.loads(out.read_text())
    api = recommend_warmup(make_problem(**PROBLEM), lr=0.08, local_steps=4,
                           total_rounds=60).to_dict()
    for key in ("warmup_rounds", "closed_form", "probe_estimate"):
        assert cli[key] == api[key]
    for key in ("never_freeze_error", "recommended_error"):
        assert cli[key] == pytest.approx(api[key], rel=1e-10)


@pytest.mark.parametrize("flags, name", [(["--total-rounds", "0"], "total-rounds"),
                                         (["--lr", "nan"], "lr"), (["--lr", "50"], "lr")])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, flags, name):
    problem_file = tmp_path / "p.json"
    problem_file.write_text(json.dumps({"make_problem": PROBLEM}))
    out = tmp_path / "o.json"
    res = subprocess.run([sys.executable, "-m", "linattn", "warmup", "--problem",
                          str(problem_file), "--local-steps", "4", "--lr", "0.08", *flags,
                          "--json", str(out)], capture_output=True, text=True)
    assert res.returncode == 2 and name in res.stderr and not out.exists()


def test_non_positive_definite_covariance_is_refused(tmp_path):
    problem = make_problem(**PROBLEM).to_dict()
    problem["covariances"][0][0][0] = -1.0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(problem))
    out = tmp_path / "o.json"
    res = subprocess.run([sys.executable, "-m", "linattn", "warmup", "--problem", str(path),
                          "--lr", "0.08", "--local-steps", "4", "--json", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "covariances" in res.stderr and not out.exists()


def test_total_rounds_zero_in_api():
    with pytest.raises(ParameterError, match="total_rounds"):
        recommend_warmup(make_problem(**PROBLEM), lr=0.08, local_steps=4, total_rounds=0)
