"""Learning-rate schedules against plain-loop references, one per kind.

Each reference walks the rounds one at a time with the textbook rule (PyTorch's MultiStepLR,
CosineAnnealingLR with eta_min, ExponentialLR, ReduceLROnPlateau in relative ``min`` mode, and a
linear warm-up), independently of the vectorized ``LRSchedule.multipliers``; they must agree to
1e-12.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from linattn_theory.errors import ParameterError
from linattn_theory.schedules import LRSchedule, PlateauState, schedule_from_dict

LR, T = 0.1, 40


def _reference(s: LRSchedule) -> list[float]:
    out = []
    cuts = []
    if s.kind == "step":
        cuts = [math.ceil(m * T) if m < 1 else int(m) for m in s.milestones]
    for t in range(1, T + 1):
        if t <= s.warmup_rounds:
            out.append(t / s.warmup_rounds)
            continue
        k = t - s.warmup_rounds  # 1-based round after the warm-up
        span = T - s.warmup_rounds
        if s.kind == "constant":
            m = 1.0
        elif s.kind == "step":
            m = 1.0
            for c in cuts:
                if t > c:
                    m *= s.factor
        elif s.kind == "cosine":
            low = s.floor / LR
            m = low + (1 - low) * (1 + math.cos(math.pi * (k - 1) / (span - 1))) / 2
        else:  # exponential
            m = s.factor ** (k - 1)
        out.append(m)
    return out


@pytest.mark.parametrize("schedule", [
    LRSchedule("constant"),
    LRSchedule("step", (0.75,), 0.1),
    LRSchedule("step", (10, 20, 30), 0.5),
    LRSchedule("step", (0.5,), 0.1, warmup_rounds=4),
    LRSchedule("cosine", floor=0.001),
    LRSchedule("cosine", floor=0.0, warmup_rounds=5),
    LRSchedule("exponential", factor=0.95),
    LRSchedule("exponential", factor=0.9, warmup_rounds=3),
])
def test_multipliers_match_a_plain_loop(schedule):
    schedule.check(LR, T)
    got = schedule.multipliers(LR, T)
    assert got.shape == (T,)
    assert np.allclose(got, _reference(schedule), rtol=0, atol=1e-12)


def test_cosine_ends_at_its_floor_and_step_cuts_after_the_milestone():
    cos = LRSchedule("cosine", floor=0.002).multipliers(LR, T)
    assert cos[0] == pytest.approx(1.0) and LR * cos[-1] == pytest.approx(0.002)
    step = LRSchedule("step", (0.75,), 0.1).multipliers(LR, T)
    assert step[29] == 1.0 and step[30] == pytest.approx(0.1)  # round 31 is the first cut


def test_plateau_matches_a_plain_loop():
    s = LRSchedule("plateau", factor=0.5, patience=2, threshold=0.01)
    losses = [1.0, 0.9, 0.895, 0.894, 0.80, 0.80, 0.80, 0.79, 0.5, 0.5, 0.5]
    state, got = PlateauState(), []
    for loss in losses:
        got.append(state.observe(loss, s))
    # reference: ReduceLROnPlateau(mode="min", threshold_mode="rel", cooldown=0)
    best, bad, mult, want = math.inf, 0, 1.0, []
    for loss in losses:
        if loss < best * (1 - s.threshold):
            best, bad = loss, 0
        else:
            bad += 1
            if bad >= s.patience:
                mult, bad = mult * s.factor, 0
        want.append(mult)
    assert got == want and state.cuts == 3


@pytest.mark.parametrize("data, key", [
    ({"kind": "weekly"}, "lr_schedule.kind"),
    ({"kind": "step", "milestones": [0.8, 0.4]}, "milestones"),
    ({"kind": "step", "milestones": [40]}, "milestones"),
    ({"kind": "step", "milestones": []}, "lr_schedule.milestones"),
    ({"kind": "step", "milestones": [0.5], "factor": 1.5}, "lr_schedule.factor"),
    ({"kind": "cosine", "floor": 0.5}, "lr_schedule.floor"),
    ({"kind": "cosine", "warmup_rounds": 40}, "lr_schedule.warmup_rounds"),
    ({"kind": "plateau", "patience": 0}, "lr_schedule.patience"),
])
def test_impossible_schedules_name_their_key(data, key):
    with pytest.raises(ParameterError, match=key):
        schedule_from_dict(data).check(LR, T)


def test_unknown_fields_are_refused():
    with pytest.raises(ParameterError, match="unknown key lr_schedule.gamma"):
        schedule_from_dict({"kind": "exponential", "gamma": 0.9})
