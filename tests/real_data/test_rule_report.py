"""The freeze-rule report: target, regret, verdicts, refrain and fire rates, on rows whose
numbers are worked out by hand."""

import json
import math

import numpy as np
import pytest

from real_data import study
from real_data.study.rule_report import fixed_arm, report_lines, rule_arms


def _row(sweep, arm, alpha, seed, score, val, t0=None, decided=math.nan, fired=math.nan,
         compute=1.0, rule_s=math.nan, wall=100.0, state=math.nan):
    return {"sweep": sweep, "arm": arm, "warmup_rounds": t0, "alpha": alpha, "seed": seed,
            "score": score, "val_score": val, "status": "completed", "decided_T0": decided,
            "rounds": 200.0, "fired": fired, "compute_ratio": compute, "rule_seconds": rule_s,
            "wall_time_s": wall, "rule_state_bytes": state}


def _setting(sweep, alpha, fedavg_val, fixed_val, seeds=(0, 1, 2)):
    """FedAvg scores 0.70 + 0.01 s; the fixed T0 (80) 0.72 + 0.01 s; perturbation never fires
    on seed 0 and fires at 40 otherwise; plateau fires at 30 everywhere; auto never freezes;
    the other rules fire at 20 and score 0.68 + 0.01 s."""
    rows = []
    for s in seeds:
        rows.append(_row(sweep, "fedavg", alpha, s, 0.70 + 0.01 * s, fedavg_val))
        rows.append(_row(sweep, "fedfrozen_fixed", alpha, s, 0.72 + 0.01 * s, fixed_val, t0=80))
        rows.append(_row(sweep, "perturbation", alpha, s, 0.70 + 0.01 * s if s == 0 else
                         0.69 + 0.01 * s, 0.5, decided=200.0 if s == 0 else 40.0,
                         fired=0.0 if s == 0 else 1.0, rule_s=2.0, state=5e5))
        rows.append(_row(sweep, "plateau", alpha, s, 0.66 + 0.01 * s, 0.5, decided=30.0,
                         fired=1.0, rule_s=0.1, state=0.0))
        rows.append(_row(sweep, "auto", alpha, s, 0.70 + 0.01 * s, 0.5, decided=200.0,
                         fired=0.0, compute=2.25, rule_s=50.0))
        for arm in ("norm_change", "norm_change_median", "kernel_stability", "fraction_half"):
            rows.append(_row(sweep, arm, alpha, s, 0.68 + 0.01 * s, 0.5, decided=20.0,
                             fired=1.0, rule_s=0.1, state=0.0))
    return rows


@pytest.fixture
def plan():
    return study.load_plan("freeze_rules")


def test_rule_and_fixed_arms_come_from_the_plan(plan):
    arms = rule_arms(plan)
    assert set(arms) == {"fmnist_softmax", "fmnist_linear", "mnist", "shakespeare"}
    assert arms["mnist"] == ["auto", "perturbation", "norm_change", "norm_change_median",
                             "kernel_stability", "plateau", "fraction_half"]
    assert fixed_arm(plan, "mnist") == "fedfrozen_fixed"
    assert rule_arms(study.load_plan("fair")) == {}
    assert not study.rule_regret(plan, [])["settings"]  # nothing finished: no setting


def test_an_arm_that_takes_the_default_warmup_is_an_online_arm(plan):
    """FedFrozen with neither algorithm.warmup nor a T0 runs ``auto`` (the default), so the
    report counts the arm with the rules; FedAvg and a fixed T0 given by override do not."""
    import dataclasses

    sw = plan.sweeps[0]
    auto = next(a for a in sw.arms if a.name == "auto")
    default = dataclasses.replace(auto, name="default", overrides=tuple(
        o for o in auto.overrides if not o.startswith("algorithm.warmup=")))
    pinned = dataclasses.replace(auto, name="pinned", overrides=(
        *default.overrides, "algorithm.warmup_rounds=30"))
    changed = dataclasses.replace(plan, sweeps=(dataclasses.replace(
        sw, arms=(*sw.arms, default, pinned)), *plan.sweeps[1:]))
    arms = rule_arms(changed)[sw.name]
    assert "default" in arms and "pinned" not in arms and "fedavg" not in arms


def test_target_regret_verdicts_and_rates(plan):
    # alpha 0.1: FedAvg validates better, so the target is never freezing (T = 200);
    # alpha 0.3: the fixed T0 validates better, so the target is T0 = 80
    runs = _setting("fmnist_softmax", 0.1, 0.80, 0.79) + _setting("fmnist_softmax", 0.3, 0.70,
                                                                  0.75)
    rep = study.rule_regret(plan, runs)
    by = {(s["sweep"], s["alpha"]): s for s in rep["settings"]}
    low, high = by["fmnist_softmax", 0.1], by["fmnist_softmax", 0.3]
    assert (low["target"], low["target_t0"], low["best_is_never"]) == ("fedavg", 200, True)
    assert (high["target"], high["target_t0"], high["best_is_never"]) == (
        "fedfrozen_fixed", 80, False)
    m = {x["method"]: x for x in low["methods"]}
    assert m["fedavg"]["regret_pts"] == pytest.approx(0.0, abs=1e-9)
    assert m["fedfrozen_fixed"]["regret_pts"] == pytest.approx(-2.0, abs=1e-9)
    # perturbation: 0 on seed 0, 1 point on seeds 1 and 2 -> mean 2/3, t interval by hand
    assert m["perturbation"]["regret_pts"] == pytest.approx(2 / 3, abs=1e-9)
    sd = np.std([0.0, 1.0, 1.0], ddof=1)
    assert m["perturbation"]["regret_ci_pts"] == pytest.approx(4.302652729911275 * sd /
                                                               math.sqrt(3), rel=1e-9)
    assert m["perturbation"]["t0_per_seed"] == [200, 40, 40]
    assert m["perturbation"]["never_fired"] == 1
    assert m["plateau"]["regret_pts"] == pytest.approx(4.0, abs=1e-9)
    assert m["plateau"]["verdict"] == "loss"  # every seed 4 points below FedAvg
    assert m["auto"]["verdict"] == "identical"
    assert m["auto"]["compute_ratio"] == pytest.approx(2.25)
    assert m["perturbation"]["rule_time_share"] == pytest.approx(0.02)
    assert m["perturbation"]["rule_state_bytes"] == pytest.approx(5e5)
    mh = {x["method"]: x for x in high["methods"]}
    assert mh["fedavg"]["regret_pts"] == pytest.approx(2.0, abs=1e-9)
    assert mh["auto"]["regret_pts"] == pytest.approx(2.0, abs=1e-9)
    assert mh["plateau"]["regret_pts"] == pytest.approx(6.0, abs=1e-9)
    summary = {s["method"]: s for s in rep["summary"]}
    assert summary["plateau"]["mean_regret_pts"] == pytest.approx(5.0, abs=1e-9)
    assert summary["auto"]["mean_regret_pts"] == pytest.approx(1.0, abs=1e-9)
    # where the best is T: auto never fires (3/3 refrain), perturbation 1 of 3, plateau 0
    assert summary["auto"]["refrain_rate"] == 1.0 and summary["auto"]["refrain_settings"] == 1
    assert summary["perturbation"]["refrain_rate"] == pytest.approx(1 / 3)
    assert summary["plateau"]["refrain_rate"] == 0.0
    # where the best T0 is 80 < T: plateau always fires, auto never
    assert summary["plateau"]["fire_rate"] == 1.0 and summary["auto"]["fire_rate"] == 0.0
    # auto never freezes, so it trains as FedAvg does: identical, counted as a tie, twice
    assert summary["plateau"]["loss"] == 2 and summary["auto"]["tie"] == 2
    # auto: regret 0 (alpha 0.1) and 2 points (alpha 0.3); never below FedAvg
    assert summary["auto"]["within_1pt_of_target"] == 1
    assert summary["auto"]["more_than_1pt_below_fedavg"] == 0
    assert summary["plateau"]["more_than_1pt_below_fedavg"] == 2
    assert summary["fedavg"]["more_than_1pt_below_fedavg"] is None
    assert rep["summary_settings"] == [["fmnist_softmax", 0.1], ["fmnist_softmax", 0.3]]


def test_summary_compares_methods_on_the_settings_all_completed(plan):
    runs = _setting("fmnist_softmax", 0.1, 0.80, 0.79)
    runs += [r for r in _setting("fmnist_softmax", 0.3, 0.70, 0.75)
             if not (r["arm"] == "plateau" and r["seed"] == 2)]
    rep = study.rule_regret(plan, runs)
    assert rep["summary_settings"] == [["fmnist_softmax", 0.1]]
    assert ["fmnist_softmax", 0.3] in rep["incomplete_settings"]
    assert {s["method"]: s["settings"] for s in rep["summary"]}["auto"] == 1
    text = "\n".join(report_lines(rep))
    assert "left out, unfinished: fmnist_softmax 0.3" in text


def test_write_rule_regret_only_for_plans_with_rules(plan, tmp_path):
    runs = _setting("mnist", 0.1, 0.80, 0.79)
    paths = study.write_rule_regret(plan, runs, tmp_path / "a")
    assert [p.name for p in paths] == ["rule_regret.json", "rule_regret.md"]
    back = json.loads(paths[0].read_text())
    assert back["settings"][0]["sweep"] == "mnist" and back["settings"][0]["target_t0"] == 200
    assert study.write_rule_regret(study.load_plan("fair"), runs, tmp_path / "b") == []
    assert not (tmp_path / "b").exists()


def test_a_setting_without_its_target_runs_is_listed_unscored(plan):
    runs = [r for r in _setting("mnist", 0.1, 0.80, 0.79) if r["arm"] != "fedfrozen_fixed"]
    rep = study.rule_regret(plan, runs)
    (st,) = rep["settings"]
    assert st["target"] is None and st["methods"] == []
    assert rep["incomplete_settings"] == [["mnist", 0.1]] and rep["summary"] == []
    assert "mnist, alpha 0.1: no target yet" in "\n".join(report_lines(rep))


def test_a_diverged_fixed_arm_leaves_never_freezing_as_the_target(plan):
    runs = _setting("fmnist_softmax", 0.3, 0.70, 0.75)
    for r in runs:
        if r["arm"] == "fedfrozen_fixed" and r["seed"] == 1:
            r.update(score=math.nan, val_score=math.nan, status="diverged")
    (st,) = study.rule_regret(plan, runs)["settings"]
    assert (st["target"], st["target_t0"], st["chosen_grid_t0"]) == ("fedavg", 200, None)
    m = {x["method"]: x for x in st["methods"]}
    assert m["plateau"]["regret_pts"] == pytest.approx(4.0, abs=1e-9)


def test_an_untuned_grid_is_chosen_on_the_final_seeds_validation(plan):
    """A fixed arm that ran T0 = 40 and 80 on the final seeds: the target is the T0 (or T)
    with the best mean validation score, whatever the test scores say."""
    runs = _setting("fmnist_softmax", 0.3, 0.70, 0.75)
    runs += [dict(r, warmup_rounds=40, score=0.90, val_score=0.74) for r in runs
             if r["arm"] == "fedfrozen_fixed"]
    (st,) = study.rule_regret(plan, runs)["settings"]
    assert (st["target"], st["target_t0"]) == ("fedfrozen_fixed", 80)
    assert st["val_score_by_t0"] == {"40": pytest.approx(0.74), "80": pytest.approx(0.75)}
    assert {x["method"]: x for x in st["methods"]}["fedfrozen_fixed"]["t0_per_seed"] == [80] * 3
