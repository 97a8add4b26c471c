"""Online freeze-timing rules: decide during a run, from what it measures, when to freeze the
attention kernel (the query/key block; the kernel M of the linear-attention model).

Pure numpy on per-round signals, so the finite-sample simulator (:mod:`linattn_theory.sampled`)
and a real-network runner feed the same rule objects. Each rule follows its authors' published
criterion with the defaults below, the same in every setting:

- ``perturbation`` (APF, Chen et al., ICDCS 2021): bias-corrected exponential averages
  (alpha 0.9) of the server's kernel update Delta_r and of |Delta_r|; the score
  P_r = ||avg Delta||_1 / ||avg |Delta| ||_1 lies in [0, 1]. Under updates that are pure noise
  (independent, zero mean) the stationary score is about sqrt((1 - alpha) / (1 + alpha))
  (0.229 at alpha 0.9): the kernel has stopped moving in any direction. Fires after 3 rounds in a
  row at or below that level.
- ``norm_change`` (AutoFreeze, Liu et al. 2021; Accordion, Agarwal et al. 2021): over intervals
  of L = max(2, T // 20) rounds, g_k = ||sum of the interval's kernel updates|| / (the
  interval's mean lr); fires when |g_k - g_(k-1)| / g_(k-1) < 0.5.
  ``norm_change_median`` fires instead when the kernel's relative change is below the median
  relative change of the other blocks (each fed the same way).
- ``kernel_stability`` (Early-Bird tickets, You et al., ICLR 2020): on a fixed probe batch, the
  top 10% keys of every attention row form a binary mask; fires when the newest mask lies
  within normalized Hamming distance 0.1 of each of the previous four.
- ``plateau``: fires when the best validation score of the last 10 rounds is no more than
  ``plateau_delta`` above the best before them (rounds, not evaluations: a run that evaluates
  every k rounds feeds the rule those rounds only) (accuracy: 0.1 point, 0.001; for a loss, the
  score is minus the loss divided by the first loss, so 0.001 is 0.1% of the starting loss).
- ``fraction=f``: T0 = ceil(f T), the fixed-schedule reference (f = 1: never freeze).

Every rule but the fixed ``fraction=f`` waits at least ``max(5, ceil(0.05 T))`` rounds
(:func:`min_wait`), and every rule may never fire, which means T0 = T (the run is FedAvg
throughout). A rule that fires after observing round t freezes from round t + 1, so T0 = t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from linattn_theory.errors import ParameterError, require

__all__ = ["RULES", "FreezeRule", "make_rule", "min_wait", "parse_rule"]

RULES = ("perturbation", "norm_change", "norm_change_median", "kernel_stability", "plateau",
         "fraction")
"""Rule names; ``fraction`` is written ``fraction=f``."""

ALPHA = 0.9
PATIENCE = 3
CHANGE_THRESHOLD = 0.5
TOP_FRACTION = 0.1
HAMMING = 0.1
HISTORY = 4
PLATEAU_WINDOW = 10
PLATEAU_DELTA = 0.001


def min_wait(total_rounds: int) -> int:
    """The fewest warm-up rounds any rule allows: max(5, ceil(0.05 T)), at most T."""
    return min(int(total_rounds), max(5, math.ceil(0.05 * total_rounds)))


def parse_rule(spec: str) -> tuple[str, float | None]:
    """``"perturbation"`` -> (name, None); ``"fraction=0.3"`` -> ("fraction", 0.3).

    Raises :class:`ParameterError` naming the rule for an unknown name or a fraction outside
    [0, 1]."""
    name, _, value = str(spec).partition("=")
    require(name in RULES, "warmup rule", spec, f"one of {', '.join(RULES[:-1])}, fraction=f")
    if name != "fraction":
        require(not value, "warmup rule", spec, f"{name} without a value")
        return name, None
    try:
        f = float(value)
    except ValueError:
        raise ParameterError(f"warmup rule={spec!r} is not allowed; fraction must be "
                             "fraction=f with a number f in [0, 1]") from None
    require(0.0 <= f <= 1.0, "fraction", f, "in [0, 1]")
    return name, f


@dataclass
class FreezeRule:
    """A rule's state: feed :meth:`observe` once per warm-up round, in order.

    Attributes
    ----------
    name : str
        The rule (``fraction=f`` for the fixed schedule).
    total_rounds : int
        T.
    fired_at : int or None
        The round after which the rule fired (T0), or None while it has not.
    signal : list of float
        The rule's score per observed round (NaN where it has none yet), for metrics.
    """

    name: str
    total_rounds: int
    fraction: float | None = None
    fired_at: int | None = None
    signal: list = field(default_factory=list)
    _state: dict = field(default_factory=dict)

    @property
    def needs(self) -> frozenset[str]:
        """The signals :meth:`observe` reads: ``delta`` (the kernel's update, flat), ``lr``,
        ``other_deltas`` (the other blocks' updates), ``scores`` (attention rows on the probe
        batch, (rows, keys)), ``val_score`` (higher is better)."""
        return frozenset({
            "perturbation": {"delta"}, "norm_change": {"delta", "lr"},
            "norm_change_median": {"delta", "lr", "other_deltas"},
            "kernel_stability": {"scores"}, "plateau": {"val_score"}, "fraction": set(),
        }[self.name.partition("=")[0]])

    @property
    def state_bytes(self) -> int:
        """Bytes of the arrays the rule keeps between rounds (its memory overhead)."""
        def size(obj) -> int:
            if isinstance(obj, np.ndarray):
                return int(obj.nbytes)
            if isinstance(obj, dict):
                return sum(size(v) for v in obj.values())
            if isinstance(obj, list | tuple):
                return sum(size(v) for v in obj)
            return 0
        return size(self._state)

    @property
    def warmup_rounds(self) -> int:
        """T0: the firing round, or T if the rule never fired."""
        return self.total_rounds if self.fired_at is None else self.fired_at

    def observe(self, rnd: int, **signals) -> bool:
        """Record round ``rnd`` (1-based, the round just finished); True when the rule fires
        now (freeze from round ``rnd + 1``). After firing it stays fired."""
        if self.fired_at is not None:
            return False
        kind = self.name.partition("=")[0]
        missing = self.needs - {k for k, v in signals.items() if v is not None}
        if missing:
            raise ParameterError(f"warmup rule {self.name}: round {rnd} lacks the signal(s) "
                                 f"{sorted(missing)}")
        score, ready = getattr(self, f"_{kind}")(rnd, **{k: signals[k] for k in self.needs})
        self.signal.append(float("nan") if score is None else float(score))
        waited = kind == "fraction" or rnd >= min_wait(self.total_rounds)  # fixed: no wait
        if ready and waited and rnd < self.total_rounds:
            self.fired_at = int(rnd)
            return True
        return False

    # -- the rules: (score, fires) ---------------------------------------------------------
    def _perturbation(self, rnd, delta):
        d = np.asarray(delta, dtype=np.float64).ravel()
        s = self._state
        s["t"] = s.get("t", 0) + 1
        s["m"] = ALPHA * s.get("m", 0.0) + (1 - ALPHA) * d
        s["a"] = ALPHA * s.get("a", 0.0) + (1 - ALPHA) * np.abs(d)
        # bias correction divides both averages by 1 - alpha^t: it cancels in the ratio
        den = float(np.sum(s["a"]))
        score = float(np.sum(np.abs(s["m"])) / den) if den > 0 else 0.0
        level = math.sqrt((1 - ALPHA) / (1 + ALPHA))
        s["below"] = s.get("below", 0) + 1 if score <= level else 0
        return score, s["below"] >= PATIENCE

    def _interval_change(self, key, rnd, delta, lr):
        """Accumulate ``delta`` for block ``key``; at an interval's end, the relative change of
        g_k against the previous interval (None before two intervals)."""
        s = self._state.setdefault(key, {"sum": 0.0, "lrs": [], "g": []})
        s["sum"] = s["sum"] + np.asarray(delta, dtype=np.float64).ravel()
        s["lrs"].append(float(lr))
        length = max(2, self.total_rounds // 20)
        if len(s["lrs"]) < length:
            return None
        mean_lr = float(np.mean(s["lrs"]))
        g = float(np.linalg.norm(s["sum"])) / mean_lr if mean_lr > 0 else 0.0
        s["g"].append(g)
        s["sum"], s["lrs"] = 0.0, []
        if len(s["g"]) < 2:
            return None
        prev = s["g"][-2]
        return abs(g - prev) / prev if prev > 0 else 0.0

    def _norm_change(self, rnd, delta, lr):
        change = self._interval_change("qk", rnd, delta, lr)
        return change, change is not None and change < CHANGE_THRESHOLD

    def _norm_change_median(self, rnd, delta, lr, other_deltas):
        change = self._interval_change("qk", rnd, delta, lr)
        others = [self._interval_change(f"other:{k}", rnd, d, lr)
                  for k, d in sorted(other_deltas.items())]
        others = [c for c in others if c is not None]
        if change is None or not others:
            return change, False
        return change, change < float(np.median(others))

    def _kernel_stability(self, rnd, scores):
        a = np.asarray(scores, dtype=np.float64)
        require(a.ndim == 2 and a.shape[1] >= 1, "scores", a.shape,
                "a (rows, keys) array of attention scores")
        k = max(1, math.ceil(TOP_FRACTION * a.shape[1]))
        top = np.argpartition(-a, k - 1, axis=1)[:, :k]
        mask = np.zeros(a.shape, dtype=bool)
        np.put_along_axis(mask, top, True, axis=1)
        masks = self._state.setdefault("masks", [])
        masks.append(mask)
        del masks[:-(HISTORY + 1)]
        if len(masks) <= HISTORY:
            return None, False
        dist = [float(np.mean(masks[-1] != m)) for m in masks[:-1]]
        return max(dist), max(dist) <= HAMMING

    def _plateau(self, rnd, val_score):
        """Windows in rounds: a run that evaluates every k rounds feeds only those rounds."""
        hist = self._state.setdefault("scores", [])
        hist.append((int(rnd), float(val_score)))
        last = [v for r, v in hist if r > rnd - PLATEAU_WINDOW]
        before = [v for r, v in hist if r <= rnd - PLATEAU_WINDOW]
        if not before:
            return None, False
        gain = max(last) - max(before)
        return gain, gain <= PLATEAU_DELTA

    def _fraction(self, rnd):
        t0 = math.ceil(self.fraction * self.total_rounds)
        return None, rnd >= t0 and t0 < self.total_rounds

    def observe_fraction_start(self) -> bool:
        """``fraction=0``: T0 = 0, decided before any round (no minimum wait applies to the
        fixed schedule). True when the rule fires at round 0."""
        if self.fraction is not None and math.ceil(self.fraction * self.total_rounds) == 0:
            self.fired_at = 0
            return True
        return False


def make_rule(spec: str, total_rounds: int) -> FreezeRule:
    """A fresh :class:`FreezeRule` for ``spec`` (see :func:`parse_rule`) over T rounds."""
    require(isinstance(total_rounds, int | np.integer) and total_rounds >= 1, "total_rounds",
            total_rounds, "an integer T >= 1")
    name, f = parse_rule(spec)
    rule = FreezeRule(spec if name == "fraction" else name, int(total_rounds), fraction=f)
    rule.observe_fraction_start()
    return rule
