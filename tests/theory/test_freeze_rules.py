"""The online freeze-timing rules (linattn_theory.freeze_rules): each rule's criterion on signals
built to meet it or not, the common minimum wait, never firing, and bad specs."""

import math

import numpy as np
import pytest

from linattn_theory.errors import ParameterError
from linattn_theory.freeze_rules import make_rule, min_wait, parse_rule


def _feed(rule, rounds, **make):
    for t in range(1, rounds + 1):
        rule.observe(t, **{k: f(t) for k, f in make.items() if k in rule.needs})
    return rule.warmup_rounds


def test_min_wait():
    assert min_wait(40) == 5 and min_wait(200) == 10 and min_wait(201) == 11 and min_wait(3) == 3


def test_perturbation_fires_on_noise_not_on_drift():
    rng = np.random.default_rng(0)
    drift = make_rule("perturbation", 200)
    assert _feed(drift, 199, delta=lambda t: 1.0 + 0.1 * rng.standard_normal(50)) == 200
    noise = make_rule("perturbation", 200)
    t0 = _feed(noise, 199, delta=lambda t: rng.standard_normal(50))
    # the score starts at 1 (one update) and falls to about sqrt(0.1/1.9) = 0.229 under noise
    assert min_wait(200) <= t0 < 60
    assert noise.signal[0] == pytest.approx(1.0)
    level = math.sqrt(0.1 / 1.9)
    assert all(s <= level for s in noise.signal[t0 - 3:t0])
    assert noise.signal[t0 - 4] > level
    assert noise.state_bytes == 2 * 50 * 8  # the two averages of a 50-vector, float64


def test_norm_change_interval_rule():
    # T = 100: intervals of 5 rounds; g_k = ||sum of 5 updates|| / mean lr
    steady = make_rule("norm_change", 100)
    assert _feed(steady, 99, delta=lambda t: np.ones(4), lr=lambda t: 0.1) == 10
    assert steady.signal[9] == pytest.approx(0.0)  # the second interval ends at round 10
    growing = make_rule("norm_change", 100)
    assert _feed(growing, 99, delta=lambda t: np.ones(4) * 2.0 ** t, lr=lambda t: 0.1) == 100


def test_norm_change_median_compares_with_other_blocks():
    rule = make_rule("norm_change_median", 100)
    t0 = _feed(rule, 99, delta=lambda t: np.ones(3) * (1.0 + 0.01 * t), lr=lambda t: 0.1,
               other_deltas=lambda t: {"v": np.ones(3) * 1.5 ** t, "mlp": np.ones(3) * t})
    assert t0 == 10
    never = make_rule("norm_change_median", 100)
    assert _feed(never, 99, delta=lambda t: np.ones(3) * 1.5 ** t, lr=lambda t: 0.1,
                 other_deltas=lambda t: {"v": np.ones(3)}) == 100


def test_kernel_stability_hamming():
    rng = np.random.default_rng(1)
    fixed = rng.standard_normal((8, 20))
    stable = make_rule("kernel_stability", 100)
    assert _feed(stable, 99, scores=lambda t: fixed + 1e-3 * t) == 5  # 5 masks, min wait 5
    moving = make_rule("kernel_stability", 100)
    assert _feed(moving, 99, scores=lambda t: rng.standard_normal((8, 20))) == 100
    with pytest.raises(ParameterError, match="scores"):
        make_rule("kernel_stability", 10).observe(1, scores=np.ones(3))


def test_plateau():
    rule = make_rule("plateau", 100)
    # improves by 0.01 a round until round 20, then flat: fires once 10 flat rounds follow
    assert _feed(rule, 99, val_score=lambda t: min(t, 20) * 0.01) == 30
    # evaluated every 5 rounds: the window is still 10 rounds (two evaluations), not 10 of them
    sparse = make_rule("plateau", 100)
    for t in range(5, 100, 5):
        if sparse.observe(t, val_score=min(t, 20) * 0.01):
            break
    assert sparse.warmup_rounds == 30
    climbing = make_rule("plateau", 100)
    assert _feed(climbing, 99, val_score=lambda t: t * 0.01) == 100


def test_fraction_and_parse():
    assert _feed(make_rule("fraction=0.3", 50), 49) == 15
    assert make_rule("fraction=0", 50).warmup_rounds == 0
    assert _feed(make_rule("fraction=1", 50), 49) == 50
    assert _feed(make_rule("fraction=0.02", 100), 99) == 2  # the fixed schedule has no wait
    assert parse_rule("fraction=0.25") == ("fraction", 0.25)
    for bad, key in [("fraction=1.5", "fraction"), ("fraction=x", "fraction"),
                     ("freeze_soon", "warmup rule"), ("plateau=3", "warmup rule")]:
        with pytest.raises(ParameterError, match=key):
            make_rule(bad, 10)


def test_missing_signal_is_named():
    with pytest.raises(ParameterError, match="lr"):
        make_rule("norm_change", 10).observe(1, delta=np.ones(2))
