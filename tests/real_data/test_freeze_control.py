"""FedFrozen's equal-size control: freezing V and the attention output instead of Q/K."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import federation, random_partition, tiny_config

from linattn.errors import ConfigError
from real_data.models import names_of_kind


def test_control_freezes_as_many_parameters_elsewhere(digits):
    t0, rounds = 2, 4
    part = random_partition(digits, 4, seed=3, alpha=0.5)
    cfg = tiny_config("algorithm.name=fedfrozen", f"algorithm.warmup_rounds={t0}",
                      "algorithm.freeze=v_attn_out", "train.clients_per_round=2")
    fed = federation(cfg, digits, part)
    qk = names_of_kind(fed.groups, "qk")
    control = names_of_kind(fed.groups, "v", "attn_out")
    shapes = fed.algorithm.ctx.shapes
    size = {k: sum(int(np.prod(shapes[n])) for n in names)
            for k, names in (("qk", qk), ("control", control))}
    assert size["qk"] == size["control"] > 0  # the same number of frozen parameters
    state = fed.initial_state()
    for rnd in range(1, rounds + 1):
        state, records = fed.run_round(state, rnd)
        if rnd == t0:
            at_t0 = {n: v.clone() for n, v in state.global_params.items()}
        stage = {k: v for r, c, k, v in records if c == "global"}
    for n in control:  # frozen: bit-identical to round T0
        assert torch.equal(state.global_params[n], at_t0[n]), n
    # Q/K keep training after T0
    assert any(not torch.equal(state.global_params[n], at_t0[n]) for n in qk)
    assert stage["qk_change"] > 0
    assert "freeze_v_attn_out" in fed.algorithm.tag()


def test_control_needs_a_trainable_rest(digits):
    with pytest.raises(ConfigError, match="algorithm.freeze=v_attn_out"):
        tiny_config("algorithm.name=fedfrozen", "algorithm.warmup_rounds=1",
                    "algorithm.freeze=v_attn_out", "algorithm.train=v")


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_finetuned_accuracy_equals_a_plain_loop(digits64, schedule):
    """eval.finetune: each client fine-tunes the final global model for one local round of
    plain SGD at train.lr (also when the schedule ends at 0, as cosine does) on fresh
    minibatches, then is tested on its own split."""
    from real_data.engines import make_batches, task_loss
    from real_data.metrics import evaluate

    part = random_partition(digits64, 3, seed=2, alpha=0.5)
    rounds, k, lr = 2, 3, 0.1
    cfg = tiny_config("algorithm.name=fedprox", "algorithm.mu=0.5", "train.precision=fp64",
                      "train.optimizer=sgd", f"train.lr={lr}", f"train.local_steps={k}",
                      f"train.rounds={rounds}", "eval.finetune=true",
                      f"train.lr_schedule={schedule}")
    fed = federation(cfg, digits64, part)
    state = fed.initial_state()
    for rnd in range(1, rounds + 1):
        state, records = fed.run_round(state, rnd)
    got = {int(c): v for r, c, key, v in records if key == "local_ft_acc"}
    x, y = fed.x_train, fed.y_train
    batches = make_batches(part.train, np.arange(3), cfg.role_seed("training"), rounds + 1,
                           cfg.train.batch_size, k, None)
    for m in range(3):
        params = {n: p.detach().clone().requires_grad_(True)
                  for n, p in state.global_params.items()}
        opt = torch.optim.SGD(list(params.values()), lr=lr)  # no proximal term
        for s in range(k):
            ix = batches.idx[m, s]
            opt.zero_grad()
            task_loss(torch.func.functional_call(fed.model, params, (x[ix],)), y[ix]).backward()
            opt.step()
        ix = torch.as_tensor(part.test[m])
        _, hit = evaluate(lambda xb, p=params: torch.func.functional_call(fed.model, p, (xb,)),
                          fed.x_test[ix], fed.y_test[ix], 1024)
        assert got[m] == pytest.approx(float(hit.mean()), abs=1e-12), m
    sizes = np.array([len(t) for t in part.test], dtype=float)
    micro = next(v for r, c, key, v in records if key == "local_ft_acc_micro")
    assert micro == pytest.approx(sum(got[m] * sizes[m] for m in range(3)) / sizes.sum())


def test_finetune_step_is_chosen_on_validation_and_only_it_is_tested(digits64):
    """eval.finetune_lr_factors: each factor fine-tunes on the same minibatches; the run keeps
    the step whose models score best on the clients' own validation samples, and its test
    accuracies are those of a run given that factor alone."""
    from real_data.data.partition import carve_validation

    part = carve_validation(random_partition(digits64, 3, seed=2, alpha=0.5), 0.2)
    base = ("algorithm.name=fedavg", "train.precision=fp64", "train.optimizer=sgd", "train.lr=0.1",
            "train.local_steps=3", "train.rounds=2", "eval.finetune=true",
            "partition.validation_fraction=0.2")
    factors = (0.01, 1.0, 4.0)

    def last_round(*extra):
        fed = federation(tiny_config(*base, *extra), digits64, part)
        state = fed.initial_state()
        for rnd in (1, 2):
            state, records = fed.run_round(state, rnd)
        glob = {k: v for r, c, k, v in records if c == "global"}
        return glob, {int(c): v for r, c, k, v in records if k == "local_ft_acc"}

    alone = {f: last_round(f"eval.finetune_lr_factors=[{f}]") for f in factors}
    vals = {f: g["local_ft_val_acc_micro"] for f, (g, _) in alone.items()}
    assert len(set(vals.values())) > 1  # the factors differ on validation here
    best = max(factors, key=lambda f: (vals[f], -factors.index(f)))
    glob, per_client = last_round("eval.finetune_lr_factors=[0.01, 1.0, 4.0]")
    assert glob["local_ft_lr"] == pytest.approx(0.1 * best, rel=1e-12)
    assert glob["local_ft_val_acc_micro"] == pytest.approx(vals[best], abs=1e-12)
    assert glob["local_ft_acc_micro"] == pytest.approx(alone[best][0]["local_ft_acc_micro"],
                                                       abs=1e-12)
    assert per_client == pytest.approx(alone[best][1], abs=1e-12)
    assert alone[best][0]["local_ft_lr"] == pytest.approx(0.1 * best)  # a factor other than 1
    assert "local_ft_lr" not in last_round("eval.finetune_lr_factors=[1.0]")[0]
    # steps too small to move any prediction tie on validation: the first listed is kept
    tied, _ = last_round("eval.finetune_lr_factors=[2e-12, 1e-12]")
    assert tied["local_ft_lr"] == pytest.approx(0.1 * 2e-12, rel=1e-9)


@pytest.mark.parametrize("value, match", [
    ("[]", "non-empty"), ("[0.1, -1.0]", "> 0"), ("[1.0, 1.0]", "distinct")])
def test_finetune_lr_factors_bad_input_names_the_key(value, match):
    with pytest.raises(ConfigError, match=match) as info:
        tiny_config("eval.finetune=true", f"eval.finetune_lr_factors={value}")
    assert "eval.finetune_lr_factors" in str(info.value)


def test_several_finetune_steps_without_a_validation_split_stop_the_run(digits, tmp_path):
    """Choosing among fine-tuning steps reads the clients' validation samples: a run without
    a validation split stops at its start (exit 2 from the command line), nothing written."""
    from linattn.cli import main

    cfg = tiny_config("algorithm.name=fedavg", "eval.finetune=true",
                      "eval.finetune_lr_factors=[0.1, 1.0]")
    with pytest.raises(ConfigError, match="partition.validation_fraction"):
        federation(cfg, digits, random_partition(digits, 3, seed=2, alpha=0.5))
    out = tmp_path / "runs"
    assert main(["run", "--config", "digits_vit", "--out", str(out), "algorithm.name=fedavg",
                 "eval.finetune=true", "eval.finetune_lr_factors=[0.1, 1.0]",
                 "train.rounds=1", "model.depth=1"]) == 2
    assert not out.exists()
