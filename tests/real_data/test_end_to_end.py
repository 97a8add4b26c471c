"""Real data end to end: FedAvg and FedFrozen learn; ``warmup=auto`` probes and picks T0."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from linattn.errors import DataError
from real_data.config import load_config
from real_data.runs import start_run

CHANCE = 0.1


@pytest.mark.parametrize("algorithm", [
    ["algorithm.name=fedavg"],
    ["algorithm.name=fedfrozen", "algorithm.warmup_rounds=5"],
])
def test_digits_beats_chance(tmp_path, algorithm):
    cfg = load_config("digits_vit", ["run.progress=false", "run.plot=false", *algorithm])
    res = start_run(cfg, out=tmp_path / "run")
    assert res.status == "completed"
    acc = res.summary["final"]["test_acc"]
    assert acc > 3 * CHANCE, acc


def test_fmnist_slice_beats_chance(tmp_path):
    from real_data.data import load_dataset

    try:
        load_dataset("fmnist", train_limit=6000, test_limit=1000)
    except DataError:
        # fetch it as DATA.md says (Debian package, no root), as a user would
        import os
        import shutil

        from real_data.data import fetch

        if os.environ.get("LINATTN_SKIP_NETWORK") == "1" or not shutil.which("apt-get"):
            pytest.skip("Fashion-MNIST absent and fetching is disabled or apt-get is missing")
        fetch("fmnist")
        load_dataset("fmnist", train_limit=6000, test_limit=1000)
    for algorithm in (["algorithm.name=fedavg"],
                      ["algorithm.name=fedfrozen", "algorithm.warmup_rounds=5"]):
        cfg = load_config("fmnist_vit", [
            "data.train_limit=6000", "data.test_limit=1000", "partition.num_clients=10",
            "partition.alpha=1.0", "model.dim=32", "model.depth=2", "model.heads=2",
            "model.mlp_dim=64", "model.patch=7", "train.rounds=15", "train.local_steps=5",
            "train.optimizer=adam", "train.lr=0.003", "train.momentum=0.0",
            "train.precision=fp32", "train.device=cpu", "run.progress=false", "run.plot=false",
            *algorithm])
        res = start_run(cfg, out=tmp_path / algorithm[0].split("=")[1])
        assert res.summary["final"]["test_acc"] > 0.5, res.summary["final"]


def test_warmup_auto_freezes_at_a_probed_snapshot(tmp_path):
    cfg = load_config("digits_vit", [
        "run.progress=false", "run.plot=false", "train.rounds=8", "algorithm.warmup=auto",
        "algorithm.warmup_rounds=null", "algorithm.probe_interval=2",
        "algorithm.probe_rounds=3", "partition.validation_fraction=0.2", "train.optimizer=sgd",
        "train.lr=0.1", "partition.alpha=0.3", "model.depth=1"])
    res = start_run(cfg, out=tmp_path / "auto")
    warm = json.loads((res.run_dir / "summary.json").read_text())["warmup"]
    t0 = warm["warmup_rounds"]
    assert warm["rule"] == "auto" and (t0 in warm["snapshots"] or t0 == 8)
    assert warm["snapshots"][0] == 0 and len(warm["predictions"]) == len(warm["snapshots"])
    rows = (res.run_dir / "metrics.csv").read_text().splitlines()
    assert any(",global,probe_prediction," in r for r in rows)
    if t0 < 8:  # after T0 the Q/K block stops moving
        qk = [float(r.split(",")[3]) for r in rows if ",global,qk_change," in r]
        assert all(v == 0.0 for v in qk[t0:]) and qk[0] > 0


def test_repo_has_shipped_configs():
    assert (REPO / "real_data" / "configs" / "fmnist_vit.yaml").is_file()
