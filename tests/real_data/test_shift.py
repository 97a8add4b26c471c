"""Concept and covariate shift on top of a partition (real_data.data.shift)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import global_metrics, metric_rows, tiny_config
from test_data_partition import text_dataset

from linattn.errors import ConfigError, DataError
from real_data.data.partition import make_partition
from real_data.data.shift import Shift, apply_shift, client_labellings, client_parameters


@pytest.fixture(scope="module")
def data(digits):
    return digits


def test_concept_shift_relabels_per_group_and_keeps_inputs(data):
    part = make_partition(data, "iid", 4, seed=1, validation_fraction=0.2)
    sd, sp = apply_shift(data, part, {"kind": "concept", "classes": 4, "groups": 2})
    maps = client_labellings(Shift("concept", classes=4, groups=2), 4, 10, 1)
    assert np.array_equal(maps[0], np.arange(10)) and np.array_equal(maps[2], np.arange(10))
    moved = np.flatnonzero(maps[1] != np.arange(10))
    assert len(moved) == 4 and set(maps[1][moved]) == set(moved)  # a derangement of 4 classes
    assert np.array_equal(maps[1], maps[3])
    assert sd.x_train is data.x_train  # inputs untouched: one tensor, not a copy
    for m in range(4):
        for idx in (part.train[m], part.val[m]):
            ix = torch.as_tensor(idx)
            assert torch.equal(sd.y_train[ix], torch.as_tensor(maps[m])[data.y_train[ix]])
        # client m's test copy: its own split, its own labelling
        src, dst = torch.as_tensor(part.test[m]), torch.as_tensor(sp.test[m])
        assert torch.equal(sd.x_test[dst], data.x_test[src])
        assert torch.equal(sd.y_test[dst], torch.as_tensor(maps[m])[data.y_test[src]])
    assert sp.params["shift"] == {"kind": "concept", "classes": 4, "groups": 2}
    assert len(sd.x_test) == sum(len(t) for t in part.test)


def test_rotation_by_90_degrees_is_a_quarter_turn(data):
    part = make_partition(data, "iid", 3, seed=0)
    u = client_parameters(3, 0)
    sd, sp = apply_shift(data, part, {"kind": "covariate", "transform": "rotation",
                                      "spread": 90})
    assert sorted(u) == [-1.0, 0.0, 1.0]
    assert torch.equal(sd.y_train, data.y_train)  # one labelling
    for m in range(3):
        ix = torch.as_tensor(part.train[m])
        got, src = sd.x_train[ix], data.x_train[ix]
        if u[m] == 0:
            torch.testing.assert_close(got, src, atol=1e-6, rtol=0)
        else:  # a quarter turn one way or the other: exact pixel moves
            want = [torch.rot90(src, k, dims=(2, 3)) for k in (1, -1)]
            errs = [float((got - w).abs().max()) for w in want]
            assert min(errs) < 1e-5 and max(errs) > 0.1, errs
    assert len(set(np.round(u, 6))) == 3


def test_rotation_equals_the_per_image_sampling_grid(data):
    """Every image of a client turns by the client's angle: the transform equals, bit for bit,
    the sampling grid built for each image on its own."""
    part = make_partition(data, "iid", 3, seed=5, validation_fraction=0.2)
    spec = {"kind": "covariate", "transform": "rotation", "spread": 40}
    sd, sp = apply_shift(data, part, spec)
    u = client_parameters(3, 5)
    for m in range(3):
        theta = np.radians(40 * float(u[m]))
        c, s = float(np.cos(theta)), float(np.sin(theta))
        for idx, x, got in ((np.concatenate([part.train[m], part.val[m]]), data.x_train,
                             sd.x_train[torch.as_tensor(np.concatenate([part.train[m],
                                                                        part.val[m]]))]),
                            (part.test[m], data.x_test, sd.x_test[torch.as_tensor(sp.test[m])])):
            src = x[torch.as_tensor(idx)]
            mat = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=src.dtype).expand(
                len(src), 2, 3)
            grid = torch.nn.functional.affine_grid(mat, list(src.shape), align_corners=False)
            want = torch.nn.functional.grid_sample(src, grid, mode="bilinear",
                                                   padding_mode="border", align_corners=False)
            assert torch.equal(got, want), m


def test_contrast_and_pattern(data):
    part = make_partition(data, "iid", 5, seed=2)
    u = client_parameters(5, 2)
    sd, _ = apply_shift(data, part, {"kind": "covariate", "transform": "contrast",
                                     "spread": 0.5})
    for m in range(5):
        ix = torch.as_tensor(part.train[m])
        x, x0 = sd.x_train[ix].double(), data.x_train[ix].double()
        mean = x0.mean(dim=(1, 2, 3), keepdim=True)
        torch.testing.assert_close(x.mean(dim=(1, 2, 3), keepdim=True), mean, atol=1e-5,
                                   rtol=0)
        torch.testing.assert_close(x - mean, np.exp(0.5 * u[m]) * (x0 - mean), atol=1e-5,
                                   rtol=0)
    sd, _ = apply_shift(data, part, {"kind": "covariate", "transform": "pattern",
                                     "spread": 0.3})
    deltas = []
    for m in range(5):
        ix = torch.as_tensor(part.train[m])
        d = (sd.x_train[ix] - data.x_train[ix]).double()
        assert torch.allclose(d, d[:1].expand_as(d), atol=1e-6)  # one pattern per client
        assert float(d[0].pow(2).mean().sqrt()) == pytest.approx(0.3, rel=1e-5)
        deltas.append(d[0])
    assert float((deltas[0] - deltas[1]).abs().max()) > 0.1


def test_shift_is_deterministic_in_the_seed(data):
    spec = {"kind": "covariate", "transform": "pattern", "spread": 1.0}
    a = apply_shift(data, make_partition(data, "iid", 4, seed=3), spec)[0]
    b = apply_shift(data, make_partition(data, "iid", 4, seed=3), spec)[0]
    c = apply_shift(data, make_partition(data, "iid", 4, seed=4), spec)[0]
    assert torch.equal(a.x_train, b.x_train) and not torch.equal(a.x_train, c.x_train)


@pytest.mark.parametrize("spec,match", [
    ({"kind": "concept", "classes": 11}, "classes=11 exceeds"),
    ({"kind": "concept", "groups": 9}, "groups=9 exceeds"),
    ({"kind": "covariate", "transform": "blur", "spread": 1}, "transform='blur'"),
    ({"kind": "covariate", "spread": 200}, "exceeds 180"),
    ({"kind": "concept", "spread": 1}, "unknown key"),
])
def test_bad_shifts_name_the_key(data, spec, match):
    with pytest.raises(DataError, match=match):
        apply_shift(data, make_partition(data, "iid", 4, seed=0), spec)


def test_text_data_is_refused():
    text = text_dataset()
    with pytest.raises(DataError, match="image data set"):
        apply_shift(text, make_partition(text, "natural", None, seed=0),
                    {"kind": "concept", "classes": 2, "groups": 2})


def test_run_scores_the_federated_objective_and_resumes(tmp_path):
    import shutil

    from real_data import rundir
    from real_data.runs import resume_run, start_run

    over = ("algorithm.name=fedavg", "partition.num_clients=4", "partition.scheme=iid",
            "partition.shift={kind: concept, classes: 6, groups: 2}", "train.precision=fp64",
            "train.rounds=3")
    full = start_run(tiny_config(*over), out=tmp_path / "full")
    rows = global_metrics(full.run_dir / "metrics.csv")
    # the global test set is every client's own split under its own labelling
    assert rows["test_acc"][3] == pytest.approx(rows["local_acc_micro"][3], abs=1e-12)
    # a run put back to its round-1 state resumes to the same rows: the shifted data are
    # rebuilt from the saved config and the unshifted partition
    cut = start_run(tiny_config(*over), out=tmp_path / "cut", snapshot_rounds=(1,))
    ckpts = cut.run_dir / "checkpoints"
    shutil.copy(ckpts / "round_1.pt", ckpts / "last.pt")
    for name in ("metrics.csv", "timings.csv"):
        rundir.truncate_rows(cut.run_dir / name, 1)
    (cut.run_dir / "summary.json").unlink()
    assert resume_run(cut.run_dir).status == "completed"
    assert (cut.run_dir / "metrics.csv").read_bytes() == \
        (full.run_dir / "metrics.csv").read_bytes()
    with pytest.raises(ConfigError, match="partition.shift.kind"):
        tiny_config("partition.shift={kind: label}")


def test_stacked_t0_branch_under_shift_equals_runs_alone(tmp_path):
    """A T0 branch forks from the parent's unshifted partition; its rows equal the same branch
    trained alone, and the already-shifted partition is refused by apply_shift."""
    from real_data.runs import load_data, start_run
    from real_data.stacked_runs import Branch, RunRequest, run_group

    over = ("algorithm.name=fedfrozen", "algorithm.train=v", "partition.num_clients=4",
            "partition.scheme=iid", "train.precision=fp64", "train.rounds=3",
            "partition.shift={kind: covariate, transform: rotation, spread: 60}")
    parent, child = tiny_config(*over, "algorithm.warmup_rounds=3"), \
        tiny_config(*over, "algorithm.warmup_rounds=1")
    alone = start_run(parent, out=tmp_path / "alone_parent", snapshot_rounds=(1,))
    start_run(child, out=tmp_path / "alone_child",
              branch=alone.run_dir / "checkpoints" / "round_1.pt")
    dataset = load_data(parent)
    results = run_group([RunRequest(tmp_path / "g_parent", parent, False, (1,),
                                    (Branch(1, child, tmp_path / "g_child"),))],
                        dataset=dataset, log=lambda s: None)
    assert sorted(r.status for _, r in results) == ["completed", "completed"]
    for a, g in (("alone_parent", "g_parent"), ("alone_child", "g_child")):
        ra = metric_rows(tmp_path / a / "metrics.csv")
        rg = metric_rows(tmp_path / g / "metrics.csv")
        assert ra.keys() == rg.keys()
        assert all(abs(ra[k] - rg[k]) <= 1e-6 * abs(ra[k]) + 1e-9 for k in ra), g
    from real_data.runs import shifted

    data2, part2 = shifted(parent, dataset, load_partition_of(tmp_path / "g_child"))
    with pytest.raises(DataError, match="already shifted"):
        apply_shift(data2, part2, parent.partition.shift)


def load_partition_of(run_dir):
    from real_data.data import load_partition

    return load_partition(run_dir / "partition.npz")



def test_stacked_group_builds_each_shift_once_and_trains_in_one_call(tmp_path, monkeypatch):
    """Runs of a group on several partitions (seeds) and shifts: each shifted data set is built
    once for the group, whatever the order of its runs and however few the process keeps
    between groups; concept-shifted data share the inputs' tensor; every round of the group is
    one engine call over the runs' pooled data; and each run's rows equal the run alone."""
    import real_data.data.shift as shift_module
    from real_data import runs
    from real_data.engines import fast
    from real_data.runs import load_data, start_run
    from real_data.stacked_runs import RunRequest, run_group
    from real_data.stacking import _POOL

    base = ("partition.num_clients=4", "partition.scheme=iid", "train.precision=fp64",
            "train.rounds=2")
    concept = "partition.shift={kind: concept, classes: 4, groups: 2}"
    rotation = "partition.shift={kind: covariate, transform: rotation, spread: 60}"
    names = {  # interleaved: no two consecutive runs share a shifted data set
        "c0": (concept, "seed=0", "algorithm.name=fedavg"),
        "r1": (rotation, "seed=1", "algorithm.name=fedavg"),
        "c1": (concept, "seed=1", "algorithm.name=fedavg"),
        "r0": (rotation, "seed=0", "algorithm.name=fedavg"),
        "c0_v": (concept, "seed=0", "algorithm.name=fedfrozen", "algorithm.train=v",
                 "algorithm.warmup_rounds=1", "train.lr=0.03"),
    }
    cfgs = {k: tiny_config(*base, *v) for k, v in names.items()}
    for name, cfg in cfgs.items():
        start_run(cfg, out=tmp_path / "alone" / name)
    built = []
    real_apply = shift_module.apply_shift
    monkeypatch.setattr(shift_module, "apply_shift",
                        lambda d, p, s: built.append((p.seed, repr(s))) or real_apply(d, p, s))
    monkeypatch.setattr(runs, "SHIFTED_KEPT", 1)  # the process keeps one between groups
    monkeypatch.setattr(runs, "_SHIFTED", {})
    calls, tensors = [], set()
    real_fast = fast.train_fast
    monkeypatch.setattr(fast, "train_fast", lambda job, **kw: calls.append(
        len(job.client_ids)) or tensors.add(id(job.x)) or real_fast(job, **kw))
    dataset = load_data(cfgs["c0"])
    results = run_group([RunRequest(tmp_path / "group" / k, c, label=k)
                         for k, c in cfgs.items()], dataset=dataset, log=lambda s: None)
    assert sorted(r.status for _, r in results) == ["completed"] * 5
    assert len(built) == 4 and len(set(built)) == 4, built  # (seed, shift) pairs, once each
    assert calls == [20, 20], calls  # 5 runs of 4 clients, one call a round
    assert len(tensors) == 1 and not _POOL  # one pooled tensor, dropped with the group
    c0 = runs.shifted(cfgs["c0"], dataset, load_partition_of(tmp_path / "group" / "c0"))[0]
    c1 = runs.shifted(cfgs["c1"], dataset, load_partition_of(tmp_path / "group" / "c1"))[0]
    assert c0.x_train is c1.x_train is dataset.x_train and c0.y_train is not c1.y_train
    for name in cfgs:
        ra = metric_rows(tmp_path / "alone" / name / "metrics.csv")
        rg = metric_rows(tmp_path / "group" / name / "metrics.csv")
        assert ra.keys() == rg.keys()
        assert all(abs(ra[k] - rg[k]) <= 1e-6 * abs(ra[k]) + 1e-9 for k in ra), name
