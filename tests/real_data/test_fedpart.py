"""FedPart: the schedule, bit-identical frozen groups, bytes by formula, a real backward saving."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import federation, random_partition, tiny_config, train_rounds

from linattn.errors import ConfigError
from real_data.algorithms.fedpart import (
    FedPartParams,
    active_group,
    fedpart_groups,
    schedule_total,
)
from real_data.engines import LocalJob, make_batches
from real_data.federation import BYTES_PER_NUMBER
from real_data.metrics import step_flops
from real_data.models import ViT, ViTConfig

# depth 1: groups embed, attention(0), FFN(0), head -> G = 4; T = W + C R G + (C - 1) F = 10
SCHEDULE = ["algorithm.name=fedpart", "algorithm.warmup_rounds=1",
            "algorithm.rounds_per_group=1", "algorithm.full_rounds_between=1",
            "algorithm.cycles=2", "train.rounds=10"]


def engines_agree(dataset, partition, rounds, *overrides, rtol=1e-6):
    """Vectorized vs sequential engine after ``rounds`` rounds (float64), as test_engines."""
    out = {}
    for engine in ("vectorized", "sequential"):
        cfg = tiny_config("train.precision=fp64", f"train.engine={engine}", *overrides)
        out[engine] = train_rounds(federation(cfg, dataset, partition), rounds)[0]
    a, b = out["vectorized"].global_params, out["sequential"].global_params
    for n in a:
        err = float((a[n] - b[n]).abs().max()) / max(float(a[n].abs().max()), 1e-12)
        assert err <= rtol, f"{n}: relative difference {err:.2e} > {rtol}"
    return out


def _vit(depth=2, dim=16, activation="gelu"):
    cfg = ViTConfig(patch=2, dim=dim, depth=depth, heads=2, mlp_dim=2 * dim,
                    activation=activation, image_size=8, channels=1, num_classes=10)
    torch.manual_seed(0)
    return ViT(cfg)


def test_groups_follow_the_transformer_grouping():
    model = _vit(depth=2)
    groups = fedpart_groups(model.param_groups())
    assert len(groups) == 2 * 2 + 2  # G = 2 depth + 2
    flat = [n for g in groups for n in g]
    assert sorted(flat) == sorted(n for n, _ in model.named_parameters())  # a partition
    assert set(groups[0]) == {"patch_embed.weight", "patch_embed.bias", "cls", "pos"}
    assert groups[1] == ("blocks.0.norm1.weight", "blocks.0.norm1.bias",
                         "blocks.0.attn.q.weight", "blocks.0.attn.q.bias",
                         "blocks.0.attn.k.weight", "blocks.0.attn.k.bias",
                         "blocks.0.attn.v.weight", "blocks.0.attn.v.bias",
                         "blocks.0.attn.out.weight", "blocks.0.attn.out.bias")
    assert groups[2][:2] == ("blocks.0.norm2.weight", "blocks.0.norm2.bias")
    assert all(".mlp." in n for n in groups[2][2:])
    assert set(groups[-1]) == {"norm.weight", "norm.bias", "head.weight", "head.bias"}


def test_schedule_of_the_original_constants():
    p = FedPartParams(cycles=4)  # W=5, R=2, F=5
    g = 10  # depth-4 ViT
    total = schedule_total(p, g, 4)
    assert total == 5 + 4 * 2 * 10 + 3 * 5 == 100
    plan = [active_group(t, p, g) for t in range(1, total + 1)]
    assert plan[:5] == [None] * 5
    assert plan[5:25] == [i // 2 for i in range(20)]  # shallow -> deep, R = 2 each
    assert plan[25:30] == [None] * 5
    assert sum(v is not None for v in plan) == 4 * 2 * 10
    assert plan[-1] == 9 and plan[-20:] == [i // 2 for i in range(20)]
    # communication: (W + (C - 1) F + R C) / T = 28% of FedAvg's, the paper's "72% less"
    assert sum(1.0 if v is None else 0.1 for v in plan) / total == pytest.approx(0.28)


def test_cycles_must_match_the_rounds(digits):
    part = random_partition(digits, 2, seed=0)
    with pytest.raises(ConfigError, match="train.rounds=10"):
        federation(tiny_config(*SCHEDULE[:-1], "train.rounds=9"), digits, part)


def test_frozen_groups_bit_identical_and_bytes_match_the_schedule(digits):
    n_clients = 3
    part = random_partition(digits, n_clients, seed=3, alpha=0.5)
    fed = federation(tiny_config(*SCHEDULE), digits, part)
    groups, shapes = fed.algorithm.layer_groups, fed.algorithm.ctx.shapes
    size = {n: int(np.prod(s)) for n, s in shapes.items()}
    total = sum(size.values())
    state, records = fed.initial_state(), []
    uploads = []
    for rnd in range(1, 11):
        prev = {n: p.clone() for n, p in state.global_params.items()}
        state, rec = fed.run_round(state, rnd)
        records += rec
        g = fed.algorithm.group_of(rnd)
        active = set(shapes) if g is None else set(groups[g])
        for n, p in state.global_params.items():
            if n not in active:
                assert torch.equal(p, prev[n]), (rnd, n)  # bit-identical
        uploads.append(sum(size[n] for n in active))
    get = {(r, k): v for r, c, k, v in records if c == "global"}
    # per round: every client uploads its active group; downloads what changed last round
    for rnd in range(1, 11):
        assert get[(rnd, "bytes_up")] == BYTES_PER_NUMBER * n_clients * uploads[rnd - 1]
        down = total if rnd == 1 else uploads[rnd - 2]
        assert get[(rnd, "bytes_down")] == BYTES_PER_NUMBER * n_clients * down
    # the whole run: N * 4 * P * (W + (C - 1) F + R C), each group once per cycle
    w, f, r, c = 1, 1, 1, 2
    assert sum(get[(t, "bytes_up")] for t in range(1, 11)) == \
        BYTES_PER_NUMBER * n_clients * total * (w + (c - 1) * f + r * c)
    assert len(groups) == 4
    # the logged FLOPs drop in partial rounds (round 1 full, round 5 the head group)
    assert get[(5, "fedpart_group")] == 3.0 and get[(1, "fedpart_group")] == -1.0
    assert get[(5, "train_flops")] < 0.6 * get[(1, "train_flops")]


def _forward_flops(model, params, x):
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        torch.func.functional_call(model, params, (x,))
    return counter.get_total_flops()


def test_backward_stops_below_the_active_group(digits):
    """Backward FLOPs per step, full network vs each group (torch.utils.flop_counter)."""
    model = _vit(depth=4, dim=32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    x, y = digits.x_train[:32], digits.y_train[:32]
    groups = fedpart_groups(model.param_groups())

    def fwd(ps, xb):
        return torch.func.functional_call(model, ps, (xb,))

    forward = _forward_flops(model, params, x)
    full = step_flops(fwd, params, list(params), x, y) - forward
    per_group = [step_flops(fwd, params, g, x, y) - forward for g in groups]
    print(f"\nbackward FLOPs per step: full {full}, per group {per_group}, forward {forward}")
    assert all(b < full for b in per_group)
    assert per_group[-1] < 0.05 * full  # head only: no backward through the blocks
    # deeper blocks cost less: backward from the loss down to the group only
    blocks = per_group[1:-1]
    assert blocks[-1] < blocks[0] and blocks[-2] < blocks[1]
    # over the original schedule (W=5, R=2, F=5, C=4; 100 rounds) the backward saving is
    p, g = FedPartParams(cycles=4), len(groups)
    plan = [active_group(t, p, g) for t in range(1, schedule_total(p, g, 4) + 1)]
    spent = sum(full if v is None else per_group[v] for v in plan)
    saving = 1 - spent / (full * len(plan))
    step = 1 - (spent + forward * len(plan)) / ((full + forward) * len(plan))
    print(f"backward saving over the schedule {saving:.3f}, forward+backward {step:.3f}")
    assert saving > 0.3


def test_vectorized_engine_skips_the_frozen_backward(digits):
    """The engine itself (vmap + torch.func.grad) does less work for a deep group."""
    from torch.utils.flop_counter import FlopCounterMode

    part = random_partition(digits, 2, seed=0)
    fed = federation(tiny_config(*SCHEDULE[:-2], "model.depth=2"), digits, part)
    state = fed.initial_state()
    ids = np.arange(2)
    batches = make_batches(part.train, ids, 0, 1, 8, 2, None)
    flops = {}
    for key, names in (("full", fed.algorithm.ctx.names),
                       ("head", fed.algorithm.layer_groups[-1]),
                       ("embed", fed.algorithm.layer_groups[0])):
        job = LocalJob(model=fed.model, algorithm=fed.algorithm,
                       global_params=state.global_params, trainable=tuple(names),
                       batches=batches, x=fed.x_train, y=fed.y_train, optimizer=fed.optimizer,
                       client_ids=ids)
        counter = FlopCounterMode(display=False)
        with counter:
            fed.engine(job)
        flops[key] = counter.get_total_flops()
    assert flops["head"] < 0.5 * flops["full"]
    assert flops["embed"] < flops["full"]


def test_engines_agree(digits64):
    part = random_partition(digits64, 4, seed=1, alpha=0.5)
    engines_agree(digits64, part, 3, "train.optimizer=adam", "train.lr=0.01",
                  "algorithm.name=fedpart", "algorithm.warmup_rounds=1",
                  "algorithm.rounds_per_group=1", "algorithm.full_rounds_between=1")


def test_digits_beats_chance(digits):
    part = random_partition(digits, 5, seed=0, alpha=1.0)
    cfg = tiny_config("algorithm.name=fedpart", "algorithm.warmup_rounds=4",
                      "algorithm.rounds_per_group=1", "algorithm.full_rounds_between=2",
                      "model.dim=16", "model.mlp_dim=32", "train.batch_size=32",
                      "train.local_steps=5", "train.rounds=12", "eval.every=12")
    _, rec = train_rounds(federation(cfg, digits, part), 12)
    acc = next(v for r, c, k, v in rec if r == 12 and c == "global" and k == "test_acc")
    assert acc > 0.3, acc


def test_native_config_runs_the_original_schedule():
    from real_data.config import load_config
    from real_data.models import complete_model_config

    cfg = load_config("fmnist_vit_fedpart_native")
    t = cfg.train
    assert (t.optimizer, t.lr, t.local_epochs, t.batch_size) == ("adam", 0.001, 8, 32)
    assert t.clients_per_round is None and cfg.partition.num_clients == 40
    mcfg = complete_model_config("vit", cfg.model.params, (1, 28, 28), 10)
    g = len(fedpart_groups(ViT(mcfg).param_groups()))
    assert schedule_total(cfg.algorithm.params, g, cfg.algorithm.params.cycles) == t.rounds
