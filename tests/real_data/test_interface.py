"""The algorithm interface carries what FedPart/FedTP/FedSQ need; FLOPs; the T0 probe."""

from __future__ import annotations

import pytest
import torch
from conftest import federation, random_partition, tiny_config, train_rounds

from real_data.algorithms import FedAvg, RoundPlan
from real_data.models import names_of_kind


class PersonalQK(FedAvg):
    """Vanilla personalization of Q/K: each client keeps its own Q/K between rounds.

    ``frozen=True`` additionally keeps the personal Q/K fixed during local training, so the
    engines see per-client values of a frozen parameter.
    """

    frozen = False

    def __init__(self, params, ctx):
        super().__init__(params, ctx)
        self.qk = names_of_kind(ctx.groups, "qk")
        self.rest = tuple(n for n in ctx.names if n not in self.qk)

    def init_client_state(self, global_params):
        n = self.ctx.num_clients
        gen = torch.Generator().manual_seed(0)
        return {q: global_params[q].unsqueeze(0).repeat(n, *[1] * global_params[q].dim())
                + 0.05 * torch.randn(n, *global_params[q].shape, generator=gen,
                                     dtype=global_params[q].dtype)
                for q in self.qk}

    def plan_round(self, rnd, server_state):
        train = self.rest if self.frozen else self.ctx.names
        return RoundPlan(train, self.rest, self.rest)

    def client_start(self, client_ids, global_params, client_state, server_state):
        return {q: client_state[q][torch.as_tensor(client_ids)] for q in self.qk}

    def update_client_state(self, rnd, client_ids, global_params, results, client_state,
                            server_state):
        if not self.frozen:
            for q in self.qk:
                client_state[q][torch.as_tensor(client_ids)] = results.params[q]

    def eval_params(self, client_id, global_params, client_state, server_state):
        return {**global_params, **{q: client_state[q][client_id] for q in self.qk}}


class PersonalFrozenQK(PersonalQK):
    frozen = True


@pytest.mark.parametrize("algo", [PersonalQK, PersonalFrozenQK])
def test_personalized_state_and_evaluation_agree_across_engines(digits64, algo):
    part = random_partition(digits64, 3, seed=0, alpha=0.5)
    out = {}
    for engine in ("vectorized", "sequential"):
        fed = federation(tiny_config("algorithm.name=fedavg", "train.precision=fp64",
                                     f"train.engine={engine}", "train.optimizer=sgd",
                                     "train.lr=0.2"), digits64, part)
        fed.algorithm = algo(fed.algorithm.params, fed.algorithm.ctx)
        state, records = train_rounds(fed, 2)
        out[engine] = (state, {(c, k): v for r, c, k, v in records if r == 2})
    (sv, rv), (ss, rs) = out["vectorized"], out["sequential"]
    for q, v in sv.client_state.items():
        torch.testing.assert_close(v, ss.client_state[q], rtol=1e-6, atol=1e-9)
    for n in sv.global_params:
        torch.testing.assert_close(sv.global_params[n], ss.global_params[n], rtol=1e-6,
                                   atol=1e-9)
    assert rv[("0", "local_test_acc")] == pytest.approx(rs[("0", "local_test_acc")])
    if algo.frozen:  # personal Q/K never change
        init = federation(tiny_config("algorithm.name=fedavg", "train.precision=fp64"),
                          digits64, part)
        init.algorithm = algo(init.algorithm.params, init.algorithm.ctx)
        start = init.initial_state().client_state
        assert all(torch.equal(start[q], sv.client_state[q]) for q in start)


def test_frozen_stage_costs_fewer_flops_and_bytes(digits):
    part = random_partition(digits, 2, seed=0)
    fed = federation(tiny_config("algorithm.name=fedfrozen", "algorithm.warmup_rounds=1",
                                 "algorithm.train=v"), digits, part)
    _, rec = train_rounds(fed, 2)
    get = {(r, k): v for r, c, k, v in rec if c == "global"}
    assert get[(2, "train_flops")] < get[(1, "train_flops")]
    assert get[(2, "bytes_up")] < get[(1, "bytes_up")]
    # round 2 sends Q/K down once (clients did not hold the round-T0 values yet)
    assert get[(2, "bytes_down")] > get[(2, "bytes_up")]


