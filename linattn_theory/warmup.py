"""The stylized bias-drift bound and the optimal warm-up length (docs/theory.md, eqs. 24-30).

Time is measured in tau = eta K T0. With constants Delta_0, mu, L, zeta, G, D_0:

    B_PL(T0)  = Delta_0 exp(-mu eta K T0)                                            (24)
    B_NC(T0)  = min(Delta_0, A / (eta K T0)),  A = D_0^2 / 2                         (25)
    dev(T0)   = eta K T0 e,  e = (K - 1) eta L zeta / 2,
    Drift(T0) = G dev(T0) + (L_Phi/2) dev(T0)^2   (linear slope S = G e per unit tau)    (26)
    E(T0)     = B(T0) + Drift(T0) + (sqrt(D_frozen) + kappa_s sqrt(E_0))^2,
                kappa_s = sqrt(cond H) rho^s,  s = T - T0                              (27, 27a)
    T0*_PL    = ln(mu Delta_0 / S) / (eta K mu)                                       (28)
    T0*_NC    = sqrt(A / S) / (eta K)                                                 (29)

both clipped to [0, T] and equal to T when S = 0 (zeta = 0 or K = 1); each is non-increasing
in zeta, K and eta (eq. 30). The closed forms minimise the bias plus the linear drift; the
numeric argmin minimises the full expression (27). These serve constants typed in without a
problem; for a problem instance :func:`recommend_warmup` returns the exact optimum
(:mod:`linattn_theory.advice`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from linattn_theory.advice import WarmupAdvice, advise_warmup
from linattn_theory.errors import ParameterError
from linattn_theory.problem import Problem
from linattn_theory.warmup_constants import WarmupConstants

__all__ = ["REGIMES", "WarmupConstants", "BoundCurves", "Recommendation", "WarmupAdvice",
           "bias_bound", "drift_bound", "stylized_bound", "optimal_warmup_pl",
           "optimal_warmup_nonconvex", "recommend_warmup"]

REGIMES = ("auto", "pl", "nonconvex")


def bias_bound(constants: WarmupConstants, warmup_rounds, regime: str) -> np.ndarray:
    """Bias_bound(T0) by eq. (24) (``pl``) or eq. (25) (``nonconvex``)."""
    t0 = np.asarray(warmup_rounds, dtype=np.float64)
    tau = constants.time_step * t0
    if regime == "pl":
        return constants.delta0 * np.exp(-constants.pl_constant * tau)
    if regime == "nonconvex":
        a = constants.sublinear_constant
        if a is None:
            raise ParameterError("the nonconvex regime needs kernel_distance (D_0); give it")
        with np.errstate(divide="ignore"):
            return np.minimum(constants.delta0, a / tau)
    raise ParameterError(f"regime={regime!r}; allowed: 'pl', 'nonconvex'")


def drift_bound(constants: WarmupConstants, warmup_rounds) -> np.ndarray:
    """Drift_bound(T0) = G dev + (L_Phi/2) dev^2, dev = eta K T0 e (eq. 26)."""
    dev = constants.time_step * np.asarray(warmup_rounds, dtype=np.float64) * constants.drift_error
    curvature = (constants.smoothness if constants.profile_smoothness is None
                 else constants.profile_smoothness)
    return constants.grad_bound * dev + 0.5 * curvature * dev**2


@dataclass(frozen=True)
class BoundCurves:
    """The terms of eq. (27) on a grid of T0 values.

    ``frozen`` is D_frozen and ``transient`` the rest of the frozen-stage term of (27a),
    (sqrt(D_frozen) + kappa_s sqrt(E_0))^2 - D_frozen, so that the columns add up to ``total``.
    """

    rounds: np.ndarray
    bias: np.ndarray
    drift: np.ndarray
    frozen: np.ndarray
    transient: np.ndarray
    total: np.ndarray


def stylized_bound(constants: WarmupConstants, warmup_rounds=None, regime: str = "pl"):
    """E_bound(T0) of eq. (27) and its terms; ``warmup_rounds`` defaults to 0..T."""
    t = constants.total_rounds
    rounds = np.arange(t + 1) if warmup_rounds is None else np.asarray(warmup_rounds)
    bias = bias_bound(constants, rounds, regime)
    drift = drift_bound(constants, rounds)
    frozen = np.full(rounds.shape, constants.frozen_floor, dtype=np.float64)
    remaining = t - rounds.astype(np.float64)
    kappa = np.sqrt(constants.hessian_condition) * constants.frozen_contraction**remaining
    value_part = (np.sqrt(constants.frozen_floor) + kappa * np.sqrt(constants.value_error0))**2
    transient = value_part - constants.frozen_floor
    return BoundCurves(rounds, bias, drift, frozen, transient, bias + drift + frozen + transient)


def _clip(x: float, total: int) -> float:
    return float(min(max(x, 0.0), float(total)))


def optimal_warmup_pl(constants: WarmupConstants) -> float:
    """T0*_PL = ln(mu Delta_0 / S) / (eta K mu), clipped to [0, T] (eq. 28)."""
    slope, mu = constants.drift_slope, constants.pl_constant
    if mu <= 0:
        raise ParameterError("pl_constant=0: the PL regime needs mu > 0")
    if slope <= 0:
        return float(constants.total_rounds)
    return _clip(math.log(mu * constants.delta0 / slope) / (constants.time_step * mu),
                 constants.total_rounds)


def optimal_warmup_nonconvex(constants: WarmupConstants) -> float:
    """T0*_NC = sqrt(A / S) / (eta K) (eq. 29) with the cap rule (29a), within [0, T].

    The capped bound min(Delta_0, A/tau) + S tau equals Delta_0 at T0 = 0 and 2 sqrt(A S) at
    tau* = sqrt(A/S); the interior point wins only if it is lower, and when tau* lies beyond T
    the bound at T is compared with T0 = 0 the same way (29b). That is the exact argmin over
    [0, T]; in that horizon-bound corner it is not monotone in eta and K (a longer horizon
    eta K T lowers the bound at T), which (30) excludes.
    """
    a, slope = constants.sublinear_constant, constants.drift_slope
    if a is None:
        raise ParameterError("the nonconvex regime needs kernel_distance (D_0); give it")
    if slope <= 0:
        return float(constants.total_rounds)
    if a == 0:
        return 0.0
    interior = _clip(math.sqrt(a / slope) / constants.time_step, constants.total_rounds)
    tau = constants.time_step * interior
    capped = min(constants.delta0, a / tau) + slope * tau if tau > 0 else constants.delta0
    return interior if capped < constants.delta0 else 0.0


@dataclass(frozen=True)
class Recommendation:
    """What :func:`recommend_warmup` returns.

    Attributes
    ----------
    warmup_rounds : int
        The recommended T0: the closed-form T0* of the chosen regime, rounded.
    closed_form : float
        T0* before rounding (eq. 28 or 29).
    numeric_argmin : int
        argmin over integer T0 in [0, T] of the full bound (27).
    regime : str
        ``pl`` or ``nonconvex``.
    constants : WarmupConstants
    rounds, bias, drift, frozen, transient, total : ndarray
        The bound's terms on T0 = 0..T.
    """

    warmup_rounds: int
    closed_form: float
    numeric_argmin: int
    regime: str
    constants: WarmupConstants
    rounds: np.ndarray
    bias: np.ndarray
    drift: np.ndarray
    frozen: np.ndarray
    transient: np.ndarray
    total: np.ndarray

    def explanation(self) -> str:
        c = self.constants
        i = self.warmup_rounds
        lines = [
            f"T0* = {self.warmup_rounds} of T = {c.total_rounds} rounds ({self.regime} regime; "
            f"closed form {self.closed_form:.2f}, argmin of the full bound {self.numeric_argmin})",
            f"  at T0*: bias bound {self.bias[i]:.4g}, drift bound {self.drift[i]:.4g}, "
            f"frozen floor {self.frozen[i]:.4g}, transient {self.transient[i]:.4g}, "
            f"total {self.total[i]:.4g}",
            f"  drift slope S = G e = {c.drift_slope:.4g} per unit eta*K*T0 "
            + (f"(e measured = {c.drift_error:.4g})" if c.measured_drift_error is not None
               else f"(e = (K-1) eta L zeta / 2 = {c.drift_error:.4g})"),
        ]
        if c.drift_slope == 0:
            lines.append("  no client drift (zeta = 0 or K = 1): freezing buys nothing, T0* = T")
        elif self.regime == "pl":
            lines.append("  longer warm-up shrinks the kernel bias geometrically "
                         f"(rate mu eta K = {c.pl_constant * c.time_step:.4g} per round) while "
                         "drift grows linearly; T0* balances the two")
        else:
            lines.append("  longer warm-up shrinks the kernel bias like A/(eta K T0) while drift "
                         "grows linearly; T0* = sqrt(A/S)/(eta K)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "warmup_rounds": self.warmup_rounds,
            "closed_form": self.closed_form,
            "numeric_argmin": self.numeric_argmin,
            "regime": self.regime,
            "constants": {k: (float(v) if v is not None else None)
                          for k, v in asdict(self.constants).items()},
        }


def _choose_regime(constants: WarmupConstants) -> str:
    has_pl = constants.pl_constant > 0
    has_nc = constants.kernel_distance is not None
    if has_pl and not has_nc:
        return "pl"
    if has_nc and not has_pl:
        return "nonconvex"
    if not (has_pl or has_nc):
        raise ParameterError("need pl_constant > 0 or kernel_distance to choose a regime")
    # both available: the regime whose bound (27) reaches the lower minimum over T0 in 0..T
    pl = float(np.min(stylized_bound(constants, None, "pl").total))
    nc = float(np.min(stylized_bound(constants, None, "nonconvex").total))
    return "pl" if pl <= nc else "nonconvex"


def recommend_warmup(constants, regime: str = "auto", **schedule):
    """The warm-up length T0: for a problem, the exact optimum; for constants, eqs. (27)-(29).

    Parameters
    ----------
    constants : Problem or WarmupConstants
        A problem instance: the answer is :func:`linattn_theory.advice.advise_warmup` (pass
        ``lr``, ``local_steps``, ``total_rounds`` and optionally ``start``, ``phi_star``,
        ``probe``, ``probe_seed`` as keywords): the argmin of the exact population dynamics
        over every T0 in 0..T, with the path-local bound (eqs. 31-35) and the probe estimate
        (eq. 36) beside it; ``linattn warmup --problem`` calls the same function.
        Constants alone (no problem): the stylized bound (27) and its closed-form T0*.
    regime : {"auto", "pl", "nonconvex"}
        For constants only: ``auto`` takes the regime whose full bound (27) reaches the lower
        minimum over the integer T0 in [0, T].

    Returns
    -------
    WarmupAdvice for a problem, Recommendation for constants.
    """
    if not isinstance(constants, WarmupConstants):
        if not isinstance(constants, Problem):
            raise ParameterError(
                f"constants is a {type(constants).__name__}; give WarmupConstants or a Problem"
            )
        missing = [k for k in ("lr", "local_steps", "total_rounds") if k not in schedule]
        if missing:
            raise ParameterError(f"recommend_warmup(problem, ...) needs keywords {missing}")
        return advise_warmup(constants, **schedule)
    if schedule:
        raise ParameterError(f"unexpected keywords {sorted(schedule)} with WarmupConstants")
    if regime not in REGIMES:
        raise ParameterError(f"regime={regime!r}; allowed: {REGIMES}")
    chosen = _choose_regime(constants) if regime == "auto" else regime
    closed = optimal_warmup_pl(constants) if chosen == "pl" else optimal_warmup_nonconvex(constants)
    curves = stylized_bound(constants, None, chosen)
    return Recommendation(
        warmup_rounds=int(round(closed)),
        closed_form=closed,
        numeric_argmin=int(np.argmin(curves.total)),
        regime=chosen,
        constants=constants,
        rounds=curves.rounds,
        bias=curves.bias,
        drift=curves.drift,
        frozen=curves.frozen,
        transient=curves.transient,
        total=curves.total,
    )
