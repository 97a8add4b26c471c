"""Population dynamics with a per-round step size eta_t against a plain per-round loop.

The oracle walks one T0 at a time: T0 FedAvg rounds (every client copies the global
parameters and takes K GD steps of size eta_t on its own f_m, the server averages with p_m)
next to the drift-free reference (K GD steps of size eta_t on F), then T - T0 frozen rounds on
V with M = M_T0 fixed, round t at eta_t; it is written from ``local_gradients``,
``global_loss`` and ``kernel_profile`` only. Every per-T0 output and error curve of
``population_dynamics(..., lr_schedule=...)`` must match it to 1e-12 (relative, absolute floor
1e-13 for differences of O(1) numbers). Without a schedule, and with a constant one, the
output is the constant-eta output bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from linattn_theory.dynamics import initial_point, population_dynamics
from linattn_theory.errors import ParameterError
from linattn_theory.objectives import global_loss, local_gradients
from linattn_theory.problem import make_problem
from linattn_theory.profile import kernel_profile, solve_profile
from linattn_theory.schedules import LRSchedule, schedule_from_dict, step_size_sequence

RTOL, ATOL = 1e-12, 1e-13
LR, STEPS, TOTAL = 0.05, 3, 24
T0S = [0, 1, 9, 18, 24]


def _problem(seed=1):
    return make_problem(dim=3, num_clients=3, context_length=4, out_dim=2,
                        kernel_heterogeneity=0.8, value_heterogeneity=0.6, covariate_shift=0.4,
                        weights="random", seed=seed)


def _oracle(problem, start, etas, t0, phi_star):
    c, p = problem.num_clients, problem.weights
    kernel, value = start.kernel, start.value
    ref_kernel, ref_value = kernel, value
    curve = [global_loss(problem, kernel, value) - phi_star]
    for t in range(t0):
        eta = etas[t]
        local_m = np.repeat(kernel[None], c, axis=0)
        local_v = np.repeat(value[None], c, axis=0)
        for _ in range(STEPS):
            gm, gv = local_gradients(problem, local_m, local_v)
            local_m, local_v = local_m - eta * gm, local_v - eta * gv
        kernel, value = np.tensordot(p, local_m, axes=1), np.tensordot(p, local_v, axes=1)
        for _ in range(STEPS):
            gm, gv = local_gradients(problem, ref_kernel, ref_value)
            ref_kernel = ref_kernel - eta * np.tensordot(p, gm, axes=1)
            ref_value = ref_value - eta * np.tensordot(p, gv, axes=1)
        curve.append(global_loss(problem, kernel, value) - phi_star)
    for t in range(t0, TOTAL):
        local_v = np.repeat(value[None], c, axis=0)
        for _ in range(STEPS):
            local_v = local_v - etas[t] * local_gradients(problem, kernel, local_v)[1]
        value = np.tensordot(p, local_v, axes=1)
        curve.append(global_loss(problem, kernel, value) - phi_star)
    phi, phi_ref = kernel_profile(problem, kernel), kernel_profile(problem, ref_kernel)
    return {"bias": phi_ref - phi_star, "drift": phi - phi_ref,
            "final_error": global_loss(problem, kernel, value) - phi_star,
            "value_error": global_loss(problem, kernel, value) - phi, "curve": np.array(curve)}


SCHEDULES = [
    LRSchedule("step", milestones=(0.75,), factor=0.1),
    LRSchedule("step", milestones=(5, 12), factor=0.5, warmup_rounds=3),
    LRSchedule("cosine", floor=0.005),
    LRSchedule("cosine", floor=0.0),
    LRSchedule("exponential", factor=0.9),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.kind)
def test_scheduled_dynamics_match_per_round_loop(schedule):
    problem = _problem()
    phi_star = solve_profile(problem).value
    start = initial_point(problem, seed=3)
    res = population_dynamics(problem, start, LR, STEPS, TOTAL, T0S, phi_star,
                              lr_schedule=schedule)
    etas = LR * schedule.multipliers(LR, TOTAL)
    np.testing.assert_array_equal(res.step_sizes, etas)
    for i, t0 in enumerate(T0S):
        ref = _oracle(problem, start, etas, t0, phi_star)
        for name in ("bias", "drift", "value_error", "final_error"):
            np.testing.assert_allclose(getattr(res, name)[i], ref[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name} at T0={t0}")
        np.testing.assert_allclose(res.error_curves[i], ref["curve"], rtol=RTOL, atol=ATOL,
                                   err_msg=f"error curve at T0={t0}")
    np.testing.assert_allclose(res.final_error, res.bias + res.drift + res.value_error,
                               rtol=1e-12, atol=1e-14)


def test_no_schedule_and_constant_schedule_are_bit_identical():
    problem = _problem(seed=2)
    phi_star = solve_profile(problem).value
    start = initial_point(problem, seed=1)
    base = population_dynamics(problem, start, LR, STEPS, TOTAL, T0S, phi_star)
    for schedule in (None, LRSchedule("constant"), "constant", {"kind": "constant"},
                     LRSchedule("step", milestones=(0.5,), factor=1.0)):
        other = population_dynamics(problem, start, LR, STEPS, TOTAL, T0S, phi_star,
                                    lr_schedule=schedule)
        for name in ("final_error", "bias", "drift", "frozen_floor", "contraction",
                     "error_curves", "kernels", "step_sizes"):
            np.testing.assert_array_equal(getattr(other, name), getattr(base, name),
                                          err_msg=f"{name} with {schedule!r}")
    np.testing.assert_array_equal(base.step_sizes, np.full(TOTAL, LR))


def test_decay_lowers_the_frozen_floor():
    """A 10x cut after 3/4 of the run: the floor is reported at the last step size, and
    D_frozen(M) shrinks with eta (eq. 17), so it lies below the constant-eta floor for every
    T0 that freezes (same kernels up to round 18, the milestone)."""
    problem = _problem()
    phi_star = solve_profile(problem).value
    start = initial_point(problem, seed=3)
    base = population_dynamics(problem, start, LR, STEPS, TOTAL, T0S, phi_star)
    cut = population_dynamics(problem, start, LR, STEPS, TOTAL, T0S, phi_star,
                              lr_schedule={"kind": "step", "milestones": [0.75], "factor": 0.1})
    same = np.array(T0S) <= 18
    np.testing.assert_array_equal(cut.kernels[:19], base.kernels[:19])
    assert np.all(cut.frozen_floor[same] < base.frozen_floor[same])


@pytest.mark.parametrize("schedule, key", [
    ({"kind": "plateau"}, "lr_schedule.kind"),
    ({"kind": "warp"}, "lr_schedule.kind"),
    ({"kind": "step", "milestones": [30]}, "lr_schedule.milestones"),
    ({"kind": "step", "milestones": [0.8, 0.5]}, "lr_schedule.milestones"),
    ({"kind": "step", "milestones": [0.5], "factor": 1.5}, "lr_schedule.factor"),
    ({"kind": "cosine", "floor": 0.2}, "lr_schedule.floor"),
    ({"kind": "cosine", "speed": 2}, "lr_schedule.speed"),
])
def test_impossible_schedules_name_their_key(schedule, key):
    problem = _problem()
    with pytest.raises(ParameterError, match=key.replace(".", r"\.")):
        population_dynamics(problem, initial_point(problem), LR, STEPS, TOTAL, [0, TOTAL], 0.0,
                            lr_schedule=schedule)


def test_step_size_sequence():
    assert step_size_sequence(0.1, 8) is None
    assert step_size_sequence(0.1, 8, "constant") is None
    etas = step_size_sequence(0.1, 8, schedule_from_dict({"kind": "step", "milestones": [0.5]}))
    np.testing.assert_allclose(etas, [0.1] * 4 + [0.01] * 4, rtol=1e-15)
