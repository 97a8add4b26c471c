"""The freeze-rule study on the warm-up grid's 4 cheapest settings: every method scored, the
fixed schedule where it must be, and the summary's counts."""

import math


def test_rule_study_quick():
    from simulations.freeze_rules_study import METHODS, run_rule_study

    result = run_rule_study(quick=True)
    assert len(result["points"]) == 4
    for row in result["points"]:
        assert set(row["methods"]) == set(METHODS)
        for m in row["methods"].values():
            assert 0 <= m["T0"] <= row["T"] and m["regret"] >= -1e-12
        # fraction=0.5 is T0 = ceil(T/2) by definition
        assert row["methods"]["fraction=0.5"]["T0"] == math.ceil(row["T"] / 2)
    summ = result["summary"]["all"]
    assert sum(summ["auto"][k] for k in ("win", "tie", "loss")) == 4
