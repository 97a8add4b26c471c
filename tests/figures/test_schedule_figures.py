"""Figures 9 and 10 (the schedule study) redraw from the reproduce run's cache, and their
captions repeat the study's summary numbers."""

from __future__ import annotations

import importlib

from figure_checks import assert_image_files

from figures.cli import MODULES
from figures.common import fmt, grid_for


def test_schedule_figures_redraw_from_the_cache(quick_run, tmp_path):
    from figures.fig9_schedules import study_data

    grid = grid_for(True)
    data, hit = study_data(grid, quick_run["cache"])
    assert hit
    for number in (9, 10):
        module = importlib.import_module(f"figures.{MODULES[number]}")
        fig = module.make(None, grid, tmp_path, quick_run["cache"])
        assert fig.cache_hits == {"schedule study": True}
        assert_image_files(list(fig.paths))
    study = data["summary"]["study"]
    caption = importlib.import_module("figures.fig9_schedules").caption(study)
    assert f"median {fmt(study['oracle']['both_over_decay']['median'])}" in caption
    assert f"{study['problems']} problems" in caption
