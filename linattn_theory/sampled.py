"""A finite-sample FedAvg run in numpy, with freeze-now probes (the probe estimator, eq. 36).

The simulator of ``simulations.engine`` runs many settings at once in torch; this one runs one
setting and one seed with no torch, so that ``linattn warmup`` can run the probe estimator on a
problem file. It follows the same model: client m holds N sequences drawn from its teacher
(eq. 1), a validation split (the last ``validation_fraction`` of them) is carved from that
training data, and a round is K minibatch SGD steps of size eta on f_m (the ridges of eq. 3)
from the global point, averaged with weights p_m (full participation).

A minibatch step on (M, V) uses, per sequence, a = M^T x_q, w = Sigma_hat V, yhat = a^T w,
r = yhat - y and

    grad_V = mean_b (Sigma_hat a) r^T + lambda V,    grad_M = mean_b x_q (w r^T)^T + lambda_M M,

the gradients of 1/2 ||x_q^T M Sigma_hat V - y||^2 (eq. 2). With M frozen, u = Sigma_hat M^T x_q
is fixed and a step is grad_V = mean_b u (u^T V - y)^T + lambda V.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.dynamics import InitialPoint
from linattn_theory.errors import ParameterError, require
from linattn_theory.freeze_rules import make_rule
from linattn_theory.probe import ProbeChoice, ProbeSelector, probe_length
from linattn_theory.problem import Problem

__all__ = ["SampledClients", "sample_clients", "ProbeRun", "probe_run", "RuleRun", "rule_run",
           "FrozenContinuations", "frozen_continuations"]


@dataclass(frozen=True)
class SampledClients:
    """Training and validation sequences per client: x_q (C, N, d), Sigma_hat (C, N, d, d),
    y (C, N, d_y); the validation arrays have N_val in place of N.

    All six are views of ``table`` (C, N + N_val, w): one row per sequence, training rows
    first, holding Sigma_hat (d^2 entries, row-major), x_q (d) and y (d_y), padded to whole
    64-byte lines; a minibatch step then gathers one contiguous row per sequence.
    """

    query: np.ndarray
    sigma_hat: np.ndarray
    target: np.ndarray
    val_query: np.ndarray
    val_sigma_hat: np.ndarray
    val_target: np.ndarray
    table: np.ndarray


# sample_clients draws a client's sequences in chunks of at most this many bytes of draws
_SAMPLE_BYTES = 1 << 19


def sample_clients(problem: Problem, samples_per_client: int, validation_fraction: float,
                   rng: np.random.Generator) -> SampledClients:
    """N sequences per client from its teacher (eq. 1); the last fraction is the validation
    split."""
    c, d, n, dy = problem.num_clients, problem.dim, problem.context_length, problem.out_dim
    n_val = max(1, int(round(validation_fraction * samples_per_client)))
    cut = samples_per_client - n_val
    require(cut >= 1, "validation_fraction", validation_fraction,
            "below 1 - 1/N, so that every client keeps training data")
    chol_t = np.swapaxes(np.linalg.cholesky(problem.covariances), 1, 2)
    width = -(-(d * d + d + dy) // 8) * 8
    table = np.zeros((c, samples_per_client, width))
    sigma_hat = table[..., :d * d].reshape(c, samples_per_client, d, d)
    query = table[..., d * d:d * d + d]
    target = table[..., d * d + d:d * d + d + dy]
    clean = np.empty(target.shape)
    # one client at a time, its sequences in chunks of h: the draws come in the order of one
    # (C, N, n+1, d) draw, every product is per sequence or per client, and a chunk's draws,
    # tokens and Gram matrices stay in cache until Sigma_hat = Gram / n lands in the table
    h = max(1, min(samples_per_client, _SAMPLE_BYTES // ((n + 1) * d * 8)))
    draws, tokens, gram = np.empty((h, n + 1, d)), np.empty((h, n + 1, d)), np.empty((h, d, d))
    # tokens x = L_m z (rows x^T = z^T L_m^T); a client whose Cholesky factor is I (Sigma_m = I:
    # no covariate shift) has x = z, the numbers of the product z^T I (its other terms are
    # exact zeros)
    identity = [bool(np.array_equal(f, np.eye(d))) for f in chol_t]
    for m in range(c):
        for lo in range(0, samples_per_client, h):
            k = min(h, samples_per_client - lo)
            rng.standard_normal(out=draws[:k])
            x = draws[:k] if identity[m] else np.matmul(draws[:k], chol_t[m], out=tokens[:k])
            context = x[:, 1:]
            np.matmul(np.swapaxes(context, 1, 2), context, out=gram[:k])
            np.divide(gram[:k], n, out=sigma_hat[m, lo:lo + k])
            query[m, lo:lo + k] = x[:, 0]
        a_star = query[m] @ problem.kernel_teachers[m]                      # (M*^T x_q)^T
        clean[m] = (sigma_hat[m] @ a_star[..., None])[..., 0] @ problem.value_teachers[m]
    target[...] = clean + problem.noise * rng.standard_normal(clean.shape)
    return SampledClients(query[:, :cut], sigma_hat[:, :cut], target[:, :cut],
                          query[:, cut:], sigma_hat[:, cut:], target[:, cut:], table)


def _features(kernel, query, sigma_hat):
    """u = Sigma_hat M^T x_q for a shared kernel: (C, N, d)."""
    return (sigma_hat @ (query @ kernel)[..., None])[..., 0]


def _validation_loss(problem, data, kernel, value) -> float:
    """The objective F of eq. (3) on the validation split: sum_m p_m mean_i 1/2
    ||u_i^T V - y_i||^2 + (lambda/2)||V||^2 + (lambda_M/2)||M||^2."""
    feats = _features(kernel, data.val_query, data.val_sigma_hat)
    return _val_loss_from(problem, data, feats, value) + _penalty(problem, kernel, value)


def _penalty(problem, kernel, value) -> float:
    """(lambda/2)||V||^2 + (lambda_M/2)||M||^2: the ridges are part of the objective R measures,
    and the kernels of different snapshots differ in norm."""
    return 0.5 * (problem.ridge * float(np.sum(value * value))
                  + problem.kernel_ridge * float(np.sum(kernel * kernel)))


# A warm-up step gathers the minibatch rows of a group of clients at a time, at most this many
# bytes (three clients' 256 rows at d = 16, twice a core's 1 MiB L2 cache): the two
# per-sequence products after the gather read the rows from the shared cache, and a group of
# 3-5 clients takes 8-10% less time per round than one client at a time on one core
# (numpy's per-call cost spread over more rows); every client's arithmetic is the same in any
# grouping
_GATHER_BYTES = 1 << 21


def _run_setup(problem: Problem, lr: float, seed: int, batch_size: int,
               samples_per_client: int, validation_fraction: float):
    """The data, the minibatch stream and the steps of the finite-sample run for ``seed``
    (:func:`probe_run`, :func:`frozen_continuations`, :func:`rule_run`: the data and the draws
    on streams of their own, spawned from the seed); B = min(``batch_size``, N)."""
    data_rng, draw_rng = (np.random.default_rng(s)
                          for s in np.random.SeedSequence(seed).spawn(2))
    data = sample_clients(problem, samples_per_client, validation_fraction, data_rng)
    return data, draw_rng, _Steps(problem, data, lr, min(batch_size, data.query.shape[1]))


class _Steps:
    """The minibatch SGD steps of one run on its training data, with the buffers they reuse.

    A minibatch is a draw idx (C, B) of training rows per client. A warm-up round runs the
    clients in groups of ``group`` (each group's K local steps in turn; clients are
    independent within a round). A step gathers the group's drawn rows of the data's table
    (``np.take`` on its (C N_all, w) view, row c N_all + i) into a buffer allocated once
    (``mode="clip"`` lets ``take`` write into it directly; every drawn index lies in [0, N),
    so clipping never moves one); Sigma_hat, x_q and y are views of the gathered rows, and
    every product of the step is written into a buffer of its own (``out=``), the views and
    buffers made once per group size. The arithmetic is the plain formulation's: the same
    numpy operations, per client, on arrays of the same shapes, hence the same numbers to the
    bit. A frozen step gathers its minibatch of features into a buffer of its own the same way.
    """

    def __init__(self, problem: Problem, data: SampledClients, lr: float, batch_size: int):
        c, n, d, dy = problem.num_clients, data.query.shape[1], problem.dim, problem.out_dim
        self.problem, self.lr, self.dim, self.out_dim, self.train = problem, lr, d, dy, n
        self.batch_size = batch_size
        per_client = data.table.shape[1]
        self.records = data.table.reshape(c * per_client, data.table.shape[2])
        self.record_offsets = per_client * np.arange(c)[:, None]
        self.train_offsets = n * np.arange(c)[:, None]
        self.targets = np.ascontiguousarray(data.target).reshape(c * n, dy)
        self.group = int(min(c, max(1, _GATHER_BYTES // (batch_size * self.records.strides[0]))))
        self.batch = np.empty((self.group * batch_size, self.records.shape[1]))
        self.features = np.empty((c * batch_size, d))
        self._views = {}

    def _group_views(self, g: int, b: int):
        """A warm-up step's views and buffers for a group of ``g`` clients and ``b`` rows each,
        made once: the gathered rows (G B, w) with their Sigma_hat (G, B, d, d), x_q (G, B, d)
        and y (G, B, d_y), the products' buffers (M^T x_q, z, V r_b, Sigma_hat V r_b:
        (G, B, d, 1); r: (G, B, d_y); the gradients: (G, d, d), (G, d, d_y)) and the views of
        them that the products read and write."""
        if (g, b) not in self._views:
            d, dy = self.dim, self.out_dim
            rec = self.batch[:g * b]
            q = rec[:, d * d:d * d + d].reshape(g, b, d)
            a, za, w, sw = (np.empty((g, b, d, 1)) for _ in range(4))
            self._views[g, b] = (
                rec, rec[:, :d * d].reshape(g, b, d, d), q, q.mT,
                rec[:, d * d + d:d * d + d + dy].reshape(g, b, dy), a[..., 0], a, za,
                za[..., 0], za[..., 0].mT, np.empty((g, b, dy)), w[..., 0], w, sw, sw[..., 0],
                np.empty((g, d, d)), np.empty((g, d, dy)))
        return self._views[g, b]

    def warmup_round(self, kernel: np.ndarray, value: np.ndarray, batches):
        """One FedAvg round on (M, V): K minibatch steps per client from the global point."""
        problem, lr, dy = self.problem, self.lr, self.out_dim
        c, group, take, matmul = problem.num_clients, self.group, self.records.take, np.matmul
        m = np.broadcast_to(kernel, (c, *kernel.shape)).copy()
        v = np.broadcast_to(value, (c, *value.shape)).copy()
        shrink_m, shrink_v = 1 - lr * problem.kernel_ridge, 1 - lr * problem.ridge
        # Sigma_hat is symmetric, so the prediction x_q^T M Sigma_hat V is z^T V with
        # z = Sigma_hat M^T x_q, and the kernel's gradient sum_b x_q (Sigma_hat V r_b)^T needs
        # no (C, B, d, d_y) product: batched matrix products only. The steps scale each
        # gradient in place (scale * g and g *= scale are the same numbers)
        rows = [idx + self.record_offsets for idx in batches]          # (C, B) per local step
        for lo in range(0, c, group):
            hi = min(lo + group, c)
            mg, vg = m[lo:hi], v[lo:hi]                                # views, updated in place
            vt = vg.mT
            for step_rows in rows:
                b = step_rows.shape[1]
                (rec, s, q, qt, y, a, a_col, za_col, za, zt, res, w, w_col, sw_col, sw,
                 gm, gv) = self._group_views(hi - lo, b)
                take(step_rows[lo:hi].ravel(), axis=0, out=rec, mode="clip")
                matmul(q, mg, out=a)                                   # (M^T x_q)^T per row
                matmul(s, a_col, out=za_col)
                matmul(za, vg, out=res)                                # (G, B, d_y)
                res -= y
                matmul(zt, res, out=gv)                                # (G, d, d_y)
                # V r_b: for d_y = 1 the product of the two factors (a matrix product with
                # one term per entry gives the same numbers)
                if dy == 1:
                    np.multiply(res, vt, out=w)
                else:
                    matmul(res, vt, out=w)
                matmul(s, w_col, out=sw_col)
                matmul(qt, sw, out=gm)                                 # (G, d, d)
                scale = lr / b
                gm *= scale
                mg *= shrink_m
                mg -= gm
                gv *= scale
                vg *= shrink_v
                vg -= gv
        p = problem.weights
        return np.tensordot(p, m, axes=1), np.tensordot(p, v, axes=1)

    def frozen_plan(self, batches):
        """A frozen round's K minibatches: their rows (K, C B) and targets (K, C, B, d_y)."""
        c, b = batches[0].shape
        rows = np.stack([(idx + self.train_offsets).ravel() for idx in batches])
        return rows, np.take(self.targets, rows, axis=0).reshape(len(batches), c, b,
                                                                 self.out_dim)

    def frozen_rounds(self, feats: np.ndarray, value: np.ndarray, plans) -> list:
        """Frozen rounds on V from ``value`` (features u (C, N, d) fixed), one per plan of
        :meth:`frozen_plan`; V before the first and after each round."""
        problem, lr = self.problem, self.lr
        c, d = problem.num_clients, self.dim
        table = np.ascontiguousarray(feats).reshape(c * self.train, d)
        shrink = 1 - lr * problem.ridge
        out = [value]
        for rows, targets in plans:
            v = np.broadcast_to(value, (c, *value.shape)).copy()
            for step_rows, y in zip(rows, targets):
                b = y.shape[1]
                u = np.take(table, step_rows, axis=0, out=self.features[:c * b],
                            mode="clip").reshape(c, b, d)
                res = u @ v - y                                        # (C, B, d_y)
                v *= shrink
                v -= (lr / b) * (u.mT @ res)
            value = np.tensordot(problem.weights, v, axes=1)
            out.append(value)
        return out


@dataclass(frozen=True)
class ProbeRun:
    """One finite-sample run with the probe estimator.

    Attributes
    ----------
    choice : ProbeChoice
        The chosen T0 and every snapshot's prediction.
    kernel, value : ndarray
        The final model (M_T0, V_T) after rolling back to T0 and freezing (with
        ``finish=False``, the snapshot's (M_T0, V_T0)).
    rounds_computed : dict
        ``warmup`` (rounds of full training), ``probe`` (frozen probe rounds), ``frozen``
        (frozen rounds after the roll-back), and ``fedavg_equivalent`` (the total against one
        T-round run, counting a frozen round as one round).
    """

    choice: ProbeChoice
    kernel: np.ndarray
    value: np.ndarray
    rounds_computed: dict


def probe_run(problem: Problem, start: InitialPoint, lr: float, local_steps: int,
              total_rounds: int, seed: int = 0, batch_size: int = 256,
              samples_per_client: int = 4096, validation_fraction: float = 0.25,
              interval: int | None = None, probe_rounds: int = 10,
              patience: int = 4, max_rate: float = 1.0, margin: float = 1.0,
              window: int = 4, max_probe_fraction: float | None = None, bend: float = 0.5,
              finish: bool = True, probe_fraction: float | None = None,
              tie_break: str = "earliest") -> ProbeRun:
    """Run finite-sample FedAvg with freeze-now probes every ``interval`` rounds (eq. 36).

    Parameters
    ----------
    problem, start : Problem, InitialPoint
    lr, local_steps, total_rounds : float, int, int
        eta, K, T.
    seed : int
        Fixes the data, the validation split and every minibatch draw.
    batch_size, samples_per_client, validation_fraction : int, int, float
        B, N (training + validation) and the validation share of N.
    interval : int, optional
        Rounds between snapshots (default max(1, T // 25)).
    probe_rounds : int
        r, frozen rounds per probe (>= 2); with ``max_probe_fraction`` the first length.
    probe_fraction : float, optional
        r as a share of the horizon: r = round(``probe_fraction`` T), in place of
        ``probe_rounds`` (0 < f <= 1, r >= 2). None (default): ``probe_rounds``.
    max_probe_fraction, bend : float or None, float
        Adaptive probes: a probe whose curve has not bent (fitted q^r > ``bend``) is doubled,
        up to max(r, round(``max_probe_fraction`` T)) rounds
        (:func:`linattn_theory.probe.probe_length`). None: every probe has r rounds.
    patience, max_rate, margin, window, tie_break : int, float, float, int, str
        The selection rule (:class:`linattn_theory.probe.ProbeSelector`).
    finish : bool
        Run the T - T0 frozen rounds after the roll-back (``value`` is V_T). False stops at
        the choice, for callers that need only the choice and its cost: ``kernel, value``
        are the snapshot's (M_T0, V_T0), no frozen round is simulated, and
        ``rounds_computed`` counts the same rounds as with True (the schedule the choice
        implies).
    """
    require(isinstance(total_rounds, int | np.integer) and total_rounds >= 1, "total_rounds",
            total_rounds, "an integer T >= 1")
    t_total = int(total_rounds)
    if probe_fraction is not None:
        require(isinstance(probe_fraction, int | float | np.floating)
                and not isinstance(probe_fraction, bool) and 0.0 < probe_fraction <= 1.0
                and int(round(probe_fraction * t_total)) >= 2, "probe_fraction",
                probe_fraction, f"a share in (0, 1] of T = {t_total} giving >= 2 rounds")
        probe_rounds = int(round(probe_fraction * t_total))
    require(probe_rounds >= 2, "probe_rounds", probe_rounds, "an integer >= 2")
    interval = max(1, t_total // 25) if interval is None else int(interval)
    data, draw_rng, steps = _run_setup(problem, lr, seed, batch_size, samples_per_client,
                                       validation_fraction)
    c, n_train, bsz = problem.num_clients, steps.train, steps.batch_size

    def draws():
        return [draw_rng.integers(0, n_train, size=(c, bsz)) for _ in range(local_steps)]

    # every probe uses the same minibatch draws (common random numbers), so that snapshots
    # differ by their model, not by their probe's noise
    probe_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
    longest = probe_rounds if max_probe_fraction is None else max(
        probe_rounds, int(round(max_probe_fraction * t_total)))
    probe_plans = [steps.frozen_plan([probe_rng.integers(0, n_train, size=(c, bsz))
                                      for _ in range(local_steps)])
                   for _ in range(longest)]

    selector = ProbeSelector(t_total, patience=patience, window=window, max_rate=max_rate,
                             margin=margin, tie_break=tie_break)
    snapshots = {}
    kernel, value = start.kernel.astype(np.float64), start.value.astype(np.float64)
    stopped, continuing = t_total, None
    with np.errstate(over="raise", invalid="raise"):
        try:
            for t in range(t_total + 1):
                if t % interval == 0 and t < t_total:
                    snapshots[t] = (kernel, value)
                    feats = _features(kernel, data.query, data.sigma_hat)
                    val_feats = _features(kernel, data.val_query, data.val_sigma_hat)
                    path = steps.frozen_rounds(feats, value, probe_plans[:probe_rounds])
                    losses = [_val_loss_from(problem, data, val_feats, v)
                              + _penalty(problem, kernel, v) for v in path]
                    while (want := probe_length(losses, t_total - t, longest, bend,
                                                max_rate)) > len(losses) - 1:
                        more = steps.frozen_rounds(feats, path[-1],
                                                   probe_plans[len(losses) - 1:want])[1:]
                        path += more
                        losses += [_val_loss_from(problem, data, val_feats, v)
                                   + _penalty(problem, kernel, v) for v in more]
                    if selector.add(t, losses):
                        stopped = t
                        break
                if t == t_total:
                    continuing = _validation_loss(problem, data, kernel, value)
                    break
                kernel, value = steps.warmup_round(kernel, value, draws())
        except FloatingPointError:
            raise ParameterError(
                f"lr={lr:g} with local_steps={local_steps}: the probe's finite-sample run "
                f"(minibatch SGD, B={bsz}) diverged in round {t}; lower lr, or skip the probe "
                "(probe=False; linattn warmup --no-probe)") from None
    choice = selector.choose(stopped, continuing)
    frozen = 0
    if choice.warmup_rounds < t_total:
        kernel, value = snapshots[choice.warmup_rounds]
        frozen = t_total - choice.warmup_rounds
        if finish:
            feats = _features(kernel, data.query, data.sigma_hat)
            plans = (steps.frozen_plan(draws()) for _ in range(frozen))
            value = steps.frozen_rounds(feats, value, plans)[-1]
    warm = stopped
    used = {"warmup": warm, "probe": choice.probe_rounds_used, "frozen": frozen}
    used["fedavg_equivalent"] = (warm + choice.probe_rounds_used + frozen) / t_total
    return ProbeRun(choice=choice, kernel=kernel, value=value, rounds_computed=used)


def _val_loss_from(problem, data, val_feats, value) -> float:
    res = val_feats @ value - data.val_target
    return float(problem.weights @ (0.5 * np.mean(np.sum(res * res, axis=-1), axis=1)))


@dataclass(frozen=True)
class RuleRun:
    """Online freeze rules on one finite-sample warm-up trajectory.

    Attributes
    ----------
    warmup_rounds : dict
        Each rule's T0 (T where it never fired).
    signals : dict
        Each rule's score per observed round (NaN where it had none).
    rounds_run : int
        Warm-up rounds computed (the run stops once every rule has fired).
    """

    warmup_rounds: dict
    signals: dict
    rounds_run: int


def rule_run(problem: Problem, start: InitialPoint, lr: float, local_steps: int,
             total_rounds: int, rules, seed: int = 0, batch_size: int = 256,
             samples_per_client: int = 4096, validation_fraction: float = 0.25,
             probe_rows: int = 16) -> RuleRun:
    """Run finite-sample FedAvg (the data and minibatch draws of :func:`probe_run` for the same
    seed) and feed every rule of ``rules`` (names, see
    :func:`linattn_theory.freeze_rules.parse_rule`) the signals of each round: the kernel's
    update Delta M (``delta``), the value block's (``other_deltas``), the lr, the attention
    scores x_q^T M x_j of a fixed probe batch of ``probe_rows`` sequences (rows: queries,
    keys: their context tokens; drawn once from the clients' input distributions in turn) and
    the validation objective as ``val_score`` = -F_val / F_val(start). A rule's T0 is the
    round after which it fired; every rule sees the same trajectory, and a rule that fires
    does not change it (what follows a freeze is the frozen stage, evaluated elsewhere)."""
    require(isinstance(total_rounds, int | np.integer) and total_rounds >= 1, "total_rounds",
            total_rounds, "an integer T >= 1")
    t_total = int(total_rounds)
    made = {str(r): make_rule(str(r), t_total) for r in rules}
    data, draw_rng, steps = _run_setup(problem, lr, seed, batch_size, samples_per_client,
                                       validation_fraction)
    c, n_train, bsz = problem.num_clients, steps.train, steps.batch_size
    probe_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[3])
    chol = np.linalg.cholesky(problem.covariances)
    owner = np.arange(probe_rows) % c
    z = probe_rng.standard_normal((probe_rows, problem.context_length + 1, problem.dim))
    x = np.einsum("rnd,red->rne", z, chol[owner])            # rows x^T per sequence
    probe_query, probe_context = x[:, 0], x[:, 1:]
    kernel, value = start.kernel.astype(np.float64), start.value.astype(np.float64)
    first = _validation_loss(problem, data, kernel, value)
    scale = abs(first) if first != 0 else 1.0
    rounds = 0
    with np.errstate(over="raise", invalid="raise"):
        try:
            for t in range(1, t_total):
                if all(r.fired_at is not None for r in made.values()):
                    break
                draws = [draw_rng.integers(0, n_train, size=(c, bsz))
                         for _ in range(local_steps)]
                new_kernel, new_value = steps.warmup_round(kernel, value, draws)
                signals = {"delta": new_kernel - kernel, "lr": lr,
                           "other_deltas": {"value": new_value - value},
                           "scores": np.einsum("rd,de,rne->rn", probe_query, new_kernel,
                                               probe_context)}
                kernel, value = new_kernel, new_value
                signals["val_score"] = -_validation_loss(problem, data, kernel, value) / scale
                rounds = t
                for r in made.values():
                    r.observe(t, **{k: signals[k] for k in r.needs})
        except FloatingPointError:
            raise ParameterError(
                f"lr={lr:g} with local_steps={local_steps}: the finite-sample run "
                f"(minibatch SGD, B={bsz}) diverged in round {rounds + 1}; lower lr") from None
    return RuleRun({k: r.warmup_rounds for k, r in made.items()},
                   {k: list(r.signal) for k, r in made.items()}, rounds)


@dataclass(frozen=True)
class FrozenContinuations:
    """Every snapshot of one finite-sample run frozen and trained to T (see
    :func:`frozen_continuations`).

    Attributes
    ----------
    rounds : tuple
        The snapshot rounds t (every ``interval`` rounds, t < T), then T.
    validation : tuple
        The validation objective (the probe's: F on the validation split, the ridges included)
        of (M_t, V_T) at each round; inf where a frozen stage diverged.
    models : tuple
        (M_t, V_T) at each round (None where a frozen stage diverged); at T the run's own.
    snapshots : dict
        (M_t, V_t) of the run at each snapshot round t < T.
    """

    rounds: tuple
    validation: tuple
    models: tuple
    snapshots: dict


def frozen_continuations(problem: Problem, start: InitialPoint, lr: float, local_steps: int,
                         total_rounds: int, seed: int = 0, batch_size: int = 256,
                         samples_per_client: int = 4096, validation_fraction: float = 0.25,
                         interval: int | None = None) -> FrozenContinuations:
    """The run of :func:`probe_run` (the same data and minibatch draws for ``seed``) trained for
    T rounds, and at every snapshot round t (``interval``, default max(1, T // 25), as the
    probe's) the kernel frozen and the frozen stage run for rounds t..T-1 with the run's own
    minibatch draws of those rounds: what an oracle with full-length probes sees. The snapshot
    whose continuation has the least validation objective bounds every rule that sees only this
    run (``simulations.probe_ceiling``).

    Raises ParameterError (names ``lr``) where the warm-up run diverges.
    """
    require(isinstance(total_rounds, int | np.integer) and total_rounds >= 1, "total_rounds",
            total_rounds, "an integer T >= 1")
    t_total = int(total_rounds)
    interval = max(1, t_total // 25) if interval is None else int(interval)
    data, draw_rng, steps = _run_setup(problem, lr, seed, batch_size, samples_per_client,
                                       validation_fraction)
    c, n_train, bsz = problem.num_clients, steps.train, steps.batch_size

    def draws(rng):
        return [rng.integers(0, n_train, size=(c, bsz)) for _ in range(local_steps)]

    snapshots, states = {}, {}
    kernel, value = start.kernel.astype(np.float64), start.value.astype(np.float64)
    with np.errstate(over="raise", invalid="raise"):
        try:
            for t in range(t_total):
                if t % interval == 0:
                    snapshots[t] = (kernel, value)
                    states[t] = draw_rng.bit_generator.state   # the draws of rounds t..T-1
                kernel, value = steps.warmup_round(kernel, value, draws(draw_rng))
        except FloatingPointError:
            raise ParameterError(
                f"lr={lr:g} with local_steps={local_steps}: the finite-sample run (minibatch "
                f"SGD, B={bsz}) diverged in round {t}; lower lr") from None
    rounds = sorted(snapshots)
    validation, models = [], []
    for t in rounds:
        m0, v0 = snapshots[t]
        rng = np.random.default_rng()
        rng.bit_generator.state = states[t]
        feats = _features(m0, data.query, data.sigma_hat)
        plans = (steps.frozen_plan(draws(rng)) for _ in range(t_total - t))
        with np.errstate(over="raise", invalid="raise"):
            try:
                v_t = steps.frozen_rounds(feats, v0, plans)[-1]
            except FloatingPointError:
                validation.append(float("inf"))
                models.append(None)
                continue
        validation.append(_validation_loss(problem, data, m0, v_t))
        models.append((m0, v_t))
    validation.append(_validation_loss(problem, data, kernel, value))
    models.append((kernel, value))
    return FrozenContinuations(tuple(rounds) + (t_total,), tuple(float(v) for v in validation),
                               tuple(models), snapshots)

