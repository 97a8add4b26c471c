"""Exact population dynamics of two-stage FedAvg (docs/theory.md, eqs. 19-21).

Warm-up (rounds 0..T0-1): every client starts from the global (M_t, V_t), runs K full-batch GD
steps of size eta_t on its local objective f_m (exact population gradients, eqs. 7-9), and the
server averages with weights p_m (eq. 19). Frozen stage (rounds T0..T-1): M stays M_T0 and V
follows the affine FedAvg map of eq. (14). The drift-free reference M_bar_t runs the same
recursion on the pooled objective F (one client, so local steps are centralized GD; eq. 20).

The step size may change from round to round: with a schedule
(:class:`linattn_theory.schedules.LRSchedule`), round t (1-based) takes
eta_t = eta * multiplier(t) for all K local steps of every client and of the reference, in both
stages; without one every round takes eta.

For a whole set of warm-up lengths the warm-up prefix is computed once: the run with warm-up
T0 shares rounds 0..T0 with every longer one, and only its frozen stage is its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.errors import ParameterError, require
from linattn_theory.frozen import check_steps, frozen_stages, local_value_maps
from linattn_theory.objectives import gradient_kernel, pooled_terms, value_quadratic
from linattn_theory.problem import Problem
from linattn_theory.schedules import step_size_sequence

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


def round_maps(problem: Problem, state: tuple, ref: tuple, lr: float, local_steps: int):
    """Rounds of FedAvg (eq. 19) and of the drift-free reference (eq. 20), batched together.

    ``state`` and ``ref`` hold parameters ((M, V) merged, (W_Q, W_K, V) factored) with a
    leading batch axis (B_f and B_r independent starting points, which may differ). Every
    point gets C local copies, and all (B_f + B_r) C copies take their K local steps as one
    batch: FedAvg's copies step on their own f_m; a reference point's copies are identical,
    so averaging their gradients with p_m gives grad F and the reference takes centralized
    GD steps. Returns (FedAvg's new points, the reference's new points), same shapes.
    """
    c, p = problem.num_clients, problem.weights
    fed = state[0].shape[0]
    local = []
    for x, y in zip(state, ref):
        both = np.empty((fed + y.shape[0], c, *x.shape[1:]))
        both[:fed] = x[:, None]
        both[fed:] = y[:, None]
        local.append(both)
    _local_steps(problem, local, fed, lr, local_steps)
    new_state = tuple((p @ x[:fed].reshape(fed, c, -1)).reshape(fed, *x.shape[2:])
                      for x in local)
    return new_state, tuple(x[fed:, 0].copy() for x in local)


def _local_steps(problem: Problem, local: list, fed: int, lr: float, local_steps: int) -> None:
    """K local GD steps, in place, on ``local`` = [M, V] or [W_Q, W_K, V], each (B, C, ...).

    Rows ``[:fed]`` are FedAvg's client copies (each steps on its own f_m); rows ``[fed:]`` are
    reference points (their gradients are averaged with p_m, i.e. grad F). The ridges of f_m
    enter as the factor (1 - eta lambda) on the parameter: x - eta (g + lambda x).
    """
    c, p, n = problem.num_clients, problem.weights, problem.context_length
    covariances, products = problem.covariances, problem.teacher_products
    refs = local[0].shape[0] - fed
    merged = len(local) == 2
    if merged:
        shrink = (1 - lr * problem.kernel_ridge, 1 - lr * problem.ridge)
    else:
        shrink = (1.0, 1.0, 1 - lr * problem.ridge)
    shapes = [(refs, c, -1) for _ in local]
    for _ in range(local_steps):
        if merged:
            # eta grad L_m (the kernel returns it scaled)
            grads = gradient_kernel(covariances, products, n, local[0], local[1], lr)[:2]
        else:
            query, key, value = local
            kernel = query @ key.mT
            grad_m, grad_v, _ = gradient_kernel(covariances, products, n, kernel, value, lr)
            grad_m += (lr * problem.kernel_ridge) * kernel
            grads = (grad_m @ key, grad_m.mT @ query, grad_v)
        for x, g, shape, a in zip(local, grads, shapes, shrink):
            if refs:
                g[fed:] = (p @ g[fed:].reshape(shape))[:, None].reshape(g[fed:, :1].shape)
            if a != 1.0:
                x *= a
            x -= g


def one_round(problem: Problem, kernel: np.ndarray, value: np.ndarray, lr: float,
              local_steps: int):
    """One FedAvg round (eq. 19) and one reference round (eq. 20) from the same (M, V).

    Returns ``((M_fedavg, V_fedavg), (M_reference, V_reference))``; their kernel difference
    divided by eta K is the measured local-drift error e_t of eq. (22). Stacked inputs
    (B, d, d) and (B, d, d_y) give stacked outputs (B independent rounds).
    """
    m = np.array(kernel, dtype=np.float64)
    v = np.array(value, dtype=np.float64)
    single = m.ndim == 2
    state = (m[None], v[None]) if single else (m, v)
    fedavg, reference = round_maps(problem, state, state, lr, local_steps)
    if single:
        return tuple(x[0] for x in fedavg), tuple(x[0] for x in reference)
    return fedavg, reference


def warmup_paths(problem: Problem, start: InitialPoint, lr: float, local_steps: int, rounds: int):
    """Global FedAvg and reference paths for ``rounds`` warm-up rounds.

    Returns
    -------
    kernels, values : ndarray, shapes (rounds+1, d, d), (rounds+1, d, d_y)
        FedAvg's global (M_t, V_t).
    reference_kernels : ndarray, shape (rounds+1, d, d)
        M_bar_t.
    """
    return warmup_paths_full(problem, start, lr, local_steps, rounds)[:3]


def warmup_paths_full(problem: Problem, start: InitialPoint, lr: float, local_steps: int,
                      rounds: int, step_sizes: np.ndarray | None = None):
    """:func:`warmup_paths` plus the reference's values and its pooled H, C, c (eq. 10).

    ``step_sizes`` (shape (>= rounds,), from
    :func:`linattn_theory.schedules.step_size_sequence`) gives round t + 1 the
    step size ``step_sizes[t]``; ``None`` takes ``lr`` in every round.
    """
    check_steps(lr, local_steps)
    if step_sizes is not None:
        step_sizes = np.asarray(step_sizes, dtype=np.float64)
        require(step_sizes.ndim == 1 and step_sizes.size >= rounds
                and bool(np.all(np.isfinite(step_sizes) & (step_sizes >= 0))), "step_sizes",
                step_sizes, f"a sequence of at least {rounds} finite step sizes >= 0")
    if start.parametrization == "merged":
        params = (start.kernel, start.value)
    else:
        params = (start.query, start.key, start.value)
    c, p = problem.num_clients, problem.weights
    # the global parameters of FedAvg (row 0) and of the reference (row 1) in every round,
    # and the C local copies of each that one round of local steps updates in place
    path = [np.empty((rounds + 1, 2, *x.shape)) for x in params]
    local = [np.empty((2, c, *x.shape)) for x in params]
    for x, y in zip(path, params):
        x[0] = y
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(rounds):
            for x, y in zip(path, local):
                y[:] = x[t][:, None]
            eta = lr if step_sizes is None else float(step_sizes[t])
            _local_steps(problem, local, 1, eta, local_steps)
            for x, y in zip(path, local):
                x[t + 1, 0] = (p @ y[0].reshape(c, -1)).reshape(x.shape[2:])
                x[t + 1, 1] = y[1, 0]
            if not np.isfinite(path[0][t + 1]).all():
                raise ParameterError(
                    f"lr={eta:g} with local_steps={local_steps} diverged in warm-up round "
                    f"{t + 1}; lr must be below the stability limit 2/L (see estimate_constants)"
                )
    if len(path) == 2:
        kernels, ref_kernels = path[0][:, 0], path[0][:, 1]
    else:
        kernels = path[0][:, 0] @ path[1][:, 0].mT
        ref_kernels = path[0][:, 1] @ path[1][:, 1].mT
    kernels, ref_kernels = kernels.copy(), ref_kernels.copy()
    values, ref_values = path[-1][:, 0].copy(), path[-1][:, 1].copy()
    # centralized GD below its stability limit decreases F every step; an increase of the
    # reference's F means eta is past the limit on this path (oscillation or chaos)
    ref_terms = pooled_terms(problem, ref_kernels)
    hessian, linear, constant = ref_terms
    ref_losses = (0.5 * np.sum(ref_values * (hessian @ ref_values), axis=(1, 2))
                  - np.sum(ref_values * linear, axis=(1, 2)) + constant)
    rises = np.flatnonzero(np.diff(ref_losses) > 1e-9 * np.maximum(1.0, np.abs(ref_losses[:-1])))
    if rises.size:
        t = int(rises[0])
        eta = lr if step_sizes is None else float(step_sizes[t])
        raise ParameterError(
            f"lr={eta:g} with local_steps={local_steps} is unstable: the drift-free "
            f"reference's F rose from {ref_losses[t]:.6g} to {ref_losses[t + 1]:.6g} in warm-up "
            f"round {t + 1}; lr must be below the stability limit 2/L along the path"
        )
    return kernels, values, ref_kernels, ref_values, ref_terms


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
    step_sizes : ndarray, shape (T,)
        eta_t of rounds 1..T (all eta without a schedule).

    With a schedule, ``frozen_floor`` and ``contraction`` are those of the frozen map at the
    last round's step size (the last positive one where a schedule ends at 0).
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
    step_sizes: np.ndarray | None = None

    @property
    def best_warmup(self) -> int:
        """The T0 with the lowest final error R(T0) among those computed."""
        return int(self.warmup_rounds[int(np.argmin(self.final_error))])


def _excess(hessian, optimum, value):
    gap = value - optimum
    return 0.5 * np.sum(gap * (hessian @ gap), axis=(-2, -1))


def _value_maps(problem: Problem, hessians, linear, lr: float, local_steps: int):
    """Abar and b of eq. (14) for client Hessians/linear terms (N, C, ...) at step ``lr``
    (eta = 0: the identity map)."""
    n, c, d = hessians.shape[0], problem.num_clients, problem.dim
    if lr == 0:
        return np.broadcast_to(np.eye(d), (n, d, d)), np.zeros((n, d, problem.out_dim))
    a, b = local_value_maps(hessians, lr, local_steps, problem.ridge)
    p = problem.weights
    transition = (p @ a.reshape(n, c, d * d)).reshape(n, d, d)
    offset = (p @ (b @ linear).reshape(n, c, -1)).reshape(n, d, -1)
    return transition, offset


def population_dynamics(problem: Problem, start: InitialPoint, lr: float, local_steps: int,
                        total_rounds: int, warmup_rounds, phi_star: float,
                        lr_schedule=None) -> DynamicsResult:
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
    lr_schedule : LRSchedule, mapping, str or None
        Round t takes eta_t = ``lr`` * multiplier(t)
        (:func:`linattn_theory.schedules.step_size_sequence`); ``None`` (the default) or
        ``constant`` give the constant-eta dynamics, number for number.
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
    etas = step_size_sequence(lr, total_rounds, lr_schedule)
    kernels, values, ref_kernels, _, (ref_hess, ref_lin, ref_const) = warmup_paths_full(
        problem, start, lr, local_steps, horizon, etas)

    # per-round kernel quantities along the shared warm-up prefix (eq. 10)
    ref_phi = ref_const - 0.5 * np.sum(ref_lin * np.linalg.solve(ref_hess, ref_lin), axis=(1, 2))
    dev_path = np.linalg.norm((kernels - ref_kernels).reshape(horizon + 1, -1), axis=1)

    # F(M_t, V_t) - Phi* = Phi(M_t) - Phi* + 1/2 ||V_t - V*(M_t)||_H^2 along the warm-up
    hess_all, pooled_lin, constant = pooled_terms(problem, kernels)
    opt_all = np.linalg.solve(hess_all, pooled_lin)
    phi_path = constant - 0.5 * np.sum(pooled_lin * opt_all, axis=(1, 2))
    warm_err = phi_path - phi_star + _excess(hess_all, opt_all, values)

    # frozen stage for every T0 at once: stack the maps of eq. (14) for kernels M_T0
    hess, optimum = hess_all[t0s], opt_all[t0s]
    if etas is None:
        last_eta = lr
    else:
        positive = etas[etas > 0]
        last_eta = float(positive[-1]) if positive.size else lr
    stage = frozen_stages(problem, kernels[t0s], last_eta, local_steps, hess, optimum)
    floor, contraction = stage.floor, stage.contraction
    if etas is None:
        def maps_at(t):
            return stage.transition, stage.offset
    else:  # one map per distinct step size, for every T0's kernel (eq. 14 at eta_t)
        client_h, client_lin, _ = value_quadratic(problem, kernels[t0s][:, None])
        maps: dict[float, tuple] = {}

        def maps_at(t):
            eta = float(etas[t])
            if eta not in maps:
                maps[eta] = _value_maps(problem, client_h, client_lin, eta, local_steps)
            return maps[eta]

    n_runs, horizon_t = t0s.size, int(total_rounds)
    curves = np.full((n_runs, horizon_t + 1), np.nan)
    for i, t0 in enumerate(t0s):
        curves[i, : t0 + 1] = warm_err[: t0 + 1]
    v = values[t0s].copy()
    kernel_err = phi_path[t0s] - phi_star
    for t in range(int(t0s.min()), horizon_t):
        active = t0s <= t
        transition, offset = maps_at(t)
        if active.all():
            v = transition @ v + offset
            curves[:, t + 1] = kernel_err + _excess(hess, optimum, v)
        else:
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
        step_sizes=np.full(horizon_t, float(lr)) if etas is None else etas.copy(),
    )
