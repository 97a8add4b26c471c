"""scripts/auto_on_chosen.py: the probe rule's decision replayed from a run's summary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "auto_on_chosen.py"


def _module():
    spec = importlib.util.spec_from_file_location("auto_on_chosen", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_decision_replays_the_best_prediction_and_the_noise():
    """Predictions 0.9, 0.7, 0.5, 0.6, 0.8 at snapshots 0..32: smoothed by medians of three to
    0.9, 0.7, 0.6, 0.6, 0.8, the first lowest at round 16; sigma = 1.4826 median|second
    differences| / sqrt 6 (second differences 0, 0.3, 0.1: median 0.1)."""
    summary = {"predictions": [0.9, 0.7, 0.5, 0.6, 0.8], "snapshots": [0, 8, 16, 24, 32],
               "continuing_loss": 0.55, "stopped_at": 40}
    got = _module()._decision(summary)
    assert got["best_snapshot"] == 16
    assert got["best_prediction"] == pytest.approx(0.6)  # median of (0.7, 0.5, 0.6)
    assert got["noise"] == pytest.approx(1.4826 * 0.1 / np.sqrt(6.0), rel=1e-12)
    assert got["continuing_loss"] == 0.55
