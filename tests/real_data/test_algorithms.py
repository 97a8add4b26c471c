"""Invariants of the algorithms: freezing, FedProx(0) = FedAvg, SCAFFOLD(1 client) = SGD."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import federation, random_partition, tiny_config, train_rounds

from linattn.errors import ConfigError
from real_data.algorithms import ALGORITHMS, get_algorithm, weighted_average
from real_data.engines import make_batches, task_loss
from real_data.federation import BYTES_PER_NUMBER
from real_data.models import names_of_kind


def _metric(records, rnd, name, client="global"):
    return next(v for r, c, k, v in records if r == rnd and c == client and k == name)


@pytest.mark.parametrize("train", ["all_but_qk", "v"])
def test_fedfrozen_qk_bit_identical_and_not_sent(digits, train):
    t0, rounds = 2, 4
    part = random_partition(digits, 4, seed=3, alpha=0.5)
    cfg = tiny_config("algorithm.name=fedfrozen", f"algorithm.warmup_rounds={t0}",
                      f"algorithm.train={train}", "train.clients_per_round=2")
    fed = federation(cfg, digits, part)
    qk = names_of_kind(fed.groups, "qk")
    seen = []
    engine = fed.engine

    def spy(job):  # record what the engine was asked to train
        seen.append(job.trainable)
        return engine(job)

    fed.engine = spy
    state, records = fed.initial_state(), []
    for rnd in range(1, rounds + 1):
        state, rec = fed.run_round(state, rnd)
        records += rec
        if rnd == t0:
            frozen = {n: state.global_params[n].clone() for n in qk}
    for n in qk:
        assert torch.equal(state.global_params[n], frozen[n]), n  # bit-identical
    assert all(not set(qk) & set(tr) for tr in seen[t0:])  # not trained after T0
    shapes = fed.algorithm.ctx.shapes
    total = sum(int(np.prod(s)) for s in shapes.values())
    n_qk = sum(int(np.prod(shapes[n])) for n in qk)
    trained = seen[-1]
    per_client_up = sum(int(np.prod(shapes[n])) for n in trained)
    assert _metric(records, 1, "bytes_up") == 2 * total * BYTES_PER_NUMBER
    assert _metric(records, rounds, "bytes_up") == 2 * per_client_up * BYTES_PER_NUMBER
    assert per_client_up <= total - n_qk
    if train == "v":
        assert set(trained) == set(names_of_kind(fed.groups, "v"))
    assert _metric(records, rounds, "qk_change") == 0.0


def test_fedfrozen_rejects_warmup_beyond_total(digits):
    with pytest.raises(ConfigError, match="warmup_rounds"):
        federation(tiny_config("train.rounds=3", "algorithm.warmup_rounds=4"), digits,
                   random_partition(digits, 2, seed=0))


def test_fedprox_with_mu_zero_equals_fedavg(digits):
    part = random_partition(digits, 3, seed=4, alpha=0.5)
    a = train_rounds(federation(tiny_config("algorithm.name=fedavg"), digits, part), 3)[0]
    b = train_rounds(federation(tiny_config("algorithm.name=fedprox", "algorithm.mu=0.0"),
                                digits, part), 3)[0]
    for n in a.global_params:
        assert torch.equal(a.global_params[n], b.global_params[n]), n


def test_fedprox_objective_includes_proximal_term(digits):
    part = random_partition(digits, 3, seed=4)
    _, rec = train_rounds(federation(tiny_config("algorithm.name=fedprox", "algorithm.mu=10"),
                                     digits, part), 2)
    assert _metric(rec, 2, "local_objective") > _metric(rec, 2, "train_loss")


def test_scaffold_one_client_equals_local_sgd(digits64):
    """With one client, c = c_1 after every round, so SCAFFOLD is R*K plain SGD steps."""
    part = random_partition(digits64, 1, seed=5)
    rounds, k, lr = 3, 3, 0.2
    cfg = tiny_config("algorithm.name=scaffold", "train.precision=fp64", "train.optimizer=sgd",
                      f"train.lr={lr}", f"train.local_steps={k}")
    fed = federation(cfg, digits64, part)
    state, _ = train_rounds(fed, rounds)
    # plain SGD with torch.optim on the same minibatches, from the same initial model
    params = {n: p.detach().clone().requires_grad_(True)
              for n, p in fed.initial_state().global_params.items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    x, y = fed.x_train, fed.y_train
    for rnd in range(1, rounds + 1):
        batches = make_batches(part.train, np.array([0]), cfg.role_seed("training"), rnd,
                               cfg.train.batch_size, k, None)
        for s in range(k):
            ix = batches.idx[0, s]
            opt.zero_grad()
            task_loss(torch.func.functional_call(fed.model, params, (x[ix],)), y[ix]).backward()
            opt.step()
    for n, p in params.items():
        torch.testing.assert_close(state.global_params[n], p.detach(), rtol=1e-10, atol=1e-12)


def test_aggregation_of_identical_clients_returns_that_client():
    gen = torch.Generator().manual_seed(0)
    one = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    stacked = one.unsqueeze(0).expand(4, 5, 7)
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    # sum_m p_m x = x (sum_m p_m) up to the rounding of a 4-term sum: a few ulps
    torch.testing.assert_close(weighted_average(stacked, weights), one, rtol=4e-16, atol=0)


def test_fedavg_round_of_identical_clients_returns_that_client(digits):
    """Two clients holding the same data and batches: the average is the client's model."""
    part = random_partition(digits, 2, seed=0)
    same = type(part)((part.train[0], part.train[0]), part.test, "iid", {}, 0)
    fed = federation(tiny_config("algorithm.name=fedavg"), digits, same)
    state = fed.initial_state()
    captured = {}
    engine = fed.engine

    def twin(job):  # give client 1 the batches of client 0
        job.batches = type(job.batches)(job.batches.idx[[0, 0]], job.batches.active[[0, 0]],
                                        job.batches.steps[[0, 0]])
        res = engine(job)
        captured.update(res.params)
        return res

    fed.engine = twin
    state, _ = fed.run_round(state, 1)
    for n, y in captured.items():
        assert torch.equal(y[0], y[1])
        torch.testing.assert_close(state.global_params[n], y[0], rtol=1e-6, atol=1e-7)


def test_registry_lists_valid_names():
    assert {"fedavg", "fedprox", "scaffold", "fedfrozen", "fedpart", "fedtp",
            "fedsq"} <= set(ALGORITHMS)
    with pytest.raises(ConfigError, match="valid: fedavg, fedprox, scaffold, fedfrozen"):
        get_algorithm("fedsgd")
