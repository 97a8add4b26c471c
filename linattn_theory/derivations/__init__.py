"""Symbolic re-derivations of the closed forms in docs/theory.md (sympy + numpy only).

Each module re-derives one block of equations from first principles at a small dimension and
exposes residuals (sympy expressions that must simplify to zero) and lambdified numeric versions
that the tests compare with the numeric code in ``linattn_theory``.

Modules
-------
moments
    Gaussian moments from the moment generating function; Isserlis; eq. (4) and the operator G.
loss
    The closed-form population loss (6) and its gradients (7), (8), (9), the scaling identity (8b).
profile
    The value minimiser V*(M) = H^{-1} C, the profile (10), the envelope theorem (11), the
    scale degeneracy (12) and the stationary point M = 0.
frozen
    The frozen-stage affine map (13)-(15), the drift floor (17) and its zero cases, the noise
    unrolling (18).
tradeoff
    The stylized bounds (24)-(27), the optimal warm-up lengths (28), (29) with their stationarity
    and second-order conditions, and the monotonicity signs (30).
"""
