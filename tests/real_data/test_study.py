"""The study command: plan checking, resumable slices, aggregation into tables."""

from __future__ import annotations

import json

import pytest
import yaml

from real_data import study
from real_data.errors import ConfigError

PLAN = {
    "name": "tiny",
    "seeds": [0],
    "sweeps": [{
        "name": "digits",
        "config": "digits_vit",
        "overrides": ["train.rounds=3", "run.plot=false", "model.depth=1", "model.dim=8",
                      "eval.clients=true"],
        "alphas": [0.5],
        "arms": [
            {"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
            {"name": "frozen", "overrides": ["algorithm.name=fedfrozen", "algorithm.train=v"],
             "warmup_rounds": [0, 2]},
            {"name": "reference", "overrides": ["algorithm.name=fedavg", "partition.scheme=iid",
                                                "partition.num_clients=1"], "reference": True},
        ],
    }],
}


def _plan(tmp_path, data=PLAN):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return study.load_plan(path, tmp_path / "out")


def test_plan_keys_and_slices_resume_and_aggregate(tmp_path):
    plan = _plan(tmp_path)
    keys = [s.key for s in study.plan_runs(plan)]
    assert keys == ["digits/fedavg/alpha=0.5/seed=0", "digits/frozen-T0=2/alpha=0.5/seed=0",
                    "digits/frozen-T0=0/alpha=0.5/seed=0", "digits/reference/alpha=0.5/seed=0"]
    first = study.run_study(plan, pattern="digits/fedavg/*", log=lambda *_: None)
    assert first == {"skipped": 0, "resumed": 0, "started": 1, "branched": 0, "left": 0}
    rest = study.run_study(plan, log=lambda *_: None)
    assert rest == {"skipped": 1, "resumed": 0, "started": 2, "branched": 1, "left": 0}
    again = study.run_study(plan, log=lambda *_: None)
    assert again["started"] == again["branched"] == 0 and again["skipped"] == 4
    rows = {(r["arm"], r["warmup_rounds"]): r for r in study.aggregate(plan)}
    assert set(rows) == {("fedavg", None), ("frozen", 2), ("frozen", 0), ("reference", None)}
    assert all(r["n_seeds"] == 1 for r in rows.values())
    # the warm-up snapshot at T0 = 0 is the shared initialisation: no deviation yet
    assert rows[("frozen", 0)]["kernel_deviation_mean"] == pytest.approx(0.0, abs=1e-12)
    assert rows[("frozen", 2)]["kernel_deviation_mean"] > 0
    # the branched T0 = 0 run uploads less than FedAvg (value block only)
    assert rows[("frozen", 0)]["bytes_up_mean"] < rows[("fedavg", None)]["bytes_up_mean"]
    paths = study.write_tables(list(rows.values()), tmp_path / "tables")
    assert json.loads(paths[1].read_text())[0]["n_seeds"] == 1
    assert "| digits | 0.5 | fedavg |" in paths[2].read_text()


def test_interrupted_run_is_resumed(tmp_path):
    plan = _plan(tmp_path, {**PLAN, "sweeps": [{**PLAN["sweeps"][0],
                                                "arms": PLAN["sweeps"][0]["arms"][:1]}]})
    study.run_study(plan, log=lambda *_: None)
    run_dir = study.plan_runs(plan)[0].run_dir
    (run_dir / "summary.json").unlink()  # as if killed after its last checkpoint
    counts = study.run_study(plan, log=lambda *_: None)
    assert counts["resumed"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("mutate, key", [
    (lambda p: p.update(colour="red"), "unknown keys"),
    (lambda p: p["sweeps"][0].update(alphas=[-1]), "sweeps[0].alphas"),
    (lambda p: p["sweeps"][0]["arms"][1].update(warmup_rounds=["x"]),
     "sweeps[0].arms[1].warmup_rounds"),
    (lambda p: p["sweeps"][0]["arms"].append({"name": "fedavg"}), "arm names must be unique"),
])
def test_bad_plans_name_the_key(tmp_path, mutate, key):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    mutate(data)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        _plan(tmp_path, data)


def test_bad_override_in_plan_writes_nothing(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][0]["arms"][0]["overrides"] = ["train.nonsense=1"]
    plan = _plan(tmp_path, data)
    with pytest.raises(ConfigError):
        study.run_study(plan, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_slice_that_matches_nothing_is_an_error(tmp_path):
    plan = _plan(tmp_path)
    with pytest.raises(ConfigError, match="matches no run"):
        study.run_study(plan, pattern="digits/nonexistent/*", log=lambda *_: None)
    assert not (tmp_path / "out").exists()
