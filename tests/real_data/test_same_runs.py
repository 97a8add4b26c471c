"""One training for two arms: FedFrozen whose fixed T0 is the horizon never freezes and trains
as its base algorithm to the bit, so a final stage that chooses it at the base arm's
configuration trains the run once and both arms read it."""

from __future__ import annotations

import copy
import csv
import json
import shutil

import pytest
import yaml
from conftest import run_cli, tuned_study

from real_data import study
from real_data.config import load_config
from real_data.runs import start_run
from real_data.study.plan import SAME_RUN_BASES

ROUNDS = 3
COMMON = [f"train.rounds={ROUNDS}", "run.plot=false", "model.depth=1", "model.dim=8",
          "model.mlp_dim=16", "partition.num_clients=4", "train.local_steps=2",
          "eval.clients=false", "train.lr_schedule=cosine"]
BASE_ARGS = {"fedavg": [], "fedprox": ["algorithm.mu=0.1"]}


def _rows(run_dir):
    """metrics.csv without its stage column (FedFrozen labels its rounds "warmup")."""
    with open(run_dir / "metrics.csv", newline="") as fh:
        return [(r["round"], r["client"], r["metric"], r["value"]) for r in csv.DictReader(fh)]


@pytest.mark.parametrize("stack", [True, False])
def test_fedfrozen_at_the_horizon_trains_as_its_base_to_the_bit(tmp_path, stack):
    """The claim behind ``SAME_RUN_BASES``: for each base listed, FedFrozen with T0 = T writes
    the base algorithm's metrics value for value, stacked and alone."""
    arms = []
    for base in SAME_RUN_BASES:
        args = BASE_ARGS[base]
        arms += [{"name": base, "overrides": [f"algorithm.name={base}", *args]},
                 {"name": f"frozen_{base}", "warmup_rounds": [ROUNDS],
                  "overrides": ["algorithm.name=fedfrozen", f"algorithm.base={base}", *args]}]
    plan = {"name": "same", "seeds": [0], "sweeps": [{
        "name": "digits", "config": "digits_vit", "overrides": COMMON, "alphas": [0.5],
        "arms": arms}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    loaded = study.load_plan(path, tmp_path / "out")
    counts = study.run_study(loaded, log=lambda *a: None, stack=stack)
    assert counts["started"] == len(arms) and counts["failed"] == 0
    for base in SAME_RUN_BASES:
        a = loaded.out_dir / study.run_key("digits", base, None, 0.5, 0)
        b = loaded.out_dir / study.run_key("digits", f"frozen_{base}", ROUNDS, 0.5, 0)
        assert _rows(a) == _rows(b), base
        assert len(_rows(a)) > 40


def test_training_identity_names_the_runs_that_train_alike():
    def cfg(*overrides):
        return study.training_identity(load_config("digits_vit", [*COMMON, *overrides]))

    fedavg = cfg("algorithm.name=fedavg")
    assert cfg("algorithm.name=fedfrozen", f"algorithm.warmup_rounds={ROUNDS}") == fedavg
    # the trainable set after T0 does not matter when T0 is the horizon
    assert cfg("algorithm.name=fedfrozen", "algorithm.train=v",
               f"algorithm.warmup_rounds={ROUNDS}") == fedavg
    assert cfg("algorithm.name=fedfrozen", "algorithm.base=fedprox", "algorithm.mu=0.1",
               f"algorithm.warmup_rounds={ROUNDS}") == cfg("algorithm.name=fedprox",
                                                            "algorithm.mu=0.1")
    # it freezes; another mu; a rule decides T0; SCAFFOLD (equal up to round-off only); lr
    for other in (["algorithm.name=fedfrozen", f"algorithm.warmup_rounds={ROUNDS - 1}"],
                  ["algorithm.name=fedfrozen", "algorithm.base=fedprox", "algorithm.mu=0.2",
                   f"algorithm.warmup_rounds={ROUNDS}"],
                  ["algorithm.name=fedfrozen", "algorithm.warmup=plateau",
                   "partition.validation_fraction=0.2"],
                  ["algorithm.name=fedfrozen", "algorithm.base=scaffold",
                   f"algorithm.warmup_rounds={ROUNDS}"],
                  ["algorithm.name=fedfrozen", f"algorithm.warmup_rounds={ROUNDS}",
                   "train.lr=0.123"]):
        assert cfg(*other) != fedavg, other
    assert cfg("algorithm.name=fedfrozen", "algorithm.base=scaffold",
               f"algorithm.warmup_rounds={ROUNDS}") != cfg("algorithm.name=scaffold")


TUNED = {
    "name": "tuned_same",
    "seeds": [0, 1, 2],
    "tune": {"seed": 7, "last": 2, "validation_fraction": 0.2},
    "sweeps": [{
        "name": "digits", "config": "digits_vit", "overrides": COMMON, "alphas": [0.5],
        "grid": {"train.lr": [0.05, 0.3]},
        "arms": [
            {"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
            {"name": "frozen", "overrides": ["algorithm.name=fedfrozen"],
             "warmup_rounds": [1, ROUNDS]},
            {"name": "control", "overrides": ["algorithm.name=fedfrozen",
                                              "algorithm.freeze=v_attn_out"],
             "warmup_rounds": [1, ROUNDS]},
        ],
    }],
}


def _choose(choices: dict, arm: str, lr_like_fedavg: bool, t0: int) -> None:
    """Set ``arm``'s choice in place: T0 ``t0`` at FedAvg's chosen lr (or the other one)."""
    by_arm = {c["arm"]: c for c in choices["choices"]}
    lr = by_arm["fedavg"]["chosen"]["overrides"]
    cell = by_arm[arm]
    cell["chosen"] = next(c for c in cell["candidates"] if c["warmup_rounds"] == t0
                          and (c["overrides"] == lr) == lr_like_fedavg)


def test_a_final_arm_that_never_freezes_at_fedavgs_configuration_reads_fedavgs_runs(tmp_path):
    path, out, plan = tuned_study(tmp_path, TUNED)
    choices = study.choose(plan, write=False)
    _choose(choices, "frozen", True, ROUNDS)  # never freezes, FedAvg's lr: the same runs
    _choose(choices, "control", False, ROUNDS)  # never freezes at another lr: its own runs
    final = study.final_plan(plan, choices)
    arms = {a.name: a for a in final.sweeps[0].arms}
    assert (arms["fedavg"].same_as, arms["frozen"].same_as, arms["control"].same_as) == \
        (None, "fedavg", None)
    trained = [s.key for s in study.plan_runs(final)]
    assert len(trained) == 6 and not any("/frozen" in k for k in trained)
    pairs = [(a.key, b.key) for a, b in study.same_runs(final)]
    assert pairs == [(f"digits/frozen-T0={ROUNDS}/alpha=0.5/seed={s}",
                      f"digits/fedavg/alpha=0.5/seed={s}") for s in (0, 1, 2)]
    # what is left to train counts the six runs, not nine
    assert sum(r["runs"] for r in study.estimate(final)) == 6
    chosen = tmp_path / "choices.json"
    chosen.write_text(json.dumps(choices))
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                  "--choices", str(chosen), "--export", str(tmp_path / "export"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "started 6" in res.stdout
    assert not (out / study.run_key("digits", "frozen", ROUNDS, 0.5, 0)).exists()
    listed = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                     "--choices", str(chosen), "--list")
    lines = [ln.split() for ln in listed.stdout.splitlines() if not ln.startswith("study")]
    assert ["same", f"digits/frozen-T0={ROUNDS}/alpha=0.5/seed=1", "=",
            "digits/fedavg/alpha=0.5/seed=1"] in lines
    assert sum(ln[0] == "completed" for ln in lines) == 6
    # the tables read FedAvg's runs under the frozen arm's name: the comparison says identical
    with open(tmp_path / "export" / "comparison.csv", newline="") as fh:
        verdicts = {r["arm"]: r for r in csv.DictReader(fh)}
    assert verdicts["frozen"]["verdict"] == "identical" and verdicts["frozen"]["n"] == "3"
    assert verdicts["control"]["verdict"] != "identical"
    with open(tmp_path / "export" / "study_per_run.csv", newline="") as fh:
        per_run = list(csv.DictReader(fh))
    score = {(r["arm"], r["seed"]): r["score"] for r in per_run}
    assert len(per_run) == 9
    assert all(score[("frozen", s)] == score[("fedavg", s)] for s in "012")
    # a final-stage --slice may name the same runs alone
    listed = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                     "--choices", str(chosen), "--list", "--slice", "digits/frozen*")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert sum(ln.split()[0] == "same" for ln in listed.stdout.splitlines()) == 3
    # a finished run in the arm's own folder is read only if it is the plan's configuration:
    # one left by an earlier choice (FedAvg's other lr) is not
    other = copy.deepcopy(choices)
    _choose(other, "frozen", False, ROUNDS)
    mine = out / study.run_key("digits", "frozen", ROUNDS, 0.5, 0)
    old = study.final_plan(plan, other)
    spec = next(s for s in study.plan_runs(old) if s.key.startswith("digits/frozen"))
    start_run(study.run_config(spec, ROUNDS), out=mine)
    rows = {(r["arm"], r["seed"]): r["score"] for r in study.run_rows(final)}
    assert rows[("frozen", 0)] == rows[("fedavg", 0)]
    # the same configuration there (trained before the rule) is read as it is
    shutil.rmtree(mine)
    same_spec = next(s for s, _ in study.same_runs(final) if s.seed == 0)
    start_run(study.run_config(same_spec, ROUNDS), out=mine)
    assert study.run_status(mine) == "completed"
    own = study.tables.run_row(mine)["score"]
    assert {(r["arm"], r["seed"]): r["score"] for r in study.run_rows(final)}[("frozen", 0)] \
        == own
    # the choice moves to FedAvg's other lr: the arm trains its own runs, and the control,
    # never freezing at that lr too, reads them
    moved = copy.deepcopy(choices)
    _choose(moved, "frozen", False, ROUNDS)
    again = study.final_plan(plan, moved)
    assert [a.same_as for a in again.sweeps[0].arms] == [None, None, "frozen"]
    assert len(study.plan_runs(again)) == 6
    # a control that freezes (T0 = 1) is a run of its own: nothing is shared
    _choose(moved, "control", False, 1)
    again = study.final_plan(plan, moved)
    assert all(a.same_as is None for a in again.sweeps[0].arms)
    assert len(study.plan_runs(again)) == 9 and study.same_runs(again) == []
