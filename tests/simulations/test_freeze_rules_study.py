"""The freeze-rule study on the warm-up grid's 4 cheapest settings: every method scored, the
fixed schedule where it must be, and the summary's counts."""

import math

import pytest


def test_rule_study_quick():
    from simulations.freeze_rules_study import METHODS, run_rule_study

    result = run_rule_study(quick=True)
    assert len(result["points"]) == 4
    for row in result["points"]:
        assert set(row["methods"]) == set(METHODS)
        for m in row["methods"].values():
            assert 0 <= m["T0"] <= row["T"]
        # fraction=0.5 is T0 = ceil(T/2) by definition
        assert row["methods"]["fraction=0.5"]["T0"] == math.ceil(row["T"] / 2)
    # every score recomputed from the row's own R values and the stated tie band
    for row in result["points"]:
        for m in row["methods"].values():
            assert m["regret"] == pytest.approx(m["R"] / row["R_grid"] - 1, rel=1e-12)
            assert m["vs_never"] == pytest.approx(m["R"] / row["R_never"], rel=1e-12)
            expect = ("win" if m["vs_never"] < 0.99 else "loss" if m["vs_never"] > 1.01
                      else "tie")
            assert m["outcome"] == expect
        # the grid T0 is the best of {0, T/10, ..., T}: no grid method can beat it
        assert row["methods"]["fraction=0.5"]["regret"] >= -1e-12
    summ = result["summary"]["all"]
    for name, s in summ.items():
        outcomes = [r["methods"][name]["outcome"] for r in result["points"]]
        assert (s["win"], s["tie"], s["loss"]) == tuple(outcomes.count(o)
                                                         for o in ("win", "tie", "loss"))
        assert s["mean_regret"] == pytest.approx(
            sum(r["methods"][name]["regret"] for r in result["points"]) / 4)
