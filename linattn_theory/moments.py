"""Gaussian moment identities (docs/theory.md, eq. 4-5).

For x_1..x_n i.i.d. N(0, Sigma) and Sigma_hat = (1/n) sum_j x_j x_j^T,

    E[Sigma_hat A Sigma_hat] = Sigma A Sigma + (1/n) (Sigma A^T Sigma + tr(A Sigma) Sigma).   (4)

The right-hand side, as a linear map of A, is the operator G (eq. 5); it satisfies
G(A)^T = G(A^T) and is self-adjoint under <X, Y> = tr(X^T Y).
"""

from __future__ import annotations

import numpy as np


def fourth_moment(matrix: np.ndarray, covariance: np.ndarray, context_length: int) -> np.ndarray:
    """E[Sigma_hat A Sigma_hat] by eq. (4); batched over leading axes.

    Parameters
    ----------
    matrix : ndarray, shape (..., d, d)
        A.
    covariance : ndarray, shape (..., d, d)
        Sigma (symmetric), broadcast against ``matrix``.
    context_length : int
        n, the number of tokens averaged in Sigma_hat.

    Returns
    -------
    ndarray, shape (..., d, d)
    """
    a = np.asarray(matrix, dtype=np.float64)
    s = np.asarray(covariance, dtype=np.float64)
    sas = s @ a @ s
    sats = s @ np.swapaxes(a, -1, -2) @ s
    trace = np.einsum("...ij,...ji->...", a, s)
    return sas + (sats + trace[..., None, None] * s) / context_length
