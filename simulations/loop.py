"""The plain-loop oracle: one run and one client at a time (numpy).

:func:`run_single` simulates one (setting, seed, T0) from scratch with Python loops over rounds,
clients and local steps (numpy over the minibatch; no prefix sharing between T0 values). It
shares nothing
with the vectorized engine except the data sets and the random streams, so the two agreeing
tests the engine's batching, prefix sharing and aggregation. It is also the baseline of the
benchmark (``simulations/bench.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulations.data import (
    ROLE_DATA,
    ROLE_PARTICIPATION,
    ROLE_SAMPLING,
    role_rng,
    sample_client_data,
)
from simulations.engine import Setting


@dataclass(frozen=True)
class LoopRun:
    """One run of the oracle.

    Attributes
    ----------
    kernels, values, reference_kernels : ndarray
        Global (M_t, V_t) and M_bar_t for t = 0..T0, shapes (T0+1, d, d) etc.
    frozen_values : ndarray, shape (T+1-T0, d, d_y)
        V_t for t = T0..T.
    """

    kernels: np.ndarray
    values: np.ndarray
    reference_kernels: np.ndarray
    frozen_values: np.ndarray


def _features(kernel, sigma_hat, query, tokens, attention):
    """u of every sequence of one minibatch, shape (B, d), and the attention weights."""
    if attention == "linear":
        return np.einsum("bij,bj->bi", sigma_hat, query @ kernel), None  # Sigma_hat M^T x_q
    scores = np.einsum("bjl,bl->bj", tokens, query @ kernel) / np.sqrt(kernel.shape[0])
    att = np.exp(scores - scores.max(axis=1, keepdims=True))
    att /= att.sum(axis=1, keepdims=True)
    return np.einsum("bj,bjl->bl", att, tokens), att


def _gradients(params, data, idx, attention, ridge, kernel_ridge, value_only=False):
    """Minibatch mean gradients of one client's local objective (one run, one client)."""
    kernel = params[0] if len(params) == 2 else params[0] @ params[1].T
    value = params[-1]
    xq = data.query[idx]
    toks = None if data.tokens is None else data.tokens[idx]
    sig = None if attention != "linear" else data.sigma_hat[idx]
    u, att = _features(kernel, sig, xq, toks, attention)
    r = u @ value - data.target[idx]  # (B, d_y)
    b = len(idx)
    gv = u.T @ r / b + ridge * value
    if value_only:
        return (gv,)
    g = r @ value.T  # rows (V r)^T
    if attention == "linear":
        gm = xq.T @ np.einsum("bij,bj->bi", sig, g) / b
    else:
        ds = att * (np.einsum("bjl,bl->bj", toks, g) - np.sum(u * g, axis=1, keepdims=True))
        gm = xq.T @ np.einsum("bj,bjl->bl", ds, toks) / (b * np.sqrt(kernel.shape[0]))
    gm = gm + kernel_ridge * kernel
    if len(params) == 2:
        return gm, gv
    return gm @ params[1], gm.T @ params[0], gv


def _client_slice(data, m):
    class View:
        sigma_hat = data.sigma_hat[m]
        query = data.query[m]
        target = data.target[m]
        tokens = None if data.tokens is None else data.tokens[m]
    return View


def run_single(setting: Setting, seed: int, warmup_rounds: int) -> LoopRun:
    """Simulate one run with warm-up ``warmup_rounds`` by plain loops (round t at eta_t of
    the setting's schedule)."""
    prob = setting.problem
    c, k_steps, bsz = prob.num_clients, setting.local_steps, setting.batch_size
    data = sample_client_data(prob, setting.samples_per_client, seed, ROLE_DATA,
                              keep_tokens=setting.attention == "softmax")
    clients = [_client_slice(data, m) for m in range(c)]
    sampling, joining = role_rng(seed, ROLE_SAMPLING), role_rng(seed, ROLE_PARTICIPATION)
    start = setting.start()
    merged = setting.parametrization == "merged"
    names = ("kernel", "value") if merged else ("query", "key", "value")
    glob = [getattr(start, n).copy() for n in names]
    ref = [x.copy() for x in glob]
    lam, lam_m, p = prob.ridge, prob.kernel_ridge, prob.weights

    def kernel(params):
        return params[0] if len(params) == 2 else params[0] @ params[1].T

    kernels, values, ref_kernels = [kernel(glob)], [glob[-1].copy()], [kernel(ref)]
    frozen_m, frozen = None, []
    etas = setting.step_sizes()  # eta_t of rounds 1..T
    for t in range(setting.total_rounds):
        eta = float(etas[t])
        draws = sampling.integers(0, setting.samples_per_client, size=(k_steps, c, bsz))
        chosen = joining.permutation(c)[: setting.participants]
        weights = np.zeros(c)
        weights[chosen] = p[chosen] / p[chosen].sum()
        if t == warmup_rounds:
            frozen_m, frozen = kernel(glob), [glob[-1].copy()]
        if t < warmup_rounds:
            new = [np.zeros_like(x) for x in glob]
            for m in range(c):
                local = [x.copy() for x in glob]
                for k in range(k_steps):
                    grads = _gradients(local, clients[m], draws[k, m], setting.attention, lam,
                                       lam_m)
                    local = [x - eta * g for x, g in zip(local, grads)]
                for acc, x in zip(new, local):
                    acc += weights[m] * x
            for k in range(k_steps):  # reference: centralized SGD on the pooled minibatch
                pooled = [np.zeros_like(x) for x in ref]
                for m in range(c):
                    grads = _gradients(ref, clients[m], draws[k, m], setting.attention, lam,
                                       lam_m)
                    for acc, g in zip(pooled, grads):
                        acc += p[m] * g
                ref = [x - eta * g for x, g in zip(ref, pooled)]
            glob = new
            kernels.append(kernel(glob))
            values.append(glob[-1].copy())
            ref_kernels.append(kernel(ref))
        else:
            value = np.zeros_like(frozen[-1])
            for m in range(c):
                local = [frozen_m, frozen[-1].copy()]
                for k in range(k_steps):
                    (gv,) = _gradients(local, clients[m], draws[k, m], setting.attention, lam,
                                       lam_m, value_only=True)
                    local[1] = local[1] - eta * gv
                value += weights[m] * local[1]
            frozen.append(value)
    if frozen_m is None:
        frozen = [glob[-1].copy()]
    return LoopRun(kernels=np.array(kernels), values=np.array(values),
                   reference_kernels=np.array(ref_kernels), frozen_values=np.array(frozen))
