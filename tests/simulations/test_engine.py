"""The vectorized engine against the plain loop; K = 1 FedAvg against centralized SGD; seeds."""

import numpy as np
import pytest

from linattn_theory.problem import make_problem
from simulations.engine import Setting, simulate
from simulations.loop import run_single

SEEDS = [0, 3]


@pytest.fixture(scope="module")
def problem():
    return make_problem(dim=3, num_clients=3, context_length=4, kernel_heterogeneity=0.7,
                        value_heterogeneity=0.7, covariate_shift=0.5, seed=2)


def _setting(problem, **kw):
    args = dict(problem=problem, lr=0.1, local_steps=3, batch_size=4, total_rounds=6,
                warmup_rounds=(0, 2, 6), samples_per_client=16, test_samples=8)
    args.update(kw)
    return Setting(**args)


@pytest.mark.parametrize("kw", [
    {},
    {"parametrization": "factored", "rank": 2},
    {"participation": 0.67},
    {"attention": "softmax", "participation": 0.67},
    {"attention": "softmax", "parametrization": "factored"},
])
def test_vectorized_equals_plain_loop(problem, kw):
    """Every run (setting x seed x T0) of the engine equals the loop to 1e-12."""
    other = make_problem(dim=3, num_clients=3, context_length=4, kernel_heterogeneity=0.2,
                         value_heterogeneity=0.1, covariate_shift=0.0, seed=5)
    settings = [_setting(problem, **kw), _setting(other, lr=0.05, **kw)]
    results = simulate(settings, SEEDS)
    for st, res in zip(settings, results):
        for s, seed in enumerate(SEEDS):
            for j, t0 in enumerate(st.warmup_rounds):
                ref = run_single(st, seed, t0)
                np.testing.assert_allclose(res.kernels[s, : t0 + 1], ref.kernels, atol=1e-12)
                np.testing.assert_allclose(res.values[s, : t0 + 1], ref.values, atol=1e-12)
                np.testing.assert_allclose(res.reference_kernels[s, : t0 + 1],
                                           ref.reference_kernels, atol=1e-12)
                np.testing.assert_allclose(res.frozen_values[s, j, t0:], ref.frozen_values,
                                           atol=1e-12)


def test_k1_fedavg_equals_centralized_sgd(problem):
    """With K = 1 and full participation FedAvg is SGD on the pooled minibatch: the global
    model equals the drift-free reference in every round."""
    res = simulate(_setting(problem, local_steps=1, total_rounds=8, warmup_rounds=(8,)), SEEDS)
    np.testing.assert_allclose(res.kernels, res.reference_kernels, atol=1e-13)
    assert np.abs(res.kernels[:, -1] - res.kernels[:, 0]).max() > 1e-3  # it did move


def test_k_gt_1_fedavg_differs_from_reference(problem):
    res = simulate(_setting(problem, local_steps=3, warmup_rounds=(6,)), SEEDS)
    assert np.abs(res.kernels[:, -1] - res.reference_kernels[:, -1]).max() > 1e-6


def test_same_seed_same_numbers(problem):
    st = _setting(problem, participation=0.67)
    a, b = simulate(st, SEEDS), simulate(st, SEEDS)
    for name in ("kernels", "values", "reference_kernels", "frozen_values", "test_loss",
                 "grad_first"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c = simulate(st, [1, 2])
    assert not np.allclose(a.kernels[:, -1], c.kernels[:, -1])


def test_run_does_not_depend_on_its_group(problem):
    """A setting simulated alone or with others (and other seeds) gives the same numbers."""
    st = _setting(problem)
    alone = simulate(st, [3])
    together = simulate([st, _setting(problem, lr=0.05)], [0, 3])[0]
    np.testing.assert_allclose(alone.frozen_values[0], together.frozen_values[1], atol=1e-13)
