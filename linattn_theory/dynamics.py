"""Exact population dynamics of two-stage FedAvg (docs/theory.md, eqs. 19-21).

Warm-up (rounds 0..T0-1): every client starts from the global (M_t, V_t), runs K full-batch GD
steps of size eta on its local objective f_m (exact population gradients, eqs. 7-9), and the
server averages with weights p_m (eq. 19). Frozen stage (rounds T0..T-1): M stays M_T0 and V
follows the affine FedAvg map of eq. (14). The drift-free reference M_bar_t runs the same
recursion on the pooled objective F (one client, so local steps are centralized GD; eq. 20).

For a whole set of warm-up lengths the warm-up prefix is computed once: the run with warm-up
T0 shares rounds 0..T0 with every longer one, and only its frozen stage is its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.errors import ParameterError, require
from linattn_theory.frozen import _check_steps, local_value_maps
from linattn_theory.objectives import (
    factored_gradients,
    global_losses,
    local_gradients,
    value_quadratic,
)
from linattn_theory.problem import Problem
from linattn_theory.profile import profile_values

PARAMETRIZATIONS = ("merged", "factored")


@dataclass(frozen=True)
class InitialPoint:
    """Where training starts. ``query``/``key`` are set for the factored parametrization.

    Attributes
    ----------
    kernel : ndarray, shape (d, d)
        M_0 (= W_Q W_K^T when factored).
    value : ndarray, shape (d, d_y)
        V_0.
    query, key : ndarray, shape (d, r) or None
        W_Q and W_K.
    """

    kernel: np.ndarray
    value: np.ndarray
    query: np.ndarray | None = None
    key: np.ndarray | None = None

    @property
    def parametrization(self) -> str:
        return "merged" if self.query is None else "factored"


def initial_point(problem: Problem, scale: float = 0.3, parametrization: str = "merged",
                  rank: int | None = None, seed: int = 0) -> InitialPoint:
    """A random start: entries N(0, scale^2/d) (factored: W_Q, W_K with N(0, scale/d)), V_0 = 0.

    M = 0 is a stationary point of Phi (docs/theory.md, section 3), so ``scale`` must be > 0.
    """
    require(np.isfinite(scale) and scale > 0, "scale", scale, "> 0 (M = 0 is stationary)")
    if parametrization not in PARAMETRIZATIONS:
        raise ParameterError(f"parametrization={parametrization!r}; allowed: {PARAMETRIZATIONS}")
    d = problem.dim
    rng = np.random.default_rng(seed)
    value = np.zeros((d, problem.out_dim))
    if parametrization == "merged":
        return InitialPoint(kernel=scale * rng.standard_normal((d, d)) / np.sqrt(d), value=value)
    r = d if rank is None else int(rank)
    require(1 <= r, "rank", rank, "an integer >= 1")
    query = np.sqrt(scale) * rng.standard_normal((d, r)) / np.sqrt(d)
    key = np.sqrt(scale) * rng.standard_normal((d, r)) / np.sqrt(d)
    return InitialPoint(kernel=query @ key.T, value=value, query=query, key=key)


def _round(problem: Problem, doubled: Problem, state: tuple, ref: tuple, lr: float,
           local_steps: int):
    """One round of FedAvg (eq. 19) and of the drift-free reference (eq. 20), batched together.

    The C local copies of FedAvg and C copies of the reference state form one batch of 2C;
    the reference's copies are identical, so averaging their gradients with p_m gives grad F
    and the reference takes centralized GD steps.
    """
    c, p = problem.num_clients, problem.weights
    local = [np.concatenate([np.broadcast_to(x, (c, *x.shape)),
                             np.broadcast_to(y, (c, *y.shape))]) for x, y in zip(state, ref)]
    for _ in range(local_steps):
        grads = _gradients(doubled, local)
        for x, g in zip(local, grads):
            x[:c] -= lr * g[:c]
            x[c:] -= lr * np.tensordot(p, g[c:], axes=1)[None]
    return (tuple(np.tensordot(p, x[:c], axes=1) for x in local), tuple(x[c] for x in local))


def _gradients(doubled: Problem, local: list) -> tuple:
    if len(local) == 2:
        return local_gradients(doubled, local[0], local[1])
    return factored_gradients(doubled, local[0], local[1], local[2])


def _doubled(problem: Problem) -> Problem:
    """The problem with its clients listed twice (weights halved), for the batched round."""
    return Problem(
        dim=problem.dim,
        out_dim=problem.out_dim,
        context_length=problem.context_length,
        weights=np.concatenate([problem.weights, problem.weights]) / 2.0,
        covariances=np.concatenate([problem.covariances] * 2),
        kernel_teachers=np.concatenate([problem.kernel_teachers] * 2),
        value_teachers=np.concatenate([problem.value_teachers] * 2),
        ridge=problem.ridge,
        kernel_ridge=problem.kernel_ridge,
        noise=problem.noise,
        knobs=dict(problem.knobs),
    )


def one_round(problem: Problem, kernel: np.ndarray, value: np.ndarray, lr: float,
              local_steps: int):
    """One FedAvg round (eq. 19) and one reference round (eq. 20) from the same (M, V).

    Returns ``((M_fedavg, V_fedavg), (M_reference, V_reference))``; their kernel difference
    divided by eta K is the measured local-drift error e_t of eq. (22).
    """
    state = (np.array(kernel, dtype=np.float64), np.array(value, dtype=np.float64))
    return _round(problem, _doubled(problem), state, state, lr, local_steps)


def _kernel(state: tuple) -> np.ndarray:
    return state[0] if len(state) == 2 else state[0] @ state[1].T


def warmup_paths(problem: Problem, start: InitialPoint, lr: float, local_steps: int, rounds: int):
    """Global FedAvg and reference paths for ``rounds`` warm-up rounds.

    Returns
    -------
    kernels, values : ndarray, shapes (rounds+1, d, d), (rounds+1, d, d_y)
        FedAvg's global (M_t, V_t).
    reference_kernels : ndarray, shape (rounds+1, d, d)
        M_bar_t.
    """
    _check_steps(lr, local_steps)
    if start.parametrization == "merged":
        state = (start.kernel.copy(), start.value.copy())
    else:
        state = (start.query.copy(), start.key.copy(), start.value.copy())
    ref = tuple(x.copy() for x in state)
    doubled = _doubled(problem)
    kernels, values, ref_kernels = [_kernel(state)], [state[-1]], [_kernel(ref)]
    ref_values = [ref[-1]]
    for t in range(rounds):
        with np.errstate(over="ignore", invalid="ignore"):
            state, ref = _round(problem, doubled, state, ref, lr, local_steps)
        if not (np.all(np.isfinite(state[0])) and np.all(np.isfinite(ref[0]))):
            raise ParameterError(
                f"lr={lr:g} with local_steps={local_steps} diverged in warm-up round {t + 1}; "
                "lr must be below the stability limit 2/L (see estimate_constants)"
            )
        kernels.append(_kernel(state))
        values.append(state[-1])
        ref_kernels.append(_kernel(ref))
        ref_values.append(ref[-1])
    # centralized GD below its stability limit decreases F every step; an increase of the
    # reference's F means eta is past the limit on this path (oscillation or chaos)
    ref_losses = global_losses(problem, np.array(ref_kernels), np.array(ref_values))
    rises = np.flatnonzero(np.diff(ref_losses) > 1e-9 * np.maximum(1.0, np.abs(ref_losses[:-1])))
    if rises.size:
        t = int(rises[0])
        raise ParameterError(
            f"lr={lr:g} with local_steps={local_steps} is unstable: the drift-free "
            f"reference's F rose from {ref_losses[t]:.6g} to {ref_losses[t + 1]:.6g} in warm-up "
            f"round {t + 1}; lr must be below the stability limit 2/L along the path"
        )
    return np.array(kernels), np.array(values), np.array(ref_kernels)


@dataclass(frozen=True)
class DynamicsResult:
    """Population dynamics for a set of warm-up lengths (eqs. 19-21).

    Per-T0 arrays have shape (n_T0,); per-round paths have shape (T+1,) (the warm-up path is
    computed up to max T0; later entries repeat NaN).

    Attributes
    ----------
    warmup_rounds : ndarray of int
        The T0 values.
    total_rounds : int
        T.
    phi_star : float
        Phi*.
    kernel_error_path, reference_error_path : ndarray
        Phi(M_t) - Phi* along FedAvg and along the reference.
    kernel_deviation_path : ndarray
        ||M_t - M_bar_t||_F.
    bias, drift, kernel_deviation, frozen_floor, contraction, value_error, final_error : ndarray
        Per T0: Phi(M_bar_T0) - Phi*, Phi(M_T0) - Phi(M_bar_T0), ||M_T0 - M_bar_T0||_F,
        D_frozen(M_T0), rho(Abar(M_T0)), F(M_T0, V_T) - Phi(M_T0) and R(T0) = F(M_T0, V_T) - Phi*.
    error_curves : ndarray, shape (n_T0, T+1)
        F(M_t, V_t) - Phi* in every round of every run.
    kernels : ndarray, shape (max T0 + 1, d, d)
        FedAvg's global kernels.
    """

    warmup_rounds: np.ndarray
    total_rounds: int
    phi_star: float
    kernel_error_path: np.ndarray
    reference_error_path: np.ndarray
    kernel_deviation_path: np.ndarray
    bias: np.ndarray
    drift: np.ndarray
    kernel_deviation: np.ndarray
    frozen_floor: np.ndarray
    contraction: np.ndarray
    value_error: np.ndarray
    final_error: np.ndarray
    error_curves: np.ndarray
    kernels: np.ndarray

    @property
    def best_warmup(self) -> int:
        """The T0 with the lowest final error R(T0) among those computed."""
        return int(self.warmup_rounds[int(np.argmin(self.final_error))])


def _excess(hessian, optimum, value):
    gap = value - optimum
    return 0.5 * np.einsum("...ia,...ij,...ja->...", gap, hessian, gap)


def population_dynamics(problem: Problem, start: InitialPoint, lr: float, local_steps: int,
                        total_rounds: int, warmup_rounds, phi_star: float) -> DynamicsResult:
    """Run warm-up then frozen stage for every T0 in ``warmup_rounds`` (eqs. 19-21).

    Parameters
    ----------
    problem : Problem
    start : InitialPoint
        (M_0, V_0), merged or factored.
    lr, local_steps : float, int
        eta and K (shared by both stages).
    total_rounds : int
        T.
    warmup_rounds : sequence of int
        T0 values, each in [0, T].
    phi_star : float
        Phi* (from :func:`linattn_theory.profile.solve_profile`).
    """
    require(isinstance(total_rounds, int | np.integer) and total_rounds >= 1, "total_rounds",
            total_rounds, "an integer T >= 1")
    t0s = np.atleast_1d(np.asarray(warmup_rounds))
    require(t0s.size >= 1 and np.issubdtype(t0s.dtype, np.integer), "warmup_rounds",
            warmup_rounds, "a non-empty list of integers")
    t0s = t0s.astype(np.int64)
    require(bool(np.all((t0s >= 0) & (t0s <= total_rounds))), "warmup_rounds", t0s.tolist(),
            f"integers in [0, total_rounds={total_rounds}]")
    horizon = int(t0s.max())
    kernels, values, ref_kernels = warmup_paths(problem, start, lr, local_steps, horizon)

    # per-round kernel quantities along the shared warm-up prefix
    ref_phi = profile_values(problem, ref_kernels)
    dev_path = np.linalg.norm((kernels - ref_kernels).reshape(horizon + 1, -1), axis=1)

    # F(M_t, V_t) - Phi* = Phi(M_t) - Phi* + 1/2 ||V_t - V*(M_t)||_H^2 along the warm-up
    p = problem.weights
    h_all, lin_all, _ = value_quadratic(problem, kernels[:, None])
    hess_all = np.einsum("c,ncij->nij", p, h_all) + problem.ridge * np.eye(problem.dim)
    pooled_lin = np.einsum("c,ncia->nia", p, lin_all)
    opt_all = np.linalg.solve(hess_all, pooled_lin)
    # Phi(M_t) of eq. (10) from the same quadratic (profile_values would rebuild it)
    phi_path = (p @ problem.teacher_products.constants
                + 0.5 * problem.kernel_ridge * np.sum(np.square(kernels), axis=(1, 2))
                - 0.5 * np.sum(pooled_lin * opt_all, axis=(1, 2)))
    warm_err = phi_path - phi_star + _excess(hess_all, opt_all, values)

    # frozen stage for every T0 at once: stack the maps of eq. (14) for kernels M_T0
    h, lin = h_all[t0s], lin_all[t0s]  # (n, C, d, d), (n, C, d, d_y)
    a, b = local_value_maps(h, lr, local_steps, problem.ridge)
    transition = np.einsum("c,ncij->nij", p, a)
    offset = np.einsum("c,ncij,ncja->nia", p, b, lin)
    d = problem.dim
    hess = hess_all[t0s]
    optimum = opt_all[t0s]
    fixed = np.linalg.solve(np.eye(d)[None] - transition, offset)
    floor = np.maximum(_excess(hess, optimum, fixed), 0.0)
    contraction = np.max(np.abs(np.linalg.eigvals(transition)), axis=-1)

    n_runs, horizon_t = t0s.size, int(total_rounds)
    curves = np.full((n_runs, horizon_t + 1), np.nan)
    for i, t0 in enumerate(t0s):
        curves[i, : t0 + 1] = warm_err[: t0 + 1]
    v = values[t0s].copy()
    kernel_err = phi_path[t0s] - phi_star
    for t in range(int(t0s.min()), horizon_t):
        active = t0s <= t
        v[active] = transition[active] @ v[active] + offset[active]
        curves[active, t + 1] = kernel_err[active] + _excess(hess[active], optimum[active],
                                                             v[active])
    value_err = _excess(hess, optimum, v)

    def padded(x):
        out = np.full(horizon_t + 1, np.nan)
        out[: x.size] = x
        return out

    return DynamicsResult(
        warmup_rounds=t0s,
        total_rounds=horizon_t,
        phi_star=float(phi_star),
        kernel_error_path=padded(phi_path - phi_star),
        reference_error_path=padded(ref_phi - phi_star),
        kernel_deviation_path=padded(dev_path),
        bias=ref_phi[t0s] - phi_star,
        drift=phi_path[t0s] - ref_phi[t0s],
        kernel_deviation=dev_path[t0s],
        frozen_floor=floor,
        contraction=contraction,
        value_error=value_err,
        final_error=kernel_err + value_err,
        error_curves=curves,
        kernels=kernels,
    )
