"""Figure 12 (P3 on real networks) from a study's exported T0 choices, and the settings the
export writes for it."""

import json

import pytest
from figure_checks import (
    T0_CHOICE_HEADER,
    profile_table_export,
    t0_choice_row,
    write_per_run_export,
    write_t0_choice_export,
)

from linattn.cli import main

_row = t0_choice_row


def _export(folder, rows):
    return write_t0_choice_export(folder, rows)


def test_figure_12_places_every_choice_on_its_axis(tmp_path, capsys):
    rows = [_row("lin_K2", 0.1, 200, 160, 200, "linear", 2, 0.2),
            _row("lin_K10", 0.1, 160, 160, 200, "linear", 10, 0.2),
            _row("lin_K40", 0.1, 80, 40, 120, "linear", 40, 0.2),
            _row("lin_K10_iid", "", 200, 200, 200, "linear", 10, 0.2, partition="iid"),
            _row("sm_lr005", 0.1, 200, 200, 200, "softmax", 10, 0.05),
            _row("sm_lr05", 0.1, 120, 80, 160, "softmax", 10, 0.5),
            _row("lin_mom09", 0.1, 160, 120, 200, "linear", 10, 0.02, momentum=0.9),
            _row("lin_xdev", 0.1, 120, 80, 160, "linear", 10, 0.2, clients=200, per_round=20),
            _row("lin_large", 0.1, 160, 160, 200, "linear", 10, 0.2, dim=192)]
    folder = _export(tmp_path / "export", rows)
    assert main(["figure", "12", "--real-data", str(folder), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "o" / "fig12_p3_real.png").stat().st_size > 10_000
    assert "lin_K40: T0 = 80 [40, 120]" in out and "lin_mom09: T0 = 160 [120, 200]" in out
    assert "step mapped as 0.05 lr / 0.2" in out  # the centre of the lr axis


def test_theory_direction_falls_with_k_and_lr_and_is_t_without_heterogeneity():
    from figures.fig12_p3_real import theory_t0

    het = [theory_t0(k, 0.05, 200, 0.5) for k in (2, 10, 40)]
    assert het == [188, 38, 14]  # the exact dynamics' argmin (recommend_warmup, no probe)
    assert theory_t0(10, 0.0125, 200, 0.5) > theory_t0(10, 0.125, 200, 0.5)
    assert theory_t0(10, 0.05, 200, 0.0) == 200


def test_figure_12_without_settings_exits_2_naming_the_fix(tmp_path, capsys):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "t0_choice.csv").write_text("sweep,alpha,arm,chosen_t0\na,0.1,f,20\n")
    assert main(["figure", "12", "--real-data", str(folder), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no column attention" in err and "--export" in err
    assert not (tmp_path / "o" / "fig12_p3_real.png").exists()
    assert main(["figure", "12", "--out", str(tmp_path / "o")]) == 2
    assert "give --real-data" in capsys.readouterr().err


@pytest.mark.parametrize("sweep, expect", [
    ("lin_K2", {"attention": "linear", "local_steps": 2, "lr": 0.2, "momentum": 0.0}),
    ("sm_lr05_iid", {"attention": "softmax", "local_steps": 10, "lr": 0.5, "partition": "iid"}),
    ("lin_K10_xdev", {"num_clients": 200, "clients_per_round": 20}),
    ("lin_K10_large", {"model_dim": 192, "rounds": 200, "freeze": "qk", "base": "fedavg"})])
def test_the_export_holds_each_sweeps_setting(sweep, expect):
    from real_data import study
    from real_data.study.tables import sweep_settings

    plan = study.load_plan("p3")
    plan = plan.__class__(**{**plan.__dict__,
                             "sweeps": [s for s in plan.sweeps if s.name == sweep]})
    settings = sweep_settings(plan)
    alpha = None if sweep.endswith("_iid") else 0.1
    got = settings[(sweep, alpha, "fedfrozen")]
    assert {k: got[k] for k in expect} == expect


def test_reproduce_draws_figure_12_only_where_the_folder_holds_the_settings(tmp_path):
    from figures.fig12_p3_real import has_choices

    folder = _export(tmp_path / "export", [_row("lin_K10", 0.1, 160, 160, 200, "linear",
                                                10, 0.2)])
    assert has_choices(folder)
    (tmp_path / "runs" / "tables").mkdir(parents=True)
    (tmp_path / "runs" / "tables" / "t0_choice.csv").write_text("sweep,alpha,chosen_t0\n")
    assert not has_choices(tmp_path / "runs") and not has_choices(tmp_path / "missing")


def test_layout_places_each_kind_on_its_axes():
    from figures.fig12_p3_real import layout

    rows = [dict(zip(T0_CHOICE_HEADER, r)) for r in (
        _row("lin_K2", 0.1, 200, 160, 200, "linear", 2, 0.2),
        _row("lin_K10", 0.1, 160, 160, 200, "linear", 10, 0.2),
        _row("lin_K10_iid", None, 200, 200, 200, "linear", 10, 0.2, partition="iid"),
        _row("lin_lr05", 0.1, 120, 140, 160, "linear", 10, 0.5),  # choice below its interval
        _row("lin_mom09", 0.1, 160, 120, 200, "linear", 10, 0.02, momentum=0.9),
        _row("lin_xdev", 0.1, 120, 80, 160, "linear", 10, 0.2, clients=200, per_round=20),
        _row("lin_large", 0.1, 160, 160, 200, "linear", 10, 0.2, dim=192),
        _row("shakespeare", None, 200, 200, 200, "softmax", 10, 0.2, partition="natural"),
        _row("adam", 0.1, 200, 200, 200, "linear", 10, 0.001),
        _row("broken", 0.1, None, 0, 200, "linear", 10, 0.2),
        _row("lin_K10", 0.1, 120, 80, 160, "linear", 10, 0.2, freeze="v_attn_out",
             arm="control"),
        _row("lin_K10", 0.1, 200, 200, 200, "linear", 10, 0.2, base="scaffold",
             arm="fedfrozen_scaffold"))]
    rows[-4]["optimizer"] = "adam"
    plan = layout(rows)
    assert plan["centre"] == (10, 0.2)
    assert {p["row"]["arm"] for p in plan["points"]} == {"fedfrozen"}  # no control, no base
    where = {(p["sweep"], p["axis"]): p for p in plan["points"]}
    assert {s for s, _ in where} == {"lin_K2", "lin_K10", "lin_K10_iid", "lin_lr05",
                                     "lin_mom09", "lin_xdev", "lin_large"}
    assert ("lin_K2", "K") in where and ("lin_K2", "lr") not in where
    assert ("lin_K10", "K") in where and ("lin_K10", "lr") in where
    assert where[("lin_mom09", "lr")]["x"] == pytest.approx(0.2)
    assert ("lin_mom09", "K") not in where
    for s in ("lin_xdev", "lin_large"):  # at K = 10 on the K axis only
        assert where[(s, "K")]["x"] == 10 and (s, "lr") not in where
    assert where[("lin_xdev", "K")]["kind"] == "cross-device"
    assert where[("lin_large", "K")]["kind"] == "wide"
    assert where[("lin_K10_iid", "K")]["iid"] and not where[("lin_K10", "K")]["iid"]
    p = where[("lin_lr05", "lr")]
    assert (p["lo"], p["t"], p["hi"]) == (0.6, 0.6, 0.8)  # widened to hold the choice


def test_a_study_without_a_placeable_choice_has_no_figure_12(tmp_path):
    from figures.fig12_p3_real import has_choices

    folder = _export(tmp_path / "mom", [
        _row("mom", 0.1, 100, 50, 150, "softmax", 10, 0.05, momentum=0.9),
        _row("shakespeare", None, 200, 200, 200, "softmax", 10, 0.5, partition="natural")])
    assert not has_choices(folder)
    assert main(["figure", "12", "--real-data", str(folder), "--out", str(tmp_path / "o")]) == 2


def test_one_axis_alone_crosses_at_its_middle_value():
    """Only the step-size sweeps ran (2 rows at each lr): the axes cross at the middle lr."""
    from figures.fig12_p3_real import layout

    rows = [dict(zip(T0_CHOICE_HEADER, _row(f"s{lr}{p}", 0.1, 160, 160, 200, "linear", 10, lr,
                                            partition=p)))
            for lr in (0.05, 0.2, 0.5) for p in ("dirichlet", "iid")]
    assert layout(rows)["centre"] == (10, 0.2)


def test_figure_13_draws_each_settings_curve_and_the_kernel_panel(tmp_path, capsys):
    rows = [_row("lin_K2", 0.1, 160, 120, 200, "linear", 2, 0.2),
            _row("lin_K10", 0.1, 160, 160, 200, "linear", 10, 0.2),
            _row("lin_K10", 0.1, 0, 0, 0, "linear", 10, 0.2, freeze="v_attn_out",
                 arm="control"),
            _row("lin_K10", 0.1, 160, 160, 200, "linear", 10, 0.2, base="scaffold",
                 arm="on_scaffold"),
            _row("lin_lr05", 0.1, 120, 80, 160, "linear", 10, 0.5),
            _row("sm_K10", 0.1, 120, 80, 160, "softmax", 10, 0.2)]
    folder = _export(tmp_path / "export", rows)
    rise = lambda t0: 0.6 + 0.0002 * t0  # noqa: E731
    write_per_run_export(folder, {("lin_K2", "fedfrozen"): rise, ("lin_K10", "fedfrozen"): rise,
                      ("lin_K10", "control"): lambda t0: 0.7 - 0.0001 * t0,
                      ("lin_K10", "on_scaffold"): rise, ("lin_lr05", "fedfrozen"): rise,
                      ("sm_K10", "fedfrozen"): rise})
    from figures.fig13_p3_curves import panels

    data = panels(folder)
    assert [c["sweep"] for c in data["K"]] == ["lin_K2", "lin_K10"]  # linear, at lr 0.2
    assert [c["sweep"] for c in data["lr"]] == ["lin_K10", "lin_lr05"]
    # softmax's axes: a second row (its only point, K = 10 at lr 0.2, lies on both axes)
    assert [c["sweep"] for c in data["more"]["softmax"]["K"]] == ["sm_K10"]
    assert [c["sweep"] for c in data["more"]["softmax"]["lr"]] == ["sm_K10"]
    kernel = {(c["sweep"], c["arm"]) for c in data["kernel"]}
    assert kernel == {("lin_K10", "fedfrozen"), ("lin_K10", "control"),
                      ("lin_K10", "on_scaffold"), ("sm_K10", "fedfrozen")}
    assert data["scale"] == []  # no wider model, no cross-device sweep
    c = next(c for c in data["K"] if c["sweep"] == "lin_K2")
    assert c["mean"][0] == pytest.approx(0.61) and c["mean"][-1] == pytest.approx(0.65)
    assert c["se"][0] == pytest.approx(0.01 / 3 ** 0.5) and c["t"] == 0.8
    assert main(["figure", "13", "--real-data", str(folder), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "o" / "fig13_p3_curves.png").stat().st_size > 10_000
    assert "lin_K10/control: 0.710 at T0 = 0, 0.690 at T0 = T" in out


def test_figure_13_draws_the_wider_model_and_the_cross_device_sweep_beside_the_main(tmp_path,
                                                                                   capsys):
    rows = [_row("lin_K2", 0.1, 160, 120, 200, "linear", 2, 0.2),
            _row("lin_K10", 0.1, 160, 160, 200, "linear", 10, 0.2),
            _row("lin_K10_iid", "natural", 160, 160, 200, "linear", 10, 0.2, partition="iid"),
            _row("lin_K10_large", 0.1, 120, 80, 160, "linear", 10, 0.2, dim=192),
            _row("lin_K10_xdev", 0.1, 80, 40, 120, "linear", 10, 0.2, clients=200,
                 per_round=20),
            _row("lin_K40_large", 0.1, 160, 160, 200, "linear", 40, 0.2, dim=192)]
    folder = _export(tmp_path / "export", rows)
    write_per_run_export(folder, {(r[0], "fedfrozen"): (lambda t0, b=0.01 * i: 0.5 + b
                                                        + 0.0002 * t0)
                                  for i, r in enumerate(rows)})
    from figures.fig13_p3_curves import panels

    data = panels(folder)
    # the centre's Dirichlet point in one attention: the main model first, then each other
    # kind by sweep name; IID twins and other K stay on the axes' panels
    assert [c["sweep"] for c in data["scale"]] == ["lin_K10", "lin_K10_large", "lin_K10_xdev"]
    assert [c["label"] for c in data["scale"]] == [
        "main: width 64 (lin_K10)", "width 192 (lin_K10_large)",
        "20 of 200 clients a round (lin_K10_xdev)"]
    assert [c["t"] for c in data["scale"]] == [0.8, 0.6, 0.4]
    # row 3: 0.5 + 0.03 at T0 = 0, seeds 0..2 adding 0.01 each: mean 0.54
    assert data["scale"][1]["mean"][0] == pytest.approx(0.54)
    assert main(["figure", "13", "--real-data", str(folder), "--out", str(tmp_path / "o")]) == 0
    assert "lin_K10_large/fedfrozen: 0.540 at T0 = 0" in capsys.readouterr().out
    assert (tmp_path / "o" / "fig13_p3_curves.png").stat().st_size > 10_000


def test_figure_13_without_per_run_scores_exits_2_naming_the_fix(tmp_path, capsys):
    folder = _export(tmp_path / "export", [_row("lin_K10", 0.1, 160, 160, 200, "linear",
                                                 10, 0.2)])
    assert main(["figure", "13", "--real-data", str(folder), "--out", str(tmp_path / "o")]) == 2
    assert "no study_per_run.csv" in capsys.readouterr().err
    assert not (tmp_path / "o" / "fig13_p3_curves.png").exists()
    assert main(["figure", "13", "--out", str(tmp_path / "o")]) == 2


def test_figure_14_draws_each_budgets_profile_converged_first(tmp_path, capsys):
    from figures.fig14_kernel_profile import has_profile, profiles

    root = tmp_path / "p3"
    profile_table_export(root / "profile_a_sgd", {"steps": 4000, "batch_size": 128, "lr": None,
                                            "optimizer": "run", "schedule": "constant",
                                            "phi_rule": "min", "eval_every": 250},
                   bias0=0.05, n_seeds=3, converged=0)
    profile_table_export(root / "profile_b_adam", {"steps": 1600, "batch_size": 2048, "lr": 0.002,
                                             "optimizer": "adam", "schedule": "constant",
                                             "phi_rule": "min", "eval_every": 50,
                                             "precision": "fp32"}, bias0=-0.02)
    assert has_profile(root) and not has_profile(tmp_path / "missing")
    data = profiles(root)
    # the budget whose every kernel passed the check comes first, whatever its folder name
    assert [p["folder"] for p in data] == ["profile_b_adam", "profile_a_sgd"]
    assert data[0]["budget"] == "1600 x 2048, adam lr 0.002, constant, min every 50"
    assert data[1]["budget"] == "4000 x 128, run's optimizer, constant, min every 250"
    from figures.fig14_kernel_profile import _budget_label

    assert _budget_label({"steps": 10, "batch_size": 4, "check": False}, "x").endswith(
        ", no check")
    ref = data[0]["refs"]["reference_iid"]
    assert ref["t0"] == [0, 10, 200] and ref["bias"] == pytest.approx([-0.02, -0.01, 0.0])
    assert ref["drift"] == pytest.approx([0.0, -0.001, -0.002])
    assert ref["drift_std"] == [0.0, 0.0, 0.0]  # a missing std draws no band
    assert main(["figure", "14", "--real-data", str(root), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "o" / "fig14_kernel_profile.png").stat().st_size > 10_000
    assert ("1600 x 2048, adam lr 0.002, constant, min every 50 (lin_K10, alpha 0.1, 1 seed, "
            "converged 1/1): federated Phi 0.3400 at T0 = 0, 0.3420 at 200") in out
    assert "pooled single client: bias -0.0200 at T0 = 0 to +0.0000 at 200" in out


def test_figure_14_without_a_profile_exits_2_naming_the_fix(tmp_path, capsys):
    (tmp_path / "export").mkdir()
    assert main(["figure", "14", "--real-data", str(tmp_path / "export"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "no kernel_profile.json" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "kernel_profile.json").write_text("{not json")
    assert main(["figure", "14", "--real-data", str(tmp_path / "bad"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "not a kernel-profile table" in capsys.readouterr().err
    assert not (tmp_path / "o" / "fig14_kernel_profile.png").exists()
    assert main(["figure", "14", "--out", str(tmp_path / "o")]) == 2
    assert "kernel-profile tables: give --real-data" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["summary"][0].pop("n_seeds"), "summary[0]: no 'n_seeds'"),
    (lambda m: m["summary"][1].update(bias_mean=None), "summary[1]: bias_mean is None"),
    (lambda m: m.update(summary={"a": 1}), "no summary list"),
    (lambda m: m.update(summary=[1]), "summary[0]: not a row"),
    (lambda m: m.update(budget={"lr": 0.1}), "budget: not a budget"),
    (lambda m: m.update(summary=[]), "no summary rows"),
    (lambda m: m["summary"][2].update(bias_std="x"), "summary[2]: bias_std is 'x'"),
])
def test_figure_14_names_a_malformed_table_and_draws_nothing(tmp_path, capsys, edit, message):
    import json

    folder = profile_table_export(tmp_path / "p" / "profile_x", {"steps": 10}, bias0=0.0)
    meta = json.loads((folder / "kernel_profile.json").read_text())
    edit(meta)
    (folder / "kernel_profile.json").write_text(json.dumps(meta))
    assert main(["figure", "14", "--real-data", str(tmp_path / "p"), "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and "kernel_profile.json" in err
    assert not (tmp_path / "o" / "fig14_kernel_profile.png").exists()


def test_figure_14_reads_a_tables_folder_once(tmp_path):
    from figures.fig14_kernel_profile import profiles

    profile_table_export(tmp_path / "out" / "tables", {"steps": 10}, bias0=0.0)
    assert len(profiles(tmp_path / "out")) == 1


def test_figure_14_draws_a_table_without_standard_deviations(tmp_path):
    import json

    from figures.fig14_kernel_profile import profiles

    folder = profile_table_export(tmp_path / "p" / "profile_x", {"steps": 10}, bias0=0.0)
    meta = json.loads((folder / "kernel_profile.json").read_text())
    for r in meta["summary"]:
        for k in ("phi_fed_std", "phi_ref_std", "bias_std", "drift_std"):
            r.pop(k, None)
    (folder / "kernel_profile.json").write_text(json.dumps(meta))
    assert profiles(tmp_path / "p")[0]["refs"]["reference"]["bias_std"] == [0.0, 0.0, 0.0]
    assert main(["figure", "14", "--real-data", str(tmp_path / "p"), "--out",
                 str(tmp_path / "o")]) == 0


def test_figure_14_names_a_profile_no_seed_of_which_ran_the_check(tmp_path, capsys):
    folder = profile_table_export(tmp_path / "p3" / "profile", {
        "steps": 1600, "batch_size": 2048, "lr": 0.002, "optimizer": "adam",
        "schedule": "constant", "phi_rule": "min", "eval_every": 50, "check": False},
        bias0=-0.02, n_seeds=3, converged=0)
    meta = json.loads((folder / "kernel_profile.json").read_text())
    for r in meta["summary"]:
        r["n_checked"] = 0
    (folder / "kernel_profile.json").write_text(json.dumps(meta))
    assert main(["figure", "14", "--real-data", str(tmp_path / "p3"),
                 "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "(lin_K10, alpha 0.1, 3 seeds, no seed checked)" in out and "0/0" not in out


def test_reproduce_draws_an_exported_studys_figures_without_its_runs(tmp_path, capsys):
    from figure_checks import make_study

    from figures.cli import _real_data_figures
    from figures.common import FigureError

    folder = _export(tmp_path / "export", [_row("lin_K10", 0.1, 160, 160, 200, "linear",
                                                10, 0.2)])
    profile_table_export(folder / "profile_adam", {"steps": 10, "batch_size": 4},
                         bias0=0.0)
    assert _real_data_figures(folder) == [12, 14]  # no run directories: no figure 7
    assert "no figure 7; figures 12, 14" in capsys.readouterr().out
    assert _real_data_figures(make_study(tmp_path / "study"))[0] == 7  # runs: figure 7 first
    assert _real_data_figures(None) == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(FigureError, match="no completed run directory.*nor a study's exported"):
        _real_data_figures(tmp_path / "empty")
    # a malformed kernel-profile table stops reproduce, naming the file
    table = folder / "profile_adam" / "kernel_profile.json"
    meta = json.loads(table.read_text())
    meta["summary"][0].pop("bias_mean")
    table.write_text(json.dumps(meta))
    with pytest.raises(FigureError, match="kernel_profile.json"):
        _real_data_figures(folder)
