"""Figure 11 from a freeze-rule study's exported tables (no run directories needed)."""

import json
import math

from real_data import study

RULES = ("auto", "perturbation", "norm_change", "norm_change_median", "kernel_stability",
         "plateau", "fraction_half")


def _setting(sweep, alpha, fedavg_val, fixed_val):
    """FedAvg scores 0.70 + 0.01 s, the fixed T0 (80) 0.72 + 0.01 s; auto never freezes and
    scores as FedAvg; every other rule fires at 20 and scores 0.68 + 0.01 s."""
    rows = []
    for s in (0, 1, 2):
        for arm, score, val, t0, decided, fired in (
                ("fedavg", 0.70, fedavg_val, None, math.nan, math.nan),
                ("fedfrozen_fixed", 0.72, fixed_val, 80, math.nan, math.nan),
                *((r, 0.70 if r == "auto" else 0.68, 0.5, None, 200.0 if r == "auto" else 20.0,
                   0.0 if r == "auto" else 1.0) for r in RULES)):
            rows.append({"sweep": sweep, "arm": arm, "warmup_rounds": t0, "alpha": alpha,
                         "seed": s, "score": score + 0.01 * s, "val_score": val,
                         "status": "completed", "decided_T0": decided, "rounds": 200.0,
                         "fired": fired, "compute_ratio": 1.0, "rule_seconds": 0.1,
                         "wall_time_s": 10.0, "rule_state_bytes": 0.0})
    return rows


def _export(folder):
    plan = study.load_plan("freeze_rules")
    runs = _setting("fmnist_softmax", 0.1, 0.80, 0.79) + _setting("mnist", 0.1, 0.70, 0.75)
    study.write_rule_regret(plan, runs, folder)
    cands = [{"grid_point": 0, "overrides": [], "warmup_rounds": t, "score": 0.6 + t / 1000,
              "status": "completed"} for t in (10, 20, 40, 80)]
    choices = {"metric": "val_acc", "last": 5, "seed": 100, "choices": [
        {"sweep": sw, "arm": "fedfrozen_fixed", "alpha": 0.1, "metric": "val_acc",
         "chosen": cands[-1], "candidates": cands} for sw in ("fmnist_softmax", "mnist")]}
    (folder / "choices.json").write_text(json.dumps(choices))


def test_figure_11_draws_every_setting_from_the_export(tmp_path, capsys):
    from linattn.cli import main

    _export(tmp_path / "export")
    assert main(["figure", "11", "--real-data", str(tmp_path / "export"),
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "out" / "fig11_freeze_timing.png").stat().st_size > 10_000
    # alpha 0.1 of fmnist_softmax: FedAvg validates better, so the target is T = 200;
    # the lowest online regret there is auto's (it never freezes: 0 points)
    assert "fmnist_softmax alpha=0.1: target T0 = 200, lowest regret auto (+0.00 pts)" in out
    assert "mnist alpha=0.1: target T0 = 80" in out


def test_figure_11_without_a_rule_report_exits_2(tmp_path, capsys):
    from linattn.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["figure", "11", "--real-data", str(tmp_path / "empty"),
                 "--out", str(tmp_path / "out")]) == 2
    assert "no rule_regret.json" in capsys.readouterr().err
    assert not (tmp_path / "out" / "fig11_freeze_timing.png").exists()
