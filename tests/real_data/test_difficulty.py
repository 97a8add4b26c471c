"""Difficulty of a shift: FedAvg's gap to the unshifted data (``reference_sweep``), on validation
from the tuning choices and on test from the final runs; matched concept/covariate pairs."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml
from conftest import REPO, run_cli
from scipy import stats

from linattn.errors import ConfigError
from real_data import study
from real_data.study import difficulty

BASE = ["train.rounds=2", "run.plot=false", "model.depth=1", "model.dim=8", "model.mlp_dim=16",
        "partition.num_clients=4", "train.local_steps=2", "partition.scheme=iid",
        "algorithm.name=fedavg"]
PLAN = {
    "name": "hard",
    "seeds": [0, 1],
    "tune": {"seed": 7, "last": 1, "validation_fraction": 0.2},
    "sweeps": [
        {"name": "none", "config": "digits_vit", "overrides": BASE,
         "grid": {"train.lr": [0.05, 0.2]}, "arms": [{"name": "fedavg"}]},
        {"name": "rotated", "config": "digits_vit", "reference_sweep": "none",
         "overrides": BASE + ["partition.shift={kind: covariate, transform: rotation, "
                              "spread: 90}"],
         "grid": {"train.lr": [0.05, 0.2]}, "arms": [{"name": "fedavg"}]},
    ],
}


def _write(tmp_path, data=PLAN):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_difficulty_on_validation_and_test_from_the_two_stages(tmp_path):
    path, out, docs = _write(tmp_path), tmp_path / "out", tmp_path / "docs"
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "tune")
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "tune",
                  "--aggregate-only", "--export", str(docs / "tune"))
    assert res.returncode == 0, res.stderr[-2000:]
    plan = study.load_plan(path, out)
    choices = study.choose(plan, write=False)
    best = {c["sweep"]: c["chosen"]["score"] for c in choices["choices"]}
    (row,) = [r for r in csv.DictReader(open(docs / "tune" / "difficulty.csv"))
              if r["table"] == "validation"]
    assert row["sweep"] == "rotated" and row["shift"] == "covariate: rotation spread 90"
    assert float(row["val_gap"]) == pytest.approx(best["none"] - best["rotated"], abs=1e-12)
    assert json.loads((docs / "tune" / "choices.json").read_text())["choices"]
    # the final stage: FedAvg's test score against the reference's, paired by seed
    res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "final",
                  "--export", str(docs / "final"))
    assert res.returncode == 0, res.stderr[-2000:]
    per_run = {(r["sweep"], int(r["seed"])): float(r["score"])
               for r in csv.DictReader(open(docs / "final" / "study_per_run.csv"))}
    d = np.array([per_run[("none", s)] - per_run[("rotated", s)] for s in (0, 1)])
    (row,) = [r for r in csv.DictReader(open(docs / "final" / "difficulty.csv"))
              if r["table"] == "test"]
    half = stats.t.ppf(0.975, 1) * d.std(ddof=1) / np.sqrt(2)
    assert int(row["n"]) == 2
    assert float(row["gap"]) == pytest.approx(d.mean(), abs=1e-9)
    assert float(row["gap_low"]) == pytest.approx(d.mean() - half, abs=1e-9)
    assert float(row["gap_high"]) == pytest.approx(d.mean() + half, abs=1e-9)
    assert "Test (final runs, paired by seed" in (docs / "final" / "difficulty.md").read_text()


def _choices(scores):
    return {"metric": "val_acc", "last": 5, "seed": 100,
            "choices": [{"sweep": k, "arm": "fedavg", "alpha": None, "chosen": {"score": v}}
                        for k, v in scores.items()]}


def test_every_concept_shift_is_paired_with_the_nearest_covariate_gap():
    plan = study.load_plan("shift_fmnist_calibration")
    scores = {"none": 0.80, "concept_4of10": 0.65, "concept_8of10": 0.50, "rotation_30": 0.74,
              "rotation_45": 0.66, "rotation_60": 0.62, "rotation_90": 0.55,
              "rotation_120": 0.53, "rotation_180": 0.49}
    rows = difficulty.validation_gaps(plan, _choices(scores))
    gaps = {r["sweep"]: r["val_gap"] for r in rows}
    assert gaps["concept_4of10"] == pytest.approx(0.15) and gaps["rotation_180"] == \
        pytest.approx(0.31)
    pairs = {p["concept"]: p["covariate"] for p in difficulty.match(rows)}
    assert pairs == {"concept_4of10": "rotation_45", "concept_8of10": "rotation_180"}
    # a covariate sweep serves one concept sweep: the harder concept takes the next nearest
    scores.update(concept_8of10=0.655)
    pairs = {p["concept"]: p["covariate"]
             for p in difficulty.match(difficulty.validation_gaps(plan, _choices(scores)))}
    assert pairs == {"concept_8of10": "rotation_45", "concept_4of10": "rotation_60"}
    # a sweep whose FedAvg is not chosen yet is left out, not guessed
    del scores["rotation_45"]
    assert "rotation_45" not in {r["sweep"] for r in difficulty.validation_gaps(
        plan, _choices(scores))}


def test_the_shipped_grid_uses_the_calibrated_spreads():
    """shift_fmnist's rotation spreads are the calibration's matches (its exported
    difficulty.csv): weak with 4 relabelled classes, strong with 8."""
    rows = list(csv.DictReader(open(REPO / "docs/study/shift_fmnist_calibration/"
                                           "difficulty.csv")))
    match = {r["concept"]: r["covariate"] for r in rows if r["table"] == "match"}
    want = {"weak": int(match["concept_4of10"].split("_")[1]),
            "strong": int(match["concept_8of10"].split("_")[1])}
    plan = study.load_plan("shift_fmnist")
    seen = 0
    for sw in plan.sweeps:
        shift = difficulty.shift_of(sw)
        if shift and shift["kind"] == "covariate":
            assert shift["spread"] == want[sw.name.rsplit("_", 1)[1]], sw.name
            seen += 1
        elif shift:
            assert shift["classes"] == (4 if sw.name.endswith("weak") else 8)
        assert (sw.reference_sweep is None) == (shift is None)
    assert seen == 8  # two strengths x four blocks (softmax / linear x K = 10 / 40)


@pytest.mark.parametrize("mutate,said", [
    (lambda d: d["sweeps"][1].update(reference_sweep="nonee"), "'nonee' is not another sweep"),
    (lambda d: d["sweeps"][1].update(reference_sweep="rotated"), "not another sweep"),
    (lambda d: d["sweeps"][1].update(reference_sweep=3), "reference_sweep"),
    (lambda d: d["sweeps"][0].update(arms=[{"name": "avg"}]), "sweep none has no"),
    (lambda d: d["sweeps"][0].update(reference_sweep="rotated"), "has a reference_sweep of"),
    (lambda d: d["sweeps"][1].update(seeds=[0, 1, 2]), "must run every alpha and seed"),
    (lambda d: d["sweeps"][1].update(score="personal"), "has score: global"),
])
def test_a_bad_reference_sweep_names_the_key(tmp_path, mutate, said):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    mutate(data)
    with pytest.raises(ConfigError, match="reference_sweep|score") as err:
        study.load_plan(_write(tmp_path, data), tmp_path / "out")
    assert said in str(err.value)
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and said in res.stderr
    assert not (tmp_path / "o").exists()


def test_a_concept_shift_reads_its_own_validation_labels_beside_the_unshifted_data(tmp_path):
    """A concept shift relabels the same inputs: stacked (or run one after the other in one
    process) beside the unshifted data, its validation scores equal the same run alone."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][1].update(name="relabelled", overrides=BASE + [
        "partition.shift={kind: concept, classes: 10, groups: 2}"])
    data["sweeps"][1]["grid"] = data["sweeps"][0]["grid"] = {"train.lr": [0.2]}
    path = _write(tmp_path, data)
    together, alone = tmp_path / "together", tmp_path / "alone"
    for out, extra in ((together, []), (together, ["--no-stack"]),
                       (alone, ["--slice", "relabelled/*"])):
        if extra == ["--no-stack"]:
            out = tmp_path / "sequential"
        res = run_cli("study", "--plan", str(path), "--out", str(out), "--stage", "tune",
                      *extra)
        assert res.returncode == 0, res.stderr[-2000:]

    def val(root):
        rows = csv.DictReader(open(root / "relabelled/fedavg+0/natural/seed=7/metrics.csv"))
        return [(r["round"], r["metric"], r["value"]) for r in rows if r["client"] == "global"
                and r["metric"] in ("val_acc", "val_loss", "local_val_acc_micro")]

    want = val(alone)
    assert len(want) == 6  # two rounds x three metrics
    assert val(together) == want and val(tmp_path / "sequential") == want


def test_gaps_read_exported_scores_and_match_per_alpha():
    """An exported choices table holds an infinite score as a string and may lack one: such
    a sweep has no gap; a covariate sweep serves one concept sweep per alpha."""
    plan = study.load_plan("shift_fmnist_calibration")
    scores = {"none": 0.80, "concept_4of10": "-inf", "concept_8of10": 0.50,
              "rotation_180": 0.49}
    table = _choices(scores)
    table["choices"].append({"sweep": "rotation_30", "arm": "fedavg", "alpha": None,
                             "chosen": {}})
    rows = difficulty.validation_gaps(plan, table)
    assert {r["sweep"] for r in rows} == {"concept_8of10", "rotation_180"}
    two = [{**r, "alpha": a} for r in rows for a in (0.1, 1.0)]
    pairs = difficulty.match(two)
    assert [(p["concept"], p["covariate"], p["alpha"]) for p in pairs] == [
        ("concept_8of10", "rotation_180", 0.1), ("concept_8of10", "rotation_180", 1.0)]
