"""The vectorized finite-sample simulator of two-stage FedAvg (FedFrozen).

One :class:`Setting` is a problem plus a schedule. :func:`simulate` runs many settings and
seeds at once: settings with the same shapes (d, C, n, N, B, K, T, T0 grid, parametrization,
attention, participation) form one group whose runs (setting x seed) share every tensor op.

A round of the warm-up, for every run r at once (tensors carry axes (run, copy, client)):

1. Draw the minibatch indices (K, C, B) from the sampling stream of the run's seed, and the
   participating clients from its participation stream.
2. Copy the global model to every client (copy 0) and the drift-free reference to a second
   copy (copy 1) of every client.
3. K local SGD steps: copy 0 steps on its own client's minibatch; copy 1 steps on the pooled
   minibatch, i.e. with sum_m p_m of the clients' minibatch gradients (centralized SGD on the
   pooled data, same samples, full participation).
4. FedAvg: the new global is sum_m p_m x_m over the participating clients (weights renormalised).

The T0 sweep shares its warm-up prefix: the frozen run with warm-up T0 starts from the global
model of round T0 and, from then on, trains V only (M fixed) on the same minibatch draws as
every other run of its seed. A run with warm-up T0 is therefore identical, number for number,
to a standalone run with that T0 (tests/simulations hold this against :mod:`simulations.loop`).

A setting's ``lr_schedule`` (:class:`linattn_theory.schedules.LRSchedule`) makes round t
(1-based) take eta_t = lr * multiplier(t) for every local step, in both stages and for the
reference; runs of one group may have different schedules.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from linattn_theory.dynamics import initial_point
from linattn_theory.problem import Problem
from linattn_theory.schedules import step_size_sequence
from simulations.data import ROLE_PARTICIPATION, ROLE_SAMPLING, role_rng
from simulations.divergence import describe, diverged_runs
from simulations.group import RunGroup, float64_tensor
from simulations.model import (
    features,
    kernel_of,
    linear_gradients_stacked,
    parameter_gradients,
    sequence_loss,
)


@dataclass(frozen=True, eq=False)
class Setting:
    """One simulated configuration: a problem and a two-stage FedAvg schedule.

    Attributes
    ----------
    problem : Problem
    lr : float
        eta, the local SGD step (both stages).
    local_steps : int
        K.
    batch_size : int
        B, sequences per local step (drawn with replacement from the client's N).
    total_rounds : int
        T.
    warmup_rounds : tuple of int
        The T0 values (sorted, each in [0, T]).
    samples_per_client : int
        N, the size of each client's training set.
    test_samples : int
        Size of each client's fresh test set.
    parametrization : str
        ``merged`` (M, V) or ``factored`` (W_Q, W_K, V).
    rank : int or None
        r of the factored parametrization (None: d).
    attention : str
        ``linear`` (the theory's model) or ``softmax`` (student only; teacher stays linear).
    participation : float
        Fraction of clients per round, in (0, 1]; ceil(fraction * C) clients are drawn.
    init_scale, init_seed : float, int
        The start (M_0, V_0) = ``linattn_theory.dynamics.initial_point(problem, init_scale,
        parametrization, rank, init_seed)``, shared by all Monte Carlo seeds.
    label : str
        A name for reports.
    lr_schedule : LRSchedule, mapping, str or None
        Round t takes eta_t = lr * multiplier(t) (``None``: eta in every round); kinds fixed in
        advance only (``linattn_theory.schedules.step_size_sequence``).
    """

    problem: Problem
    lr: float
    local_steps: int
    batch_size: int
    total_rounds: int
    warmup_rounds: tuple
    samples_per_client: int = 2048
    test_samples: int = 256
    parametrization: str = "merged"
    rank: int | None = None
    attention: str = "linear"
    participation: float = 1.0
    init_scale: float = 0.3
    init_seed: int = 1
    label: str = ""
    extra: dict = field(default_factory=dict)
    lr_schedule: object = None

    def step_sizes(self) -> np.ndarray:
        """eta_t of rounds 1..T, shape (T,)."""
        etas = step_size_sequence(self.lr, self.total_rounds, self.lr_schedule)
        return np.full(self.total_rounds, float(self.lr)) if etas is None else etas

    def start(self):
        return initial_point(self.problem, self.init_scale, self.parametrization, self.rank,
                             self.init_seed)

    def group_key(self) -> tuple:
        p = self.problem
        return (p.dim, p.out_dim, p.num_clients, p.context_length, self.samples_per_client,
                self.test_samples, self.batch_size, self.local_steps, self.total_rounds,
                tuple(self.warmup_rounds), self.parametrization, self.rank, self.attention,
                self.participation)

    @property
    def participants(self) -> int:
        return max(1, int(np.ceil(self.participation * self.problem.num_clients - 1e-9)))


@dataclass(frozen=True, eq=False)
class SimResult:
    """Raw trajectories of one setting over its seeds (S seeds, H = max T0, J T0 values).

    Attributes
    ----------
    setting : Setting
    seeds : ndarray, shape (S,)
    kernels, values : ndarray, shapes (S, H+1, d, d), (S, H+1, d, d_y)
        FedAvg's global (M_t, V_t) along the warm-up.
    reference_kernels : ndarray, shape (S, H+1, d, d)
        The drift-free reference M_bar_t.
    test_loss : ndarray, shape (S, H+1)
        sum_m p_m (mean loss on client m's fresh test set) of the global model.
    grad_first, grad_last : ndarray, shape (S, H)
        p-weighted mean over participating clients of the minibatch gradient norm (whole model)
        at the first and at the last local step of each warm-up round.
    frozen_values : ndarray, shape (S, J, T+1, d, d_y)
        V_t of the run with warm-up T0_j (NaN for t < T0_j); its kernel is kernels[:, T0_j].
    frozen_test_loss : ndarray, shape (S, J)
        Test loss of every run's final model.
    """

    setting: Setting
    seeds: np.ndarray
    kernels: np.ndarray
    values: np.ndarray
    reference_kernels: np.ndarray
    test_loss: np.ndarray
    grad_first: np.ndarray
    grad_last: np.ndarray
    frozen_values: np.ndarray
    frozen_test_loss: np.ndarray


def _expand(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """Per-run scalars (R,) -> (R, 1, ..., 1) with ``ndim`` axes in all."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _test_loss(group: RunGroup, test: dict, kernel: torch.Tensor, value: torch.Tensor):
    """sum_m p_m mean_i 1/2||yhat - y||^2 on the test sets; kernel (R, d, d) -> (R,)."""
    loss = sequence_loss(kernel[:, None], value[:, None], test, group.attention)  # (R, C)
    return torch.sum(loss * group.weights, dim=1)


def _draw_streams(settings: list[Setting], seeds: list[int]):
    """Minibatch indices (T, S, K, C, B) and participation masks (T, S, C) of every seed.

    Each seed's streams are drawn round by round, exactly as a standalone run draws them.
    """
    first = settings[0]
    c, t_total = first.problem.num_clients, first.total_rounds
    shape = (first.local_steps, c, first.batch_size)
    sampling = [role_rng(s, ROLE_SAMPLING) for s in seeds]
    joining = [role_rng(s, ROLE_PARTICIPATION) for s in seeds]
    index = np.empty((t_total, len(seeds), *shape), dtype=np.int64)
    chosen = np.zeros((t_total, len(seeds), c))
    for t in range(t_total):
        for i in range(len(seeds)):
            index[t, i] = sampling[i].integers(0, first.samples_per_client, size=shape)
            chosen[t, i, joining[i].permutation(c)[: first.participants]] = 1.0
    return torch.as_tensor(index), torch.as_tensor(chosen)


def _simulate_group(settings: list[Setting], seeds: list[int]) -> list[SimResult]:
    first = settings[0]
    group = RunGroup(settings, seeds)
    runs = len(group.run_setting)
    t_total = first.total_rounds
    t0s = np.asarray(first.warmup_rounds, dtype=np.int64)
    horizon = int(t0s.max())
    d, dy = first.problem.dim, first.problem.out_dim
    index, chosen = _draw_streams(settings, seeds)
    seed_of = torch.as_tensor(group.run_seed)
    if all(step_size_sequence(s.lr, t_total, s.lr_schedule) is None for s in settings):
        def lr_at(t):
            return group.lr
    else:
        etas = float64_tensor(np.stack([s.step_sizes() for s in settings], axis=1))  # (T, S)
        run_setting = torch.as_tensor(group.run_setting)

        def lr_at(t):
            return etas[t, run_setting]  # (R,) eta_{t+1} of every run

    def weights_at(t):
        mask = chosen[t][seed_of] * group.weights
        return mask / mask.sum(dim=1, keepdim=True)  # (R, C) FedAvg weights

    def batches_at(t):
        flat = group.flat_index(index[t][seed_of].permute(1, 0, 2, 3), group.n_train)
        both = group.gather(group.train, flat)  # (K, R, C, B, ...)
        return [{key: v[k] for key, v in both.items()} for k in range(flat.shape[0])]

    starts = [s.start() for s in settings]
    names = ("kernel", "value") if first.parametrization == "merged" else ("query", "key", "value")
    glob = tuple(float64_tensor(np.stack([getattr(starts[i], n) for i in group.run_setting]))
                 for n in names)  # each (R, ...)
    ref = tuple(x.clone() for x in glob)
    test = group.test_set()

    # 1. warm-up: FedAvg and the reference, rounds 0..H-1
    kernels = torch.empty(runs, horizon + 1, d, d, dtype=torch.float64)
    values = torch.empty(runs, horizon + 1, d, dy, dtype=torch.float64)
    ref_kernels = torch.empty_like(kernels)
    test_loss = torch.empty(runs, horizon + 1, dtype=torch.float64)
    grad_first = torch.zeros(runs, horizon, dtype=torch.float64)
    grad_last = torch.zeros_like(grad_first)
    for t in range(horizon + 1):
        kernels[:, t], values[:, t], ref_kernels[:, t] = kernel_of(glob), glob[-1], kernel_of(ref)
        test_loss[:, t] = _test_loss(group, test, kernel_of(glob), glob[-1])
        if t < horizon:
            glob, ref, norms = _warmup_round(group, glob, ref, batches_at(t), weights_at(t),
                                             lr_at(t))
            grad_first[:, t], grad_last[:, t] = norms

    # 2. frozen stage of every T0: V only, M = M_T0, on the same minibatch draws
    frozen_hist = torch.full((runs, t0s.size, t_total + 1, d, dy), float("nan"),
                             dtype=torch.float64)
    frozen_test = torch.empty(runs, t0s.size, dtype=torch.float64)
    for j, t0 in enumerate(t0s):
        kernel, value = kernels[:, t0], values[:, t0].clone()
        frozen_hist[:, j, t0] = value
        feats = _frozen_features(group, kernel)  # (rows * C * N, d) per run: (R, C, N, d)
        for t in range(int(t0), t_total):
            value = _frozen_round(group, feats, index[t][seed_of], value, weights_at(t),
                                  lr_at(t))
            frozen_hist[:, j, t + 1] = value
        frozen_test[:, j] = _test_loss(group, test, kernel, value)

    out = []
    for i, s in enumerate(settings):
        sel = torch.as_tensor(np.flatnonzero(group.run_setting == i))
        out.append(SimResult(
            setting=s, seeds=np.asarray(seeds), kernels=kernels[sel].numpy(),
            values=values[sel].numpy(), reference_kernels=ref_kernels[sel].numpy(),
            test_loss=test_loss[sel].numpy(), grad_first=grad_first[sel].numpy(),
            grad_last=grad_last[sel].numpy(), frozen_values=frozen_hist[sel].numpy(),
            frozen_test_loss=frozen_test[sel].numpy()))
    return out


def _warmup_round(group, glob, ref, batches, agg, lr):
    """One FedAvg round (copy 0) and one reference round (copy 1) for every run, at the
    runs' step sizes ``lr`` (R,).

    Returns the new global model, the new reference and the p-weighted mean gradient norms
    of the participating clients at the first and the last local step.
    """
    c = agg.shape[1]
    p = group.weights
    # (R, 2, C, ...): copy 0 = client m's local model, copy 1 = the reference
    local = [torch.stack([g.unsqueeze(1).expand(-1, c, *g.shape[1:]),
                          r.unsqueeze(1).expand(-1, c, *r.shape[1:])], dim=1).clone()
             for g, r in zip(glob, ref)]
    ridge, kridge = _expand(group.ridge, 5), _expand(group.kernel_ridge, 5)
    norms = [None, None]
    for k, batch in enumerate(batches):
        grads = _gradients(group, tuple(local), batch, ridge, kridge)
        sq = sum(torch.sum(g[:, 0] ** 2, dim=(-2, -1)) for g in grads)  # (R, C)
        norm = torch.sum(agg * torch.sqrt(sq), dim=1)
        if k == 0:
            norms[0] = norm
        norms[1] = norm
        for x, g in zip(local, grads):
            step = _expand(lr, g.dim() - 1)
            x[:, 0] -= step * g[:, 0]
            pooled = torch.einsum("rc...,rc->r...", g[:, 1], p)  # pooled minibatch gradient
            x[:, 1] -= step * pooled.unsqueeze(1)
    new_glob = tuple(torch.einsum("rc...,rc->r...", x[:, 0], agg) for x in local)
    new_ref = tuple(x[:, 1, 0].clone() for x in local)
    return new_glob, new_ref, norms


def _gradients(group, params, batch, ridge, kridge):
    """Gradients of the stacked copies (R, 2, C, ...) on the minibatch (R, C, B, ...)."""
    if group.attention != "linear":
        batch = {key: v.unsqueeze(1) for key, v in batch.items()}
        return parameter_gradients(params, batch, group.attention, ridge, kridge)
    kernel = kernel_of(params)
    grad_m, grad_v = linear_gradients_stacked(kernel, params[-1], batch["sigma_hat"],
                                              batch["query"], batch["target"], ridge, kridge)
    if len(params) == 2:
        return grad_m, grad_v
    query, key = params[0], params[1]
    return grad_m @ key, grad_m.transpose(-1, -2) @ query, grad_v


def _frozen_features(group, kernel, chunk: int = 8):
    """u_i of every training sequence of every run under its frozen kernel, (R, C, N, d).

    Computed ``chunk`` runs at a time to bound the memory of the gathered data.
    """
    runs = len(group.run_setting)
    out = []
    for lo in range(0, runs, chunk):
        rows = slice(lo, min(lo + chunk, runs))
        data = group.rows(group.train, group.data_row[rows])  # (size, C, N, ...)
        if group.attention == "linear":  # u = Sigma_hat M^T x_q, elementwise (no tiny matmuls)
            a = torch.matmul(data["query"], kernel[rows, None])  # rows (M^T x_q)^T
            u = torch.sum(data["sigma_hat"] * a.unsqueeze(-2), dim=-1)
        else:
            u = features(kernel[rows, None], data, group.attention)[0]
        out.append(torch.cat([u, data["target"]], dim=-1))  # packed [u, y], (size, C, N, d+d_y)
    return torch.cat(out)


def _frozen_round(group, feats, index, value, agg, lr):
    """One frozen-stage round (V only, M fixed) at step sizes ``lr`` (R,); value (R, d, d_y)
    -> new global value.

    feats (R, C, N, d + d_y) are the fixed features u_i packed with the labels y_i;
    index (R, K, C, B) the minibatches.
    """
    runs, c = agg.shape
    n, d = feats.shape[2], value.shape[-2]
    base = torch.arange(runs * c).reshape(runs, 1, c, 1) * n
    rows = feats.reshape(-1, feats.shape[-1]).index_select(0, (base + index).reshape(-1))
    rows = rows.reshape(*index.shape, -1)  # (R, K, C, B, d + d_y)
    local = value.unsqueeze(1).expand(-1, c, -1, -1).clone()  # (R, C, d, d_y)
    ridge, lr = _expand(group.ridge, 4), _expand(lr, 4)
    for k in range(index.shape[1]):
        u, y = rows[:, k, ..., :d], rows[:, k, ..., d:]  # (R, C, B, d), (R, C, B, d_y)
        res = torch.matmul(u, local) - y
        local -= lr * (torch.matmul(u.transpose(-1, -2), res) / u.shape[2] + ridge * local)
    return torch.einsum("rc...,rc->r...", local, agg)


def simulate(settings, seeds) -> list[SimResult]:
    """Simulate every setting for every seed; returns one :class:`SimResult` per setting.

    Settings are grouped by :meth:`Setting.group_key` and each group runs vectorized. A
    setting with diverged seeds raises a ``RuntimeWarning`` naming them and the round
    (:func:`simulations.divergence.diverged_runs` gives the records).
    """
    single = isinstance(settings, Setting)
    settings = [settings] if single else list(settings)
    seeds = [int(s) for s in np.atleast_1d(seeds)]
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(settings):
        groups.setdefault(s.group_key(), []).append(i)
    results: list[SimResult | None] = [None] * len(settings)
    for members in groups.values():
        for i, res in zip(members, _simulate_group([settings[i] for i in members], seeds)):
            results[i] = res
    for i, res in enumerate(results):
        records = diverged_runs(res)
        if records:
            name = res.setting.label or f"setting {i}"
            warnings.warn(f"{name} (lr={res.setting.lr:g}, K={res.setting.local_steps}) "
                          f"diverged: {describe(records)}", RuntimeWarning, stacklevel=2)
    return results[0] if single else results
