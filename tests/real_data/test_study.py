"""The study command: plan checking, resumable slices, aggregation into tables."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli

from linattn.errors import ConfigError, DataError, UserError
from real_data import study
from real_data.config import load_config
from real_data.study import runner

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
    assert first == {"skipped": 0, "resumed": 0, "started": 1, "branched": 0, "left": 0,
                     "diverged": 0, "failed": 0}
    rest = study.run_study(plan, log=lambda *_: None)
    assert rest == {"skipped": 1, "resumed": 0, "started": 2, "branched": 1, "left": 0,
                    "diverged": 0, "failed": 0}
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
    runs = study.run_rows(plan)
    assert sorted((r["arm"], r["warmup_rounds"], r["seed"]) for r in runs if r["arm"] != "frozen") \
        == [("fedavg", None, 0), ("reference", None, 0)]
    by_run = {(r["arm"], r["warmup_rounds"]): r for r in runs}
    assert by_run[("frozen", 2)]["kernel_deviation"] == \
        pytest.approx(rows[("frozen", 2)]["kernel_deviation_mean"], rel=1e-12)
    assert study.aggregate(plan, runs) == study.aggregate(plan)
    paired = {(r["arm"], r["warmup_rounds"]): r for r in study.paired_differences(runs)}
    assert set(paired) == {("frozen", 2), ("frozen", 0), ("reference", None)}
    assert paired[("frozen", 0)]["n"] == 1 and paired[("frozen", 0)]["diff_se"] is None
    assert paired[("frozen", 0)]["diff_mean"] == pytest.approx(
        by_run[("frozen", 0)]["final_acc"] - by_run[("fedavg", None)]["final_acc"], abs=1e-12)
    paths = study.write_tables(list(rows.values()), tmp_path / "tables", runs)
    assert [p.name for p in paths] == ["study.csv", "study.json", "study.md", "study_per_run.csv",
                                       "study_paired.csv", "study_paired.md"]
    assert json.loads(paths[1].read_text())[0]["n_seeds"] == 1
    assert "| digits | 0.5 | fedavg |" in paths[2].read_text()
    assert len(paths[3].read_text().splitlines()) == 1 + 4  # header + one row per run
    assert "| digits | 0.5 | frozen | 0 | 1 |" in paths[5].read_text()


def test_paired_differences_mean_and_standard_error():
    def run(arm, seed, acc, t0=None, sweep="s", alpha=0.1):
        return {"sweep": sweep, "arm": arm, "warmup_rounds": t0, "alpha": alpha, "seed": seed,
                "final_acc": acc}
    runs = [run("fedavg", 0, 0.70), run("fedavg", 1, 0.72), run("fedavg", 2, 0.80),
            run("x", 0, 0.71, 5), run("x", 1, 0.75, 5), run("x", 2, 0.82, 5),
            run("y", 0, 0.60), run("y", 3, 0.90),  # seed 3 has no fedavg run: left out
            run("fedavg", 0, 0.10, alpha=1.0), run("x", 0, float("nan"), 5, alpha=1.0)]
    out = {(r["arm"], r["alpha"]): r for r in study.paired_differences(runs)}
    assert set(out) == {("x", 0.1), ("y", 0.1)}  # a nan metric is no difference
    d = np.array([0.01, 0.03, 0.02])
    assert out[("x", 0.1)]["diff_mean"] == pytest.approx(0.02, abs=1e-12)
    assert out[("x", 0.1)]["diff_se"] == pytest.approx(d.std(ddof=1) / np.sqrt(3), rel=1e-12)
    assert out[("x", 0.1)]["n"] == 3 and out[("x", 0.1)]["warmup_rounds"] == 5
    assert out[("y", 0.1)]["n"] == 1 and out[("y", 0.1)]["diff_se"] is None
    assert out[("y", 0.1)]["diff_mean"] == pytest.approx(-0.10, abs=1e-12)


def test_paired_table_of_a_plan_without_fedavg_has_its_header(tmp_path):
    from real_data.study.tables import PAIRED_FIELDS, write_csv

    runs = [{"sweep": "s", "arm": "x", "warmup_rounds": 5, "alpha": 0.1, "seed": 0,
             "final_acc": 0.7}]
    assert study.paired_differences(runs) == []
    write_csv(study.paired_differences(runs), tmp_path / "paired.csv", PAIRED_FIELDS)
    assert (tmp_path / "paired.csv").read_text().strip() == ",".join(PAIRED_FIELDS)
    write_csv([], tmp_path / "none.csv")
    assert (tmp_path / "none.csv").read_text() == ""


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
    # the tuning stage's name for fedavg's grid point 2
    (lambda p: p["sweeps"][0]["arms"][0].update(name="fedavg+2"),
     "sweeps[0].arms[0].name: 'fedavg.2' ends in '.' and a number"),
])
def test_bad_plans_name_the_key(tmp_path, mutate, key):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    mutate(data)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        _plan(tmp_path, data)


def test_an_arm_whose_default_warmup_needs_a_validation_split_is_refused_at_load(tmp_path):
    """FedFrozen with no T0 runs ``warmup=auto`` (the default), which reads a validation
    split: a plan without a tune section must give it one, or loading it names the arm."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][0]["arms"].append({"name": "decides", "overrides": [
        "algorithm.name=fedfrozen", "algorithm.warmup_rounds=null"]})
    with pytest.raises(ConfigError, match=r"sweeps\[0\] arm decides: algorithm.warmup=auto"):
        _plan(tmp_path, data)
    data["sweeps"][0]["arms"][-1]["overrides"].append("partition.validation_fraction=0.1")
    assert [a.name for a in _plan(tmp_path, data).sweeps[0].arms][-1] == "decides"


def test_a_bad_stack_pad_stops_the_study_before_any_run(tmp_path):
    _plan(tmp_path)
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "out"),
                  "--no-tables", env={"LINATTN_STACK_PAD": "tight"})
    assert res.returncode == 2 and "LINATTN_STACK_PAD='tight': one of group, live" in res.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_bad_override_in_plan_writes_nothing(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][0]["arms"][0]["overrides"] = ["train.nonsense=1"]
    plan = _plan(tmp_path, data)
    with pytest.raises(ConfigError):
        study.run_study(plan, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_listing_a_plan_with_an_unknown_method_option_names_it(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][0]["arms"][0]["overrides"].append("algorithm.muu=0.1")
    _plan(tmp_path, data)
    for flag in ("--list", "--estimate"):
        res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"),
                      "--out", str(tmp_path / "out"), flag)
        assert res.returncode == 2, (flag, res.stdout, res.stderr)
        assert ("unknown key(s) algorithm.muu; valid keys in algorithm "
                "(algorithm.name=fedavg; besides name): none") in res.stderr
        if flag == "--list":
            assert "digits/fedavg: unknown key(s) algorithm.muu" in res.stderr
    # a --slice that leaves the arm out lists the rest
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "out"),
                  "--list", "--slice", "digits/frozen-*")
    assert res.returncode == 0 and "digits/frozen-T0=2/alpha=0.5/seed=0" in res.stdout
    assert not (tmp_path / "out").exists()


def test_slice_that_matches_nothing_is_an_error(tmp_path):
    plan = _plan(tmp_path)
    with pytest.raises(ConfigError, match="matches no run"):
        study.run_study(plan, pattern="digits/nonexistent/*", log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_shards_split_the_groups_disjointly_and_cover_the_plan(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1]
    plan = _plan(tmp_path, data)
    groups: dict = {}
    for s in study.plan_runs(plan):
        groups.setdefault((s.arm.name, s.seed), []).append(s)
    parts = [study.shard_groups(list(groups.values()), (k, 3)) for k in range(3)]
    keys = [[m.key for g in part for m in g] for part in parts]
    flat = [k for part in keys for k in part]
    assert sorted(flat) == sorted(s.key for s in study.plan_runs(plan))  # each run exactly once
    assert all(part for part in keys)  # 6 groups over 3 shards: none idle
    # two workers, one after the other here, finish the whole plan between them
    a = study.run_study(plan, shard=(0, 2), log=lambda *_: None)
    b = study.run_study(plan, shard=(1, 2), log=lambda *_: None)
    assert a["started"] + b["started"] == 6 and a["branched"] + b["branched"] == 2
    assert all(study._status(s.run_dir) == "completed" for s in study.plan_runs(plan))
    again = study.run_study(plan, shard=(0, 2), log=lambda *_: None)  # nothing left
    assert again["started"] == again["branched"] == again["resumed"] == 0


def test_plan_pretraining_runs_once_and_feeds_fedsq(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["pretrain"] = [{"name": "src", "config": "digits_vit", "source": "digits", "epochs": 1,
                         "overrides": ["model.depth=1", "model.dim=8", "model.activation=relu"]}]
    data["sweeps"][0]["arms"] = [{"name": "fedsq", "overrides": [
        "algorithm.name=fedsq", "model.activation=relu", "algorithm.init=pretrained",
        "algorithm.pretrained={out_dir}/pretrained/src.pt"]}]
    plan = _plan(tmp_path, data)
    counts = study.run_study(plan, pretrain_only=True, log=lambda *_: None)
    path = tmp_path / "out" / "pretrained" / "src.pt"
    assert counts == {"pretrained": 1} and path.is_file()
    assert not list(path.parent.glob("*.tmp*"))  # written under a temporary name, renamed
    stamp = path.stat().st_mtime_ns
    study.run_study(plan, log=lambda *_: None)
    assert path.stat().st_mtime_ns == stamp  # not redone
    run = study.plan_runs(plan)[0].run_dir
    assert study._status(run) == "completed"
    assert str(path) in (run / "config.yaml").read_text()


def test_fedsq_refuses_weights_pretrained_with_another_attention(tmp_path):
    from linattn.errors import UserError

    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["pretrain"] = [{"name": "src", "config": "digits_vit", "source": "digits", "epochs": 1,
                         "overrides": ["model.depth=1", "model.dim=8", "model.activation=relu",
                                       "model.attention=softmax"]}]
    data["sweeps"][0]["overrides"].append("model.attention=linear")
    data["sweeps"][0]["arms"] = [{"name": "fedsq", "overrides": [
        "algorithm.name=fedsq", "model.activation=relu", "algorithm.init=pretrained",
        "algorithm.pretrained={out_dir}/pretrained/src.pt"]}]
    plan = _plan(tmp_path, data)
    with pytest.raises(UserError, match="model.attention='softmax'"):
        study.run_study(plan, log=lambda *_: None)


def test_pretraining_can_leave_out_the_federated_groups():
    import numpy as np
    import torch

    from linattn.errors import UserError
    from real_data.data.base import TensorDataset
    from real_data.pretrain import PretrainSettings, source_indices

    sizes = [5, 9, 2, 7]  # group 1 and 3 are the two largest
    groups, start = [], 0
    for n in sizes:
        groups.append(np.arange(start, start + n))
        start += n
    x = torch.zeros(start, 4, dtype=torch.long)
    ds = TensorDataset("toy", "text", x, x, x[:2], x[:2], 10, tuple(groups),
                       tuple(np.arange(1) for _ in sizes), ("a", "b", "c", "d"))
    kept = source_indices(ds, PretrainSettings("toy", exclude_largest_groups=2)).numpy()
    assert kept.tolist() == [*groups[0], *groups[2]]
    assert len(source_indices(ds, PretrainSettings("toy"))) == start
    with pytest.raises(UserError, match="exclude-largest-groups"):
        source_indices(ds, PretrainSettings("toy", exclude_largest_groups=4))


def test_an_iid_reference_of_another_alpha_stands_in(tmp_path):
    """The reference arm (one client, pooled data) ignores alpha: the same seed's run at any
    alpha gives the kernel deviation when this alpha's reference is missing."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][0]["alphas"] = [0.5, 1.0]
    plan = _plan(tmp_path, data)
    study.run_study(plan, pattern=["digits/reference/alpha=0.5/*", "digits/frozen*/alpha=1/*"],
                    log=lambda *_: None)
    rows = {(r["arm"], r["warmup_rounds"], r["alpha"]): r for r in study.aggregate(plan)}
    assert rows[("frozen", 2, 1.0)]["kernel_deviation_mean"] > 0
    assert rows[("frozen", 0, 1.0)]["kernel_deviation_mean"] == pytest.approx(0.0, abs=1e-12)


def test_a_failing_run_is_counted_and_the_others_go_on(tmp_path, monkeypatch):
    import real_data.runs

    plan = _plan(tmp_path)
    real_start = real_data.runs.start_run

    def start(cfg, out=None, **kw):
        if "fedavg" in str(out):
            raise RuntimeError("simulated crash")
        return real_start(cfg, out=out, **kw)

    monkeypatch.setattr(real_data.runs, "start_run", start)
    lines = []
    counts = study.run_study(plan, log=lines.append, stack=False)
    assert counts["failed"] == 1 and counts["started"] == 2 and counts["branched"] == 1
    assert any("FAILED digits/fedavg" in line and "simulated crash" in line for line in lines)
    assert study._status(study.plan_runs(plan)[3].run_dir) == "completed"


def test_pack_and_markers_carry_a_study_to_another_machine(tmp_path):
    import tarfile

    plan = _plan(tmp_path)
    study.run_study(plan, log=lambda *_: None)
    packed = study.pack_results(plan, tmp_path / "runs.tar.gz")
    assert packed == {"runs": 4, "snapshots": 4, "skipped": 0}  # T0=2 head: 0, 2; ref: 0, 2
    marked = study.write_markers(plan, tmp_path / "done.tar.gz")
    assert marked == 4
    # the same machine, a later call: what came back before is left out of the pack, unless
    # the run trained again (its summary.json differs)
    before = study.packed_before(tmp_path / "done.tar.gz")
    assert len(before) == 4
    assert study.pack_results(plan, tmp_path / "new.tar.gz", before) == {
        "runs": 0, "snapshots": 0, "skipped": 4}
    retrained = study.plan_runs(plan)[0].run_dir / "summary.json"
    retrained.write_text(retrained.read_text().replace("}", ', "again": 1}', 1))
    assert study.pack_results(plan, tmp_path / "new.tar.gz", before)["runs"] == 1
    with pytest.raises(DataError, match="not a readable study archive"):
        study.packed_before(retrained)
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "x"),
                  "--aggregate-only", "--pack-except", str(tmp_path / "done.tar.gz"))
    assert res.returncode == 2 and "--pack-except: only with --pack" in res.stderr
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "x"),
                  "--aggregate-only", "--pack", str(tmp_path / "p.tar.gz"), "--pack-except",
                  str(retrained))
    assert res.returncode == 2 and "not a readable study archive" in res.stderr
    assert not (tmp_path / "p.tar.gz").exists()
    # another machine: the markers alone make every group skip, and nothing is packed twice
    other = study.replace_out(plan, tmp_path / "other")
    other.out_dir.mkdir()
    with tarfile.open(tmp_path / "done.tar.gz") as tar:
        tar.extractall(other.out_dir, filter="data")
    counts = study.run_study(other, log=lambda *_: None)
    assert counts["skipped"] == 4 and counts["started"] == counts["branched"] == 0
    assert study.pack_results(other, tmp_path / "again.tar.gz")["runs"] == 0
    # here: the pack unpacked into an empty out_dir gives the same tables
    local = study.replace_out(plan, tmp_path / "local")
    local.out_dir.mkdir()
    with tarfile.open(tmp_path / "runs.tar.gz") as tar:
        tar.extractall(local.out_dir, filter="data")
    key = ("arm", "warmup_rounds", "final_acc_mean", "kernel_deviation_mean", "bytes_up_mean")
    rows = sorted(tuple(r[k] for k in key) for r in study.aggregate(plan))
    again = sorted(tuple(r[k] for k in key) for r in study.aggregate(local))
    assert rows == again


def test_a_marker_of_another_configuration_is_stale_and_the_run_trains(tmp_path):
    """Markers carry each run's config: on a machine where the plan asks another
    configuration for a marked run (its arm's choice moved), the marker is removed and the run
    trains; markers of unchanged runs skip. A real run of another configuration
    stops the study (exit 2 in the CLI), naming the key."""
    import tarfile

    plan = _plan(tmp_path)
    study.run_study(plan, log=lambda *_: None)
    assert study.write_markers(plan, tmp_path / "done.tar.gz") == 4
    with tarfile.open(tmp_path / "done.tar.gz") as tar:
        names = tar.getnames()
    assert "digits/fedavg/alpha=0.5/seed=0/config.yaml" in names
    assert not any(n.endswith("metrics.csv") for n in names)
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][0]["arms"][0]["overrides"] = ["algorithm.name=fedavg", "train.lr=0.07"]
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(data))
    other = study.load_plan(path, tmp_path / "other")
    other.out_dir.mkdir()
    with tarfile.open(tmp_path / "done.tar.gz") as tar:
        tar.extractall(other.out_dir, filter="data")
    said = []
    counts = study.run_study(other, log=said.append)
    assert counts["started"] == 1 and counts["skipped"] == 3
    assert any(m.startswith("stale marker digits/fedavg/alpha=0.5/seed=0 (train.lr: ran "
                            "with") for m in said)
    fedavg = other.out_dir / "digits/fedavg/alpha=0.5/seed=0"
    assert (fedavg / "metrics.csv").is_file() and "lr: 0.07" in (fedavg / "config.yaml").read_text()
    # the run that trained here is real: the first plan's configuration is refused for it
    first = study.replace_out(plan, other.out_dir)
    with pytest.raises(UserError, match="holds a run of another configuration"):
        study.run_study(first, log=lambda *_: None)


def test_stale_markers_go_with_their_family_and_a_refused_plan_removes_none(tmp_path):
    import tarfile

    plan = _plan(tmp_path)
    study.run_study(plan, log=lambda *_: None)
    study.write_markers(plan, tmp_path / "done.tar.gz")
    other = study.replace_out(plan, tmp_path / "other")
    other.out_dir.mkdir()
    with tarfile.open(tmp_path / "done.tar.gz") as tar:
        tar.extractall(other.out_dir, filter="data")
    head = other.out_dir / "digits/frozen-T0=2/alpha=0.5/seed=0"
    branch = other.out_dir / "digits/frozen-T0=0/alpha=0.5/seed=0"
    fedavg = other.out_dir / "digits/fedavg/alpha=0.5/seed=0"
    cfg = (branch / "config.yaml").read_text()
    assert "  lr: 0.01\n" in cfg
    (branch / "config.yaml").write_text(cfg.replace("  lr: 0.01\n", "  lr: 0.02\n"))
    # a real run of another configuration beside it: refused, and no marker removed
    (fedavg / "metrics.csv").write_text("round,client,metric,value,stage\n")
    (fedavg / "config.yaml").write_text((fedavg / "config.yaml").read_text().replace(
        "  lr: 0.01\n", "  lr: 0.07\n"))
    with pytest.raises(UserError, match="fedavg.*holds a run of another configuration"):
        study.run_study(other, log=lambda *_: None)
    assert (head / "summary.json").is_file() and (branch / "summary.json").is_file()
    # without the conflict: the stale branch takes its head's marker along (a family trains
    # whole, from its head's snapshots); the other markers stay
    shutil.rmtree(fedavg)
    counts = study.run_study(other, pattern="digits/frozen*", log=lambda *_: None)
    assert counts["started"] == 1 and counts["branched"] == 1
    assert (head / "metrics.csv").is_file() and (branch / "metrics.csv").is_file()
    assert (other.out_dir / "digits/reference/alpha=0.5/seed=0/summary.json").is_file()


def test_deadline_leaves_groups_that_would_not_fit(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1]
    plan = _plan(tmp_path, data)
    # after the first group the pace is known; a deadline of ~0 s leaves every other group
    counts = study.run_study(plan, deadline_s=1e-9, log=lambda *_: None, stack=False)
    done = sum(study._status(s.run_dir) == "completed" for s in study.plan_runs(plan))
    assert counts["started"] == 1 and counts["left"] == len(study.plan_runs(plan)) - done


def test_a_slice_not_run_yet_is_priced_by_the_plan_and_a_late_batch_splits(tmp_path,
                                                                           monkeypatch):
    """The pace measured in one sweep prices another at its own local work; a stacked batch
    that would overrun the deadline is split into halves until a part fits."""

    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1, 2, 3]
    base = data["sweeps"][0]
    base["arms"] = base["arms"][:1]
    base["overrides"] = base["overrides"] + ["train.local_steps=10"]
    new = {**base, "name": "new", "overrides": base["overrides"] + ["train.local_steps=21"]}
    data["sweeps"] = [base, new]
    plan = _plan(tmp_path, data)
    for spec in study.plan_runs(plan):
        if spec.sweep.name == "digits":
            spec.run_dir.mkdir(parents=True)
            (spec.run_dir / "summary.json").write_text(json.dumps(
                {"status": "completed", "seconds_per_round": 1.0, "device": {"type": "cuda"}}))
    pace = study.measured_pace(study.plan_runs(plan))
    # per unit of local work (50 clients at K = 10): these runs have 10 clients, narrower than
    # the width floor, so WIDTH_FLOOR units (a narrow round costs its steps' latency)
    floor = runner.WIDTH_FLOOR
    assert pace["*"] == pytest.approx(1.0 / floor) and "new" not in pace
    fresh = [s for s in study.plan_runs(plan) if s.sweep.name == "new"]
    # 3 rounds at 1 / floor s per unit of local work, K = 21 being 2 floor units: 6 s
    assert study.batch_cost([[s] for s in fresh], pace) == pytest.approx(4 * 6.0)
    # what is left, as --estimate prints it: the measured sweep is done, the new one priced
    (row,) = study.estimate(plan)
    assert row == {"sweep": "new", "runs": 4, "run_rounds": 12, "gpu_seconds":
                   pytest.approx(24.0), "priced_by": "local work"}
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out",
                  str(tmp_path / "out"), "--estimate")
    assert res.returncode == 0 and "total: 4 runs, 12 run-rounds, 24 GPU-s" in res.stdout
    assert not any(s.run_dir.exists() for s in fresh)  # nothing trained
    # a fresh folder of the plan: unpriced, or priced at another plan's measured pace
    blank = study.load_plan(tmp_path / "plan.yaml", tmp_path / "blank")
    assert {r["gpu_seconds"] for r in study.estimate(blank)} == {None}
    priced = {r["sweep"]: r for r in study.estimate(blank, pace_plan=plan)}
    assert priced["new"]["gpu_seconds"] == pytest.approx(24.0)
    assert priced["digits"]["gpu_seconds"] == pytest.approx(4 * 3 * 1.0)
    assert priced["new"]["priced_by"] == "local work at tiny's pace"
    ran = []
    monkeypatch.setattr(runner, "_run_stacked", lambda batch, counts, log: ran.append(
        sorted(f[0].seed for f in batch)))
    monkeypatch.setattr(runner, "_run_group", lambda members, counts, log: ran.append(
        sorted(m.seed for m in members)))
    # 24 s of work against a 7 s deadline: halves (12 s) are late too, quarters (6 s) fit;
    # once a part has run the pace here is known (near 0 s: nothing trains) and the rest fit
    study.run_study(plan, pattern="new/*", deadline_s=7.0, pending=True, log=lambda *_: None)
    assert ran == [[0], [1], [2, 3]]
    # runs that recorded their GPU to themselves, priced for a worker that shares its GPU with
    # another (LINATTN_DEVICE_WORKERS=2, as gpu_study.sh sets it): 48 s, so against 13 s the
    # halves (24 s) are late and the quarters (12 s) fit; unshared, the halves fit
    for spec in study.plan_runs(plan):
        if spec.sweep.name == "digits":
            (spec.run_dir / "summary.json").write_text(json.dumps(
                {"status": "completed", "seconds_per_round": 1.0,
                 "device": {"type": "cuda", "workers": 1}}))
    for workers, parts in (("1", [[0, 1], [2, 3]]), ("2", [[0], [1], [2, 3]])):
        ran.clear()
        monkeypatch.setenv("LINATTN_DEVICE_WORKERS", workers)
        study.run_study(plan, pattern="new/*", deadline_s=13.0, pending=True,
                        log=lambda *_: None)
        assert ran == parts, workers
    monkeypatch.delenv("LINATTN_DEVICE_WORKERS")
    # without a measured pace the first batch always starts, whole
    ran.clear()
    for spec in study.plan_runs(plan):
        if spec.sweep.name == "digits":
            (spec.run_dir / "summary.json").unlink()
    study.run_study(plan, pattern="new/*", deadline_s=7.0, pending=True, log=lambda *_: None)
    assert ran == [[0, 1, 2, 3]]


def test_a_larger_model_not_run_yet_is_priced_by_its_work_per_token(tmp_path):
    """A sweep of a larger Transformer not run yet costs the measured pace times its weight
    work per token, depth (4 d^2 + 2 d mlp_dim), over the measured sweeps' median; a smaller
    one is not priced below the measured pace."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    base = dict(data["sweeps"][0], arms=data["sweeps"][0]["arms"][:1])
    data["sweeps"] = [dict(base, name="small"),
                      dict(base, name="big", overrides=[*base["overrides"], "model.dim=16",
                                                        "model.depth=3", "model.mlp_dim=64"]),
                      dict(base, name="tiny", overrides=[*base["overrides"], "model.dim=4"])]
    plan = _plan(tmp_path, data)
    small = study.plan_runs(plan)[0]
    small.run_dir.mkdir(parents=True)
    (small.run_dir / "summary.json").write_text(json.dumps(
        {"status": "completed", "device": {"type": "cuda"}, "seconds_per_round": 1.5}))
    pace = study.measured_pace(study.plan_runs(plan))
    cfgs = {s.sweep.name: study.run_config(s, None) for s in study.plan_runs(plan)}
    mlp = cfgs["small"].model.params.mlp_dim
    assert runner._block_work(cfgs["small"]) == 1 * (4 * 8 * 8 + 2 * 8 * mlp)
    assert runner._block_work(cfgs["big"]) == 3 * (4 * 16 * 16 + 2 * 16 * 64)
    assert pace["*model"] == runner._block_work(cfgs["small"])
    rows = {r["sweep"]: r["gpu_seconds"] for r in study.estimate(plan)}
    ratio = runner._block_work(cfgs["big"]) / runner._block_work(cfgs["small"])
    assert ratio > 1 and rows["big"] == pytest.approx(3 * 1.5 * ratio)
    assert rows["tiny"] == pytest.approx(3 * 1.5)


def test_a_sweep_not_run_yet_is_priced_by_its_attentions_measured_ratio(tmp_path):
    """Each attention kind's pace per unit of local work, the median over its runs (not its
    sweeps), relative to the overall median, prices a sweep of that kind not run yet."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1]
    base = dict(data["sweeps"][0], arms=data["sweeps"][0]["arms"][:1])
    lin = [*base["overrides"], "model.attention=linear"]
    data["sweeps"] = [dict(base, name="soft"), dict(base, name="soft2"),
                      dict(base, name="lin", overrides=lin),
                      dict(base, name="lin40", overrides=[*lin, "train.local_steps=40"])]
    plan = _plan(tmp_path, data)
    measured = {("soft", 0): 1.0, ("soft", 1): 1.0, ("soft2", 0): 3.0, ("lin", 0): 2.0,
                ("lin", 1): 2.0}  # soft2's seed 1 has not run
    for spec in study.plan_runs(plan):
        if (spec.sweep.name, spec.seed) in measured:
            spec.run_dir.mkdir(parents=True)
            (spec.run_dir / "summary.json").write_text(json.dumps(
                {"status": "completed", "device": {"type": "cuda"},
                 "seconds_per_round": measured[spec.sweep.name, spec.seed]}))
    pace = study.measured_pace(study.plan_runs(plan))
    floor = runner.WIDTH_FLOOR  # these runs have 10 clients: GPU prices take the floor
    unit = runner._local_work(study.run_config(study.plan_runs(plan)[0], None), floor)
    assert pace["*"] == pytest.approx(2.0 / unit)  # the median of the 5 runs
    assert pace[("*attention", "softmax")] == pytest.approx(0.5)  # median(1, 1, 3) / 2
    assert pace[("*attention", "linear")] == pytest.approx(1.0)
    rows = {r["sweep"]: r for r in study.estimate(plan)}
    work = runner._local_work(study.run_config(study.plan_runs(plan)[-1], None), floor)
    assert rows["lin40"]["gpu_seconds"] == pytest.approx(2 * 3 * (2.0 / unit) * work * 1.0)
    assert rows["soft2"]["gpu_seconds"] == pytest.approx(3 * 3.0)  # its own measured pace
    # a plan borrowing this pace takes the ratios along
    blank = study.load_plan(tmp_path / "plan.yaml", tmp_path / "blank")
    priced = {r["sweep"]: r["gpu_seconds"] for r in study.estimate(blank, pace_plan=plan)}
    assert priced["lin40"] == pytest.approx(rows["lin40"]["gpu_seconds"])
    assert priced["soft"] == pytest.approx(2 * 3 * (2.0 / unit) * unit * 0.5)
    # the same paces from the plan's exported per-run table, its runs gone (a fresh clone):
    # GPU rows by device_type, or by a CUDA card's name where the column is absent; a CPU
    # row, an unfinished one and an arm the plan lacks are left out
    table = tmp_path / "study_per_run.csv"
    lines = ["sweep,arm,seconds_per_round,status,device"]
    lines += [f"{sw},fedavg,{sec},completed,NVIDIA H200" for (sw, _), sec in measured.items()]
    lines += ["soft,fedavg,50.0,completed,x86_64", "soft,fedavg,50.0,diverged,NVIDIA H200",
              "soft,other_arm,50.0,completed,NVIDIA H200"]
    table.write_text("\n".join(lines) + "\n")
    gone = study.load_plan(tmp_path / "plan.yaml", tmp_path / "gone")
    assert study.exported_pace(gone, table) == pytest.approx(pace)
    assert study.estimate(blank, pace_plan=gone, pace_table=table) == study.estimate(
        blank, pace_plan=plan)
    typed = tmp_path / "typed.csv"
    typed.write_text("sweep,arm,seconds_per_round,status,device_type\n"
                     + "".join(f"{sw},fedavg,{sec},completed,cuda\n"
                               for (sw, _), sec in measured.items())
                     + "soft,fedavg,50.0,completed,cpu\n")
    assert study.exported_pace(gone, typed) == pytest.approx(pace)
    with pytest.raises(DataError, match="missing.csv"):
        study.exported_pace(gone, tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text("sweep,arm\nsoft,fedavg\n")
    with pytest.raises(DataError, match="not a study's per-run table"):
        study.exported_pace(gone, tmp_path / "bad.csv")
    (tmp_path / "latin.csv").write_bytes(b"sweep,arm,seconds_per_round,status,device\n\xff\n")
    with pytest.raises(DataError, match="cannot read the per-run table"):
        study.exported_pace(gone, tmp_path / "latin.csv")
    # a header alone, a short row, a non-finite or non-numeric pace: no measured pace
    odd = tmp_path / "odd.csv"
    odd.write_text("sweep,arm,seconds_per_round,status,device\nsoft,fedavg,0.2\n"
                   "soft,fedavg,inf,completed,NVIDIA H200\nsoft,fedavg,x,completed,NVIDIA H200\n")
    assert study.exported_pace(gone, odd) == {}
    odd.write_text("sweep,arm,seconds_per_round,status,device\n")
    assert study.exported_pace(gone, odd) == {}
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "out"),
                  "--estimate", "--pace-from", str(tmp_path / "plan.yaml"), "--pace-table",
                  str(tmp_path / "missing.csv"))
    assert res.returncode == 2 and "missing.csv" in res.stderr
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out",
                  str(tmp_path / "blank"), "--estimate", "--pace-table", str(table))
    assert res.returncode == 2 and "--pace-table: only with --pace-from" in res.stderr


def test_pending_shards_balance_only_the_unfinished_groups(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1]
    data["sweeps"][0]["arms"] = data["sweeps"][0]["arms"][:1]  # 2 single-run groups
    plan = _plan(tmp_path, data)
    study.run_study(plan, pattern="*/seed=0", log=lambda *_: None)
    # over the whole plan, shard 0 of 2 owns the finished seed-0 group and has nothing to do
    whole = study.run_study(plan, shard=(0, 2), log=lambda *_: None)
    assert (whole["started"], whole["skipped"]) == (0, 1)
    # over the pending groups, shard 0 takes the one left and shard 1 has none
    b = study.run_study(plan, shard=(1, 2), pending=True, log=lambda *_: None)
    assert (b["started"], b["skipped"]) == (0, 0)  # shard 1 has no pending group
    a = study.run_study(plan, shard=(0, 2), pending=True, log=lambda *_: None)
    assert (a["started"], a["skipped"]) == (1, 0)
    assert all(study._status(s.run_dir) == "completed" for s in study.plan_runs(plan))


def test_sharded_pretraining_splits_the_jobs(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    model = ["model.depth=1", "model.dim=8", "model.activation=relu"]
    data["pretrain"] = [{"name": f"src{i}", "config": "digits_vit", "source": "digits",
                         "epochs": 1, "overrides": model} for i in range(2)]
    data["sweeps"][0]["arms"] = [{"name": f"fedsq{i}", "overrides": [
        "algorithm.name=fedsq", "model.activation=relu", "algorithm.init=pretrained",
        f"algorithm.pretrained={{out_dir}}/pretrained/src{i}.pt"]} for i in range(2)]
    plan = _plan(tmp_path, data)
    out = tmp_path / "out" / "pretrained"
    study.run_study(plan, pretrain_only=True, shard=(1, 2), log=lambda *_: None)
    assert [p.name for p in out.glob("*.pt")] == ["src1.pt"]
    study.run_study(plan, pretrain_only=True, shard=(0, 2), log=lambda *_: None)
    assert sorted(p.name for p in out.glob("*.pt")) == ["src0.pt", "src1.pt"]


def test_measured_pace_weighs_the_pending_split(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1, 2]
    data["sweeps"][0]["arms"] = [{"name": "slow", "overrides": ["algorithm.name=fedprox"]},
                                 {"name": "fast", "overrides": ["algorithm.name=fedavg"]}]
    plan = _plan(tmp_path, data)
    specs = study.plan_runs(plan)

    def finish(spec, sec, kind="cuda"):
        spec.run_dir.mkdir(parents=True)
        (spec.run_dir / "summary.json").write_text(json.dumps(
            {"status": "completed", "seconds_per_round": sec, "device": {"type": kind}}))

    by_key = {s.key: s for s in specs}
    finish(by_key["digits/slow/alpha=0.5/seed=2"], 0.6)
    finish(by_key["digits/fast/alpha=0.5/seed=2"], 0.2)
    finish(by_key["digits/fast/alpha=0.5/seed=1"], 9.0, kind="cpu")  # CPU runs do not count
    pace = study.measured_pace(specs)
    assert pace[("digits", "slow")] == pytest.approx(0.6)
    assert pace[("digits", "fast")] == pytest.approx(0.2)
    assert pace["digits"] == pytest.approx(0.4)
    # overall: per unit of local work (K = 10 local steps is one unit)
    cfg = study.run_config(specs[0], None)
    clients = min(cfg.train.clients_per_round or 50, cfg.partition.num_clients)
    assert pace["*"] == pytest.approx(0.4 * 11 / (1 + cfg.train.local_steps)
                                      / max(clients / 50, runner.WIDTH_FLOOR))
    assert pace[("*", "slow")] == pytest.approx(1.5) and pace[("*", "fast")] == pytest.approx(0.5)
    # an arm measured only in another sweep: that sweep's ratio times this sweep's median
    other = dict(pace, **{"other": 0.1})
    del other[("digits", "slow")]
    group = [by_key["digits/slow/alpha=0.5/seed=0"]]
    # the sweep's base (its median as if both arms ran): each arm's pace over its ratio,
    # 0.6 / 1.5 and 0.2 / 0.5
    assert other[("*sweep", "digits")] == pytest.approx(0.4)
    assert study._group_cost(group, other) == pytest.approx(3 * 0.4 * 1.5)
    assert pace[("*sweep", "digits")] == pytest.approx(0.4)
    no_base = {k: v for k, v in other.items() if k != ("*sweep", "digits")}
    assert study._group_cost(group, {**no_base, "digits": 0.1}) == pytest.approx(3 * 0.1 * 1.5)
    order = ["digits/slow/alpha=0.5/seed=0", "digits/fast/alpha=0.5/seed=0",
             "digits/slow/alpha=0.5/seed=1"]
    groups = [[by_key[k]] for k in order]
    # 3 rounds each: by rounds, shard 0 takes both slow groups (loads 3.6 s vs 0.6 s of
    # measured time); by measured seconds (1.8, 0.6, 1.8) the slow groups are split
    by_rounds = [[g[0].key for g in study.shard_groups(groups, (k, 2))] for k in range(2)]
    by_pace = [[g[0].key for g in study.shard_groups(groups, (k, 2), pace)] for k in range(2)]
    assert by_rounds == [[order[0], order[2]], [order[1]]]
    assert by_pace == [[order[0], order[1]], [order[2]]]


def test_arm_ratios_come_from_sweeps_where_several_arms_ran(tmp_path):
    """Sweep ``a`` ran both arms, sweep ``b`` only the cheap one (a pooled reference, say):
    the arms' ratios come from ``a`` alone, ``b``'s base is its cheap arm's pace over that
    arm's ratio, and ``b``'s slow arm is priced at that base times the slow arm's ratio, not
    at ``b``'s median (its cheap arm) times it."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    arms = [{"name": "slow", "overrides": ["algorithm.name=fedprox"]},
            {"name": "fast", "overrides": ["algorithm.name=fedavg"]}]
    data["sweeps"] = [dict(data["sweeps"][0], name=name, arms=arms) for name in ("a", "b")]
    plan = _plan(tmp_path, data)
    by_key = {s.key: s for s in study.plan_runs(plan)}
    for key, sec in (("a/slow", 0.9), ("a/fast", 0.3), ("b/fast", 0.1)):
        run_dir = by_key[f"{key}/alpha=0.5/seed=0"].run_dir
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(
            {"status": "completed", "seconds_per_round": sec, "device": {"type": "cuda"}}))
    pace = study.measured_pace(study.plan_runs(plan))
    # sweep a's median 0.6: slow 1.5x, fast 0.5x; sweep b (one arm) adds no ratio
    assert pace[("*", "slow")] == pytest.approx(1.5)
    assert pace[("*", "fast")] == pytest.approx(0.5)
    assert pace[("*sweep", "a")] == pytest.approx(0.6)
    assert pace[("*sweep", "b")] == pytest.approx(0.1 / 0.5)
    assert pace["b"] == pytest.approx(0.1)
    # b's slow arm: 3 rounds at 0.2 x 1.5 s, where b's median would give 0.1 x 1.5
    slow_b = by_key["b/slow/alpha=0.5/seed=0"]
    assert study._group_cost([slow_b], pace) == pytest.approx(3 * 0.2 * 1.5)
    # a tuning stage's grid point of an arm (``slow+1``) is priced as its arm, here and in
    # sweep a, where the arm's own pace was measured
    for spec, cost in ((slow_b, 3 * 0.2 * 1.5), (by_key["a/slow/alpha=0.5/seed=0"], 3 * 0.9)):
        tuned = dataclasses.replace(spec, arm=dataclasses.replace(spec.arm, name="slow+1"))
        assert study._group_cost([tuned], pace) == pytest.approx(cost)
    assert runner.tuned_arm_base("slow+12") == "slow"
    assert runner.tuned_arm_base("a+b") == "a+b" and runner.tuned_arm_base("x+") == "x+"
    assert runner.tuned_arm_base("+1") == "+1"


def test_the_deadline_prices_with_runs_finished_after_the_split(tmp_path, monkeypatch):
    """``price_runs`` finished after the workers' launch (``pending``) still price the
    deadline at this call's sharing: a run measured at 1 s a round alone costs 3 s a round to
    a worker of 3 on the GPU, so a 3-round group does not fit in 5 s."""
    import time

    data = yaml.safe_load(yaml.safe_dump(PLAN))
    arms = data["sweeps"][0]["arms"][:1]
    data["sweeps"] = [dict(data["sweeps"][0], name=name, arms=arms) for name in ("a", "b")]
    plan = _plan(tmp_path, data)
    launch = time.time() - 5.0
    measured = next(s for s in study.plan_runs(plan) if s.sweep.name == "a")
    measured.run_dir.mkdir(parents=True)
    (measured.run_dir / "summary.json").write_text(json.dumps(
        {"status": "completed", "seconds_per_round": 1.0,
         "device": {"type": "cuda", "workers": 1}}))
    monkeypatch.setenv("LINATTN_DEVICE_WORKERS", "3")
    counts = study.run_study(plan, pattern="b/*", deadline_s=5.0, pending=launch,
                             price_runs=[measured], log=lambda *_: None)
    assert (counts["started"], counts["left"]) == (0, 1)
    monkeypatch.setenv("LINATTN_DEVICE_WORKERS", "1")  # alone: 3 s, it fits
    counts = study.run_study(plan, pattern="b/*", deadline_s=5.0, pending=launch,
                             price_runs=[measured], log=lambda *_: None)
    assert (counts["started"], counts["left"]) == (1, 0)


def test_pending_before_freezes_what_counts_as_finished(tmp_path):
    import time

    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1]
    data["sweeps"][0]["arms"] = data["sweeps"][0]["arms"][:1]  # 2 single-run groups
    plan = _plan(tmp_path, data)
    launch = time.time() - 1.0  # the workers' launch, before seed 0 finished
    study.run_study(plan, pattern="*/seed=0", log=lambda *_: None)
    # as of the launch both groups were pending: shard 0 owns seed 0 (finished meanwhile by
    # another worker: skipped), shard 1 owns seed 1; a worker reading "now" would disagree
    late = study.run_study(plan, shard=(0, 2), pending=launch, log=lambda *_: None)
    assert (late["started"], late["skipped"]) == (0, 1)
    other = study.run_study(plan, shard=(1, 2), pending=launch, log=lambda *_: None)
    assert (other["started"], other["skipped"]) == (1, 0)


def test_a_failing_run_leaves_its_stacked_group_and_the_others_go_on(tmp_path, monkeypatch):
    import real_data.stacked_runs

    plan = _plan(tmp_path)
    real_start = real_data.stacked_runs.prepare_start

    def start(cfg, out=None, **kw):
        if "fedavg" in str(out):
            raise RuntimeError("simulated crash")
        return real_start(cfg, out=out, **kw)

    monkeypatch.setattr(real_data.stacked_runs, "prepare_start", start)
    lines = []
    counts = study.run_study(plan, log=lines.append)
    assert counts["failed"] == 1 and counts["started"] == 3 and counts["branched"] == 1
    assert any("FAILED digits/fedavg" in line and "simulated crash" in line for line in lines)
    assert [study._status(s.run_dir) for s in study.plan_runs(plan)].count("completed") == 3


class AcceleratorError(RuntimeError):
    """Named as torch's error after a device-side assert (torch.AcceleratorError)."""


def test_device_unusable_tells_a_lost_cuda_context_from_a_broken_run():
    assert study.device_unusable(AcceleratorError("CUDA error: device-side assert triggered"))
    # torch raises AcceleratorError for errors the context survives too
    assert not study.device_unusable(AcceleratorError(
        "CUDA error: invalid configuration argument"))
    assert not study.device_unusable(AcceleratorError("CUDA error: out of memory"))
    assert study.device_unusable(RuntimeError("CUDA error: an illegal memory access was "
                                              "encountered"))
    assert study.device_unusable(RuntimeError("CUDA error: unspecified launch failure"))
    assert study.device_unusable(RuntimeError("CUDA error: misaligned address"))
    assert not study.device_unusable(torch.OutOfMemoryError("CUDA out of memory"))
    # errors the context survives fail one run, not the worker
    assert not study.device_unusable(RuntimeError("CUDA error: out of memory"))
    assert not study.device_unusable(RuntimeError("CUDA error: invalid configuration argument"))
    assert not study.device_unusable(RuntimeError(
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`"))
    assert not study.device_unusable(RuntimeError("simulated crash"))
    assert not study.device_unusable(ValueError("CUDA error: in a value error"))


@pytest.mark.parametrize("stack", [True, False])
def test_a_lost_device_stops_the_worker_instead_of_failing_every_run(tmp_path, monkeypatch,
                                                                     capsys, stack):
    """After a device-side assert every CUDA call of the process fails: the worker stops at
    the first such error (exit 3 from the command line, nothing else started), and a new
    process trains every run."""
    import real_data.runs
    import real_data.stacked_runs

    plan = _plan(tmp_path)
    tried = []
    module, name = ((real_data.stacked_runs, "prepare_start") if stack
                    else (real_data.runs, "start_run"))
    real = getattr(module, name)

    def lost(cfg, out=None, **kw):
        tried.append(out)
        raise AcceleratorError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(module, name, lost)
    lines = []
    with pytest.raises(study.DeviceLost, match="CUDA context is unusable"):
        study.run_study(plan, log=lines.append, stack=stack)
    assert len(tried) == 1 and sum("FAILED" in ln for ln in lines) == 1
    argv = ["study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "out"),
            "--no-tables"] + ([] if stack else ["--no-stack"])
    from linattn.cli import main

    capsys.readouterr()
    code = main(argv)  # in this process, where the patched start fails
    assert code == study.EXIT_DEVICE_LOST == 3
    assert "a new process resumes" in capsys.readouterr().err and len(tried) == 2
    monkeypatch.setattr(module, name, real)  # the next process: every run trains
    study.run_study(plan, log=lambda *_: None, stack=stack)
    assert all(study._status(s.run_dir) == "completed" for s in study.plan_runs(plan))


def test_a_run_directory_of_another_configuration_is_refused(tmp_path):
    """Editing a plan after its runs exist (another lr for an arm) must not reuse them."""
    plan = _plan(tmp_path)
    study.run_study(plan, pattern="digits/fedavg/*", log=lambda *_: None)
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["sweeps"][0]["arms"][0]["overrides"].append("train.lr=0.123")
    changed = _plan(tmp_path, data)
    with pytest.raises(UserError, match=r"train\.lr: ran with 0\.01, the plan asks 0\.123"):
        study.run_study(changed, pattern="digits/fedavg/*", log=lambda *_: None)
    # unchanged, it is skipped as before
    again = study.run_study(plan, pattern="digits/fedavg/*", log=lambda *_: None)
    assert again["skipped"] == 1


def test_study_workers_share_the_cores(monkeypatch, capsys):
    """n shards side by side take the cores divided by n unless --threads or OMP_NUM_THREADS
    says otherwise; --threads below 1 exits 2 naming it."""
    from linattn.cli import main as linattn_main
    from real_data.cli import study_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert study_threads(None, (0, 4), cores=32) == 8
    assert study_threads(None, (1, 64), cores=32) == 1
    assert study_threads(None, None, cores=32) is None
    assert study_threads(3, (0, 4), cores=32) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert study_threads(None, (0, 4), cores=32) is None
    assert linattn_main(["study", "--plan", "smoke", "--threads", "0", "--list"]) == 2
    assert "--threads 0" in capsys.readouterr().err


def test_the_a_priori_split_weighs_local_steps(tmp_path):
    """Without a measured pace a round costs (clients / 50) (1 + K) / 11 of a round of 50
    clients at K = 10 (here 10 clients, 0.2 of that; 100 clients cost twice 50): three runs of
    K = 40 and three of K = 2 split by their work (counting rounds alone would put two K = 40
    runs on one shard and one on the other, each beside K = 2 runs); with a measured pace, a
    sweep not run yet takes the overall median times its local work on a GPU, where a round
    narrower than WIDTH_FLOOR x 50 clients costs its sequential steps' latency: the floor."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1, 2]
    base = data["sweeps"][0]
    data["sweeps"] = [dict(base, name=f"k{k}", arms=[base["arms"][0]],
                           overrides=[*base["overrides"], f"train.local_steps={k}"])
                      for k in (40, 2)]
    plan = _plan(tmp_path, data)
    groups = [[s] for s in study.plan_runs(plan)]
    assert study._group_cost(groups[0]) == pytest.approx(3 * 0.2 * 41 / 11)
    assert study._group_cost(groups[-1]) == pytest.approx(3 * 0.2 * 3 / 11)
    wide = load_config("digits_vit", ["partition.num_clients=100", "train.local_steps=10"])
    assert runner._local_work(wide) == pytest.approx(2.0)
    shards = [[g[0].sweep.name for g in study.shard_groups(groups, (k, 2))] for k in range(2)]
    assert [sorted(s) for s in shards] == [["k40", "k40"], ["k2", "k2", "k2", "k40"]]
    pace = {"*": 0.5, "k2": 0.1, ("k2", "fedavg"): 0.1, ("*", "fedavg"): 1.0}
    floor = runner.WIDTH_FLOOR
    assert study._group_cost(groups[0], pace) == pytest.approx(3 * 0.5 * floor * 41 / 11)
    assert study._group_cost(groups[-1], pace) == pytest.approx(3 * 0.1)


def test_a_stacked_batch_costs_every_family_it_holds(tmp_path):
    """A stacked batch of two T0 families (T0 in {0, 2}, 3 rounds): each family's head trains
    3 rounds and its branch 3 - 0 = 3 more, so the batch costs 12 rounds, not the 9 of one
    family's rule applied to the batch as a whole."""
    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1]
    data["sweeps"][0]["arms"] = [data["sweeps"][0]["arms"][1]]
    plan = _plan(tmp_path, data)
    families = {}
    for s in study.plan_runs(plan):
        families.setdefault(s.seed, []).append(s)
    batch = [sorted(f, key=lambda s: -s.warmup_rounds) for f in families.values()]
    assert [[s.warmup_rounds for s in f] for f in batch] == [[2, 0], [2, 0]]
    work = runner._local_work(study.run_config(batch[0][0], 2))  # 10 clients, K = 5
    assert work == pytest.approx(10 / 50 * 6 / 11)
    assert study.batch_cost(batch) == pytest.approx(2 * (3 + 3) * work)
    assert study._group_cost([m for f in batch for m in f]) == pytest.approx((3 + 3 + 1 + 3)
                                                                             * work)


def test_gpu_seconds_count_a_shared_gpu_once(tmp_path, monkeypatch):
    """A run trained beside another worker on its GPU records it (device.workers): its wall
    pace is what a worker sharing the GPU sees (--deadline), and half of it is the GPU's
    (--estimate); a run that records nothing takes --pace-workers."""
    from real_data import rundir

    data = yaml.safe_load(yaml.safe_dump(PLAN))
    data["seeds"] = [0, 1, 2]
    data["sweeps"][0]["arms"] = data["sweeps"][0]["arms"][:1]
    plan = _plan(tmp_path, data)
    specs = study.plan_runs(plan)
    for spec, info in zip(specs[:2], ({"type": "cuda", "workers": 2}, {"type": "cuda"})):
        spec.run_dir.mkdir(parents=True)
        (spec.run_dir / "summary.json").write_text(json.dumps(
            {"status": "completed", "device": info, "seconds_per_round": 4.0}))
    wall = runner.measured_pace(specs)
    assert wall[(specs[0].sweep.name, specs[0].arm.name)] == pytest.approx(4.0)
    shared = runner.measured_pace(specs, device_share=1)
    assert shared[(specs[0].sweep.name, specs[0].arm.name)] == pytest.approx(3.0)  # (2 + 4) / 2
    assert runner.measured_pace(specs, device_share=2)[
        (specs[0].sweep.name, specs[0].arm.name)] == pytest.approx(2.0)
    # a worker sharing its GPU with 3 processes in all (the deadline's wall pace): 2 GPU-s
    # (recorded 2 workers) and 4 / 3 (recorded none: shared as this call's workers) per
    # round, times 3
    key0 = (specs[0].sweep.name, specs[0].arm.name)
    three = runner.wall_pace(specs, None, 3)
    assert three[key0] == pytest.approx(3 * (2.0 + 4.0 / 3) / 2)
    assert three[("*", specs[0].arm.name)] == pytest.approx(1.0)  # ratios unscaled
    assert runner.wall_pace(specs, None, 1)[key0] == pytest.approx((2.0 + 4.0) / 2)
    (row,) = study.estimate(plan, device_share=2)
    assert row["runs"] == 1 and row["gpu_seconds"] == pytest.approx(2.0 * row["run_rounds"])
    # the exported table: its device_workers column, else the default share
    table = tmp_path / "per_run.csv"
    table.write_text("sweep,arm,seconds_per_round,status,device_type,device_workers\n"
                     f"{specs[0].sweep.name},{specs[0].arm.name},4.0,completed,cuda,2\n"
                     f"{specs[0].sweep.name},{specs[0].arm.name},4.0,completed,cuda,\n")
    key = (specs[0].sweep.name, specs[0].arm.name)
    assert study.exported_pace(plan, table)[key] == pytest.approx(4.0)
    assert study.exported_pace(plan, table, 1)[key] == pytest.approx(3.0)
    assert study.exported_pace(plan, table, 4)[key] == pytest.approx(1.5)  # (2 + 1) / 2
    # the env variable the GPU script sets, recorded in every run's provenance
    monkeypatch.setenv(rundir.DEVICE_WORKERS_ENV, "3")
    assert rundir.provenance(torch.device("cpu"))["device"]["workers"] == 3
    monkeypatch.setenv(rundir.DEVICE_WORKERS_ENV, "0")
    with pytest.raises(UserError, match="LINATTN_DEVICE_WORKERS='0'"):
        rundir.device_workers()
    # a run refuses it before it writes anything (not at its end, in the summary)
    out = tmp_path / "refused"
    res = run_cli("run", "--config", "digits_vit", "train.rounds=1", f"run.out_dir={out}",
                  env={rundir.DEVICE_WORKERS_ENV: "two"})
    assert res.returncode == 2 and "LINATTN_DEVICE_WORKERS='two'" in res.stderr
    assert not out.exists() or not any(out.iterdir())
    monkeypatch.delenv(rundir.DEVICE_WORKERS_ENV)
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "o"),
                  "--pace-workers", "2")
    assert res.returncode == 2 and "--pace-workers: only with --estimate" in res.stderr
    res = run_cli("study", "--plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "o"),
                  "--estimate", "--pace-workers", "0")
    assert res.returncode == 2 and "--pace-workers=0" in res.stderr


def test_an_unreadable_snapshot_is_a_data_error_naming_it(tmp_path):
    """A run folder unpacked from an archive that lost its last part ends in a truncated
    checkpoint: the tables stop with the file's name and the fix, not a zip traceback."""
    from real_data.study import tables

    good = tmp_path / "round_0.pt"
    torch.save({"global_params": {}}, good)
    bad = tmp_path / "round_160.pt"
    bad.write_bytes(good.read_bytes()[:40])
    with pytest.raises(DataError, match=r"round_160\.pt: not a readable checkpoint.*trains it"):
        tables.kernel_deviation(good, bad, 2)
    assert tables.kernel_deviation(good, good, 2) == 0.0
