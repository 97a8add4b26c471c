"""The vectorized engine agrees with the sequential reference (plain loop, torch.optim)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import federation, random_partition, tiny_config, train_rounds

from real_data.engines import BatchPlanner, make_batches
from real_data.federation import sample_clients

RTOL = 1e-6  # float64 on CPU: both engines compute the same sums in different orders


def _assert_params_close(a: dict, b: dict, rtol: float) -> None:
    for n in a:
        scale = max(float(a[n].abs().max()), 1e-12)
        err = float((a[n] - b[n]).abs().max()) / scale
        assert err <= rtol, f"{n}: relative difference {err:.2e} > {rtol}"


def _both_engines(dataset, partition, rounds, *overrides):
    out = {}
    for engine in ("vectorized", "sequential"):
        cfg = tiny_config("train.precision=fp64", f"train.engine={engine}", *overrides)
        out[engine] = train_rounds(federation(cfg, dataset, partition), rounds)
    return out


@pytest.mark.parametrize("algorithm", [
    ["algorithm.name=fedavg"],
    ["algorithm.name=fedfrozen", "algorithm.warmup_rounds=1", "algorithm.train=all_but_qk"],
    ["algorithm.name=fedfrozen", "algorithm.warmup_rounds=2", "algorithm.train=v"],
])
def test_engines_agree_after_three_rounds(digits64, algorithm):
    part = random_partition(digits64, 4, seed=1, alpha=0.5)
    out = _both_engines(digits64, part, 3, "train.optimizer=sgd", "train.lr=0.2", *algorithm)
    (vs, vrec), (ss, srec) = out["vectorized"], out["sequential"]
    _assert_params_close(vs.global_params, ss.global_params, RTOL)
    v = {(r, c, k): val for r, c, k, val in vrec if k in ("train_loss", "local_objective")}
    s = {(r, c, k): val for r, c, k, val in srec if k in ("train_loss", "local_objective")}
    assert v.keys() == s.keys()
    for key in v:
        assert v[key] == pytest.approx(s[key], rel=1e-9), key


def test_engines_agree_adam_momentum_clipping_epochs(digits64):
    """Ragged local work (epochs, clients of different sizes), Adam, clipping, weight decay."""
    part = random_partition(digits64, 3, seed=2, alpha=0.3, min_size=5)
    part = type(part)(tuple(ix[: 8 + 9 * m] for m, ix in enumerate(part.train)), part.test,
                      part.scheme, part.params, part.seed)
    for opt in (["train.optimizer=adam", "train.lr=0.01"],
                ["train.optimizer=sgd", "train.lr=0.1", "train.momentum=0.9"]):
        out = _both_engines(digits64, part, 2, "train.local_steps=null", "train.local_epochs=1",
                            "train.weight_decay=0.01", "train.clip_grad_norm=0.5",
                            "algorithm.name=fedavg", *opt)
        _assert_params_close(out["vectorized"][0].global_params,
                             out["sequential"][0].global_params, RTOL)


def test_batches_depend_only_on_seed_round_client(digits):
    part = random_partition(digits, 5, seed=0)
    a = make_batches(part.train, np.array([1, 3]), 7, 4, 8, 3, None)
    b = make_batches(part.train, np.array([0, 1, 2, 3]), 7, 4, 8, 3, None)
    assert torch.equal(a.idx[0], b.idx[1]) and torch.equal(a.idx[1], b.idx[3])
    assert set(a.idx[0].flatten().tolist()) <= set(part.train[1].tolist())


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.idx, b.idx), (a.active, b.active),
                                              (a.steps, b.steps)))


@pytest.mark.parametrize("steps, epochs", [(3, None), (None, 1.5)])
def test_planner_drawn_ahead_equals_make_batches(digits, steps, epochs):
    part = random_partition(digits, 6, seed=0)
    train = tuple(ix[:s] for ix, s in zip(part.train, (10, 40, 25, 60, 8, 33)))  # ragged epochs
    planner = BatchPlanner(train, 7, 8, steps, epochs)

    def ref(ids, rnd):
        return make_batches(train, ids, 7, rnd, 8, steps, epochs)

    try:
        ahead = np.array([0, 2, 3, 5])
        planner.prefetch(ahead, 4)
        assert _same(planner.plan(ahead, 4), ref(ahead, 4))  # the clients drawn ahead
        # a subset of the clients drawn ahead, then others only partly drawn ahead
        for ids in (np.array([2, 5]), np.array([0, 1, 4, 5])):
            assert _same(planner.plan(ids, 4), ref(ids, 4))
        # a round other than the one drawn ahead is drawn now
        assert _same(planner.plan(np.array([1, 3]), 5), ref(np.array([1, 3]), 5))
        assert planner.plan(np.array([1]), 4).idx.shape[0] == 1
        if epochs:
            assert len(set(ref(ahead, 4).steps.tolist())) > 1
        assert ref(ahead, 4).idx.dtype == planner.plan(ahead, 4).idx.dtype == torch.int64
    finally:
        planner.close()


def test_planner_falls_back_when_the_draw_ahead_failed(digits):
    part = random_partition(digits, 4, seed=0)
    train = (part.train[0], part.train[1][:0], part.train[2], part.train[3])  # client 1: empty
    planner = BatchPlanner(train, 7, 8, 3, None)
    try:
        planner.prefetch(np.array([0, 1, 2]), 2)  # fails in the thread (no samples)
        ids = np.array([0, 2, 3])
        assert _same(planner.plan(ids, 2), make_batches(train, ids, 7, 2, 8, 3, None))
    finally:
        planner.close()


def test_federation_draws_the_next_rounds_plan_ahead(digits):
    cfg = tiny_config("train.rounds=2", "train.clients_per_round=3", "algorithm.name=fedavg")
    fed = federation(cfg, digits, random_partition(digits, 6, seed=0))
    state, _ = fed.run_round(fed.initial_state(), 1)
    rnd, ahead, future = fed.planner._ahead
    ids = sample_clients(cfg.role_seed("sampling"), 2, fed.partition.num_clients, 3)
    assert rnd == 2 and ahead.tolist() == ids.tolist()
    assert sorted(future.result()[0]) == ids.tolist()
    fed.run_round(state, 2)
    assert fed.planner._ahead is None  # used, and nothing drawn past the last round
    fed.planner.close()


def test_epochs_give_larger_clients_more_steps(digits):
    part = random_partition(digits, 3, seed=0)
    sizes = [10, 40, 100]
    train = tuple(ix[:s] for ix, s in zip(part.train, sizes))
    b = make_batches(train, np.arange(3), 0, 1, 16, None, 2.0)
    assert b.steps.tolist() == [2, 5, 13]  # ceil(E n_m / B)
    assert b.active.sum(1).tolist() == [2, 5, 13]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engines_agree_on_gpu_fp32(digits):
    part = random_partition(digits, 4, seed=1, alpha=0.5)
    out = {}
    for engine in ("vectorized", "sequential"):
        # SGD, not the config's Adam: the key bias has zero gradient in exact arithmetic under
        # softmax, and Adam's normalisation turns its rounding-noise gradient into steps of size
        # lr with a random sign (seen on an H200: 3.2e-2 relative on blocks.0.attn.k.bias)
        cfg = tiny_config("train.device=cuda", f"train.engine={engine}", "algorithm.name=fedavg",
                          "train.optimizer=sgd", "train.lr=0.05")
        out[engine] = train_rounds(federation(cfg, digits, part), 2)[0].global_params
    _assert_params_close({k: v.double() for k, v in out["vectorized"].items()},
                         {k: v.double() for k, v in out["sequential"].items()}, 1e-3)


def test_compiled_engine_is_selectable():
    from real_data.config import load_config
    from real_data.engines import get_engine, train_vectorized_compiled

    cfg = load_config("digits_vit", ["train.engine=vectorized_compiled"])
    assert get_engine(cfg.train.engine) is train_vectorized_compiled
