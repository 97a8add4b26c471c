"""Learning-rate schedules over rounds, one definition for the theory, simulator and runner.

The round's step size is ``eta_t = lr * multiplier(t)`` for rounds ``t = 1..T``; it scales the
clients' local learning rate for every local step of round ``t``. Kinds:

- ``constant``: 1;
- ``step``: ``factor ** (number of milestones <= t - 1)``; milestones are rounds (integers
  >= 1) or fractions of T in (0, 1), so ``milestones: [0.75]`` cuts after 3/4 of the run;
- ``cosine``: from 1 down to ``floor / lr`` along a half cosine over the rounds after the warm-up;
- ``exponential``: ``factor ** (t - 1)``;
- ``plateau``: cut by ``factor`` when the validation loss has not improved by more than
  ``threshold`` (relative) for ``patience`` evaluations (Charles and Konecny's automatic decay);
  it depends on measurements, so its multiplier comes from :class:`PlateauState`.

Every kind may start with a linear warm-up over ``warmup_rounds`` rounds (``t / warmup`` for
``t <= warmup``, then the schedule counted from the end of the warm-up).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from linattn_theory.errors import ParameterError

KINDS = ("constant", "step", "cosine", "exponential", "plateau")


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule (see the module docstring for each kind).

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    milestones : tuple of float
        ``step``: rounds (integers >= 1) or fractions of T in (0, 1), strictly increasing.
    factor : float
        ``step`` and ``plateau``: the cut, in (0, 1]; ``exponential``: the per-round factor.
    floor : float
        ``cosine``: the final learning rate (absolute), in [0, lr].
    warmup_rounds : int
        Linear warm-up length (0: none).
    patience : int
        ``plateau``: evaluations without improvement before a cut.
    threshold : float
        ``plateau``: relative improvement that counts.
    """

    kind: str = "constant"
    milestones: tuple[float, ...] = field(default_factory=tuple)
    factor: float = 0.1
    floor: float = 0.0
    warmup_rounds: int = 0
    patience: int = 5
    threshold: float = 1e-4

    def check(self, lr: float, total_rounds: int, key: str = "lr_schedule") -> None:
        """Raise :class:`ParameterError` naming ``key.<field>`` for an impossible schedule."""
        def bad(name: str, value, allowed: str) -> ParameterError:
            return ParameterError(f"{key}.{name}={value!r} is not allowed; {key}.{name} must "
                                  f"be {allowed}")

        if self.kind not in KINDS:
            raise bad("kind", self.kind, f"one of {', '.join(KINDS)}")
        if not (isinstance(self.factor, int | float) and math.isfinite(self.factor)
                and 0 < self.factor <= 1):
            raise bad("factor", self.factor, "in (0, 1]")
        if not (isinstance(self.warmup_rounds, int) and 0 <= self.warmup_rounds < total_rounds):
            raise bad("warmup_rounds", self.warmup_rounds,
                      f"an integer in [0, total rounds = {total_rounds})")
        if not (isinstance(self.floor, int | float) and math.isfinite(self.floor)
                and 0 <= self.floor <= lr):
            raise bad("floor", self.floor, f"in [0, lr = {lr}] (a final learning rate)")
        if not (isinstance(self.patience, int) and self.patience >= 1):
            raise bad("patience", self.patience, "an integer >= 1")
        if not (isinstance(self.threshold, int | float) and 0 <= self.threshold < 1):
            raise bad("threshold", self.threshold, "in [0, 1)")
        if self.kind == "step":
            rounds = self.milestone_rounds(total_rounds, key)
            if not rounds:
                raise bad("milestones", list(self.milestones), "a non-empty list for step")

    def milestone_rounds(self, total_rounds: int, key: str = "lr_schedule") -> list[int]:
        """The milestones as rounds: a fraction f of T is round ``ceil(f T)``; the cut applies
        from the round after the milestone."""
        out = []
        for m in self.milestones:
            if not isinstance(m, int | float) or isinstance(m, bool) or not math.isfinite(m):
                raise ParameterError(f"{key}.milestones: {m!r} is not a number")
            if 0 < m < 1:
                r = math.ceil(m * total_rounds)
            elif float(m).is_integer() and 1 <= m < total_rounds:
                r = int(m)
            else:
                raise ParameterError(f"{key}.milestones: {m!r} is outside the run; give rounds "
                                     f"in [1, {total_rounds - 1}] or fractions in (0, 1)")
            out.append(r)
        if any(b <= a for a, b in zip(out, out[1:])):
            raise ParameterError(f"{key}.milestones={list(self.milestones)} must be strictly "
                                 "increasing")
        return out

    def multipliers(self, lr: float, total_rounds: int) -> np.ndarray:
        """``(T,)`` multipliers of rounds 1..T (``plateau``: the warm-up, then 1)."""
        t = np.arange(1, total_rounds + 1, dtype=np.float64)
        w = self.warmup_rounds
        after = np.maximum(t - w, 0.0)  # rounds counted from the end of the warm-up
        span = max(total_rounds - w, 1)
        if self.kind in ("constant", "plateau"):
            out = np.ones_like(t)
        elif self.kind == "step":
            cuts = np.array(self.milestone_rounds(total_rounds), dtype=np.float64)
            out = self.factor ** (t[:, None] > cuts[None, :]).sum(1)
        elif self.kind == "cosine":
            low = self.floor / lr
            out = low + (1 - low) * 0.5 * (1 + np.cos(np.pi * (after - 1).clip(0) / max(
                span - 1, 1)))
        else:  # exponential
            out = self.factor ** (after - 1).clip(0)
        if w:
            out = np.where(t <= w, t / w, out)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["milestones"] = list(self.milestones)
        return d


@dataclass
class PlateauState:
    """The running state of a ``plateau`` schedule: the current multiplier and the best loss.

    :meth:`observe` takes each evaluation's validation loss, in order.
    """

    multiplier: float = 1.0
    best: float = math.inf
    bad: int = 0
    cuts: int = 0

    def observe(self, loss: float, schedule: LRSchedule) -> float:
        """Record one validation loss; returns the multiplier for the rounds that follow."""
        if loss < self.best * (1 - schedule.threshold):
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
            if self.bad >= schedule.patience:
                self.multiplier *= schedule.factor
                self.bad, self.cuts = 0, self.cuts + 1
        return self.multiplier


FIXED_KINDS = ("constant", "step", "cosine", "exponential")


def step_size_sequence(lr: float, total_rounds: int, lr_schedule=None,
                       key: str = "lr_schedule") -> np.ndarray | None:
    """eta_t = lr * multiplier(t) for rounds t = 1..T, shape ``(T,)``, or ``None`` where every
    round takes ``lr`` (no schedule, or one whose multipliers are all 1, such as ``constant``).

    ``lr_schedule`` is an :class:`LRSchedule`, a mapping or a kind name
    (:func:`schedule_from_dict`). It is checked against ``lr`` and ``T`` (errors name
    ``key.<field>``). Only kinds fixed in advance are allowed (:data:`FIXED_KINDS`):
    ``plateau`` cuts on measured validation losses, which the population dynamics and the
    simulator's T0 sweep do not have.
    """
    if lr_schedule is None:
        return None
    if not isinstance(lr_schedule, LRSchedule):
        lr_schedule = schedule_from_dict(lr_schedule, key)
    lr_schedule.check(lr, total_rounds, key)
    if lr_schedule.kind not in FIXED_KINDS:
        raise ParameterError(f"{key}.kind={lr_schedule.kind!r} is not allowed here; {key}.kind "
                             f"must be one of {', '.join(FIXED_KINDS)} (a plateau schedule "
                             "cuts on measured validation losses)")
    etas = lr * lr_schedule.multipliers(lr, total_rounds)
    return None if bool(np.all(etas == lr)) else etas


def schedule_from_dict(data: dict | str | None, key: str = "lr_schedule") -> LRSchedule:
    """A schedule from a mapping (``{kind: step, milestones: [0.75], factor: 0.1}``) or a kind
    name; unknown fields name ``key.<field>``."""
    if data is None:
        return LRSchedule()
    if isinstance(data, str):
        data = {"kind": data}
    if not isinstance(data, dict):
        raise ParameterError(f"{key} must be a kind name or a mapping, got {data!r}")
    names = set(LRSchedule.__dataclass_fields__)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ParameterError(f"unknown key {key}.{unknown[0]}; valid: {', '.join(sorted(names))}")
    data = dict(data)
    if "milestones" in data:
        ms = data["milestones"]
        if not isinstance(ms, list | tuple):
            raise ParameterError(f"{key}.milestones must be a list, got {ms!r}")
        data["milestones"] = tuple(ms)
    return LRSchedule(**data)
