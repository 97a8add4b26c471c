"""The stylized bias-drift bound and T0* (docs/theory.md, eqs. 24-30).

Checks and tolerances:
- stationarity: the closed-form T0* (eqs. 28, 29) zeroes the central-difference derivative of
  bias + linear drift, B(T0) + G dev(T0), to 1e-6 relative to the slope G e eta K, and is a
  minimum (the function is higher 5% either side);
- with the quadratic drift term switched off (profile_smoothness = 0) the integer argmin of the
  full bound is floor or ceil of T0*; with it on, the argmin is never above ceil(T0*) (every
  extra term is non-decreasing in T0) and the test prints how far below it lands;
- hypothesis: T0* is non-increasing in heterogeneity zeta, local_steps K and lr eta (each alone,
  measured_drift_error None, both regimes), equals T when zeta = 0 or K = 1, lies in [0, T];
- recommend_warmup works on constants and on a problem (curves of length T + 1).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from linattn_theory.errors import ParameterError
from linattn_theory.problem import make_problem
from linattn_theory.warmup import (
    WarmupConstants,
    bias_bound,
    drift_bound,
    optimal_warmup_nonconvex,
    optimal_warmup_pl,
    recommend_warmup,
    stylized_bound,
)

BASE = dict(delta0=2.0, pl_constant=0.3, smoothness=2.0, heterogeneity=0.5, grad_bound=1.2,
            lr=0.05, local_steps=5, total_rounds=2000, kernel_distance=1.5)


def _constants(**kw):
    args = dict(BASE)
    args.update(kw)
    return WarmupConstants(**args)


def _bias_plus_linear_drift(c, t0, regime):
    """B(T0) + G dev(T0), dev = eta K T0 e: what eqs. (28), (29) minimise."""
    return bias_bound(c, t0, regime) + c.grad_bound * c.time_step * np.asarray(t0) * c.drift_error


def _closed_unclipped(c, regime):
    s = c.grad_bound * c.drift_error
    if regime == "pl":
        return math.log(c.pl_constant * c.delta0 / s) / (c.time_step * c.pl_constant)
    return math.sqrt(c.sublinear_constant / s) / c.time_step


CASES = [
    ("pl", {}),
    ("pl", dict(heterogeneity=1.0, local_steps=3, pl_constant=0.5)),
    ("pl", dict(measured_drift_error=0.01)),
    ("nonconvex", {}),
    ("nonconvex", dict(heterogeneity=0.1, kernel_distance=0.5)),
    ("nonconvex", dict(measured_drift_error=0.003)),
]


@pytest.mark.parametrize(("regime", "kw"), CASES)
def test_closed_form_is_stationary(regime, kw):
    c = _constants(**kw)
    closed = optimal_warmup_pl(c) if regime == "pl" else optimal_warmup_nonconvex(c)
    assert 0 < closed < c.total_rounds  # unclipped on these cases
    assert closed == pytest.approx(_closed_unclipped(c, regime), rel=1e-14)
    if regime == "nonconvex":  # on the A / tau branch of min(Delta_0, A / tau)
        assert c.sublinear_constant / (c.time_step * closed) < c.delta0
    h = 1e-4 * closed
    slope = (_bias_plus_linear_drift(c, closed + h, regime)
             - _bias_plus_linear_drift(c, closed - h, regime)) / (2 * h)
    scale = c.grad_bound * c.drift_error * c.time_step  # d(linear drift)/dT0
    assert abs(slope) < 1e-6 * scale, (slope, scale)
    at = _bias_plus_linear_drift(c, closed, regime)
    assert _bias_plus_linear_drift(c, 0.95 * closed, regime) > at
    assert _bias_plus_linear_drift(c, 1.05 * closed, regime) > at


@pytest.mark.parametrize(("regime", "kw"), CASES)
def test_numeric_argmin_of_full_bound(regime, kw):
    linear = _constants(profile_smoothness=0.0, **kw)
    rec = recommend_warmup(linear, regime=regime)
    assert rec.numeric_argmin in (math.floor(rec.closed_form), math.ceil(rec.closed_form))
    np.testing.assert_allclose(rec.drift, _bias_plus_linear_drift(linear, rec.rounds, regime)
                               - rec.bias, rtol=1e-12, atol=1e-15)
    full = _constants(frozen_floor=0.01, frozen_contraction=0.99, value_error0=0.5, **kw)
    rec = recommend_warmup(full, regime=regime)
    assert rec.numeric_argmin <= math.ceil(rec.closed_form)
    gap = rec.total[rec.warmup_rounds] / rec.total[rec.numeric_argmin] - 1
    print(f"{regime} {kw}: closed form {rec.closed_form:.1f}, argmin of full bound "
          f"{rec.numeric_argmin} ({rec.closed_form - rec.numeric_argmin:.1f} rounds earlier, "
          f"full bound {100 * gap:.2f}% higher at the closed form)")


def test_closed_forms_are_clipped():
    """mu Delta_0 < S gives a negative unclipped T0*_PL: clipped to 0; a tiny slope: to T."""
    steep = _constants(heterogeneity=2.0, local_steps=10, pl_constant=0.1)
    assert _closed_unclipped(steep, "pl") < 0 and optimal_warmup_pl(steep) == 0.0
    flat = _constants(measured_drift_error=1e-12, total_rounds=50)
    assert _closed_unclipped(flat, "pl") > 50 and optimal_warmup_pl(flat) == 50.0
    assert _closed_unclipped(flat, "nonconvex") > 50 and optimal_warmup_nonconvex(flat) == 50.0
    with pytest.raises(ParameterError, match="pl_constant"):
        optimal_warmup_pl(_constants(pl_constant=0.0))


def test_bound_terms():
    c = _constants(frozen_floor=0.02, frozen_contraction=0.9, value_error0=0.3,
                   profile_smoothness=4.0)
    curves = stylized_bound(c, regime="pl")
    t = np.arange(c.total_rounds + 1)
    np.testing.assert_allclose(curves.bias, c.delta0 * np.exp(-c.pl_constant * c.time_step * t),
                               rtol=1e-14)
    dev = c.time_step * t * (c.local_steps - 1) * c.lr * c.smoothness * c.heterogeneity / 2
    np.testing.assert_allclose(curves.drift, c.grad_bound * dev + 2.0 * dev**2, rtol=1e-14)
    np.testing.assert_allclose(drift_bound(c, t), curves.drift, rtol=1e-14)
    # eq. (27a): frozen-stage term (sqrt(D_frozen) + sqrt(cond H) rho^s sqrt(E_0))^2, s = T - T0
    value_part = (np.sqrt(0.02) + 0.9 ** (c.total_rounds - t) * np.sqrt(0.3)) ** 2
    np.testing.assert_allclose(curves.frozen + curves.transient, value_part, rtol=1e-12)
    assert np.all(curves.frozen == 0.02)
    conditioned = stylized_bound(_constants(frozen_floor=0.02, frozen_contraction=0.9,
                                            value_error0=0.3, hessian_condition=4.0))
    np.testing.assert_allclose(conditioned.frozen + conditioned.transient,
                               (np.sqrt(0.02) + 2 * 0.9 ** (c.total_rounds - t) * np.sqrt(0.3))
                               ** 2, rtol=1e-12)
    np.testing.assert_allclose(curves.total, curves.bias + curves.drift + 0.02
                               + curves.transient, rtol=1e-14)
    nc = stylized_bound(c, regime="nonconvex")
    assert nc.bias[0] == c.delta0
    np.testing.assert_allclose(nc.bias[1:], np.minimum(c.delta0, 0.5 * 1.5**2
                                                       / (c.time_step * t[1:])), rtol=1e-14)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_closed_form_minimises_bias_plus_linear_drift_on_0_T(data):
    """With clipping (and the cap rule 29a of the nonconvex regime), T0* minimises
    B(T0) + S eta K T0 over the real interval [0, T]: no point of a 20001-point grid is lower
    (relative 1e-12). Nonconvex cases whose interior point lies beyond T are left out: there
    the horizon corner (29b), tested by test_nonconvex_horizon_corner_* at the end."""
    kw = data.draw(constant_sets())
    regime = data.draw(REGIMES)
    assume(not _horizon_binds(kw, regime))
    c = WarmupConstants(**kw)
    closed = optimal_warmup_pl(c) if regime == "pl" else optimal_warmup_nonconvex(c)
    grid = np.linspace(0.0, c.total_rounds, 20001)
    at = _bias_plus_linear_drift(c, closed, regime)
    best = np.min(_bias_plus_linear_drift(c, grid, regime))
    assert at <= best * (1 + 1e-12) + 1e-300, (closed, at, best)


# --- hypothesis: monotonicity (eq. 30) ------------------------------------------------------

positive = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False)
fraction = st.floats(min_value=0.01, max_value=0.99)


@st.composite
def constant_sets(draw):
    smooth = draw(st.floats(min_value=0.1, max_value=10.0))
    return dict(
        delta0=draw(positive), pl_constant=draw(st.floats(min_value=1e-3, max_value=2.0)),
        smoothness=smooth, heterogeneity=draw(st.floats(min_value=0.0, max_value=5.0)),
        grad_bound=draw(positive), lr=draw(fraction) * 2.0 / smooth,
        local_steps=draw(st.integers(1, 50)), total_rounds=draw(st.integers(1, 3000)),
        kernel_distance=draw(st.floats(min_value=0.05, max_value=5.0)),
    )


def _t0(kw, regime):
    c = WarmupConstants(**kw)
    value = optimal_warmup_pl(c) if regime == "pl" else optimal_warmup_nonconvex(c)
    assert 0.0 <= value <= c.total_rounds
    rec = recommend_warmup(c, regime=regime)
    assert rec.closed_form == value and 0 <= rec.warmup_rounds <= c.total_rounds
    assert 0 <= rec.numeric_argmin <= c.total_rounds
    return value


def _non_increasing(a, b):
    return b <= a + 1e-9 * max(abs(a), 1.0)


REGIMES = st.sampled_from(["pl", "nonconvex"])


@settings(max_examples=150, deadline=None)
@given(constant_sets(), st.floats(min_value=0.0, max_value=5.0), REGIMES)
def test_t0_non_increasing_in_heterogeneity(kw, other, regime):
    lo, hi = sorted((kw["heterogeneity"], other))
    assert _non_increasing(_t0({**kw, "heterogeneity": lo}, regime),
                           _t0({**kw, "heterogeneity": hi}, regime))


def _horizon_binds(kw, regime):
    """True when the nonconvex interior point sqrt(A/S)/(eta K) lies beyond T: then the cap
    rule (29a) compares the bound at T with T0 = 0, and a larger eta K (a longer horizon in
    tau) can raise T0* (test_nonconvex_horizon_corner_* at the end). Eq. (30): elsewhere."""
    c = WarmupConstants(**kw)
    if regime != "nonconvex" or c.drift_slope == 0:
        return False
    return _closed_unclipped(c, "nonconvex") > c.total_rounds


@settings(max_examples=150, deadline=None)
@given(constant_sets(), st.integers(1, 50), REGIMES)
def test_t0_non_increasing_in_local_steps(kw, other, regime):
    lo, hi = sorted((kw["local_steps"], other))
    assume(not _horizon_binds({**kw, "local_steps": lo}, regime))
    assert _non_increasing(_t0({**kw, "local_steps": lo}, regime),
                           _t0({**kw, "local_steps": hi}, regime))


@settings(max_examples=150, deadline=None)
@given(constant_sets(), fraction, REGIMES)
def test_t0_non_increasing_in_lr(kw, other, regime):
    lo, hi = sorted((kw["lr"], other * 2.0 / kw["smoothness"]))
    assume(not _horizon_binds({**kw, "lr": lo}, regime))
    assert _non_increasing(_t0({**kw, "lr": lo}, regime), _t0({**kw, "lr": hi}, regime))


@settings(max_examples=100, deadline=None)
@given(constant_sets(), REGIMES)
def test_t0_is_total_without_drift(kw, regime):
    for change in ({"heterogeneity": 0.0}, {"local_steps": 1}, {"measured_drift_error": 0.0}):
        c = WarmupConstants(**{**kw, **change})
        assert c.drift_slope == 0.0
        assert _t0({**kw, **change}, regime) == c.total_rounds
        assert recommend_warmup(c, regime=regime).warmup_rounds == c.total_rounds


# --- recommend_warmup ------------------------------------------------------------------------


def test_recommend_warmup_from_constants():
    c = _constants()
    rec = recommend_warmup(c)
    assert rec.regime in ("pl", "nonconvex")
    for name in ("rounds", "bias", "drift", "frozen", "transient", "total"):
        assert getattr(rec, name).shape == (c.total_rounds + 1,)
    assert rec.warmup_rounds == round(rec.closed_form)
    # auto picks the regime whose bound is lower at its own (rounded) T0*
    own = {r: recommend_warmup(c, regime=r) for r in ("pl", "nonconvex")}
    totals = {r: x.total[x.warmup_rounds] for r, x in own.items()}
    assert rec.regime == min(totals, key=totals.get)
    assert "T0*" in rec.explanation() and rec.to_dict()["regime"] == rec.regime
    assert recommend_warmup(_constants(kernel_distance=None)).regime == "pl"
    assert recommend_warmup(_constants(pl_constant=0.0)).regime == "nonconvex"
    with pytest.raises(ParameterError, match="kernel_distance"):
        recommend_warmup(_constants(kernel_distance=None), regime="nonconvex")
    with pytest.raises(ParameterError, match="regime"):
        recommend_warmup(c, regime="convex")
    with pytest.raises(ParameterError, match="unexpected keywords"):
        recommend_warmup(c, lr=0.1)


def test_recommend_warmup_from_problem():
    """A problem gets the exact optimum over every T0, the path-local bound's T0* and R(T)."""
    problem = make_problem(dim=3, num_clients=4, context_length=4, kernel_heterogeneity=0.8,
                           value_heterogeneity=0.8, covariate_shift=0.3, seed=0)
    total = 60
    rec = recommend_warmup(problem, lr=0.05, local_steps=4, total_rounds=total, probe=False)
    path = rec.path
    for name in ("final_error", "bound", "bound_bias", "bound_drift", "bound_value"):
        curve = getattr(path, name)
        assert curve.shape == (total + 1,) and np.all(np.isfinite(curve))
    assert rec.warmup_rounds == int(np.argmin(path.final_error))
    assert rec.closed_form == int(np.argmin(path.bound))
    assert rec.recommended_error == path.final_error.min()
    assert rec.never_freeze_error == path.final_error[-1]
    assert np.all(path.bound >= path.final_error)
    assert rec.probe_estimate is None
    with pytest.raises(ParameterError, match="local_steps"):
        recommend_warmup(problem, lr=0.05, total_rounds=total)
    with pytest.raises(ParameterError, match="constants"):
        recommend_warmup({"lr": 0.05})


AUTO_CASE = dict(delta0=1.0, pl_constant=1.0, smoothness=0.25, grad_bound=1.0, lr=0.09375,
                 local_steps=6, total_rounds=200, kernel_distance=0.125)


def test_auto_regime_monotone_while_both_closed_forms_exceed_a_round():
    """The per-regime property carries over to regime='auto' away from the corner below."""
    for het in (0.1, 0.3, 0.6):
        c = _constants(heterogeneity=het)
        assert min(optimal_warmup_pl(c), optimal_warmup_nonconvex(c)) >= 1
    values = [recommend_warmup(_constants(heterogeneity=h)).warmup_rounds
              for h in (0.1, 0.3, 0.6)]
    assert values == sorted(values, reverse=True)


def test_auto_regime_non_increasing_in_heterogeneity():
    low = recommend_warmup(WarmupConstants(heterogeneity=1.0, **AUTO_CASE))
    high = recommend_warmup(WarmupConstants(heterogeneity=2.0, **AUTO_CASE))
    assert high.warmup_rounds <= low.warmup_rounds, (low.regime, low.warmup_rounds,
                                                     high.regime, high.warmup_rounds)


NC_HORIZON_CASE = dict(delta0=1.0, pl_constant=0.0, smoothness=1.0, heterogeneity=0.01,
                       grad_bound=1.0, lr=0.1, local_steps=2, total_rounds=100,
                       kernel_distance=10.0)


def test_nonconvex_horizon_corner_is_the_exact_argmin_not_monotone_in_lr():
    """(29b): when sqrt(A/S)/(eta K) lies beyond T, T0* is the argmin over [0, T] of the capped
    bound, which compares T with 0; a longer horizon eta K T can then raise T0* (eq. 30
    excludes this corner). Both answers are checked against a dense grid."""
    low = WarmupConstants(**NC_HORIZON_CASE)
    high = WarmupConstants(**{**NC_HORIZON_CASE, "lr": 0.3})
    assert optimal_warmup_nonconvex(low) == 0.0
    assert optimal_warmup_nonconvex(high) == float(high.total_rounds)
    for c in (low, high):
        grid = np.linspace(0.0, c.total_rounds, 20001)
        bound = bias_bound(c, grid, "nonconvex") + c.drift_slope * c.time_step * grid
        best = bias_bound(c, [optimal_warmup_nonconvex(c)], "nonconvex")[0] + (
            c.drift_slope * c.time_step * optimal_warmup_nonconvex(c))
        assert best <= bound.min() * (1 + 1e-12)


def test_nonconvex_horizon_corner_in_local_steps():
    low = WarmupConstants(**{**NC_HORIZON_CASE, "local_steps": 5})
    high = WarmupConstants(**{**NC_HORIZON_CASE, "local_steps": 8})
    assert optimal_warmup_nonconvex(low) == 0.0
    assert optimal_warmup_nonconvex(high) == float(high.total_rounds)
