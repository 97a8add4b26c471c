"""FedSQ: the DualCopy forward, strict attention, S frozen and never sent, pretraining."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    PRETRAIN_SKIP,
    federation,
    pretrain_target,
    pretrained_file,
    random_partition,
    tiny_config,
)
from test_fedpart import engines_agree

from linattn.cli import main as linattn_main
from real_data.algorithms.fedsq import dual_forward
from real_data.config import load_config
from real_data.federation import BYTES_PER_NUMBER, sample_clients
from real_data.models import CharTransformer, CharTransformerConfig, ViT, ViTConfig, names_of_kind
from real_data.pretrain import load_pretrained


def _vit(activation="relu", seed=0):
    cfg = ViTConfig(patch=2, dim=8, depth=2, heads=2, mlp_dim=16, activation=activation,
                    image_size=8, channels=1, num_classes=10)
    torch.manual_seed(seed)
    return ViT(cfg).double()


def _char(activation="relu"):
    cfg = CharTransformerConfig(dim=8, depth=2, heads=2, mlp_dim=16, activation=activation,
                                vocab_size=12, seq_len=6)
    torch.manual_seed(0)
    return CharTransformer(cfg).double()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _perturbed(params, scale=0.1, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {n: p + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            for n, p in params.items()}


@pytest.mark.parametrize("strict", [False, True])
def test_s_equal_q_with_relu_is_the_plain_forward(digits64, strict):
    x = digits64.x_train[:16]
    tokens = torch.randint(0, 12, (4, 6), generator=torch.Generator().manual_seed(0))
    for model, inp in ((_vit(), x), (_char(), tokens)):
        p = _params(model)
        plain = torch.func.functional_call(model, p, (inp,))
        torch.testing.assert_close(dual_forward(model, p, p, inp, strict), plain,
                                   rtol=1e-13, atol=1e-13)
    # and S matters: another S gives another output
    model = _vit()
    p = _params(model)
    assert not torch.allclose(dual_forward(model, _perturbed(p, 1.0), p, x, strict),
                              torch.func.functional_call(model, p, (x,)))


def test_gelu_model_gets_hard_gates(digits64):
    """With a GELU MLP the gate is 1[z_S > 0] applied linearly: S = Q is the ReLU model."""
    x = digits64.x_train[:16]
    gelu, relu = _vit("gelu"), _vit("relu")
    p = _params(gelu)
    torch.testing.assert_close(dual_forward(gelu, p, p, x),
                               torch.func.functional_call(relu, p, (x,)), rtol=1e-13,
                               atol=1e-13)


@pytest.mark.parametrize("strict", [False, True])
def test_strict_query_key_get_no_gradient(digits64, strict):
    model = _vit()
    s = _params(model)
    q = {n: v.requires_grad_(True) for n, v in _perturbed(s).items()}
    x, y = digits64.x_train[:16], digits64.y_train[:16]
    loss = torch.nn.functional.cross_entropy(dual_forward(model, s, q, x, strict), y)
    names = list(q)
    grads = dict(zip(names, torch.autograd.grad(loss, [q[n] for n in names],
                                                allow_unused=True)))
    qk = set(names_of_kind(model.param_groups(), "qk"))
    for n, g in grads.items():
        if strict and n in qk:
            assert g is None, n  # not even in the graph
        else:
            assert g is not None and float(g.abs().max()) > 0, n


@pytest.mark.parametrize("strict", [False, True])
def test_structure_never_changes_and_is_never_sent(tmp_path, digits64, strict):
    path, _ = pretrained_file(tmp_path, digits64)
    data = pretrain_target(digits64)
    part = random_partition(data, 4, seed=0, alpha=0.5)
    fed = federation(tiny_config("algorithm.name=fedsq", f"algorithm.pretrained={path}",
                                 f"algorithm.strict={str(strict).lower()}",
                                 "model.activation=relu", "train.precision=fp64",
                                 "train.clients_per_round=2", "train.rounds=4"), data, part)
    loaded, _ = load_pretrained(path)
    state = fed.initial_state()
    head = set(names_of_kind(fed.groups, "head"))
    for n, p in state.global_params.items():  # Q starts at the pretrained model, fresh head
        assert torch.equal(p, loaded[n]) != (n in head), n
    shapes = fed.algorithm.ctx.shapes
    size = {n: int(np.prod(s)) for n, s in shapes.items()}
    total = sum(size.values())
    sent = total - (sum(size[n] for n in names_of_kind(fed.groups, "qk")) if strict else 0)
    holds, records = set(), []
    for rnd in range(1, 5):
        state, rec = fed.run_round(state, rnd)
        records += rec
        for n, s in state.server_state.structure.items():
            assert torch.equal(s, loaded[n]), (rnd, n)  # S bit-identical to the file
    get = {(r, k): v for r, c, k, v in records if c == "global"}
    ids = [set(sample_clients(fed.cfg.role_seed("sampling"), t, 4, 2).tolist())
           for t in range(1, 5)]
    for t in range(1, 5):
        assert get[(t, "bytes_up")] == BYTES_PER_NUMBER * 2 * sent  # Q only, never S
        # S is derived from the round-1 Q; a client first sampled later downloads it once
        new = 0 if t == 1 else len(ids[t - 1] - holds)
        assert get[(t, "bytes_down")] == BYTES_PER_NUMBER * (2 * sent + new * total)
        holds |= ids[t - 1]


def test_from_scratch_variant_takes_s_after_the_warmup(digits64):
    part = random_partition(digits64, 3, seed=0)
    fed = federation(tiny_config("algorithm.name=fedsq", "algorithm.init=warmup",
                                 "algorithm.pretrained=null", "algorithm.warmup_rounds=2",
                                 "train.precision=fp64", "train.rounds=4"), digits64, part)
    assert "scratch" in fed.algorithm.tag()
    state = fed.initial_state()
    stages = []
    for rnd in range(1, 5):
        stages.append(fed.algorithm.plan_round(rnd, state.server_state).stage)
        state, _ = fed.run_round(state, rnd)
        if rnd == 2:
            t0 = {n: p.clone() for n, p in state.global_params.items()}
    assert stages == ["warmup", "warmup", "dual", "dual"]
    for n, s in state.server_state.structure.items():
        assert torch.equal(s, t0[n])
    assert any(not torch.equal(state.global_params[n], t0[n]) for n in t0)  # Q moved on


def test_engines_agree(tmp_path, digits64):
    path, _ = pretrained_file(tmp_path, digits64, activation="gelu")
    data = pretrain_target(digits64)
    part = random_partition(data, 4, seed=1, alpha=0.5)
    engines_agree(data, part, 3, "train.optimizer=sgd", "train.lr=0.1", "train.momentum=0.9",
                  "algorithm.name=fedsq", f"algorithm.pretrained={path}")
    # strict, from scratch: a FedAvg round, then two DualCopy rounds without Q/K
    engines_agree(digits64, part, 3, "train.optimizer=sgd", "train.lr=0.1",
                  "algorithm.name=fedsq", "algorithm.init=warmup", "algorithm.pretrained=null",
                  "algorithm.warmup_rounds=1", "algorithm.strict=true")


def test_pretrain_command_then_fedsq_beats_chance(tmp_path, capsys):
    """``linattn pretrain`` on a disjoint digits split, then FedSQ; best accuracy and round."""
    model = ["model.activation=relu", "model.depth=1"]
    out = tmp_path / "s.pt"
    code = linattn_main(["pretrain", "--config", "digits_vit", "--source", "digits",
                         "--source-skip", str(PRETRAIN_SKIP), "--epochs", "4", "--lr", "0.01",
                         "--batch-size", "32", "--out", str(out), *model])
    assert code == 0, capsys.readouterr().err
    params, meta = load_pretrained(out)
    assert meta["samples"] > 0 and meta["source_test_acc"] > 0.3, meta
    assert set(params) == set(load_pretrained(out)[0])
    from real_data.runs import start_run

    cfg = load_config("digits_vit", [*model, "algorithm.name=fedsq",
                                     f"algorithm.pretrained={out}",
                                     f"data.train_limit={PRETRAIN_SKIP}", "train.rounds=5",
                                     "run.progress=false", "run.plot=false"])
    res = start_run(cfg, out=tmp_path / "run")
    best = res.summary["best"]["test_acc"]
    print(f"\nFedSQ (pretrained on disjoint digits): best test_acc {best['value']:.3f} "
          f"at round {best['round']}; source acc {meta['source_test_acc']:.3f}")
    assert best["value"] > 0.3 and 1 <= best["round"] <= 5


def test_scratch_variant_resumes_after_the_warmup(tmp_path, digits64):
    """S made mid-run is checkpointed; a resumed run gates with it exactly as before."""
    from conftest import train_rounds

    from real_data.checkpoint import load_checkpoint, save_checkpoint

    part = random_partition(digits64, 3, seed=0)
    cfg = tiny_config("algorithm.name=fedsq", "algorithm.init=warmup",
                      "algorithm.pretrained=null", "algorithm.warmup_rounds=1",
                      "train.precision=fp64", "train.rounds=3")
    straight, _ = train_rounds(federation(cfg, digits64, part), 3)
    state, _ = train_rounds(federation(cfg, digits64, part), 2)
    save_checkpoint(tmp_path / "c.pt", state, {})
    fed = federation(cfg, digits64, part)
    state, _, _ = load_checkpoint(tmp_path / "c.pt", torch.device("cpu"))
    state, _ = fed.run_round(state, 3)
    for n, p in straight.global_params.items():
        assert torch.equal(p, state.global_params[n]), n


def test_native_config_loads():
    cfg = load_config("fmnist_vit_fedsq")
    assert cfg.model.params.activation == "relu"
    assert cfg.algorithm.params.init == "pretrained" and cfg.algorithm.params.pretrained
