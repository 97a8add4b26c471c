"""The exact R(T0) of every T0 (eq. 31), the path-local bound (eqs. 32-35), the probe
estimator's extrapolation (eq. 36) and the one path shared by recommend_warmup and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest

from linattn_theory import warmup_path as warmup_path_module
from linattn_theory.dynamics import initial_point, population_dynamics
from linattn_theory.errors import ParameterError
from linattn_theory.frozen import frozen_stages
from linattn_theory.objectives import global_loss, pooled_kernel_gradient
from linattn_theory.probe import (
    _RATES,
    ProbeSelector,
    best_snapshot,
    extrapolate,
    probe_length,
    smoothed,
)
from linattn_theory.problem import make_problem
from linattn_theory.profile import solve_profile
from linattn_theory.warmup import recommend_warmup
from linattn_theory.warmup_path import (
    WarmupPath,
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


@pytest.mark.parametrize("spec, total", [(PROBLEM, 37),
                                         (dict(dim=4, num_clients=3, out_dim=2, seed=5), 50)])
def test_chunked_stacks_give_the_numbers_of_one_call(spec, total, monkeypatch):
    """The frozen stages and reference rounds over T0 are evaluated in chunks; every field
    of the path is, to the bit, that of one call on the whole stack."""
    problem = make_problem(**spec)
    start = initial_point(problem)
    star = solve_profile(problem).value
    chunked = warmup_path(problem, start, 0.08, 4, total, star)
    monkeypatch.setattr(warmup_path_module, "_CHUNK", total + 1)
    whole = warmup_path(problem, start, 0.08, 4, total, star)
    for f in fields(WarmupPath):
        assert np.array_equal(getattr(chunked, f.name), getattr(whole, f.name)), f.name


def test_chunked_frozen_stages_name_the_whole_stacks_limit(monkeypatch):
    """An unstable local value problem is reported with the stability limit over the whole
    stack (a chunk alone would name its own, larger limit)."""
    problem = make_problem(**PROBLEM)
    kernels = (np.random.default_rng(0).standard_normal((20, 3, 3))
               * np.linspace(0.1, 3.0, 20)[:, None, None])
    monkeypatch.setattr(warmup_path_module, "_CHUNK", 4)
    with pytest.raises(ParameterError) as whole:
        frozen_stages(problem, kernels, 0.05, 3)
    with pytest.raises(ParameterError) as chunked:
        warmup_path_module._frozen_stages(problem, kernels, 0.05, 3)
    assert str(chunked.value) == str(whole.value)
    messages = []
    for i in range(0, 20, 4):
        try:
            frozen_stages(problem, kernels[i:i + 4], 0.05, 3)
        except ParameterError as err:
            messages.append(str(err))
    assert len(messages) > 1 and messages[0] != str(whole.value)


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


def test_extrapolation_recovers_a_floor_the_probe_identifies():
    """q = 0.9 over r = 10 rounds (q^r = 0.35: more than a half-life seen): the floor and the
    prediction at T - t = 150 within 2e-3 with the guards on (default) and off."""
    s = np.arange(11)
    curve = 0.8 + 0.5 * 0.9**s
    for kw in ({}, {"lower_bound": None, "reach": None}):
        pred, floor, q = extrapolate(curve, 150, **kw)
        assert q == pytest.approx(0.9, abs=0.01)
        assert floor[0] == pytest.approx(0.8, abs=2e-3) and pred[0] == pytest.approx(0.8, abs=2e-3)


def near_linear_curve():
    """The real-network failure: validation cross-entropy 2.391 -> 2.233 over r = 10 frozen
    rounds, a straight line plus noise of sd 0.002 (fixed seed), horizon T - t = 200."""
    curve = np.linspace(2.391, 2.233, 11) + np.random.default_rng(0).normal(0.0, 0.002, 11)
    curve[0], curve[-1] = 2.391, 2.233
    return curve


def test_unidentified_floor_is_bounded_below_and_in_reach():
    curve = near_linear_curve()
    # unguarded: q at the grid's end and a floor far below zero (a negative cross-entropy)
    pred, floor, q = extrapolate(curve, 200, lower_bound=None, reach=None)
    assert q > 0.99 and floor[0] < -5 and pred[0] < 0
    # the lower bound alone: floor and prediction >= 0, still far below the curve
    pred, floor, _ = extrapolate(curve, 200, reach=None)
    assert floor[0] >= 0 and 0 <= pred[0] < 1.5
    # with the reach cap (default): at most the probe's own drop (0.158) below its end
    pred, floor, _ = extrapolate(curve, 200)
    assert pred[0] == pytest.approx(2.233 - 0.158, abs=0.01)


def test_reach_caps_a_slow_geometric_curve_at_one_probe_drop():
    """q = 0.98 (q^r = 0.82, less than a half-life seen): the prediction is the fitted end minus
    the fitted drop, above the true floor 1.0; without the cap the floor is recovered."""
    s = np.arange(11)
    curve = 1.0 + 0.5 * 0.98**s
    pred, _, _ = extrapolate(curve, 300)
    assert pred[0] == pytest.approx(2 * curve[-1] - curve[0], abs=1e-3)
    assert pred[0] > 1.0 + 0.3
    pred, floor, _ = extrapolate(curve, 300, reach=None)
    # q = 0.98 lies between two rates of the grid: the floor within 0.03
    assert floor[0] == pytest.approx(1.0, abs=0.03) and pred[0] == pytest.approx(
        1.0 + 0.5 * 0.98**300, abs=0.03)


def test_end_point_rule_and_finality_of_the_smoothed_predictions():
    # the measured predictions (snapshots 0..32): the oldest follows its neighbours' trend
    real = [-1.889, 1.913, 1.583, 1.364, 1.212]
    assert smoothed(real)[0] == pytest.approx(1.583)
    assert smoothed(real, end_rule=False)[0] == -1.889
    # a run whose best snapshot is the first keeps it
    rising = [0.5, 0.6, 0.7, 0.8, 0.9]
    assert smoothed(rising)[0] == 0.5 and int(np.argmin(smoothed(rising))) == 0
    # an inner outlier (0.518 among 0.8-1.1) is the median of its neighbours
    assert smoothed([0.95, 0.9, 0.518, 0.88, 0.93])[2] == pytest.approx(0.88)
    # all but the newest smoothed value are final from the fourth prediction on (the runner
    # prunes snapshots on that)
    x = np.random.default_rng(3).normal(size=12)
    for n in range(4, 12):
        np.testing.assert_array_equal(smoothed(x[:n])[:-1], smoothed(x)[:n - 1])


def test_selector_does_not_stop_on_an_unidentified_first_probe():
    """The real-network run (T = 200, a snapshot every 8 rounds, r = 10): snapshot 0 is the
    near-linear curve, snapshots 8..56 contract (q = 0.75) to floors 1.913, 1.583, 1.364,
    1.212, 1.18, 1.20, 1.23, 1.26. Unguarded, snapshot 0 predicts a negative loss, stays the
    best and warm-up stops at round 32 with T0 = 0; guarded, its prediction stays within one
    probe drop of its curve and T0 is the minimum of the later predictions (round 40)."""
    s = np.arange(11)
    starts = [2.6, 1.96, 1.69, 1.53, 1.45, 1.40, 1.37, 1.35]
    floors = [1.913, 1.583, 1.364, 1.212, 1.18, 1.20, 1.23, 1.26]
    curves = [near_linear_curve()] + [f + (a - f) * 0.75**s for a, f in zip(starts, floors)]

    def run(**kw):
        sel = ProbeSelector(200, patience=4, **kw)
        for j, c in enumerate(curves):
            if sel.add(8 * j, c):
                return sel, 8 * j
        return sel, 200

    sel, stopped = run(lower_bound=None, reach=None, end_rule=False)
    assert sel.predictions[0] < 0 and stopped == 32 and sel.choose(stopped).warmup_rounds == 0
    for kw in ({}, {"reach": None}, {"end_rule": False}):   # each guard alone suffices here
        sel, stopped = run(**kw)
        assert sel.predictions[0] >= 0 and stopped == 200
        assert sel.choose(stopped).warmup_rounds == 40
    sel, _ = run()
    assert sel.predictions[0] == pytest.approx(2.075, abs=0.01)
    # the later probes share q with the near-linear one in their window: floors within 0.015
    np.testing.assert_allclose(sel.predictions[1:], floors, atol=0.015)


@pytest.mark.parametrize("q", [0.5, 0.8, float(_RATES[-30]), float(_RATES[-5])])
def test_probe_length_doubles_until_the_fitted_curve_bends(q):
    """Exact geometric curves l(s) = 1 + 0.5 q^s with q on the rate grid: the fit recovers q
    exactly and the floor to 1e-8; the probe is long enough iff q^r <= 1/2, else it doubles
    (capped by max_rounds and the horizon)."""
    s = np.arange(61)
    curve = 1.0 + 0.5 * q**s
    for r in (5, 10, 20, 40):
        _, floor, q_fit = extrapolate(curve[:r + 1], 300, reach=None)
        bent = q**r <= 0.5
        if bent or r >= 10:     # a probe that bends, or long enough to tell q from 1
            assert q_fit == q and floor[0] == pytest.approx(1.0, abs=1e-8)
        assert probe_length(curve[:r + 1], 300, 60) == (r if bent else min(2 * r, 60))
        assert probe_length(curve[:r + 1], 300, r + 3) == (r if bent else r + 3)
        assert probe_length(curve[:r + 1], r + 1, 60) == (r if bent else r + 1)
        assert probe_length(curve[:r + 1], 300, r) == r
    with pytest.raises(ParameterError):
        probe_length(curve[:6], 300, 60, bend=1.0)


def test_probe_length_extends_a_slow_curve_until_its_prediction_is_exact():
    """q = 0.9693 (a grid rate): 5 rounds show q^5 = 0.86 of the drop still to come, so the
    reach guard holds the prediction at horizon 150 far above the truth; the probe doubles to
    10, 20 and 40 rounds (q^40 = 0.29 <= 1/2) and its prediction is then exact to 1e-8.
    A curve with a fast and a slow rate (0.5 and 0.97) is fitted with the fast one on 5 rounds
    and counts as bent: the rule extends a probe only as far as its own fit sees."""
    q = float(_RATES[-30])
    s = np.arange(41)
    curve = 1.0 + 0.5 * q**s
    lengths = [5]
    while (nxt := probe_length(curve[:lengths[-1] + 1], 150, 40)) > lengths[-1]:
        lengths.append(nxt)
    truth = 1.0 + 0.5 * q**150
    assert lengths == [5, 10, 20, 40]
    assert extrapolate(curve[:6], 150)[0][0] - truth > 0.3
    assert extrapolate(curve, 150)[0][0] == pytest.approx(truth, abs=1e-8)
    two_rate = 1.0 + 0.05 * 0.5**s + 0.3 * 0.97**s
    assert probe_length(two_rate[:6], 150, 40) == 5


def test_selector_shares_the_rate_of_probes_of_different_lengths_on_their_common_rounds():
    """A window of probes of 5, 10 and 20 rounds is fitted on its first 5 rounds: the same
    predictions as the same probes cut to 5 rounds (exact, both are the same least squares)."""
    s = np.arange(21)
    curves = [f + 0.2 * 0.7**s for f in (0.9, 0.8, 0.75)]
    ragged, cut = ProbeSelector(200, window=3), ProbeSelector(200, window=3)
    for j, (c, r) in enumerate(zip(curves, (5, 10, 20))):
        ragged.add(10 * j, c[:r + 1])
        cut.add(10 * j, c[:6])
    assert ragged.predictions == cut.predictions
    assert ragged.probe_rounds_used == 35 and cut.probe_rounds_used == 15


def test_selector_stops_after_patience_and_compares_with_continuing():
    sel = ProbeSelector(total_rounds=100, patience=2)
    s = np.arange(6)
    floors = [0.5, 0.4, 0.3, 0.35, 0.4, 0.45]
    stops = [sel.add(10 * j, f + 0.1 * 0.5**s) for j, f in enumerate(floors)]
    # smoothed (running median of 3): 0.5, 0.4, 0.35, 0.35, 0.4, 0.45; sigma = 0 here
    assert stops.index(True) == 5
    assert sel.choose(50).warmup_rounds == 20
    assert sel.choose(100, continuing_loss=0.1).warmup_rounds == 100


def test_tied_smoothed_predictions_by_either_tie_break():
    # the warm-up grid's setting 93 (fresh4): the end-point rule and the medians give the first
    # three snapshots the same smoothed value, 7.682; their own predictions are 10.146, 7.682
    # and 7.533: "earliest" keeps round 0, "own" round 24
    preds = [10.14629, 7.68203, 7.53288, 7.71569, 7.92040, 7.95493, 7.99588, 8.08438]
    z = smoothed(preds)
    assert z[0] == z[1] == z[2] == 7.68203 and int(np.argmin(z)) == 0
    assert best_snapshot(z, preds) == 0                              # the default: earliest
    assert best_snapshot(z, preds, "own") == 2
    assert best_snapshot([1.0, 1.0, 1.0], [2.0, 1.0, 1.0], "own") == 1    # then the earliest
    with pytest.raises(ParameterError, match="tie_break"):
        best_snapshot(z, preds, "latest")
    for rule, t0 in (("earliest", 0), ("own", 24)):
        sel = ProbeSelector(total_rounds=300, tie_break=rule)
        sel.snapshots, sel.predictions = [12 * j for j in range(8)], preds
        assert sel.choose(84).warmup_rounds == t0


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
