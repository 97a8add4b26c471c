"""The validation split: carved per client from its training data, fixed by seed, saved with the
partition, evaluated every evaluation round (``val_loss``, ``val_acc``), read by the plateau
schedule, and the only split a tuning run (``eval.test=false``) reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import global_metrics, run_cli, tiny_config
from test_data_partition import synthetic, text_dataset

from linattn.errors import ConfigError, DataError
from real_data.data.partition import carve_validation, make_partition
from real_data.data.partition_io import check_partition, load_partition, save_partition


@pytest.fixture(scope="module")
def data():
    return synthetic()


@pytest.mark.parametrize("scheme,params", [("iid", {}), ("dirichlet", {"alpha": 0.1}),
                                           ("classes", {"classes_per_client": 2})])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_carved_per_client_disjoint_and_deterministic(data, scheme, params, fraction):
    full = make_partition(data, scheme, 10, seed=3, **params)
    part = make_partition(data, scheme, 10, seed=3, validation_fraction=fraction, **params)
    assert part.has_validation and part.params["validation_fraction"] == fraction
    for m in range(10):
        tr, va, whole = part.train[m], part.val[m], full.train[m]
        # the client's own samples, split in two: nothing lost, nothing shared
        assert np.array_equal(np.sort(np.concatenate([tr, va])), np.sort(whole))
        assert not np.intersect1d(tr, va).size
        assert len(va) == min(max(1, round(fraction * len(whole))), len(whole) - 1)
    check_partition(part, data)
    # the local test splits follow the full training mix: unchanged by the validation split
    assert all(np.array_equal(a, b) for a, b in zip(part.test, full.test))
    again = make_partition(data, scheme, 10, seed=3, validation_fraction=fraction, **params)
    assert all(np.array_equal(a, b) for a, b in zip(part.val, again.val))
    other = make_partition(data, scheme, 10, seed=4, validation_fraction=fraction, **params)
    assert any(not np.array_equal(a, b) for a, b in zip(part.val, other.val))


def test_validation_follows_each_clients_label_mix(data):
    part = make_partition(data, "dirichlet", 10, seed=0, alpha=0.1, validation_fraction=0.2)
    y = data.y_train.numpy()
    for tr, va in zip(part.train, part.val):
        if len(va) < 30:
            continue
        mix_tr = np.bincount(y[tr], minlength=10) / len(tr)
        mix_va = np.bincount(y[va], minlength=10) / len(va)
        # a uniform draw from the client's samples: total variation within 0.25 at >= 30 draws
        assert 0.5 * np.abs(mix_tr - mix_va).sum() < 0.25


def test_text_natural_clients_carve_too():
    part = make_partition(text_dataset(), "natural", None, seed=0, validation_fraction=0.5)
    # round(0.5 n) for n = 5, 3, 8, halves to even (2.5 -> 2, 1.5 -> 2)
    assert [len(v) for v in part.val] == [2, 2, 4]
    assert [len(t) for t in part.train] == [3, 1, 4]


@pytest.mark.parametrize("bad", [0, 0.0, 0.6, -0.1, 1, float("nan"), "0.1", True])
def test_bad_fraction_names_the_key(data, bad):
    with pytest.raises(DataError, match="validation_fraction"):
        make_partition(data, "iid", 4, seed=0, validation_fraction=bad)


def test_too_small_clients_and_double_carving_are_errors(data):
    tiny = make_partition(text_dataset(), "natural", None, seed=0)
    tiny = type(tiny)((tiny.train[0][:1],), tiny.test[:1], "natural", {}, 0)
    with pytest.raises(DataError, match="client 0 holds 1 training sample"):
        carve_validation(tiny, 0.2)
    part = make_partition(data, "iid", 4, seed=0, validation_fraction=0.1)
    with pytest.raises(DataError, match="already has a validation split"):
        carve_validation(part, 0.1)


def test_save_load_round_trip_and_overlap_check(tmp_path, data):
    part = make_partition(data, "dirichlet", 6, seed=1, alpha=0.3, validation_fraction=0.2)
    path = save_partition(part, tmp_path / "p")
    back = load_partition(path)
    assert all(np.array_equal(a, b) for a, b in zip(back.val, part.val))
    assert json.loads(path.with_suffix(".json").read_text())["val_sizes"] == [
        len(v) for v in part.val]
    bad = type(part)(part.train, part.test, part.scheme, part.params, part.seed,
                     (part.train[0][:2],) + part.val[1:])
    with pytest.raises(DataError, match="overlap"):
        check_partition(bad, data)
    # a partition without a validation split keeps its file format
    plain = load_partition(save_partition(make_partition(data, "iid", 3, seed=0),
                                          tmp_path / "q"))
    assert plain.val == () and not plain.has_validation


def test_config_key_checked():
    cfg = tiny_config("partition.validation_fraction=0.2")
    assert cfg.partition.validation_fraction == 0.2
    for bad in ("0", "0.7", "-1", "yes"):
        with pytest.raises(ConfigError, match="partition.validation_fraction"):
            tiny_config(f"partition.validation_fraction={bad}")


def test_run_reports_validation_metrics_equal_to_a_direct_evaluation(tmp_path):
    from real_data.checkpoint import load_checkpoint
    from real_data.federation import Federation
    from real_data.metrics import evaluate
    from real_data.runs import load_data, resolve, start_run

    cfg = tiny_config("algorithm.name=fedavg", "train.rounds=3", "partition.num_clients=4",
                      "train.precision=fp64", "partition.validation_fraction=0.2")
    res = start_run(cfg, out=tmp_path / "run")
    rows = global_metrics(res.run_dir / "metrics.csv")
    assert set(rows["val_acc"]) == set(rows["test_acc"]) == {1, 2, 3}
    part = load_partition(res.run_dir / "partition.npz")
    state, _, _ = load_checkpoint(res.run_dir / "checkpoints" / "last.pt", torch.device("cpu"))
    data = load_data(cfg)
    idx = torch.as_tensor(part.val_pooled)
    fed = Federation(resolve(cfg, data), data, part)
    loss, hit = evaluate(lambda xb: fed.algorithm.forward(fed.model, state.global_params, xb),
                         fed.x_train[idx], fed.y_train[idx], 1024)
    assert rows["val_loss"][3] == pytest.approx(float(loss.mean()), rel=1e-9)
    assert rows["val_acc"][3] == pytest.approx(float(hit.mean()), abs=1e-12)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert "val_acc" in summary["best"]
    # training uses only the clients' remaining samples: the validation samples are unseen
    assert not np.intersect1d(np.concatenate(part.train), part.val_pooled).size


def test_tuning_run_never_reads_the_test_set(tmp_path, monkeypatch):
    from real_data import federation as federation_module
    from real_data.runs import start_run

    seen = []
    evaluate = federation_module.evaluate
    monkeypatch.setattr(federation_module, "evaluate",
                        lambda fwd, x, y, *a, **k: seen.append(x.data_ptr()) or
                        evaluate(fwd, x, y, *a, **k))
    cfg = tiny_config("algorithm.name=fedavg", "train.rounds=2", "partition.num_clients=4",
                      "eval.test=false", "partition.validation_fraction=0.1")
    res = start_run(cfg, out=tmp_path / "run")
    rows = global_metrics(res.run_dir / "metrics.csv")
    assert "val_acc" in rows and "test_acc" not in rows and "test_loss" not in rows
    from real_data.federation import _DATA

    test_ptrs = {v[1][2].data_ptr() for v in _DATA.values()}
    assert seen and not set(seen) & test_ptrs
    with pytest.raises(ConfigError, match="eval.test=false"):
        start_run(tiny_config("eval.test=false"), out=tmp_path / "no")
    assert not (tmp_path / "no").exists()


def test_plateau_schedule_observes_the_validation_loss(tmp_path):
    from linattn_theory.schedules import PlateauState, schedule_from_dict
    from real_data.runs import start_run

    sched = {"kind": "plateau", "factor": 0.5, "patience": 1, "threshold": 0.0}
    cfg = tiny_config("algorithm.name=fedavg", "train.rounds=8", "partition.num_clients=4",
                      "train.precision=fp64", "train.lr=0.8", "partition.validation_fraction=0.2",
                      f"train.lr_schedule={json.dumps(sched)}")
    res = start_run(cfg, out=tmp_path / "run")
    rows = global_metrics(res.run_dir / "metrics.csv")
    ref, schedule, lrs = PlateauState(), schedule_from_dict(sched), []
    for rnd in range(1, 9):
        lrs.append(0.8 * ref.multiplier)
        ref.observe(rows["val_loss"][rnd], schedule)
    assert [rows["lr"][r] for r in range(1, 9)] == pytest.approx(lrs, rel=1e-12)
    assert min(lrs) < 0.8  # the reference cut at least once, so the check has teeth


def test_cli_rejects_a_bad_fraction_with_exit_2(tmp_path):
    res = run_cli("run", "--config", "digits_vit", "partition.validation_fraction=0.9",
                  f"run.out_dir={tmp_path}")
    assert res.returncode == 2, res.stderr
    assert "partition.validation_fraction" in res.stderr
    assert not any(tmp_path.iterdir())
