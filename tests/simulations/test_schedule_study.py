"""The schedule study: its grid's design, the comparison (i)-(iii) on hand-made tables, the
held-out protocol, and ``linattn simulate schedules --quick``."""

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from linattn.cli import main as linattn_main
from simulations.schedule_stats import held_out, shift_pairs
from simulations.schedule_study import (
    STUDY_LEVELS,
    compare,
    decay_schedules,
    excess_table,
    map_cells,
    study_cells,
)

NAMES = list(decay_schedules(0.1, 10))
T0S = [0, 5, 10]


def _table(excess):
    return {"schedules": NAMES, "warmup_rounds": T0S, "excess": excess}


def test_study_grid_is_a_balanced_resolution_v_fraction():
    """64 distinct cells; every pair of factors takes each of its 4 level pairs 16 times."""
    cells = study_cells()
    assert len(cells) == 64 and len(set(cells)) == 64
    for a, b in itertools.combinations(STUDY_LEVELS, 2):
        counts = {}
        for c in cells:
            key = (getattr(c, a), getattr(c, b))
            counts[key] = counts.get(key, 0) + 1
        assert sorted(counts.values()) == [16] * 4, (a, b)
    assert len(map_cells()) == 105


def test_compare_on_a_hand_made_table():
    excess = np.full((len(NAMES), 3), 1.0)
    excess[NAMES.index("constant")] = [0.9, 0.5, 0.8]  # constant-eta FedFrozen best at T0 = 5
    excess[NAMES.index("cosine-0")] = [0.7, 0.3, 0.4]  # best decay (T0 = T): 0.4
    excess[NAMES.index("step-4/5")] = [0.6, 0.2, 0.6]  # the cut: 0.6 alone, 0.2 with T0 = 5
    out = compare(_table(excess.tolist()))
    assert (out["frozen"], out["frozen_warmup"]) == (0.5, 5)
    assert (out["decay"], out["decay_schedule"]) == (0.4, "cosine-0")
    assert (out["both"], out["both_schedule"], out["both_warmup"]) == (0.2, "step-4/5", 5)
    assert out["both_over_decay"] == pytest.approx(0.5, rel=1e-15)
    assert out["frozen_over_decay"] == pytest.approx(1.25, rel=1e-15)
    assert out["cut_frozen_over_cut"] == pytest.approx(1 / 3, rel=1e-15)


def test_held_out_chooses_on_the_selection_seeds():
    """The selection seed's table picks (constant, T0 = 0), the decay schedule exp-0.1 and the
    pair (step-1/2, T0 = 5); the held-out seed is scored with exactly those choices."""
    base = {k: 1 for k in STUDY_LEVELS}
    sel = np.full((len(NAMES), 3), 1.0)
    sel[NAMES.index("constant")] = [0.5, 0.9, 0.9]
    sel[NAMES.index("exp-0.1")] = [0.9, 0.9, 0.6]
    sel[NAMES.index("step-1/2")] = [0.9, 0.1, 0.9]
    test = np.full((len(NAMES), 3), 2.0)
    test[NAMES.index("exp-0.1"), 2] = 4.0
    test[NAMES.index("step-1/2"), 1] = 1.0
    rows = [{"part": "study", "cell": 0, "seed": s, **base, "table": _table(t.tolist())}
            for s, t in ((0, sel), (1, test))]
    (out,) = held_out(rows, [0])
    assert (out["frozen_warmup"], out["decay_schedule"]) == (0, "exp-0.1")
    assert (out["both_schedule"], out["both_warmup"]) == ("step-1/2", 5)
    assert out["both_over_decay"] == pytest.approx(0.25, rel=1e-15)
    assert out["frozen_over_decay"] == pytest.approx(0.5, rel=1e-15)


def test_shift_pairs_match_same_teachers():
    rows = [{"seed": 0, "kernel_heterogeneity": 1.0, "value_heterogeneity": 1.0, "lr": 0.1,
             "covariate_shift": rho, "cut_frozen_over_cut": r, "both_over_decay": b}
            for rho, r, b in ((0.0, 0.3, 0.5), (0.5, 0.9, 0.5), (1.0, 0.2, 1.0))]
    out = shift_pairs(rows)["cut_frozen_over_cut"]
    assert out["pairs"] == 2 and out["lower_without_shift"] == 0.5
    assert shift_pairs(rows)["both_over_decay"]["equal"] == 0.5


def test_unstable_step_size_is_a_recorded_error():
    cell = study_cells(True)[0]
    assert "error" in excess_table(replace(cell, lr=5.0), 0)


def test_cli_quick_writes_results(tmp_path, capsys):
    out = tmp_path / "sched"
    assert linattn_main(["simulate", "schedules", "--quick", "--out", str(out)]) == 0
    result = json.loads((out / "schedule_study.json").read_text())
    assert result["study"]["problems"] == 8 and result["map"]["problems"] == 8
    assert {"code_version", "protocol", "simulator"} <= set(result)
    assert (out / "schedule_study.csv").read_text().startswith("part,cell,seed,dim")
    assert "R(both)/R(decay)" in capsys.readouterr().out


def test_cli_bad_arguments_exit_2(tmp_path):
    out = tmp_path / "sched"
    assert linattn_main(["simulate", "schedules", "--quick", "--workers", "0", "--out",
                         str(out)]) == 2
    assert not out.exists()
