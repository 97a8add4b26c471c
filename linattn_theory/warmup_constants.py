"""The constants of the stylized bias-drift bound (docs/theory.md, eq. 23).

A leaf of the analytic module: :mod:`linattn_theory.constants` measures these constants on a
problem and :mod:`linattn_theory.warmup` turns them into the bound and T0*.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.errors import require


@dataclass(frozen=True)
class WarmupConstants:
    """Constants of the stylized bound (eq. 23).

    Attributes
    ----------
    delta0 : float
        Delta_0 = Phi(M_0) - Phi* (> 0).
    pl_constant : float
        mu, the local PL constant of Phi (>= 0; 0 disables the PL regime).
    smoothness : float
        L (> 0).
    heterogeneity : float
        zeta = sqrt(sum_m p_m ||grad f_m - grad F||^2) along the path (>= 0).
    grad_bound : float
        G, a bound on ||grad Phi|| along the path (>= 0).
    lr : float
        eta, in (0, 2/L).
    local_steps : int
        K >= 1.
    total_rounds : int
        T >= 1.
    kernel_distance : float or None
        D_0 = ||M_0 - M_*||_F; needed by the non-convex regime (A = D_0^2 / 2).
    frozen_floor : float
        D_frozen (>= 0), added as a constant.
    frozen_contraction : float
        rho in [0, 1), the frozen-stage contraction for the transient.
    value_error0 : float
        E_0^inf (>= 0) = 1/2 ||V_T0 - V_inf||_H^2, the distance of the value block from the
        frozen-stage fixed point when the kernel is frozen (eq. 27a).
    hessian_condition : float
        cond(H) >= 1, which bounds kappa_s = ||H^{1/2} Abar^s H^{-1/2}|| <= sqrt(cond H) rho^s.
    measured_drift_error : float or None
        e measured directly (for a problem instance: the kernel gap between one FedAvg round
        and one reference round from the same point, divided by eta K; eq. 22). When given
        it replaces the heuristic (K - 1) eta L zeta / 2, which is an upper estimate.
    profile_smoothness : float or None
        L_Phi, the smoothness of Phi alone, used in the quadratic drift term when given
        (otherwise L).
    stability_limit : float or None
        The largest stable step size. Defaults to 2 / L. ``math.inf`` when stability was
        verified on the path itself (measured constants: the exact warm-up path stayed finite
        and every frozen-stage map is a contraction), because L is a worst case over the
        path that the iterates need not meet.
    """

    delta0: float
    pl_constant: float
    smoothness: float
    heterogeneity: float
    grad_bound: float
    lr: float
    local_steps: int
    total_rounds: int
    kernel_distance: float | None = None
    frozen_floor: float = 0.0
    frozen_contraction: float = 0.0
    value_error0: float = 0.0
    hessian_condition: float = 1.0
    measured_drift_error: float | None = None
    profile_smoothness: float | None = None
    stability_limit: float | None = None

    def __post_init__(self) -> None:
        def finite(x):
            return x is not None and np.isfinite(x)

        require(finite(self.delta0) and self.delta0 > 0, "delta0", self.delta0,
                "> 0 (Phi(M_0) - Phi*)")
        require(finite(self.pl_constant) and self.pl_constant >= 0, "pl_constant",
                self.pl_constant, ">= 0")
        require(finite(self.smoothness) and self.smoothness > 0, "smoothness", self.smoothness,
                "> 0")
        require(finite(self.heterogeneity) and self.heterogeneity >= 0, "heterogeneity",
                self.heterogeneity, ">= 0 (0 is the i.i.d. case)")
        require(finite(self.grad_bound) and self.grad_bound >= 0, "grad_bound",
                self.grad_bound, ">= 0")
        require(isinstance(self.local_steps, int | np.integer) and self.local_steps >= 1,
                "local_steps", self.local_steps, "an integer K >= 1")
        require(isinstance(self.total_rounds, int | np.integer) and self.total_rounds >= 1,
                "total_rounds", self.total_rounds, "an integer T >= 1")
        limit = 2.0 / self.smoothness if self.stability_limit is None else self.stability_limit
        require(limit > 0, "stability_limit", limit, "> 0")
        require(finite(self.lr) and 0 < self.lr < limit, "lr", self.lr,
                f"in (0, {limit:.4g}) (2 / largest curvature); above it local GD is unstable")
        if self.kernel_distance is not None:
            require(finite(self.kernel_distance) and self.kernel_distance >= 0,
                    "kernel_distance", self.kernel_distance, ">= 0")
        require(finite(self.frozen_floor) and self.frozen_floor >= 0, "frozen_floor",
                self.frozen_floor, ">= 0")
        require(finite(self.frozen_contraction) and 0 <= self.frozen_contraction < 1,
                "frozen_contraction", self.frozen_contraction, "in [0, 1)")
        require(finite(self.value_error0) and self.value_error0 >= 0, "value_error0",
                self.value_error0, ">= 0")
        require(finite(self.hessian_condition) and self.hessian_condition >= 1,
                "hessian_condition", self.hessian_condition, ">= 1")
        if self.profile_smoothness is not None:
            require(finite(self.profile_smoothness) and self.profile_smoothness >= 0,
                    "profile_smoothness", self.profile_smoothness, ">= 0")
        if self.measured_drift_error is not None:
            require(finite(self.measured_drift_error) and self.measured_drift_error >= 0,
                    "measured_drift_error", self.measured_drift_error, ">= 0")

    @property
    def time_step(self) -> float:
        """eta K, the time one round advances."""
        return self.lr * self.local_steps

    @property
    def drift_error(self) -> float:
        """e, the local-drift error per unit time (eq. 22).

        The measured value when one is given, else the heuristic (K - 1) eta L zeta / 2.
        """
        if self.measured_drift_error is not None:
            return self.measured_drift_error
        return (self.local_steps - 1) * self.lr * self.smoothness * self.heterogeneity / 2.0

    @property
    def drift_slope(self) -> float:
        """S = G e, the linear drift slope per unit time (eq. 26)."""
        return self.grad_bound * self.drift_error

    @property
    def sublinear_constant(self) -> float | None:
        """A = D_0^2 / 2 of eq. (25), or None without D_0."""
        return None if self.kernel_distance is None else 0.5 * self.kernel_distance**2
