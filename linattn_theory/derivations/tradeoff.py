"""The stylized bias-drift bound and the optimal warm-up length, eqs. (24)-(30).

Time is tau = eta K T0 (eta K is the distance in "gradient-flow time" that one round covers).
With drift error e = (K - 1) eta L zeta / 2 and drift slope S = G e,

    PL:          E_PL(T0) = Delta_0 exp(-mu eta K T0) + S eta K T0,
                 T0*_PL   = ln(mu Delta_0 / S) / (eta K mu)                          (28)
    non-convex:  E_NC(T0) = A / (eta K T0) + S eta K T0,  A = D_0^2 / 2,
                 T0*_NC   = sqrt(A / S) / (eta K)                                    (29)

The functions return sympy expressions and residuals; ``*_numeric`` functions are plain-float
versions (with the clipping rules of docs/theory.md) for comparison with
``linattn_theory.warmup``.
"""

from __future__ import annotations

import math
import random
from functools import cache

import sympy as sp

DELTA0, MU, LR, K, SMOOTH, ZETA, GRAD, AREA = sp.symbols(
    "Delta_0 mu eta K L zeta G A", positive=True)
T0 = sp.Symbol("T_0", positive=True)
TAU = sp.Symbol("tau", positive=True)
KAPPA = sp.Symbol("kappa", positive=True)  # K = 1 + kappa: at least two local steps


def drift_error(lr=LR, local_steps=K, smoothness=SMOOTH, heterogeneity=ZETA):
    """e = (K - 1) eta L zeta / 2 (eqs. 22, 23)."""
    return (local_steps - 1) * lr * smoothness * heterogeneity / 2


def drift_slope(**kwargs):
    """S = G e, the drift bound's growth per unit of tau (eq. 23)."""
    return GRAD * drift_error(**kwargs)


def pl_bound(rounds=T0):
    """Delta_0 exp(-mu eta K T0) + S eta K T0: the PL bias bound (24) plus the linear drift."""
    return DELTA0 * sp.exp(-MU * LR * K * rounds) + drift_slope() * LR * K * rounds


def nonconvex_bound(rounds=T0):
    """A / (eta K T0) + S eta K T0: the sublinear bias bound (25) plus the linear drift."""
    return AREA / (LR * K * rounds) + drift_slope() * LR * K * rounds


def pl_optimum():
    """T0*_PL = ln(mu Delta_0 / S) / (eta K mu), eq. (28), before clipping."""
    return sp.log(MU * DELTA0 / drift_slope()) / (LR * K * MU)


def nonconvex_optimum():
    """T0*_NC = sqrt(A / S) / (eta K), eq. (29), before clipping."""
    return sp.sqrt(AREA / drift_slope()) / (LR * K)


@cache
def stationarity() -> dict:
    """First and second derivatives of the bounds at T0*.

    Keys ``pl_first``, ``nc_first``: d E / d T0 at T0* (must simplify to 0);
    ``pl_second``, ``nc_second``: d^2 E / d T0^2 at T0* (must be positive: sympy decides
    ``is_positive`` from the symbols' positivity); ``pl_convex``, ``nc_convex``: the second
    derivative at a generic T0 (positive everywhere, so the stationary point is the global
    minimiser on T0 > 0). K is written 1 + kappa (kappa > 0): with K = 1 there is no drift and
    no interior optimum.
    """
    out = {}
    for key, bound, opt in (("pl", pl_bound(), pl_optimum()),
                            ("nc", nonconvex_bound(), nonconvex_optimum())):
        first = sp.diff(bound, T0)
        second = sp.diff(bound, T0, 2)
        out[f"{key}_first"] = sp.simplify(first.subs(T0, opt).subs(K, 1 + KAPPA))
        out[f"{key}_second"] = sp.simplify(second.subs(T0, opt).subs(K, 1 + KAPPA))
        out[f"{key}_convex"] = sp.simplify(second.subs(K, 1 + KAPPA))
    return out


@cache
def monotonicity() -> dict:
    """d T0* / d zeta, d K, d eta for both regimes, as sympy expressions (eq. 30).

    The PL derivatives are written with ell = ln(mu Delta_0 / S) > 0 (the interior case,
    T0* > 0) and K = 1 + kappa, kappa > 0, so that sympy can decide their sign from the
    symbols' assumptions. Values are (expression, is_negative).
    """
    ell, kappa = sp.Symbol("ell", positive=True), KAPPA
    interior = {DELTA0: drift_slope() * sp.exp(ell) / MU}
    out = {}
    for var in (ZETA, K, LR):
        pl = sp.diff(pl_optimum(), var).subs(interior)
        pl = sp.simplify(sp.expand_log(pl, force=True).subs(K, 1 + kappa))
        nc = sp.simplify(sp.diff(nonconvex_optimum(), var).subs(K, 1 + kappa))
        out[f"pl_d{var}"] = (pl, bool(pl.is_negative))
        out[f"nc_d{var}"] = (nc, bool(nc.is_negative))
    return out


@cache
def limits() -> dict:
    """T0* as S -> 0 (zeta -> 0 or K -> 1): both closed forms diverge to +infinity (eq. 30)."""
    pl, nc = pl_optimum().subs(K, 1 + KAPPA), nonconvex_optimum().subs(K, 1 + KAPPA)
    return {
        "pl_zeta": sp.limit(pl, ZETA, 0, "+"),
        "pl_k": sp.limit(pl, KAPPA, 0, "+"),
        "nc_zeta": sp.limit(nc, ZETA, 0, "+"),
        "nc_k": sp.limit(nc, KAPPA, 0, "+"),
    }


@cache
def nonconvex_kink() -> dict:
    """The capped bound min(Delta_0, A/tau) + S tau (eq. 25) and when its argmin is 0.

    Keys: ``value_at_optimum`` (A/tau* + S tau* - 2 sqrt(A S), must be 0), ``threshold``
    (the S at which 2 sqrt(A S) = Delta_0, i.e. Delta_0^2 / (4 A): above it the capped bound is
    smallest at T0 = 0), ``cap_active`` (tau* - A/Delta_0 at the threshold, = A/Delta_0 > 0:
    between Delta_0^2/(4A) and Delta_0^2/A the stationary point lies where the cap is inactive
    and still loses to T0 = 0, so clipping tau* to [0, T] alone is not enough).
    """
    slope = sp.Symbol("S", positive=True)
    tau_star = sp.sqrt(AREA / slope)
    value = AREA / tau_star + slope * tau_star
    threshold = sp.solve(sp.Eq(2 * sp.sqrt(AREA * slope), DELTA0), slope)[0]
    return {
        "value_at_optimum": sp.simplify(value - 2 * sp.sqrt(AREA * slope)),
        "threshold": threshold,
        "cap_active": sp.simplify(tau_star.subs(slope, threshold) - AREA / DELTA0),
    }


@cache
def quadratic_drift_correction() -> dict:
    """Effect of the (L/2) dev^2 term of eq. (26), dropped from (28) and (29).

    With dev = e tau, the full PL bound is Delta_0 e^{-mu tau} + G e tau + (L/2) e^2 tau^2.
    Keys: ``pl_slope_at_closed_form`` (its tau-derivative at tau* = eta K T0*_PL, equal to
    L e^2 tau* > 0, so the exact argmin lies below the closed form), ``lambert_residual``
    (the tau-derivative at the Lambert-W solution
    tau = W(z)/mu - G/(L e), z = mu^2 Delta_0 exp(mu G / (L e)) / (L e^2), with W(z) written as
    w and z = w e^w; must simplify to 0), ``nc_cubic`` (the non-convex stationarity condition
    L e^2 tau^3 + G e tau^2 - A = 0: one sign change, so exactly one positive root).
    """
    err = drift_error()
    full = DELTA0 * sp.exp(-MU * TAU) + GRAD * err * TAU + SMOOTH * err**2 * TAU**2 / 2
    derivative = sp.diff(full, TAU)
    tau_star = LR * K * pl_optimum()
    slope_at_closed = sp.simplify(derivative.subs(TAU, tau_star) - SMOOTH * err**2 * tau_star)
    w = sp.Symbol("w", positive=True)
    e_sym = sp.Symbol("e", positive=True)
    deriv_e = -MU * DELTA0 * sp.exp(-MU * TAU) + GRAD * e_sym + SMOOTH * e_sym**2 * TAU
    z = w * sp.exp(w)
    delta_from_w = z * SMOOTH * e_sym**2 / (MU**2 * sp.exp(MU * GRAD / (SMOOTH * e_sym)))
    tau_w = w / MU - GRAD / (SMOOTH * e_sym)
    lambert = sp.simplify(deriv_e.subs(TAU, tau_w).subs(DELTA0, delta_from_w))
    nc_full = AREA / TAU + GRAD * e_sym * TAU + SMOOTH * e_sym**2 * TAU**2 / 2
    cubic = sp.expand(sp.diff(nc_full, TAU) * TAU**2)
    return {"pl_slope_at_closed_form": slope_at_closed, "lambert_residual": lambert,
            "nc_cubic": cubic}


def lambert_numeric_residual(seed: int = 0, digits: int = 40) -> float:
    """|d/dtau of the full PL bound| at the Lambert-W argmin, at random values, to ``digits``."""
    rng = random.Random(seed)
    vals = {s: sp.Rational(rng.randint(1, 20), rng.randint(1, 10))
            for s in (DELTA0, MU, GRAD, SMOOTH)}
    e = sp.Rational(rng.randint(1, 20), 50)
    z = vals[MU] ** 2 * vals[DELTA0] * sp.exp(vals[MU] * vals[GRAD] / (vals[SMOOTH] * e)) / (
        vals[SMOOTH] * e**2)
    tau = sp.LambertW(z) / vals[MU] - vals[GRAD] / (vals[SMOOTH] * e)
    deriv = (-vals[MU] * vals[DELTA0] * sp.exp(-vals[MU] * tau) + vals[GRAD] * e
             + vals[SMOOTH] * e**2 * tau)
    return float(abs(sp.N(deriv, digits)))


def optimal_warmup_pl_numeric(delta0, pl_constant, smoothness, heterogeneity, grad_bound, lr,
                              local_steps, total_rounds) -> float:
    """Eq. (28), clipped to [0, T]; T when S = 0. Plain floats."""
    slope = grad_bound * (local_steps - 1) * lr * smoothness * heterogeneity / 2
    if slope <= 0:
        return float(total_rounds)
    ratio = pl_constant * delta0 / slope
    if ratio <= 1:
        return 0.0
    return float(min(max(math.log(ratio) / (lr * local_steps * pl_constant), 0.0), total_rounds))


def optimal_warmup_nonconvex_numeric(delta0, kernel_distance, smoothness, heterogeneity,
                                     grad_bound, lr, local_steps, total_rounds) -> float:
    """Eq. (29) with A = D_0^2/2 on the capped bound min(Delta_0, A/tau) + S tau, in [0, T].

    Candidates: T0 = 0 and the stationary point clipped to [0, T]; the one with the lower
    capped bound wins (ties go to the stationary point). T when S = 0.
    """
    area = kernel_distance**2 / 2
    slope = grad_bound * (local_steps - 1) * lr * smoothness * heterogeneity / 2
    if slope <= 0:
        return float(total_rounds)
    per_round = lr * local_steps
    candidate = min(math.sqrt(area / slope) / per_round, float(total_rounds))

    def capped(rounds):
        tau = per_round * rounds
        bias = delta0 if tau <= 0 else min(delta0, area / tau)
        return bias + slope * tau

    return float(candidate) if capped(candidate) <= capped(0.0) else 0.0
