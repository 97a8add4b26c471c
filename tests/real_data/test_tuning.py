"""The two-stage study: a grid tuned on a validation split, then the chosen configurations over
every seed, compared by paired intervals and two one-sided tests."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml
from conftest import global_metrics, run_cli
from scipy import stats

from linattn.errors import ConfigError
from real_data import study

PLAN = {
    "name": "tuned",
    "seeds": [0, 1, 2],
    "tune": {"seed": 7, "last": 2, "validation_fraction": 0.2},
    "sweeps": [{
        "name": "digits",
        "config": "digits_vit",
        "overrides": ["train.rounds=4", "run.plot=false", "model.depth=1", "model.dim=8",
                      "model.mlp_dim=16", "partition.num_clients=4", "train.local_steps=2"],
        "alphas": [0.5],
        "grid": {"train.lr": [0.05, 0.3]},
        "arms": [
            {"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
            {"name": "frozen", "overrides": ["algorithm.name=fedfrozen", "algorithm.train=v"],
             "warmup_rounds": [1, 3],
             "grid": {"train.lr_schedule": [{"kind": "constant"},
                                            {"kind": "step", "milestones": [0.5],
                                             "factor": 0.1}]}},
        ],
    }],
}


def _write(tmp_path, data=PLAN):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_tune_then_final_then_compare(tmp_path):
    path = _write(tmp_path)
    out = tmp_path / "out"
    plan = study.load_plan(path, out)
    # before tuning, the final stage cannot be planned and says why (exit 2)
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final")
    assert res.returncode == 2 and "tuning of plan tuned is unfinished" in res.stderr
    tune = study.tuning_plan(plan)
    keys = [s.key for s in study.plan_runs(tune)]
    # fedavg: 2 lrs; frozen: 2 lrs x 2 schedules, each a T0 family of 2
    assert len(keys) == 2 + 4 * 2 and all(k.endswith("seed=7") for k in keys)
    res = run_cli("study", "--plan", str(path), "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    # tuning runs read validation only
    for spec in study.plan_runs(tune):
        rows = global_metrics(spec.run_dir / "metrics.csv")
        assert rows.get("val_acc") and not rows.get("test_acc")
    # the choice is the best mean of the last 2 validation accuracies, ties to the first
    choices = json.loads((out / study.CHOICES_FILE).read_text())
    by_arm = {c["arm"]: c for c in choices["choices"]}
    for arm, cell in by_arm.items():
        scores = []
        for cand in cell["candidates"]:
            key = study.run_key("digits", f"{arm}+{cand['grid_point']}", cand["warmup_rounds"],
                                0.5, 7)
            vals = global_metrics(out / key / "metrics.csv").get("val_acc", {})
            mine = float(np.mean([vals[r] for r in sorted(vals)[-2:]]))
            assert cand["score"] == pytest.approx(mine, abs=1e-12)
            scores.append(mine)
        assert cell["chosen"]["score"] == max(scores)
        assert cell["candidates"].index(cell["chosen"]) == scores.index(max(scores))
    assert len(by_arm["frozen"]["candidates"]) == 8
    # final runs: the chosen lr (and schedule, T0) over seeds 0-2, test evaluated
    final = study.final_plan(plan, choices)
    specs = study.plan_runs(final)
    assert sorted(s.seed for s in specs) == [0, 0, 1, 1, 2, 2]
    for spec in specs:
        chosen = by_arm[spec.arm.name]["chosen"]
        cfg_text = (spec.run_dir / "config.yaml").read_text()
        lr = float(chosen["overrides"][-1].split("=")[1]) if spec.arm.name == "fedavg" else \
            float([o for o in chosen["overrides"] if o.startswith("train.lr=")][0][9:])
        assert f"lr: {lr}" in cfg_text and "validation_fraction: 0.2" in cfg_text
        assert spec.warmup_rounds == chosen["warmup_rounds"]
        assert global_metrics(spec.run_dir / "metrics.csv").get("test_acc", {})
    table = list(csv.DictReader(open(out / "tables" / "comparison.csv")))
    assert [r["arm"] for r in table] == ["frozen"] and table[0]["n"] == "3"
    # the table's difference: each seed's mean test accuracy of the last 5 evaluations, frozen
    # minus FedAvg, averaged; recomputed here from the runs' metrics.csv
    score = {}
    for spec in specs:
        acc = global_metrics(spec.run_dir / "metrics.csv")["test_acc"]
        score[(spec.arm.name, spec.seed)] = np.mean([acc[r] for r in sorted(acc)[-5:]])
    diff = np.mean([score[("frozen", s)] - score[("fedavg", s)] for s in (0, 1, 2)])
    assert float(table[0]["diff_mean"]) == pytest.approx(diff, abs=1e-12)
    assert "| digits | 0.5 | frozen |" in (out / "tables" / "comparison.md").read_text()


def _rows(diffs, base=0.8):
    out = []
    for seed, d in enumerate(diffs):
        out.append({"sweep": "s", "arm": "fedavg", "warmup_rounds": None, "alpha": 0.1,
                    "seed": seed, "score": base})
        out.append({"sweep": "s", "arm": "new", "warmup_rounds": None, "alpha": 0.1,
                    "seed": seed, "score": base + d})
    return out


def test_compare_intervals_tost_and_verdicts():
    diffs = np.array([0.021, 0.03, 0.025, 0.028, 0.019])
    (r,) = study.compare(_rows(diffs))
    n, m, se = 5, diffs.mean(), diffs.std(ddof=1) / np.sqrt(5)
    t = stats.t.ppf(0.975, n - 1)
    assert r["diff_mean"] == pytest.approx(m, abs=1e-12)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((m - t * se, m + t * se), abs=1e-12)
    assert r["verdict"] == "win"
    # a tie needs the 90% interval inside +-1 point: small, consistent differences
    (tie,) = study.compare(_rows([0.001, -0.002, 0.0015, -0.001, 0.0005]))
    p = max(stats.t.sf((tie["diff_mean"] + 0.01) / tie["diff_se"], 4),
            stats.t.cdf((tie["diff_mean"] - 0.01) / tie["diff_se"], 4))
    assert tie["tost_p"] == pytest.approx(p, rel=1e-12) and tie["tost_p"] < 0.05
    assert tie["verdict"] == "tie"
    # noisy differences around zero: neither a difference nor an equivalence is shown
    (noisy,) = study.compare(_rows([0.04, -0.05, 0.03, -0.02, 0.0]))
    assert noisy["verdict"] == "inconclusive" and noisy["tost_p"] > 0.05
    (loss,) = study.compare(_rows([-0.05, -0.06, -0.045]))
    assert loss["verdict"] == "loss"
    (close,) = study.compare(_rows([0.002, 0.0025, 0.0021, 0.0022, 0.0024]))
    assert close["verdict"] == "win within margin"  # significant, and smaller than 1 point
    rows = _rows([0.03, 0.02, 0.025]) + [
        {"sweep": "s", "arm": "new", "warmup_rounds": None, "alpha": 0.1, "seed": 3,
         "score": float("nan"), "status": "diverged"}]
    (div,) = study.compare(rows)
    assert div["n"] == 3 and div["diverged"] == 1 and div["against_diverged"] == 0
    (same,) = study.compare(_rows([0.0, 0.0, 0.0]))
    assert same["verdict"] == "identical"
    (one,) = study.compare(_rows([0.01]))
    assert one["verdict"] == "inconclusive" and one["ci_low"] is None


def test_an_arm_on_a_base_algorithm_is_compared_with_that_arm(tmp_path):
    from real_data.study.plan import Arm, Plan, Sweep
    arms = (Arm("fedavg", ("algorithm.name=fedavg",)),
            Arm("scaffold", ("algorithm.name=scaffold",)),
            Arm("frozen_on_scaffold", ("algorithm.name=fedfrozen", "algorithm.base=scaffold"),
                warmup_rounds=(5, 10)),
            Arm("frozen_on_fedprox", ("algorithm.name=fedfrozen", "algorithm.base=fedprox"),
                warmup_rounds=(5,)))  # no FedProx arm in the sweep: no partner
    plan = Plan("p", tmp_path, (Sweep("s", "c", (), (0.1,), arms, (0, 1, 2)),))
    assert study.base_arms(plan) == {("s", "frozen_on_scaffold"): "scaffold"}
    rows = []
    for seed, (avg, scaf, frozen) in enumerate([(0.80, 0.83, 0.84), (0.81, 0.82, 0.825),
                                                (0.79, 0.84, 0.85)]):
        for arm, score, t0 in (("fedavg", avg, None), ("scaffold", scaf, None),
                               ("frozen_on_scaffold", frozen, 10)):
            rows.append({"sweep": "s", "arm": arm, "warmup_rounds": t0, "alpha": 0.1,
                         "seed": seed, "score": score})
    (r,) = study.compare_with_bases(rows, study.base_arms(plan))
    assert r["against"] == "scaffold" and r["arm"] == "frozen_on_scaffold"
    assert r["diff_mean"] == pytest.approx((0.01 + 0.005 + 0.01) / 3, abs=1e-12)
    paths = study.write_comparison(rows, tmp_path, bases=study.base_arms(plan))
    text = (tmp_path / "comparison.md").read_text()
    assert "Against scaffold:" in text and "diverged (arm / scaffold)" in text
    assert "| s | 0.1 | frozen_on_scaffold | 10 | 3 | +0.83 |" in text
    assert tmp_path / "comparison_bases.csv" in paths
    # without bases: the FedAvg table alone, and the earlier base comparison removed
    study.write_comparison(rows, tmp_path)
    assert "Against" not in (tmp_path / "comparison.md").read_text()
    assert not (tmp_path / "comparison_bases.csv").exists()


@pytest.mark.parametrize("mutate,key", [
    (lambda d: d["sweeps"][0].update(grid={"train.lr": []}), "grid.train.lr"),
    (lambda d: d["sweeps"][0].update(grid=[0.1]), "grid"),
    (lambda d: d["tune"].update(validation_fraction=0.7), "tune.validation_fraction"),
    (lambda d: d["tune"].update(metric="test_acc"), "tune.metric"),
    (lambda d: d.pop("tune"), "no 'tune' section"),
    (lambda d: d["tune"].update(seed=1), "tune.seed"),
])
def test_bad_tuning_plans_name_the_key(tmp_path, mutate, key):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    mutate(data)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        study.load_plan(_write(tmp_path, data), tmp_path / "out")
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name,runs", [("fair", 1512), ("fair_digits", 144), ("shift_digits", 84),
                                       ("shift_fmnist", 552), ("shift_fmnist_calibration", 27)])
def test_shipped_tuned_plans_expand(name, runs):
    plan = study.load_plan(name)
    tune = study.tuning_plan(plan)
    specs = study.plan_runs(tune)
    assert len(specs) == runs and {s.seed for s in specs} == {plan.tune.seed}
    assert plan.tune.seed not in plan.sweeps[0].seeds  # tuned on a seed the finals do not use
    for spec in specs[::97]:  # a sample of configs resolves
        cfg = study.run_config(spec, spec.warmup_rounds)
        assert cfg.partition.validation_fraction == plan.tune.validation_fraction
        assert cfg.eval.test is False


def test_a_branch_of_a_diverged_warm_up_scores_as_diverged(tmp_path):
    """A T0 family whose warm-up run diverged before a branch's T0 leaves no snapshot: the
    branch is the same diverged trajectory, so the choice goes on without it."""
    plan = study.load_plan(_write(tmp_path), tmp_path / "out")
    out = tmp_path / "out"

    def fake(key, status, val=None):
        d = out / key
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"status": status}))
        rows = ["round,client,metric,value,stage"] + [
            f"{r},global,val_acc,{v},warmup" for r, v in enumerate(val or [], 1)]
        (d / "metrics.csv").write_text("\n".join(rows) + "\n")

    for i in (0, 1):
        fake(study.run_key("digits", f"fedavg+{i}", None, 0.5, 7), "completed", [0.5, 0.6])
    for i in range(4):
        head = study.run_key("digits", f"frozen+{i}", 3, 0.5, 7)
        if i == 2:  # diverged in round 1, before T0 = 1's snapshot: no branch directory
            fake(head, "diverged", [0.1])
        else:
            fake(head, "completed", [0.5, 0.7 + i / 100])
            fake(study.run_key("digits", f"frozen+{i}", 1, 0.5, 7), "completed", [0.5, 0.4])
    choices = study.choose(plan, write=False)
    frozen = next(c for c in choices["choices"] if c["arm"] == "frozen")
    cands = {(c["grid_point"], c["warmup_rounds"]): c for c in frozen["candidates"]}
    assert cands[(2, 1)]["status"] == "diverged" and cands[(2, 3)]["status"] == "diverged"
    assert frozen["chosen"]["grid_point"] == 3 and frozen["chosen"]["warmup_rounds"] == 3
    assert not (out / study.CHOICES_FILE).exists()  # write=False writes nothing


def test_tuning_runs_marked_elsewhere_leave_their_arm_unchosen(tmp_path):
    """A `--markers` archive holds each finished run's summary.json and no metrics: on the
    machine it is unpacked on, those runs are finished (not trained again) but have no score,
    so with a slice their arm is listed as unfinished and the others are chosen; without one
    the choice names them and says to unpack their runs."""
    plan = study.load_plan(_write(tmp_path), tmp_path / "out")
    out = tmp_path / "out"
    for i in (0, 1):  # FedAvg's tuning ran here
        d = out / study.run_key("digits", f"fedavg+{i}", None, 0.5, 7)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"status": "completed"}))
        (d / "metrics.csv").write_text("round,client,metric,value,stage\n"
                                       f"1,global,val_acc,{0.5 + i / 10},full\n")
    for i in range(4):  # the frozen arm's tuning finished on another machine: markers only
        for t0 in (1, 3):
            d = out / study.run_key("digits", f"frozen+{i}", t0, 0.5, 7)
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"status": "completed"}))
    table = study.choose(plan, write=False, partial=True)
    assert [c["arm"] for c in table["choices"]] == ["fedavg"]
    assert table["choices"][0]["chosen"]["grid_point"] == 1
    assert table["unfinished"] == [{"sweep": "digits", "arm": "frozen", "alpha": 0.5,
                                    "runs_not_final": 8}]
    with pytest.raises(ConfigError, match="8 run\\(s\\) finished elsewhere are here only "
                       "as markers.*frozen.*unpack their --pack archive"):
        study.choose(plan, write=False)


def test_final_stage_of_a_slice_and_from_a_choices_file(tmp_path):
    """--slice: the final stage needs only the selected arms tuned; --choices: it takes the
    chosen configurations from a file, with no tuning runs present; a choices file that does
    not fit the plan exits 2 naming it, with nothing written."""
    path = _write(tmp_path)
    out = tmp_path / "out"
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "tune",
                  "--slice", "digits/fedavg+*/*")
    assert res.returncode == 0, res.stderr[-2000:]
    # FedAvg is tuned, the frozen arm is not: its final runs cannot be chosen yet
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                  "--slice", "digits/frozen*")
    assert res.returncode == 2 and "no final run of plan tuned is selected" in res.stderr
    assert not (out / study.CHOICES_FILE).exists()  # nothing written on exit 2
    # a typo among the patterns: exit 2 naming it, nothing run
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                  "--slice", "digits/fedavg/*/seed=0", "--slice", "digits/fedvag/*")
    assert res.returncode == 2 and "'digits/fedvag/*' matches no run" in res.stderr
    assert not (out / study.run_key("digits", "fedavg", None, 0.5, 0)).exists()
    # the tune stage: a typo, or only final-run keys, exit 2 before anything runs
    for pattern, said in (("digits/fedvag+*/*", "matches no run"),
                          ("digits/fedavg/*/seed=0", "selects no tuning run")):
        res = run_cli("study", "--plan", str(path), "--out", str(tmp_path / "t"), "--stage",
                      "tune", "--slice", pattern)
        assert res.returncode == 2 and said in res.stderr, res.stderr[-2000:]
        assert not (tmp_path / "t").exists()
    # a pattern whose arm is not tuned yet is skipped, the tuned arm's runs go on
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                  "--slice", "digits/fedavg/*/seed=0", "--slice", "digits/frozen*")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--slice digits/frozen* selects no final run with a chosen configuration" \
        in res.stdout
    listed = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                     "--list", "--slice", "digits/fedavg/*/seed=0", "--slice", "digits/frozen*")
    assert [ln.split() for ln in listed.stdout.splitlines()
            if not ln.startswith("study:")] == \
        [["completed", "digits/fedavg/alpha=0.5/seed=0"]]
    choices = json.loads((out / study.CHOICES_FILE).read_text())
    assert [c["arm"] for c in choices["choices"]] == ["fedavg"]
    # the frozen arm: 4 grid points x 2 T0 values, none run
    assert choices["unfinished"] == [{"sweep": "digits", "arm": "frozen", "alpha": 0.5,
                                      "runs_not_final": 8}]
    chosen = choices["choices"][0]["chosen"]
    lrs = {}
    for cand in choices["choices"][0]["candidates"]:
        vals = global_metrics(out / study.run_key("digits", f"fedavg+{cand['grid_point']}",
                                                  None, 0.5, 7) / "metrics.csv")["val_acc"]
        lrs[cand["overrides"][0]] = np.mean([vals[r] for r in sorted(vals)[-2:]])
    assert chosen["overrides"][0] == max(lrs, key=lrs.get)
    final_dir = out / study.run_key("digits", "fedavg", None, 0.5, 0)
    assert global_metrics(final_dir / "metrics.csv").get("test_acc")
    assert not (out / study.run_key("digits", "fedavg", None, 0.5, 1)).exists()
    # the same final run elsewhere, from the choices file alone: the same configuration
    other = tmp_path / "other"
    res = run_cli("study", "--plan", str(path), "--out", str(other), "--stage", "final",
                  "--choices", str(out / study.CHOICES_FILE), "--slice", "digits/fedavg/*/seed=0",
                  "--export", str(tmp_path / "export"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "export" / study.CHOICES_FILE).read_text()) == choices
    there = other / study.run_key("digits", "fedavg", None, 0.5, 0)
    assert (there / "config.yaml").read_text() == (final_dir / "config.yaml").read_text()
    assert global_metrics(there / "metrics.csv") == global_metrics(final_dir / "metrics.csv")
    # choices that are not the plan's: exit 2, the option named, nothing written
    bad = dict(choices)
    bad["choices"] = [json.loads(json.dumps(choices["choices"][0]))]
    bad["choices"][0]["chosen"]["overrides"] = ["train.lr=0.7"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    for args in (["--choices", str(tmp_path / "bad.json")],
                 ["--choices", str(tmp_path / "missing.json")],
                 ["--choices", str(out / study.CHOICES_FILE), "--stage", "tune"]):
        fresh = tmp_path / "fresh"
        res = run_cli("study", "--plan", str(path), "--out", str(fresh), *args)
        assert res.returncode == 2 and "--choices" in res.stderr, res.stderr[-2000:]
        assert not fresh.exists()


def test_schedule_gains_from_the_tuning_candidates(tmp_path):
    """What a decay and what freezing gain on validation: the best constant-lr and the best
    decayed candidate of every arm, and each arm against FedAvg at a constant lr and with
    every schedule (hand-computed from the candidates)."""
    const, cos = 'train.lr_schedule={"kind": "constant"}', 'train.lr_schedule={"kind": "cosine"}'
    step = 'train.lr_schedule={"kind": "step", "milestones": [0.75], "factor": 0.1}'

    def cand(lr, sched, score, t0=None):
        return {"overrides": [f"train.lr={lr}", sched], "warmup_rounds": t0, "score": score}

    choices = {"metric": "val_acc", "last": 5, "seed": 100, "choices": [
        {"sweep": "s", "arm": "fedavg", "alpha": 0.1, "candidates": [
            cand(0.05, const, 0.70), cand(0.1, const, 0.72), cand(0.1, cos, 0.78),
            cand(0.05, step, 0.77)]},
        {"sweep": "s", "arm": "frozen", "alpha": 0.1, "candidates": [
            cand(0.1, const, 0.75, 50), cand(0.1, const, 0.72, 200), cand(0.1, step, 0.785, 150),
            cand(0.1, cos, float("nan"), 50)]},
        {"sweep": "s", "arm": "nogrid", "alpha": 0.1,
         "candidates": [{"overrides": ["train.lr=0.1"], "warmup_rounds": None, "score": 0.7}]},
    ]}
    rows = {r["arm"]: r for r in study.schedule_gains(choices)}
    assert set(rows) == {"fedavg", "frozen"}  # a grid without a schedule axis: no row
    fa, fr = rows["fedavg"], rows["frozen"]
    assert (fa["constant_score"], fa["constant_lr"], fa["decay_score"], fa["decay_schedule"]) \
        == (0.72, 0.1, 0.78, "cosine")
    assert fa["decay_gain"] == pytest.approx(0.06, abs=1e-12)
    assert fa["vs_against_constant"] is None and fa["vs_against_best"] is None
    assert (fr["constant_T0"], fr["decay_T0"], fr["decay_schedule"]) == (50, 150, "step@0.75x0.1")
    assert fr["vs_against_constant"] == pytest.approx(0.03, abs=1e-12)
    assert fr["vs_against_best"] == pytest.approx(0.005, abs=1e-12)
    paths = study.write_schedule_gains(choices, tmp_path)
    text = (tmp_path / "schedule_gain.md").read_text()
    assert [p.name for p in paths] == ["schedule_gain.csv", "schedule_gain.md"]
    assert "| s | 0.1 | frozen | 75.00 (lr 0.1, T0 50) | 78.50 (lr 0.1, step@0.75x0.1, T0 150) " \
           "| +3.50 | +3.00 | +0.50 |" in text
    # a loss metric: lower is better, so the signs follow the improvement
    loss = json.loads(json.dumps(choices).replace("NaN", "null"))
    loss["metric"] = "val_loss"
    rows = {r["arm"]: r for r in study.schedule_gains(loss)}
    assert rows["fedavg"]["constant_score"] == 0.70
    assert rows["fedavg"]["decay_gain"] == pytest.approx(0.70 - 0.77, abs=1e-12)
    assert study.write_schedule_gains({"choices": []}, tmp_path / "none") == []
    # an export without a schedule axis leaves no table from an earlier one behind
    assert study.write_schedule_gains({"choices": []}, tmp_path) == []
    assert not (tmp_path / "schedule_gain.md").exists()
    assert not (tmp_path / "schedule_gain.csv").exists()


def test_an_arm_with_one_candidate_takes_no_tuning_run(tmp_path):
    """An arm with one grid point and one T0 (or none) is chosen without a run: no tuning run,
    a choice without a score, and its final runs planned before the other arms finish tuning.
    FedAvg keeps its tuning run where a reference sweep reads its validation score."""
    data = json.loads(json.dumps(PLAN))
    sweep = data["sweeps"][0]
    sweep.pop("grid")
    sweep["arms"][1]["grid"] = {"train.lr": [0.05, 0.3]}
    sweep["arms"].append({"name": "rule", "overrides": ["algorithm.name=fedfrozen",
                                                         "algorithm.train=v"],
                          "warmup_rounds": [2]})
    plan = study.load_plan(_write(tmp_path, data), tmp_path / "out")
    keys = [s.key for s in study.plan_runs(study.tuning_plan(plan))]
    assert keys and all(k.startswith("digits/frozen+") for k in keys)  # 2 lrs x 2 T0
    assert len(keys) == 4
    table = study.choose(plan, False, partial=True)
    only = {c["arm"]: c for c in table["choices"]}
    assert set(only) == {"fedavg", "rule"} and table["unfinished"][0]["arm"] == "frozen"
    assert only["rule"]["chosen"] == {"grid_point": 0, "overrides": [], "warmup_rounds": 2,
                                      "score": None, "status": "only candidate"}
    final = study.final_plan(plan, table, partial=True)
    assert sorted({s.arm.name for s in study.plan_runs(final)}) == ["fedavg", "rule"]
    assert {s.warmup_rounds for s in study.plan_runs(final) if s.arm.name == "rule"} == {2}
    with pytest.raises(ConfigError, match="unfinished"):  # the tuned arm still needs its runs
        study.choose(plan, False)
    # with a reference sweep, FedAvg's single configuration is tuned (difficulty reads it)
    ref = json.loads(json.dumps(data))
    shifted = json.loads(json.dumps(ref["sweeps"][0]))
    shifted.update(name="shifted", reference_sweep="digits")
    ref["sweeps"].append(shifted)
    plan = study.load_plan(_write(tmp_path, ref), tmp_path / "out2")
    tuned = {s.key.split("/")[0] + "/" + s.arm.name.split("+")[0]
             for s in study.plan_runs(study.tuning_plan(plan))}
    assert tuned == {"digits/fedavg", "digits/frozen", "shifted/fedavg", "shifted/frozen"}


def test_a_pack_of_both_stages_carries_the_tuning_runs_that_choose_the_finals(tmp_path):
    """Run without --stage, the study trains both stages; its --pack and --markers then hold the
    tuning runs too, so a machine that unpacks them chooses the same final configurations
    (a pack of the final stage alone would leave the choice behind)."""
    import tarfile

    path = _write(tmp_path)
    out = tmp_path / "out"
    res = run_cli("study", "--plan", str(path), "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    pack, markers = tmp_path / "runs.tar.gz", tmp_path / "markers.tar.gz"
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--aggregate-only",
                  "--no-tables", "--pack", str(pack), "--markers", str(markers))
    assert res.returncode == 0, res.stderr[-2000:]
    plan = study.load_plan(path, out)
    tune_keys = {s.key for s in study.plan_runs(study.tuning_plan(plan))}
    final_keys = {s.key for s in study.plan_runs(study.final_plan(plan, study.choose(plan)))}
    with tarfile.open(pack) as tar:
        packed = {n.rsplit("/", 1)[0] for n in tar.getnames() if n.endswith("metrics.csv")}
    assert packed == tune_keys | final_keys and len(tune_keys) == 10
    with tarfile.open(markers) as tar:
        marked = {n.rsplit("/", 1)[0] for n in tar.getnames() if n.endswith("summary.json")}
    assert marked == tune_keys | final_keys
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with tarfile.open(pack) as tar:
        tar.extractall(fresh, filter="data")
    res = run_cli("study", "--plan", str(path), "--out", str(fresh), "--stage", "final",
                  "--aggregate-only")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (json.loads((fresh / study.CHOICES_FILE).read_text())
            == json.loads((out / study.CHOICES_FILE).read_text()))


def test_a_timed_worker_waits_for_tuning_another_worker_holds(tmp_path, monkeypatch, capsys):
    """Both stages under --deadline, two workers: worker 0's tuning shard ends while a run of
    worker 1's shard is still held (its lock), so the final stage cannot be planned yet;
    worker 0 waits for it, polling, instead of leaving, and stops waiting once nobody has held
    an unfinished tuning run for TUNING_GRACE_POLLS looks. Without --deadline (not a timed
    worker) nothing waits."""
    import real_data.cli as cli
    from linattn.cli import main as linattn_main
    from real_data.lock import RunLock
    from real_data.study.runner import families

    path = _write(tmp_path)
    out = tmp_path / "out"
    plan = study.load_plan(path, out)
    other = study.shard_groups(families(study.plan_runs(study.tuning_plan(plan))),
                               (1, 2))
    held = other[0][0].run_dir  # a family head worker 1 trains
    held.mkdir(parents=True)
    lock = RunLock.acquire(held)
    assert cli._tuning_in_progress(plan)
    polls = []

    def pause(seconds):  # worker 1 ends (killed) without finishing its run
        polls.append(seconds)
        lock.release()
    monkeypatch.setattr(cli, "_pause", pause)
    worker0 = ["study", "--plan", str(path), "--out", str(out), "--shard", "0/2"]
    assert linattn_main([*worker0, "--deadline", "3600"]) == 0
    # one look finds worker 1 tuning; after it ends, TUNING_GRACE_POLLS more looks find none
    assert polls == [cli.TUNING_POLL_S] * (1 + cli.TUNING_GRACE_POLLS)
    assert not cli._tuning_in_progress(plan)
    assert "the final stage waits for the tuning runs" in capsys.readouterr().out
    lock = RunLock.acquire(held)
    try:
        assert linattn_main(worker0) == 0
    finally:
        lock.release()
    assert "the final stage waits" in capsys.readouterr().out
    assert len(polls) == 1 + cli.TUNING_GRACE_POLLS


def test_the_final_stages_deadline_is_priced_by_the_tuning_runs(tmp_path, monkeypatch):
    """A final stage none of whose runs has finished starts its first group blind unless the
    tuning runs' measured GPU pace prices it (price_runs): with 3 s left and 1 s per round
    measured, no final group (4 rounds) fits and none starts."""
    from real_data.study import runner

    path = _write(tmp_path)
    out = tmp_path / "out"
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "tune")
    assert res.returncode == 0, res.stderr[-2000:]
    plan = study.load_plan(path, out)
    tuning = study.tuning_runs(plan)  # named by their arms, as the CLI passes them
    for spec in tuning:  # as if measured on a GPU: 1 s a round
        summary = spec.run_dir / "summary.json"
        info = json.loads(summary.read_text())
        info["device"] = {"type": "cuda", "name": "NVIDIA H200"}
        info["seconds_per_round"] = 1.0
        summary.write_text(json.dumps(info))
    final = study.final_plan(plan, study.choose(plan))
    ran = []
    monkeypatch.setattr(runner, "_run_stacked", lambda batch, counts, log: ran.append(batch))
    monkeypatch.setattr(runner, "_run_group", lambda members, counts, log: ran.append(members))
    study.run_study(final, deadline_s=3.0, pending=True, log=lambda *_: None,
                    price_runs=tuning)
    assert ran == []  # every group trains at least 4 rounds: >= 4 s
    study.run_study(final, deadline_s=3.0, pending=True, log=lambda *_: None)
    assert ran  # unpriced, the first group starts whatever its length


def test_a_worker_waits_only_for_tuning_that_can_change_its_final_runs(tmp_path, monkeypatch):
    """With --choices the choice is fixed, and with a --slice only the selected arms' tuning
    matters: tuning of other arms held by another worker makes nobody wait."""
    import real_data.cli as cli
    from linattn.cli import main as linattn_main
    from real_data.lock import RunLock

    path = _write(tmp_path)
    out = tmp_path / "out"
    plan = study.load_plan(path, out)
    frozen = next(s for s in study.plan_runs(study.tuning_plan(plan))
                  if s.arm.name.startswith("frozen"))
    frozen.run_dir.mkdir(parents=True)
    lock = RunLock.acquire(frozen.run_dir)
    polls = []
    monkeypatch.setattr(cli, "_pause", polls.append)
    try:
        assert cli._tuning_in_progress(plan, {("digits", "frozen")})
        assert not cli._tuning_in_progress(plan, {("digits", "fedavg")})
        # fedavg's final runs wait on fedavg's tuning only, which nobody holds
        base = ["study", "--plan", str(path), "--out", str(out), "--deadline", "3600"]
        assert linattn_main([*base, "--slice", "digits/fedavg*/*"]) == 0
        assert polls == [] and all(study.run_status(s.run_dir) == "completed"
                                   for s in study.plan_runs(plan)
                                   if s.arm.name == "fedavg")
        # a fixed choice (fedavg's alone) cannot change: the frozen slice waits for nothing
        table = tmp_path / "choices.json"
        table.write_text((out / study.CHOICES_FILE).read_text())
        assert linattn_main([*base, "--choices", str(table), "--slice", "digits/frozen-*"]) == 0
        assert polls == []
        # a fresh folder: fedavg's final runs need fedavg's tuning, which nobody trains
        # (frozen's is held); past the start-up window the worker leaves at once
        monkeypatch.setattr(cli, "TUNING_START_S", 0.0)
        other = study.load_plan(path, tmp_path / "fresh")
        held = next(s for s in study.plan_runs(study.tuning_plan(other))
                    if s.arm.name.startswith("frozen")).run_dir
        held.mkdir(parents=True)
        lock2 = RunLock.acquire(held)
        try:
            assert linattn_main(["study", "--plan", str(path), "--out", str(tmp_path / "fresh"),
                                 "--deadline", "3600", "--slice", "digits/fedavg/*"]) == 0
        finally:
            lock2.release()
        assert polls == []
    finally:
        lock.release()
    # the tuning runs price the final arms by their own names (fedavg+1 -> fedavg)
    names = {(s.sweep.name, s.arm.name) for s in study.tuning_runs(plan)}
    assert names == {("digits", "fedavg"), ("digits", "frozen")}


def test_a_later_machine_takes_the_choice_and_restores_unfinished_final_runs(tmp_path):
    """The recipe for a tuned plan over several calls: a machine with no tuning runs, given
    the choice (--choices) and the first machine's --pack-partial archive, restores the
    unfinished final run, resumes it, and ends with the first machine's metrics."""
    path = _write(tmp_path)
    first, later = tmp_path / "first", tmp_path / "later"
    res = run_cli("study", "--plan", str(path), "--out", str(first))
    assert res.returncode == 0, res.stderr[-2000:]
    plan = study.load_plan(path, first)
    victim = study.plan_runs(study.final_plan(plan, study.choose(plan)))[0]
    whole = (victim.run_dir / "metrics.csv").read_bytes()
    (victim.run_dir / "summary.json").unlink()  # as if killed after its last checkpoint
    archive = tmp_path / "partial.tar.gz"
    res = run_cli("study", "--plan", str(path), "--out", str(first), "--aggregate-only",
                  "--no-tables", "--pack-partial", str(archive))
    assert res.returncode == 0, res.stderr[-2000:]
    final = ["study", "--plan", str(path), "--out", str(later), "--stage", "final",
             "--choices", str(first / study.CHOICES_FILE)]
    res = run_cli(*final, "--restore-partial", str(archive))
    assert res.returncode == 0 and "restored 1 unfinished runs" in res.stdout, res.stdout
    res = run_cli(*final, "--slice", victim.key)
    assert res.returncode == 0 and "resumed 1" in res.stdout, res.stdout + res.stderr
    assert (later / victim.run_dir.relative_to(first) / "metrics.csv").read_bytes() == whole
