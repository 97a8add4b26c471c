"""The personalized score: every client's own model on its own validation (tuning) and test
(final) samples, FedTP's personalized models against the fine-tuned global model of the others,
and a study sweep (``score: personal``) tuned and compared on it."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
import yaml
from conftest import (
    federation,
    random_partition,
    run_cli,
    tiny_config,
    train_rounds,
    tuned_study,
)

from linattn.errors import ConfigError
from real_data import study
from real_data.data.partition import carve_validation
from real_data.metrics import evaluate


def _with_validation(data, seed=4):
    return carve_validation(random_partition(data, 3, seed=seed, alpha=0.3), 0.3)


def _globals(records, rnd):
    return {k: v for r, c, k, v in records if r == rnd and c == "global"}


def test_local_validation_accuracy_of_a_global_model_is_the_pooled_one(digits64):
    fed = federation(tiny_config("algorithm.name=fedavg", "train.precision=fp64"), digits64,
                     _with_validation(digits64))
    _, rec = train_rounds(fed, 2)
    g = _globals(rec, 2)
    assert g["local_val_acc_micro"] == pytest.approx(g["val_acc"], abs=1e-12)


def test_fedtp_is_scored_on_each_clients_own_validation_samples(digits64):
    part = _with_validation(digits64)
    fed = federation(tiny_config("algorithm.name=fedtp", "train.precision=fp64",
                                 "train.optimizer=sgd", "train.lr=0.2"), digits64, part)
    state, rec = train_rounds(fed, 2)
    algo, correct, n = fed.algorithm, 0.0, 0
    for m, idx in enumerate(part.val):  # a plain loop: client m's model on its own samples
        own = algo.eval_params(m, state.global_params, state.client_state, state.server_state)
        assert own is not None  # its own generated attention, not the global model
        ix = torch.as_tensor(idx)
        _, hit = evaluate(lambda xb, own=own: algo.forward(fed.model, own, xb),
                          fed.x_train[ix], fed.y_train[ix], 512)
        correct, n = correct + float(hit.sum()), n + len(idx)
    g = _globals(rec, 2)
    assert g["local_val_acc_micro"] == pytest.approx(correct / n, abs=1e-12)


def test_finetuned_validation_accuracy_equals_a_plain_loop(digits64):
    """eval.finetune with a validation split: one local round of plain SGD at train.lr from
    the final global model, then each client's own validation samples (no test set read)."""
    from real_data.engines import make_batches, task_loss

    part = _with_validation(digits64, seed=2)
    rounds, k, lr = 2, 3, 0.1
    cfg = tiny_config("algorithm.name=fedavg", "train.precision=fp64", "train.optimizer=sgd",
                      f"train.lr={lr}", f"train.local_steps={k}", f"train.rounds={rounds}",
                      "eval.finetune=true", "eval.test=false")
    fed = federation(cfg, digits64, part)
    state, rec = train_rounds(fed, rounds)
    g = _globals(rec, rounds)
    assert "local_ft_acc_micro" not in g and "test_acc" not in g  # the test set is not read
    batches = make_batches(part.train, np.arange(3), cfg.role_seed("training"), rounds + 1,
                           cfg.train.batch_size, k, None)
    correct, n = 0.0, 0
    for m in range(3):
        params = {name: p.detach().clone().requires_grad_(True)
                  for name, p in state.global_params.items()}
        opt = torch.optim.SGD(list(params.values()), lr=lr)
        for s in range(k):
            ix = batches.idx[m, s]
            opt.zero_grad()
            task_loss(torch.func.functional_call(fed.model, params, (fed.x_train[ix],)),
                      fed.y_train[ix]).backward()
            opt.step()
        ix = torch.as_tensor(part.val[m])
        _, hit = evaluate(lambda xb, p=params: torch.func.functional_call(fed.model, p, (xb,)),
                          fed.x_train[ix], fed.y_train[ix], 1024)
        correct, n = correct + float(hit.sum()), n + len(ix)
    assert g["local_ft_val_acc_micro"] == pytest.approx(correct / n, abs=1e-12)


BASE = ["train.rounds=2", "run.plot=false", "model.depth=1", "model.dim=8", "model.mlp_dim=16",
        "partition.num_clients=4", "train.local_steps=2", "eval.every=1"]
PLAN = {
    "name": "personal",
    "seeds": [0, 1],
    "tune": {"seed": 7, "last": 2, "validation_fraction": 0.3},
    "sweeps": [{
        "name": "tp", "config": "digits_vit", "overrides": BASE, "alphas": [0.3],
        "score": "personal", "grid": {"train.lr": [0.05, 0.2]},
        "arms": [{"name": "fedavg", "overrides": ["algorithm.name=fedavg", "eval.finetune=true"]},
                 {"name": "fedtp", "overrides": ["algorithm.name=fedtp"]}],
    }],
}


def _metric(run_dir, name):
    rows = [r for r in csv.DictReader(open(run_dir / "metrics.csv"))
            if r["client"] == "global" and r["metric"] == name]
    return [float(r["value"]) for r in sorted(rows, key=lambda r: int(r["round"]))]


def test_a_personal_sweep_is_tuned_and_compared_on_each_clients_own_model(tmp_path):
    path, out, plan = tuned_study(tmp_path, PLAN)
    choices = {c["arm"]: c for c in study.choose(plan, write=False)["choices"]}
    tune = study.tuning_plan(plan)
    # every arm read at the last round (FedTP evaluates every round, the fine-tuning once)
    for arm, metric in (("fedavg", "local_ft_val_acc_micro"), ("fedtp", "local_val_acc_micro")):
        assert choices[arm]["metric"] == "personal"
        scores = []
        for i in range(2):  # every candidate scored on its arm's personal validation metric
            (spec,) = [s for s in study.plan_runs(tune) if s.arm.name == f"{arm}+{i}"]
            values = _metric(spec.run_dir, metric)
            assert len(values) == (1 if arm == "fedavg" else 2)  # fine-tuned once, at the end
            scores.append(values[-1])
        got = [c["score"] for c in choices[arm]["candidates"]]
        assert got == pytest.approx(scores, abs=1e-12)
        assert choices[arm]["chosen"]["grid_point"] == int(np.argmax(scores))
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                  "--export", str(tmp_path / "docs"))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {(r["arm"], int(r["seed"])): r
            for r in csv.DictReader(open(tmp_path / "docs" / "study_per_run.csv"))}
    final = study.final_plan(plan, study.load_choices(tmp_path / "docs" / "choices.json", plan))
    for spec in study.plan_runs(final):  # the score is the personalized test accuracy
        want = _metric(spec.run_dir, "local_ft_acc_micro" if spec.arm.name == "fedavg"
                       else "local_acc_micro")[-1]
        row = rows[(spec.arm.name, spec.seed)]
        assert float(row["score"]) == pytest.approx(want, abs=1e-12)
    assert "(tp: the personalized accuracy at the last round" in \
        (tmp_path / "docs" / "comparison.md").read_text()
    (cmp,) = list(csv.DictReader(open(tmp_path / "docs" / "comparison.csv")))
    d = [float(rows[("fedtp", s)]["score"]) - float(rows[("fedavg", s)]["score"]) for s in (0, 1)]
    assert cmp["arm"] == "fedtp" and float(cmp["diff_mean"]) == pytest.approx(np.mean(d))


@pytest.mark.parametrize("mutate,said", [
    (lambda sw: sw.update(score="personalised"), "'personalised': allowed global, personal"),
    (lambda sw: sw["arms"][1]["overrides"].append("eval.clients=false"),
     "arm fedtp sets neither eval.clients=true nor eval.finetune=true"),
])
def test_a_bad_score_names_the_key(tmp_path, mutate, said):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    mutate(data["sweeps"][0])
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"sweeps\[0\]\.score") as err:
        study.load_plan(path, tmp_path / "out")
    assert said in str(err.value)
    res = run_cli("study", "--plan", str(path), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and said in res.stderr and not (tmp_path / "o").exists()
