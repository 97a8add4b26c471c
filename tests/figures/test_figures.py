"""Each figure script renders on tiny inputs (the quick grid, read back from the test run's
cache; tiny synthetic run directories; generated labels), and what the figures compute agrees
with the validation numbers it sits beside."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from figure_checks import assert_image_files

from figures.cli import MODULES

REPO = Path(__file__).resolve().parents[2]


def _validation(quick_run) -> dict:
    return json.loads((quick_run["out"] / "validation" / "validation.json").read_text())


@pytest.mark.parametrize("number", [1, 2, 3, 4, 5, 6])
def test_simulated_figure_script_renders_from_the_cache(quick_run, tmp_path, capsys, number):
    module = importlib.import_module(f"figures.{MODULES[number]}")
    assert module.main(["--quick", "--out", str(tmp_path), "--cache",
                        str(quick_run["cache"]), "--threads", "1"]) == 0
    assert_image_files([tmp_path / f"{MODULES[number]}.png", tmp_path / f"{MODULES[number]}.pdf"])
    assert capsys.readouterr().out.strip()  # the caption line
    assert not (tmp_path / ".cache").exists()  # everything came from the given cache


def test_cached_intermediates_are_hits_on_a_second_draw(quick_run, tmp_path):
    from figures.common import grid_for

    result, grid = _validation(quick_run), grid_for(True)
    for number in (3, 4, 6):  # the expensive sweeps; 1 and 2 are checked below
        module = importlib.import_module(f"figures.{MODULES[number]}")
        fig = module.make(result, grid, tmp_path, quick_run["cache"])
        assert fig.cache_hits and all(fig.cache_hits.values()), (number, fig.cache_hits)


def test_figure_script_runs_as_a_module(quick_run, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "figures.fig5_bound", "--quick", "--out",
                           str(tmp_path), "--cache", str(quick_run["cache"])], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_image_files([tmp_path / "fig5_bound.png", tmp_path / "fig5_bound.pdf"])


def test_real_data_figure_on_tiny_runs(quick_run, tmp_path):
    from figures import fig7_real_data as fig7

    fig = fig7.make(quick_run["study"], tmp_path)
    assert_image_files(fig.paths)
    runs, notes = fig7.find_runs(quick_run["study"])
    conditions = fig7.group(runs)
    arms = conditions["digits, alpha=0.3"]
    assert set(arms) == {"fedavg", "fedfrozen_v", "fedfrozen_auto", "reference"}
    assert sorted(arms["fedfrozen_v"].runs_by_t0) == [0, 2, 4, 6]
    assert all(len(rs) == 2 for rs in arms["fedfrozen_v"].runs_by_t0.values())
    assert fig7.recommended_t0(arms) == 3.0
    assert len(notes) == 1 and "fedprox" in notes[0]
    # a run directory outside a study layout is labelled from its config
    single, _ = fig7.find_runs(quick_run["study"] / "digits" / "fedavg" / "alpha=0.3" / "seed=0")
    assert single[0].arm == "fedavg" and single[0].condition == "digits, alpha=0.3"


def test_real_data_figure_reads_study_keys_of_both_splits():
    from figures.fig7_real_data import STUDY_KEY
    from real_data.study import _key

    m = STUDY_KEY.match(_key("x", "fedfrozen_v", 40, 0.3, 1).split("/", 1)[1])
    assert (m["arm"], m["t0"], m["alpha"], m["natural"]) == ("fedfrozen_v", "40", "0.3", None)
    m = STUDY_KEY.match(_key("shakespeare", "fedavg", None, None, 2).split("/", 1)[1])
    assert (m["arm"], m["t0"], m["alpha"], m["natural"]) == ("fedavg", None, None, "natural")


def test_real_data_figure_rejects_a_folder_without_runs(tmp_path):
    from figures.common import FigureError
    from figures.fig7_real_data import make

    with pytest.raises(FigureError, match="no completed run directory"):
        make(tmp_path, tmp_path / "out")


def test_partition_figure_on_generated_labels(tmp_path, monkeypatch):
    from figures import fig8_partitions as fig8

    monkeypatch.setattr(fig8, "dataset", lambda: fig8.generated_dataset(300))
    fig = fig8.make(tmp_path, num_clients=5)
    assert_image_files(fig.paths)
    assert "generated balanced labels" in fig.caption
    # IID has the smallest label skew, two classes per client the largest
    from real_data.data import label_skew

    data = fig8.generated_dataset(300)
    skews = [label_skew(p.train, data.y_train.numpy(), 10) for p in fig8.partitions(data, 5)]
    assert skews[0] == min(skews) and skews[-1] == max(skews)


# --------------------------------------------------------------- agreement with the validation


def test_population_curves_pass_through_the_validation_numbers(quick_run):
    """Fig. 1/2 lines are the population dynamics the validation evaluates at the T0 grid."""
    from figures import fig1_bias_drift, fig2_final_error
    from figures.common import grid_for, grid_setting

    result, grid = _validation(quick_run), grid_for(True)
    t0 = result["grid"]["warmup_grid"]
    lines, _ = fig1_bias_drift.population_curves(grid, quick_run["cache"])
    for (zeta, k, lr), row in zip(grid.p1_points, result["checks"]["P1"]["points"]):
        line = lines[grid_setting(grid, zeta, k, lr).label]
        for name in ("bias", "drift"):
            np.testing.assert_allclose(np.asarray(line[name])[t0], row[name]["population"],
                                       rtol=1e-9, atol=1e-12)
    curves, _ = fig2_final_error.population_curves(grid, quick_run["cache"])
    for label, line in curves.items():
        np.testing.assert_allclose(np.asarray(line["final_error"])[t0],
                                   result["settings"][label]["R_population"], rtol=1e-9)


def test_theory_sweep_matches_the_validation_at_grid_points(quick_run):
    """Fig. 3's sweep recomputes T0* at the grid points: equal to P2's numbers."""
    from figures import fig3_optimal_warmup as fig3
    from figures.common import grid_for, grid_setting, p2_rows

    result, grid = _validation(quick_run), grid_for(True)
    curves, _ = fig3.theory_curves(grid, quick_run["cache"])
    rows = p2_rows(result)
    checked = 0
    for axis, spec in fig3.sweeps(grid).items():
        for point in curves[axis]:
            coords = {**spec["fixed"], axis: point[axis]}
            label = grid_setting(grid, coords["heterogeneity"], coords["local_steps"],
                                 coords["lr"]).label
            if label in rows:
                assert point["population"] == rows[label]["predicted_T0"]
                assert point["closed_form"] == rows[label]["closed_form_T0"]
                assert point["bound_argmin"] == rows[label]["bound_argmin_T0"]
                checked += 1
    assert checked >= 3


def test_floor_sweep_reuses_the_p4_computation(quick_run):
    """Fig. 4 at the P4 point gives P4's numbers (same code, same seeds): a consistency check
    that the figure plots the validated computation, not an independent test of the floor."""
    from figures import fig4_frozen_floor as fig4
    from figures.common import grid_for

    result, grid = _validation(quick_run), grid_for(True)
    data, _ = fig4.compute_floors(grid, quick_run["cache"])
    p4 = {r["setting"]: r for r in result["checks"]["P4"]["points"]}
    matched = [r for r in data["rows"] if r["setting"] in p4]
    assert matched
    for row in matched:
        for key in ("measured_floor", "D_frozen", "noise_term", "predicted"):
            assert row[key] == pytest.approx(p4[row["setting"]][key], rel=1e-9)


def test_simulator_jumps_match_the_validation_mean(quick_run):
    """Fig. 6's per-round simulator jumps average to the validation's gradient_jump_mean."""
    from figures import fig6_gradient_jumps as fig6
    from figures.common import grid_for

    result, grid = _validation(quick_run), grid_for(True)
    data, _ = fig6.compute_jumps(grid, quick_run["cache"])
    for label, rec in data.items():
        assert np.mean(rec["sim_mean"]) == pytest.approx(
            result["settings"][label]["gradient_jump_mean"], rel=1e-8)


def test_population_jumps_follow_the_exact_dynamics():
    """The local loop of fig. 6 reproduces ``warmup_paths`` (eq. 19) and the frozen map."""
    from figures.fig6_gradient_jumps import population_jumps
    from linattn_theory.dynamics import initial_point, warmup_paths
    from linattn_theory.problem import make_problem

    problem = make_problem(dim=3, num_clients=3, context_length=4, kernel_heterogeneity=0.7,
                           value_heterogeneity=0.7, seed=2)
    start = initial_point(problem, seed=1)
    out = population_jumps(problem, start, 0.1, 3, total_rounds=6, warmup_rounds=4)
    kernels, _, _ = warmup_paths(problem, start, 0.1, 3, 4)
    np.testing.assert_allclose(out["kernels"], kernels, rtol=1e-10, atol=1e-12)
    assert np.isnan(out["jump"][0]) and np.isnan(out["jump"][4])
    np.testing.assert_allclose(out["jump"][1:4], out["first"][1:4] / out["last"][0:3])
    # K = 1: the client's first step is its last, so there is no local drift to jump from
    one = population_jumps(problem, start, 0.1, 1, total_rounds=5, warmup_rounds=5)
    np.testing.assert_allclose(one["first"], one["last"])


def test_cache_hits_misses_and_recomputes_a_corrupt_entry(tmp_path):
    from figures.cache import cached, config_hash

    calls = []

    def compute():
        calls.append(1)
        return {"x": [1.0, 2.0]}

    assert cached("t", {"a": 1}, compute, tmp_path) == ({"x": [1.0, 2.0]}, False)
    assert cached("t", {"a": 1}, compute, tmp_path) == ({"x": [1.0, 2.0]}, True)
    assert cached("t", {"a": 2}, compute, tmp_path)[1] is False
    (tmp_path / f"t-{config_hash({'a': 1})}.json").write_text("{not json")
    assert cached("t", {"a": 1}, compute, tmp_path) == ({"x": [1.0, 2.0]}, False)
    assert len(calls) == 3


def test_real_data_figure_marks_the_freeze_rules_choice(tmp_path):
    """A run with an online freeze rule (algorithm.warmup=perturbation) reads the T0 it chose
    from its summary and is drawn as a point in the T0 panel."""
    from figure_checks import write_run

    from figures import fig7_real_data as fig7

    root = tmp_path / "study"
    for seed, t0 in ((0, 2), (1, 4)):
        tail = f"alpha=0.3/seed={seed}"
        write_run(root / "digits" / "fedavg" / tail, {"name": "fedavg"}, 6, lambda r: 0.1 * r,
                  seed)
        write_run(root / "digits" / "perturbation" / tail,
                  {"name": "fedfrozen", "warmup": "perturbation", "warmup_rounds": None},
                  6, lambda r: 0.09 * r, seed,
                  summary_extra={"warmup": {"rule": "perturbation", "fired_at": t0,
                                            "warmup_rounds": t0}})
    runs, _ = fig7.find_runs(root)
    rule = [r for r in runs if r.arm == "perturbation"]
    assert sorted(r.decided for r in rule) == [2, 4]
    assert all(r.recommended is None and r.warmup_rounds is None for r in rule)
    fig = fig7.make(root, tmp_path / "out")
    assert len(fig.paths) >= 1


def test_real_data_figure_skips_tuning_runs(tmp_path):
    """A tuned study's tuning runs evaluate the validation split only (no test_acc): skipped
    with a note, not drawn."""
    from figure_checks import write_run

    from figures import fig7_real_data as fig7

    root = tmp_path / "study"
    write_run(root / "digits" / "fedavg" / "alpha=0.3/seed=0", {"name": "fedavg"}, 4,
              lambda r: 0.1 * r, 0)
    tuning = root / "digits" / "fedavg+0" / "alpha=0.3/seed=100"
    write_run(tuning, {"name": "fedavg"}, 4, lambda r: 0.1 * r, 0)
    lines = (tuning / "metrics.csv").read_text().splitlines()
    (tuning / "metrics.csv").write_text("\n".join(
        ln.replace(",test_acc,", ",val_acc,") for ln in lines) + "\n")
    runs, notes = fig7.find_runs(root)
    assert [r.arm for r in runs] == ["fedavg"]
    assert any("no test accuracy" in n for n in notes)
