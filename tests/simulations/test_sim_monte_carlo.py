"""Monte Carlo: the simulator's losses and gradients converge to the exact closed forms."""

import numpy as np
import torch

from linattn_theory.dynamics import initial_point
from linattn_theory.objectives import client_gradients, client_losses
from linattn_theory.problem import make_problem
from simulations.data import sample_client_data
from simulations.engine import Setting, simulate
from simulations.model import kernel_value_gradients, sequence_loss


def _problem():
    return make_problem(dim=4, num_clients=3, context_length=6, kernel_heterogeneity=0.8,
                        value_heterogeneity=0.8, covariate_shift=0.7, seed=4)


def _per_sequence(problem, kernel, value, samples, seed):
    data = sample_client_data(problem, samples, seed)
    batch = {k: torch.as_tensor(getattr(data, k)) for k in ("sigma_hat", "query", "target")}
    m = torch.as_tensor(kernel)[None]  # broadcast over clients
    v = torch.as_tensor(value)[None]
    loss = sequence_loss(m, v, batch, "linear")  # (C,) means over N sequences
    gm, gv = kernel_value_gradients(m, v, batch, "linear", 0.0, 0.0)
    return loss.numpy(), gm.numpy(), gv.numpy()


def test_mean_loss_and_gradient_converge_to_population():
    """Mean over 16 data sets of N sequences: |mean - exact| <= 4 SE for every client and
    entry, and the SE shrinks like 1/sqrt(N) (N = 500 -> 8000: factor ~4)."""
    prob = _problem()
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((4, 4)) / 2
    value = rng.standard_normal((4, 1)) / 2
    exact_loss = client_losses(prob, kernel, value)
    exact_gm, exact_gv = client_gradients(prob, kernel, value)
    ses = []
    for n in (500, 8000):
        runs = [_per_sequence(prob, kernel, value, n, seed) for seed in range(16)]
        for k, exact in enumerate((exact_loss, exact_gm, exact_gv)):
            x = np.stack([r[k] for r in runs])
            mean, se = x.mean(0), x.std(0, ddof=1) / 4.0
            assert np.all(np.abs(mean - exact) <= 4 * se + 1e-12), (n, k)
            if k == 0:
                ses.append(se.mean())
    assert 2.5 < ses[0] / ses[1] < 6.0


def test_simulated_test_loss_matches_exact_population_loss():
    """The engine's test loss at the start and after training equals the exact population
    loss sum_m p_m L_m of the same parameters within 4 SE over seeds."""
    prob = _problem()
    st = Setting(problem=prob, lr=0.02, local_steps=2, batch_size=8, total_rounds=4,
                 warmup_rounds=(4,), samples_per_client=64, test_samples=2000)
    res = simulate(st, list(range(12)))
    assert np.all(np.isfinite(res.kernels))
    start = initial_point(prob, 0.3, seed=1)
    exact0 = prob.weights @ client_losses(prob, start.kernel, start.value)
    diffs = [res.test_loss[:, 0] - exact0]
    exact_t = [prob.weights @ client_losses(prob, m, v)
               for m, v in zip(res.kernels[:, -1], res.values[:, -1])]
    diffs.append(res.test_loss[:, -1] - np.asarray(exact_t))
    for d in diffs:
        assert abs(d.mean()) <= 4 * d.std(ddof=1) / np.sqrt(d.size)
