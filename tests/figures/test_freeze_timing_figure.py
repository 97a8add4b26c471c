"""Figure 11 from a freeze-rule study's exported tables (no run directories needed)."""

from figure_checks import write_rule_export


def test_figure_11_draws_every_setting_from_the_export(tmp_path, capsys):
    from linattn.cli import main

    write_rule_export(tmp_path / "export")
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
