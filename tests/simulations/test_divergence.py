"""Diverged simulator runs: detected per seed and round, reported, and harmless to the metrics.

A step size far beyond the stability limit makes every seed blow up within a few rounds; the
records name the seed and the first bad round, ``simulate`` warns, ``compute_metrics`` returns
NaN for the diverged rounds only (no ``LinAlgError``), and ``linattn simulate run`` writes its
run directory with the diverged seeds listed and a warning on stderr, while a stable setting of
the same sweep keeps finite numbers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from linattn.cli import main as linattn_main
from linattn_theory.problem import make_problem
from simulations.divergence import LIMIT, describe, diverged_runs, healthy
from simulations.engine import Setting, simulate
from simulations.metrics import compute_metrics

DEFAULT = Path(__file__).resolve().parents[2] / "simulations" / "configs" / "default.yaml"
TINY = ["problem.dim=3", "problem.num_clients=3", "problem.context_length=4",
        "training.total_rounds=6", "training.warmup_rounds=[0,3,6]", "training.batch_size=4",
        "data.samples_per_client=32", "data.test_samples=8", "simulation.seeds=2"]


def _setting(lr: float) -> Setting:
    problem = make_problem(dim=3, num_clients=3, context_length=4, seed=0)
    return Setting(problem=problem, lr=lr, local_steps=3, batch_size=4, total_rounds=6,
                   warmup_rounds=(0, 3, 6), samples_per_client=32, test_samples=8)


def test_healthy_flags_nan_inf_and_overflowing_entries():
    x = np.zeros((4, 2, 2))
    x[1, 0, 0], x[2, 1, 1], x[3, 0, 1] = np.nan, np.inf, 10 * LIMIT
    assert healthy(x).tolist() == [True, False, False, False]


def test_diverged_seeds_are_reported_and_metrics_stay_finite_elsewhere():
    with pytest.warns(RuntimeWarning, match=r"diverged: seed 0: warm-up from round \d"):
        stable, wild = simulate([_setting(0.05), _setting(200.0)], [0, 1])
    assert diverged_runs(stable) == []
    records = diverged_runs(wild)
    assert [r["seed"] for r in records] == [0, 1]
    first = records[0]["warmup_round"]
    assert first is not None and 1 <= first <= 6
    assert not healthy(wild.kernels[0, first]) or not healthy(wild.values[0, first])
    assert healthy(wild.kernels[0, first - 1]) and healthy(wild.values[0, first - 1])
    assert "seed 1: warm-up from round" in describe(records)
    m = compute_metrics(wild)  # no LinAlgError on NaN or overflowing kernels
    assert np.isnan(m.kernel_error_path[0, first:]).all()
    assert np.isfinite(m.kernel_error_path[0, :first]).all()
    good = compute_metrics(stable)
    assert np.isfinite(good.final_error).all() and np.isfinite(good.frozen_floor).all()


def test_cli_lists_diverged_seeds_and_writes_the_run(tmp_path, capsys):
    out = tmp_path / "sim"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = linattn_main(["simulate", "run", "--config", str(DEFAULT), "--out", str(out),
                             *TINY, "sweep.training.lr=[0.05, 200.0]"])
    assert code == 0
    assert not [w for w in caught if "diverged" in str(w.message)]  # reported once, below
    err = capsys.readouterr().err
    assert "warning: setting 1 (training.lr=200) diverged: seed 0: warm-up from round" in err
    assert "setting 0" not in err
    summary = json.loads((out / "summary.json").read_text())
    stable, wild = summary["settings"]
    assert stable["diverged"] == [] and all(np.isfinite(stable["final_mean"]))
    assert [r["seed"] for r in wild["diverged"]] == [0, 1]
    assert (out / "metrics.csv").read_text().startswith("round,run,metric,value\n")
