"""simulations/probe_ceiling.py: the oracle continuations share the probe estimator's trajectory,
and the oracles pick what they claim to pick."""

from __future__ import annotations

import numpy as np

from simulations.probe_ceiling import oracle_setting, run_probe_ceiling
from simulations.warmup_grid import warmup_settings


def _cheapest():
    return sorted(warmup_settings(96), key=lambda s: (s.total_rounds, s.dim * s.num_clients))[0]


def test_oracles_on_the_probe_trajectory():
    st = _cheapest()
    row = oracle_setting(st, samples_per_client=512, batch_size=64, check_probe=True)
    rounds, val, grid = row["rounds"], np.array(row["val_T"]), np.array(row["R_grid"])
    interval = max(1, st.total_rounds // 25)
    assert rounds == list(range(0, st.total_rounds, interval)) + [st.total_rounds]
    # the probe estimator's chosen snapshot is this run's snapshot, bit for bit
    assert row["probe_snapshot_identical"] is True
    assert row["probe_T0"] in rounds
    # oracle-V: least validation objective at T; oracle-grid: least exact R on the grid
    assert row["oracle_V_T0"] == rounds[int(np.argmin(val))]
    assert row["oracle_grid_T0"] == rounds[int(np.argmin(grid))]
    assert row["oracle_grid_excess"] <= row["oracle_V_excess"] + 1e-12
    assert row["oracle_grid_excess"] >= -1e-12          # R* is the minimum over all T0
    assert row["R_never"] == grid[-1]
    # the population error of the finite-sample model is an excess over Phi*: non-negative
    assert min(row["R_sampled"]) >= -1e-9


def test_summary_counts_match_rows():
    st = _cheapest()
    res = run_probe_ceiling(count=96, samples_per_client=512, batch_size=64, indices={st.index})
    (row,) = res["points"]
    s = res["summary"][st.part]["oracle_V"]
    assert s["within_10pct"] == int(row["oracle_V_within_10pct"])
    assert s["not_worse_5pct"] == int(row["oracle_V_not_worse_5pct"])
    assert res["summary"]["all"]["settings"] == 1
