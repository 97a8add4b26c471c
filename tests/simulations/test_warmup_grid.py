"""simulations/warmup_grid.py: the design of the warm-up grid's parts."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from simulations.warmup_grid import FRESH3, FRESH4, FRESH5, LEVELS, PARTS, warmup_settings

# sha256 of "index part label" per line for settings 0..47 (development, held_out, fresh,
# fresh2), as reported in docs/results/validation.md
FIRST_48 = "a77aae24c054d89e0ac9c156c073dc6619ac4368ad9e978387788d4260cd7174"


def _digest(settings) -> str:
    text = "\n".join(f"{s.index} {s.part} {s.label}" for s in settings)
    return hashlib.sha256(text.encode()).hexdigest()


def test_fresh3_keeps_the_first_48_settings_and_the_default_count():
    every = warmup_settings(72)
    assert _digest(every[:48]) == FIRST_48 == _digest(warmup_settings(48))
    assert [s.label for s in warmup_settings()] == [s.label for s in every[:36]]
    assert [s.problem().kernel_teachers.tolist() for s in every[:48:7]] == \
        [s.problem().kernel_teachers.tolist() for s in warmup_settings(48)[::7]]
    assert Counter(s.part for s in every) == {"development": 20, "held_out": 8, "fresh": 8,
                                              "fresh2": 12, "fresh3": FRESH3}
    assert PARTS[4] == "fresh3" and [s.index for s in every] == list(range(72))


def test_fresh4_and_fresh5_keep_the_settings_before_them():
    every = warmup_settings(120)
    assert [s.label for s in every[:72]] == [s.label for s in warmup_settings(72)]
    assert [s.label for s in every[:96]] == [s.label for s in warmup_settings(96)]
    assert Counter(s.part for s in every[72:]) == {"fresh4": FRESH4, "fresh5": FRESH5}
    assert PARTS[-2:] == ("fresh4", "fresh5") and [s.index for s in every] == list(range(120))


@pytest.mark.parametrize("part", ["fresh3", "fresh4", "fresh5"])
def test_late_parts_are_balanced_designs(part):
    chosen = [s for s in warmup_settings(120) if s.part == part]
    assert len(chosen) == 24
    for name, levels in LEVELS.items():
        counts = Counter(getattr(s, name) for s in chosen)
        assert set(counts) == set(levels) and len(set(counts.values())) == 1, name
