"""The probe estimator of the warm-up length: freeze-now continuations forked from snapshots of
the federated run, their floor extrapolated (docs/theory.md, eq. 36).

Pure numpy on loss curves: it needs no covariances or teachers, only what a run measures, so the
finite-sample simulator (:mod:`linattn_theory.sampled`) and a real-network runner can call the
same functions.

Every ``interval`` rounds the run keeps a snapshot t_j and forks a short continuation with the
attention kernel frozen: ``probe_rounds`` rounds of the frozen stage, with the validation
objective l_j(s) after each (s = 0..r): the training objective, weight decay included, on a
validation split carved from the clients' training data. The frozen stage is a contraction
(eq. 16), so its loss approaches its floor geometrically, l(s) ~ l_inf + b q^s;
:func:`extrapolate` fits (l_inf, b) per probe and one q shared by neighbouring probes, and
predicts the loss after the T - t_j frozen rounds that freezing at t_j would leave:

    P_j = l_inf + b q^(T - t_j).                                                        (36)

Each prediction uses the rate fitted on its own probe and the ``window - 1`` before it (the
frozen stage's rate changes slowly along the run). The predictions are smoothed by a running
median of three, and their noise is estimated from their second differences,
sigma = 1.4826 median|P_{j+1} - 2 P_j + P_{j-1}| / sqrt(6). The run stops warming up once the
last ``patience`` smoothed predictions all exceed the best one by more than ``margin`` sigma
(default 1), rolls back to the best snapshot and freezes there (:class:`ProbeSelector`). If it
reaches T, it freezes only if the best prediction beats the never-freeze loss l_T (continuing)
by more than sigma.

A probe of r rounds identifies its floor only if it shows the curve bending: when the loss
falls almost linearly, every rate q near 1 fits as well as any other, and the horizon T - t_j
(often 20x r) carries the fitted line far below anything the objective can reach. Three
guards keep such a probe from deciding T0; each is valid on its own assumption:

- Lower bound (``lower_bound``, default 0): the floors satisfy l_inf_j >= lower_bound in the
  least squares, so no prediction lies below it. Valid for any objective with a known lower
  bound: cross-entropy and squared loss, weight decay included, are >= 0.
- Reach (``reach``, default 1): beyond the curve a prediction falls below the fitted l_j(r)
  by at most ``reach`` times the fitted drop over the probe, b_j (1 - q^r). For a geometric
  curve the drop still to come is b_j q^r, at most the drop seen iff q^r <= 1/2: the cap is
  inactive when the probe spans at least one half-life of the frozen stage's loss (the curve
  visibly bends) and otherwise replaces the floor the data do not pin down by the one of a
  contraction with half-life r, q^r = 1/2: under the geometric model an overestimate of the
  loss reached, so a probe that does not show its floor cannot win the selection by
  extrapolation alone.
- End-point rule (``end_rule``, default on): the oldest prediction has no earlier neighbour,
  so the median of three cannot confirm it; its smoothed value is Tukey's end-point median of
  itself, its smoothed neighbour z_1 and 3 z_1 - 2 z_2 (:func:`smoothed`). A lone low
  prediction at snapshot 0 thus does not stay the best; a run whose predictions rise from the
  start keeps snapshot 0. Inner predictions are medians of three already, and the newest one
  never decides a stop (``patience`` predictions must follow the best).

A probe that has not bent is held up by the reach guard, above the loss the fork reaches when
its decay has a slow part its r rounds do not show. :func:`probe_length` (an option of
:func:`linattn_theory.sampled.probe_run`, ``max_probe_fraction``; not the default) doubles
such a probe until its own fit spans a half-life, q^r <= 1/2, or a cap; probes of different
lengths share their rate on their common rounds. On the warm-up grid it is within 10% of
the exact optimum on more settings of the parts it was chosen on and fewer of an untouched
part than the fixed 10-round probe, at more compute (docs/results/validation.md).

On the warm-up grid the three guards change no setting's outcome count (W2,
docs/results/validation.md); on a near-linear probe (2.391 -> 2.233 over 10 rounds, horizon 200)
the unguarded prediction is negative and the guarded one 2.07.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from linattn_theory.errors import require

__all__ = ["extrapolate", "probe_length", "smoothed", "best_snapshot", "ProbeSelector",
           "ProbeChoice"]

_RATES = np.concatenate([np.linspace(0.0, 0.9, 46), 1.0 - np.geomspace(0.1, 1e-3, 40)])


def _fit(curves: np.ndarray, lower_bound: float | None):
    """Least-squares (l_inf_j, b_j) for every rate on the grid, subject to b_j >= 0 and
    l_inf_j >= ``lower_bound``; curves (J, r+1).

    Returns (residual (Q,), floors (Q, J), scales (Q, J)). The constrained least squares of two
    parameters has its optimum at the unconstrained one if that is feasible, else on a face of
    the feasible set: the floor at the bound (b_j refitted) or the flat curve (b_j = 0, the
    floor at the larger of the mean and the bound); the best feasible of the three is kept.
    """
    s = np.arange(curves.shape[1], dtype=np.float64)
    basis = _RATES[:, None] ** s[None, :]                        # (Q, r+1)
    b_mean = basis.mean(axis=1)
    centred = basis - b_mean[:, None]
    denom = np.sum(centred**2, axis=1)                           # (Q,)
    y_mean = curves.mean(axis=1)                                 # (J,)
    lb = -np.inf if lower_bound is None else float(lower_bound)

    def residual(floors, scales):
        fitted = floors[:, :, None] + scales[:, :, None] * basis[:, None, :]
        return np.sum((fitted - curves[None]) ** 2, axis=2)     # (Q, J)

    with np.errstate(divide="ignore", invalid="ignore"):
        free_b = (centred @ (curves - y_mean[:, None]).T) / denom[:, None]   # (Q, J)
    free_f = y_mean[None, :] - free_b * b_mean[:, None]
    feasible = np.isfinite(free_b) & (free_b > 0) & (free_f >= lb)
    free_b, free_f = np.where(feasible, free_b, 0.0), np.where(feasible, free_f, 0.0)
    flat_f = np.broadcast_to(np.maximum(y_mean, lb), free_b.shape)
    flat_b = np.zeros_like(free_b)
    cands = [(free_f, free_b, np.where(feasible, residual(free_f, free_b), np.inf)),
             (flat_f, flat_b, residual(flat_f, flat_b))]
    if np.isfinite(lb):
        bound_b = np.maximum((basis @ (curves - lb).T) / np.sum(basis**2, axis=1)[:, None], 0.0)
        bound_f = np.full_like(bound_b, lb)
        cands.append((bound_f, bound_b, residual(bound_f, bound_b)))
    res = np.stack([c[2] for c in cands])
    pick = np.argmin(res, axis=0)
    floors = np.choose(pick, [c[0] for c in cands])
    scales = np.choose(pick, [c[1] for c in cands])
    return np.sum(np.min(res, axis=0), axis=1), floors, scales


def extrapolate(curves, horizons, max_rate: float = 1.0, lower_bound: float | None = 0.0,
                reach: float | None = 1.0) -> tuple[np.ndarray, np.ndarray, float]:
    """Fit l_j(s) = l_inf_j + b_j q^s with one rate q shared by all curves and predict
    l_j(horizon_j) (eq. 36).

    The frozen stages of nearby snapshots contract at nearly the same rate, so sharing q makes
    the fit of short, noisy curves stable; q is chosen on a grid in [0, 0.999] by least
    squares, (l_inf_j >= lower_bound, b_j >= 0) by constrained linear least squares for each q.
    A horizon within the curve (horizon_j <= r) is read off the curve. Beyond the curve the
    prediction falls below the fitted l_j(r) by at most ``reach`` times the fitted drop over
    the probe, l_j(0) - l_j(r) (see the module docstring).

    Parameters
    ----------
    curves : array, shape (J, r+1) or (r+1,)
        Validation losses after s = 0..r frozen rounds, r >= 2.
    horizons : int or array (J,)
        The frozen rounds each fork would get (T - t_j).
    max_rate : float
        The largest rate considered.
    lower_bound : float or None
        A known lower bound of the objective (0 for cross-entropy and squared loss): the floors
        l_inf_j, hence the predictions, are not below it. None: no bound.
    reach : float or None
        The most further drop, beyond the probe, in units of the drop the probe shows. None:
        the fitted curve is followed to the horizon whatever its rate.

    Returns
    -------
    predictions (J,), floors l_inf (J,), q.
    """
    y = np.atleast_2d(np.asarray(curves, dtype=np.float64))
    require(y.shape[1] >= 3 and np.all(np.isfinite(y)), "curves", y.shape,
            "finite curves of at least 3 values (s = 0..r, r >= 2)")
    require(reach is None or (np.isfinite(reach) and reach >= 0), "reach", reach,
            "a finite number >= 0, or None")
    resid, floors, scales = _fit(y, lower_bound)
    resid = np.where(_RATES <= max_rate, resid, np.inf)
    best = int(np.argmin(resid))
    q = float(_RATES[best])
    r = y.shape[1] - 1
    h = np.broadcast_to(np.maximum(np.asarray(horizons, dtype=np.int64), 0), (y.shape[0],))
    floor, scale = floors[best], scales[best]
    model = floor + scale * q ** h.astype(np.float64)
    if reach is not None:
        end = floor + scale * q**r                      # the fitted l_j(r)
        model = np.maximum(model, end - reach * scale * (1.0 - q**r))
    # a fork whose remaining rounds the probe has already run needs no model: read it off
    seen = h < y.shape[1]
    model[seen] = y[seen, h[seen]]
    return model, floor, q


def probe_length(losses, horizon: int, max_rounds: int, bend: float = 0.5,
                 max_rate: float = 1.0, lower_bound: float | None = 0.0) -> int:
    """The frozen rounds a probe needs: its own length r once its curve bends, else a longer one.

    A probe identifies its floor once it spans a half-life of its own fitted curve,
    q^r <= ``bend`` (1/2: the reach guard of :func:`extrapolate` is then inactive); until
    then the prediction is the guard's conservative one, which misses the slow part of the
    frozen stage's decay. Returns r when the curve bends, when r reaches ``max_rounds`` or the
    horizon (the fork's remaining rounds, then read off the curve), else min(2 r, max_rounds,
    horizon): the probe continues from its last round, so a doubling costs r more rounds.

    Parameters
    ----------
    losses : array (r+1,)
        The probe's curve so far, r >= 2.
    horizon : int
        T - t_j.
    max_rounds : int
        The longest probe.
    bend : float
        The fraction q^r of the fitted drop still to come below which the curve counts as
        bent (0 < bend < 1).
    max_rate, lower_bound : float
        As in :func:`extrapolate`.
    """
    y = np.asarray(losses, dtype=np.float64)
    require(0.0 < bend < 1.0, "bend", bend, "a fraction in (0, 1)")
    r = y.size - 1
    limit = min(int(max_rounds), max(int(horizon), 0))
    if r >= limit:
        return r
    _, _, q = extrapolate(y, horizon, max_rate, lower_bound, reach=None)
    return r if q**r <= bend else min(2 * r, limit)


def smoothed(predictions, end_rule: bool = True) -> np.ndarray:
    """The running median of three neighbouring predictions: one noisy probe does not decide
    the snapshot or stop the warm-up.

    The oldest prediction has one neighbour, so a median of three cannot confirm it; with
    ``end_rule`` (Tukey's end-point rule) its smoothed value is the median of itself, its
    smoothed neighbour z_1 and the line through the next two smoothed values, 3 z_1 - 2 z_2:
    it stands only where the trend of the later predictions supports it. The newest prediction
    keeps its value (median of itself twice and its neighbour): the stop rule needs
    ``patience`` predictions after the best one, so the newest never decides a stop, and it
    becomes an inner value, a median of three, at the next probe. Without ``end_rule`` the
    oldest keeps its value too.
    """
    x = np.asarray(predictions, dtype=np.float64)
    if x.size < 3:
        return x
    padded = np.concatenate([x[:1], x, x[-1:]])
    z = np.median(np.stack([padded[:-2], padded[1:-1], padded[2:]]), axis=0)
    if end_rule:
        z[0] = np.median([x[0], z[1], 3.0 * z[1] - 2.0 * z[2]])
    return z


TIE_BREAKS = ("earliest", "own")


def best_snapshot(smooth, predictions, tie_break: str = "earliest") -> int:
    """The index of the least smoothed prediction; among equal ones the earliest
    (``tie_break="earliest"``, the default), or the one with the least prediction of its own,
    its probe's evidence, then the earliest (``"own"``).

    A median of three copies a neighbour's value, so neighbouring snapshots often share the
    least smoothed value, and the end-point rule sets the oldest one to z_1 wherever the trend
    of z_1, z_2 is flat: with "earliest" a snapshot at round 0 whose probe predicted 10.1
    beside 7.7 and 7.5 is kept (T0 = 0), with "own" the snapshot that predicted 7.5.
    """
    require(tie_break in TIE_BREAKS, "tie_break", tie_break, f"one of {', '.join(TIE_BREAKS)}")
    z = np.asarray(smooth, dtype=np.float64)
    if tie_break == "earliest":
        return int(np.argmin(z))
    x = np.asarray(predictions, dtype=np.float64)
    return int(np.lexsort((np.arange(z.size), x, z))[0])


@dataclass(frozen=True)
class ProbeChoice:
    """What :class:`ProbeSelector` decides.

    Attributes
    ----------
    warmup_rounds : int
        The chosen T0 (a snapshot round, or T for never freezing).
    predicted_loss : float
        The prediction (36) at the chosen snapshot (l_T for T0 = T).
    snapshots, predictions : tuple
        Every probed snapshot t_j and its prediction P_j.
    rate : float
        The fitted contraction q of the frozen-stage loss at the last probe.
    stopped_at : int
        The round at which warm-up stopped (T if it ran to the end).
    probe_rounds_used : int
        Frozen rounds spent in probes (the extra compute).
    """

    warmup_rounds: int
    predicted_loss: float
    snapshots: tuple
    predictions: tuple
    rate: float
    stopped_at: int
    probe_rounds_used: int


@dataclass
class ProbeSelector:
    """The online rule of eq. (36): feed probes in round order, ask whether to stop.

    Parameters
    ----------
    total_rounds : int
        T.
    patience : int
        Snapshots that must all lie above the best prediction (by ``margin`` sigma) before
        warm-up stops.
    window : int
        Probes that share one fitted rate (the current one and those before it).
    max_rate : float
        The largest rate q the fit may take.
    margin : float
        The stop rule's margin in units of sigma.
    lower_bound, reach : float or None
        The guards of :func:`extrapolate` (a known lower bound of the objective; the most
        further drop in units of the probe's drop). None switches a guard off.
    end_rule : bool
        Tukey's end-point rule for the oldest prediction (:func:`smoothed`).
    tie_break : str
        Which of the snapshots sharing the least smoothed prediction is the best
        (:func:`best_snapshot`): "earliest" (default) or "own".
    """

    total_rounds: int
    patience: int = 4
    window: int = 4
    max_rate: float = 1.0
    margin: float = 1.0
    lower_bound: float | None = 0.0
    reach: float | None = 1.0
    end_rule: bool = True
    tie_break: str = "earliest"
    snapshots: list = field(default_factory=list)
    curves: list = field(default_factory=list)
    predictions: list = field(default_factory=list)
    rate: float = 0.0
    probe_rounds_used: int = 0

    def noise(self) -> float:
        """sigma of the predictions, from their second differences (0 with fewer than 3)."""
        x = np.asarray(self.predictions)
        if x.size < 3:
            return 0.0
        return float(1.4826 * np.median(np.abs(np.diff(x, 2))) / np.sqrt(6.0))

    def add(self, round_index: int, losses) -> bool:
        """Record the freeze-now probe forked at ``round_index``; True when warm-up should stop.

        The new prediction (36) uses the rate shared with the ``window - 1`` probes before it.
        """
        self.snapshots.append(int(round_index))
        self.curves.append(np.asarray(losses, dtype=np.float64))
        self.probe_rounds_used += len(losses) - 1
        # probes of different lengths share their rate on the common rounds
        shortest = min(len(c) for c in self.curves[-self.window:])
        recent = np.stack([c[:shortest] for c in self.curves[-self.window:]])
        horizons = self.total_rounds - np.asarray(self.snapshots[-self.window:])
        preds, _, q = extrapolate(recent, horizons, self.max_rate, self.lower_bound,
                                  self.reach)
        self.predictions.append(float(preds[-1]))
        self.rate = q
        smooth = smoothed(self.predictions, self.end_rule)
        best = best_snapshot(smooth, self.predictions, self.tie_break)
        tail = smooth[best + 1:]
        return tail.size >= self.patience and bool(
            np.min(tail[-self.patience:]) > smooth[best] + self.margin * self.noise())

    def choose(self, stopped_at: int, continuing_loss: float | None = None) -> ProbeChoice:
        """The best snapshot; ``continuing_loss`` (the run's loss at T, when it got there) is
        the never-freeze candidate T0 = T, kept unless a snapshot beats it by sigma."""
        smooth = smoothed(self.predictions, self.end_rule)
        best = best_snapshot(smooth, self.predictions, self.tie_break)
        t0, pred = self.snapshots[best], float(smooth[best])
        if continuing_loss is not None and continuing_loss <= pred + self.noise():
            t0, pred = self.total_rounds, float(continuing_loss)
        return ProbeChoice(warmup_rounds=int(t0), predicted_loss=float(pred),
                           snapshots=tuple(self.snapshots), predictions=tuple(self.predictions),
                           rate=float(self.rate), stopped_at=int(stopped_at),
                           probe_rounds_used=int(self.probe_rounds_used))
