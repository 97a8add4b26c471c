"""The finite-sample simulator (linattn_theory.sampled) against a plain reference: bit for bit.

The reference below is the simulator written straight from its definition: each minibatch is
gathered with fancy indexing from (C, N, ...) arrays, the per-sequence products are formed step
by step, and the frozen rounds gather their features step by step. ``sample_clients``,
``probe_run`` and ``rule_run`` must return exactly the reference's numbers (np.array_equal on
every array, == on every float; only the sign of an exact zero may differ) on problems with
d_y = 1 and 2, covariate shift, unequal weights, K = 1, a batch larger than the training split,
a run that stops early and one that reaches T. The problem of ``benchmarks/bench_warmup.py``
is pinned to its probe run's numbers (rel. 1e-12, so that another BLAS build passes too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from linattn_theory import sampled
from linattn_theory.dynamics import initial_point
from linattn_theory.errors import ParameterError
from linattn_theory.freeze_rules import make_rule
from linattn_theory.probe import ProbeSelector
from linattn_theory.problem import make_problem
from linattn_theory.sampled import probe_run, rule_run, sample_clients

# --- the reference simulator ---------------------------------------------------------------


@dataclass(frozen=True)
class _Data:
    query: np.ndarray
    sigma_hat: np.ndarray
    target: np.ndarray
    val_query: np.ndarray
    val_sigma_hat: np.ndarray
    val_target: np.ndarray


def ref_sample_clients(problem, samples_per_client, validation_fraction, rng):
    c, d, n = problem.num_clients, problem.dim, problem.context_length
    chol = np.linalg.cholesky(problem.covariances)
    z = rng.standard_normal((c, samples_per_client, n + 1, d))
    x = z @ np.swapaxes(chol, 1, 2)[:, None]
    query, context = x[:, :, 0], x[:, :, 1:]
    sigma_hat = np.swapaxes(context, 2, 3) @ context / n
    a_star = query @ problem.kernel_teachers
    target = (sigma_hat @ a_star[..., None])[..., 0] @ problem.value_teachers
    target = target + problem.noise * rng.standard_normal(target.shape)
    n_val = max(1, int(round(validation_fraction * samples_per_client)))
    cut = samples_per_client - n_val
    return _Data(query[:, :cut], sigma_hat[:, :cut], target[:, :cut],
                 query[:, cut:], sigma_hat[:, cut:], target[:, cut:])


def _ref_features(kernel, query, sigma_hat):
    return (sigma_hat @ (query @ kernel)[..., None])[..., 0]


def _ref_penalty(problem, kernel, value):
    return 0.5 * (problem.ridge * float(np.sum(value * value))
                  + problem.kernel_ridge * float(np.sum(kernel * kernel)))


def _ref_val_loss_from(problem, data, val_feats, value):
    res = val_feats @ value - data.val_target
    return float(problem.weights @ (0.5 * np.mean(np.sum(res * res, axis=-1), axis=1)))


def _ref_validation_loss(problem, data, kernel, value):
    feats = _ref_features(kernel, data.val_query, data.val_sigma_hat)
    return _ref_val_loss_from(problem, data, feats, value) + _ref_penalty(problem, kernel, value)


def _ref_warmup_round(problem, data, kernel, value, lr, batches):
    c = problem.num_clients
    m = np.broadcast_to(kernel, (c, *kernel.shape)).copy()
    v = np.broadcast_to(value, (c, *value.shape)).copy()
    rows = np.arange(c)[:, None]
    shrink_m, shrink_v = 1 - lr * problem.kernel_ridge, 1 - lr * problem.ridge
    for idx in batches:
        q, s, y = data.query[rows, idx], data.sigma_hat[rows, idx], data.target[rows, idx]
        za = (s @ (q @ m)[..., None])[..., 0]
        res = za @ v - y
        scale = lr / idx.shape[1]
        grad_v = za.mT @ res
        grad_m = q.mT @ (s @ (res @ v.mT)[..., None])[..., 0]
        m *= shrink_m
        m -= scale * grad_m
        v *= shrink_v
        v -= scale * grad_v
    p = problem.weights
    return np.tensordot(p, m, axes=1), np.tensordot(p, v, axes=1)


def _ref_frozen_rounds(problem, data, feats, value, lr, schedule):
    c = problem.num_clients
    rows = np.arange(c)[:, None]
    out = [value]
    shrink = 1 - lr * problem.ridge
    for batches in schedule:
        v = np.broadcast_to(value, (c, *value.shape)).copy()
        for idx in batches:
            u, y = feats[rows, idx], data.target[rows, idx]
            res = u @ v - y
            v *= shrink
            v -= (lr / idx.shape[1]) * (u.mT @ res)
        value = np.tensordot(problem.weights, v, axes=1)
        out.append(value)
    return out


def ref_probe_run(problem, start, lr, local_steps, total_rounds, seed=0, batch_size=256,
                  samples_per_client=4096, validation_fraction=0.25, interval=None,
                  probe_rounds=10, patience=4, max_rate=1.0, margin=1.0, window=4):
    t_total = int(total_rounds)
    interval = max(1, t_total // 25) if interval is None else int(interval)
    data_rng, draw_rng = (np.random.default_rng(s)
                          for s in np.random.SeedSequence(seed).spawn(2))
    data = ref_sample_clients(problem, samples_per_client, validation_fraction, data_rng)
    c, n_train = problem.num_clients, data.query.shape[1]
    bsz = min(batch_size, n_train)

    def draws():
        return [draw_rng.integers(0, n_train, size=(c, bsz)) for _ in range(local_steps)]

    probe_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
    probe_draws = [[probe_rng.integers(0, n_train, size=(c, bsz)) for _ in range(local_steps)]
                   for _ in range(probe_rounds)]
    selector = ProbeSelector(t_total, patience=patience, window=window, max_rate=max_rate,
                             margin=margin)
    snapshots = {}
    kernel, value = start.kernel.astype(np.float64), start.value.astype(np.float64)
    stopped, continuing = t_total, None
    with np.errstate(over="raise", invalid="raise"):
        for t in range(t_total + 1):
            if t % interval == 0 and t < t_total:
                snapshots[t] = (kernel, value)
                feats = _ref_features(kernel, data.query, data.sigma_hat)
                val_feats = _ref_features(kernel, data.val_query, data.val_sigma_hat)
                path = _ref_frozen_rounds(problem, data, feats, value, lr, probe_draws)
                losses = [_ref_val_loss_from(problem, data, val_feats, v)
                          + _ref_penalty(problem, kernel, v) for v in path]
                if selector.add(t, losses):
                    stopped = t
                    break
            if t == t_total:
                continuing = _ref_validation_loss(problem, data, kernel, value)
                break
            kernel, value = _ref_warmup_round(problem, data, kernel, value, lr, draws())
    choice = selector.choose(stopped, continuing)
    frozen = 0
    if choice.warmup_rounds < t_total:
        kernel, value = snapshots[choice.warmup_rounds]
        feats = _ref_features(kernel, data.query, data.sigma_hat)
        frozen = t_total - choice.warmup_rounds
        value = _ref_frozen_rounds(problem, data, feats, value, lr,
                                   [draws() for _ in range(frozen)])[-1]
    used = {"warmup": stopped, "probe": choice.probe_rounds_used, "frozen": frozen}
    used["fedavg_equivalent"] = (stopped + choice.probe_rounds_used + frozen) / t_total
    return choice, kernel, value, used


def ref_rule_run(problem, start, lr, local_steps, total_rounds, rules, seed=0, batch_size=256,
                 samples_per_client=4096, validation_fraction=0.25, probe_rows=16):
    t_total = int(total_rounds)
    made = {str(r): make_rule(str(r), t_total) for r in rules}
    data_rng, draw_rng = (np.random.default_rng(s)
                          for s in np.random.SeedSequence(seed).spawn(2))
    data = ref_sample_clients(problem, samples_per_client, validation_fraction, data_rng)
    c, n_train = problem.num_clients, data.query.shape[1]
    bsz = min(batch_size, n_train)
    probe_rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[3])
    chol = np.linalg.cholesky(problem.covariances)
    owner = np.arange(probe_rows) % c
    z = probe_rng.standard_normal((probe_rows, problem.context_length + 1, problem.dim))
    x = np.einsum("rnd,red->rne", z, chol[owner])
    probe_query, probe_context = x[:, 0], x[:, 1:]
    kernel, value = start.kernel.astype(np.float64), start.value.astype(np.float64)
    first = _ref_validation_loss(problem, data, kernel, value)
    scale = abs(first) if first != 0 else 1.0
    rounds = 0
    with np.errstate(over="raise", invalid="raise"):
        for t in range(1, t_total):
            if all(r.fired_at is not None for r in made.values()):
                break
            draws = [draw_rng.integers(0, n_train, size=(c, bsz)) for _ in range(local_steps)]
            new_kernel, new_value = _ref_warmup_round(problem, data, kernel, value, lr, draws)
            signals = {"delta": new_kernel - kernel, "lr": lr,
                       "other_deltas": {"value": new_value - value},
                       "scores": np.einsum("rd,de,rne->rn", probe_query, new_kernel,
                                           probe_context)}
            kernel, value = new_kernel, new_value
            signals["val_score"] = -_ref_validation_loss(problem, data, kernel, value) / scale
            rounds = t
            for r in made.values():
                r.observe(t, **{k: signals[k] for k in r.needs})
    return ({k: r.warmup_rounds for k, r in made.items()},
            {k: list(r.signal) for k, r in made.items()}, rounds)


# --- the comparisons --------------------------------------------------------------------------

# (problem, run) settings: d_y = 1 and 2, covariate shift, random weights, K = 1, B > N_train,
# interval and probe length off their defaults; runs that stop early (one at T0 = 0) and runs
# that reach T
CASES = {
    "dy1": (dict(dim=4, num_clients=3, context_length=5, kernel_heterogeneity=0.8,
                 value_heterogeneity=0.6, seed=1),
            dict(lr=0.1, local_steps=3, total_rounds=60, seed=0, batch_size=16,
                 samples_per_client=96)),
    "dy2_shift": (dict(dim=3, num_clients=4, out_dim=2, context_length=4, covariate_shift=0.5,
                       kernel_heterogeneity=0.9, value_heterogeneity=0.9, weights="random",
                       seed=2),
                  dict(lr=0.08, local_steps=4, total_rounds=100, seed=3, batch_size=8,
                       samples_per_client=70, validation_fraction=0.3, probe_rounds=6,
                       patience=2)),
    "dy2_to_the_end": (dict(dim=3, num_clients=4, out_dim=2, context_length=4,
                            covariate_shift=0.5, kernel_heterogeneity=0.9,
                            value_heterogeneity=0.9, weights="random", seed=2),
                       dict(lr=0.08, local_steps=4, total_rounds=50, seed=3, batch_size=8,
                            samples_per_client=70, validation_fraction=0.3, probe_rounds=6)),
    "k1_big_batch": (dict(dim=5, num_clients=2, context_length=3, kernel_heterogeneity=0.4,
                          value_heterogeneity=0.4, seed=4),
                     dict(lr=0.05, local_steps=1, total_rounds=40, seed=5, batch_size=64,
                          samples_per_client=41, interval=3, patience=2)),
    "dy1_to_the_end": (dict(dim=3, num_clients=3, context_length=6, kernel_heterogeneity=0.0,
                            value_heterogeneity=0.0, seed=6),
                       dict(lr=0.1, local_steps=2, total_rounds=30, seed=7, batch_size=12,
                            samples_per_client=50, patience=30)),
}


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=True))


@pytest.mark.parametrize("seed", [0, 11])
@pytest.mark.parametrize("case", ["dy1", "dy2_shift"])
def test_sample_clients_matches_reference(case, seed):
    problem = make_problem(**CASES[case][0])
    run = CASES[case][1]
    args = (run["samples_per_client"], run.get("validation_fraction", 0.25))
    new = sample_clients(problem, *args, np.random.default_rng(seed))
    ref = ref_sample_clients(problem, *args, np.random.default_rng(seed))
    for name in ("query", "sigma_hat", "target", "val_query", "val_sigma_hat", "val_target"):
        assert _same(getattr(new, name), getattr(ref, name)), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_probe_run_matches_reference(case):
    spec, run = CASES[case]
    problem = make_problem(**spec)
    start = initial_point(problem)
    lr, steps, total = run["lr"], run["local_steps"], run["total_rounds"]
    rest = {k: v for k, v in run.items() if k not in ("lr", "local_steps", "total_rounds")}
    new = probe_run(problem, start, lr, steps, total, **rest)
    choice, kernel, value, used = ref_probe_run(problem, start, lr, steps, total, **rest)
    assert new.choice == choice
    assert _same(new.kernel, kernel) and _same(new.value, value)
    assert new.rounds_computed == used
    short = probe_run(problem, start, lr, steps, total, finish=False, **rest)
    assert short.choice == choice and short.rounds_computed == used
    assert _same(short.kernel, kernel)
    assert _same(short.value, value) == (used["frozen"] == 0)
    assert (choice.stopped_at == total) == case.endswith("to_the_end")
    assert (used["frozen"] > 0) == (case in ("dy1", "dy2_shift", "k1_big_batch"))


@pytest.mark.parametrize("clients_per_group", [1, 2])
@pytest.mark.parametrize("case", ["dy1", "dy2_shift"])
def test_client_groups_give_the_same_numbers(case, clients_per_group, monkeypatch):
    """A warm-up round runs the clients in groups sized by a byte budget; forced to groups of
    one or two clients (3 clients in dy1: a group of 2 and one of 1), the run is the
    reference's to the bit."""
    spec, run = CASES[case]
    problem = make_problem(**spec)
    row_bytes = 64 * -(-(problem.dim**2 + problem.dim + problem.out_dim) // 8)
    monkeypatch.setattr(sampled, "_GATHER_BYTES", clients_per_group * run["batch_size"]
                        * row_bytes)
    start = initial_point(problem)
    lr, steps, total = run["lr"], run["local_steps"], run["total_rounds"]
    rest = {k: v for k, v in run.items() if k not in ("lr", "local_steps", "total_rounds")}
    data = sample_clients(problem, run["samples_per_client"],
                          run.get("validation_fraction", 0.25), np.random.default_rng(0))
    assert sampled._Steps(problem, data, lr, run["batch_size"]).group == clients_per_group
    new = probe_run(problem, start, lr, steps, total, **rest)
    choice, kernel, value, used = ref_probe_run(problem, start, lr, steps, total, **rest)
    assert new.choice == choice and new.rounds_computed == used
    assert _same(new.kernel, kernel) and _same(new.value, value)


@pytest.mark.parametrize("case", ["dy1", "dy2_shift"])
def test_rule_run_matches_reference(case):
    spec, run = CASES[case]
    problem = make_problem(**spec)
    start = initial_point(problem)
    keys = ("seed", "batch_size", "samples_per_client", "validation_fraction")
    rest = {k: run[k] for k in keys if k in run}
    rules = ["perturbation", "norm_change", "norm_change_median", "kernel_stability", "plateau"]
    new = rule_run(problem, start, run["lr"], run["local_steps"], run["total_rounds"], rules,
                   **rest)
    fired, signals, rounds = ref_rule_run(problem, start, run["lr"], run["local_steps"],
                                          run["total_rounds"], rules, **rest)
    assert new.warmup_rounds == fired and new.rounds_run == rounds
    for name in signals:
        assert _same(new.signals[name], signals[name]), name


def test_recommend_warmup_reports_the_reference_probe():
    """recommend_warmup's probe estimate and compute are the reference run's (its defaults)."""
    from linattn_theory.advice import PROBE_DEFAULTS
    from linattn_theory.warmup import recommend_warmup

    problem = make_problem(**CASES["dy1"][0])
    advice = recommend_warmup(problem, lr=0.1, local_steps=3, total_rounds=60)
    choice, _, _, used = ref_probe_run(problem, initial_point(problem), 0.1, 3, 60,
                                       **PROBE_DEFAULTS)
    assert advice.probe_estimate == choice.warmup_rounds and advice.probe_compute == used
    assert advice.probe_error == float(advice.path.final_error[choice.warmup_rounds])


def test_divergence_is_reported_in_the_same_round():
    spec, run = CASES["dy2_shift"]
    problem = make_problem(**{**spec, "seed": 0})
    start = initial_point(problem)
    rest = {k: v for k, v in run.items() if k not in ("lr", "local_steps", "total_rounds")}
    with pytest.raises(ParameterError, match="diverged in round 5;"):
        probe_run(problem, start, 0.08, 4, 100, **rest)
    with pytest.raises(FloatingPointError):
        ref_probe_run(problem, start, 0.08, 4, 100, **rest)


def test_benchmark_problem_is_pinned():
    """The probe run of benchmarks/bench_warmup.py's problem (d = 16, 20 clients, T = 500)."""
    from linattn_theory.advice import PROBE_DEFAULTS

    problem = make_problem(dim=16, num_clients=20, kernel_heterogeneity=0.5,
                           value_heterogeneity=0.5)
    run = probe_run(problem, initial_point(problem), 0.05, 5, 500, **PROBE_DEFAULTS)
    c = run.choice
    assert (c.warmup_rounds, c.snapshots, c.stopped_at, c.probe_rounds_used) == \
        (40, (0, 20, 40, 60, 80, 100, 120, 140), 140, 80)
    assert run.rounds_computed == {"warmup": 140, "probe": 80, "frozen": 460,
                                   "fedavg_equivalent": 1.36}
    pinned = [0.7796593847346235, 0.6315776436095716, 0.6188519742017108, 0.6192169526271857,
              0.620038108983673, 0.6200227413576503, 0.6200705272705224, 0.6204963361833323]
    assert c.predictions == pytest.approx(pinned, rel=1e-12)
    assert c.predicted_loss == pytest.approx(0.6192169526271857, rel=1e-12)
    assert c.rate == pytest.approx(0.911137618372566, rel=1e-12)
    sums = (float(np.sum(run.kernel)), float(np.sum(run.value)), float(np.sum(run.value**2)))
    assert sums == pytest.approx((0.014235440000120114, 0.05713502169759027, 4.32918734786653),
                                 rel=1e-10)


@pytest.mark.parametrize("case", ["dy1", "dy2_shift"])
def test_adaptive_probes_are_prefixes_of_the_fixed_probes(case, monkeypatch):
    """Adaptive probes (``max_probe_fraction``) continue on the same minibatch draws: with a
    cap equal to the first length the run is the fixed run to the bit; with a length rule
    that always doubles (to min(cap, T - t) rounds), one rate per probe (window 1), each
    prediction is the one of the fixed run with cap rounds (equal to 1e-12; past the horizon
    both read the same curve value)."""
    spec, run = CASES[case]
    problem = make_problem(**spec)
    start = initial_point(problem)
    lr, steps, total = run["lr"], run["local_steps"], run["total_rounds"]
    rest = {k: v for k, v in run.items() if k not in ("lr", "local_steps", "total_rounds")}
    r0 = rest.pop("probe_rounds", 10)
    fixed = probe_run(problem, start, lr, steps, total, probe_rounds=r0, **rest)
    same = probe_run(problem, start, lr, steps, total, probe_rounds=r0,
                     max_probe_fraction=r0 / total, **rest)
    assert same.choice == fixed.choice and same.rounds_computed == fixed.rounds_computed
    assert _same(same.value, fixed.value)
    cap = 4 * r0
    long = probe_run(problem, start, lr, steps, total, probe_rounds=cap, window=1, **rest)

    def always_double(losses, horizon, max_rounds, *args):
        r = len(losses) - 1
        return min(2 * r, max_rounds, horizon) if r < min(max_rounds, horizon) else r

    monkeypatch.setattr(sampled, "probe_length", always_double)
    grown = probe_run(problem, start, lr, steps, total, probe_rounds=r0, window=1,
                      max_probe_fraction=cap / total, **rest)
    assert grown.choice.warmup_rounds == long.choice.warmup_rounds
    assert grown.choice.predictions == pytest.approx(long.choice.predictions, abs=1e-12)
    horizons = total - np.asarray(grown.choice.snapshots)
    assert grown.choice.probe_rounds_used == int(np.sum(np.minimum(cap, horizons)))


@pytest.mark.parametrize("case", ["dy1", "dy2_shift", "dy1_to_the_end"])
def test_probe_fraction_is_the_same_run_as_its_absolute_length(case):
    """``probe_fraction=f`` runs probes of round(f T) rounds: the same run, to the bit, as
    ``probe_rounds=round(f T)`` (choice, cost and final model)."""
    spec, run = CASES[case]
    problem = make_problem(**spec)
    start = initial_point(problem)
    lr, steps, total = run["lr"], run["local_steps"], run["total_rounds"]
    rest = {k: v for k, v in run.items()
            if k not in ("lr", "local_steps", "total_rounds", "probe_rounds")}
    for fraction in (0.1, 0.13):
        rounds = int(round(fraction * total))
        absolute = probe_run(problem, start, lr, steps, total, probe_rounds=rounds, **rest)
        shared = probe_run(problem, start, lr, steps, total, probe_rounds=99,
                           probe_fraction=fraction, **rest)
        assert shared.choice == absolute.choice
        assert shared.rounds_computed == absolute.rounds_computed
        assert _same(shared.kernel, absolute.kernel) and _same(shared.value, absolute.value)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan"), float("inf"), True, "0.1",
                                      0.01])
def test_bad_probe_fraction_names_the_parameter(fraction):
    """A share outside (0, 1], not a number, or one giving fewer than 2 rounds (0.01 of
    T = 60) exits with ParameterError naming ``probe_fraction``."""
    problem = make_problem(**CASES["dy1"][0])
    with pytest.raises(ParameterError, match="probe_fraction="):
        probe_run(problem, initial_point(problem), 0.1, 3, 60, probe_fraction=fraction)
