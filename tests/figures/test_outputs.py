"""Where the figures go and how they are written: default folders under the current directory,
mode 0644 files, integer counts in cached JSON, readable tick labels in figure 8."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from figure_checks import assert_image_files

from linattn.cli import main as linattn_main


@pytest.fixture
def small_fig8(monkeypatch):
    """Figure 8 on 300 generated labels (no scikit-learn digits needed, fast)."""
    from figures import fig8_partitions as fig8

    monkeypatch.setattr(fig8, "dataset", lambda: fig8.generated_dataset(300))
    return fig8


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode))
            for p in root.rglob("*") if p.is_file()}


def test_default_outputs_land_under_the_current_directory(tmp_path, monkeypatch, small_fig8,
                                                          capsys):
    from figures.cache import cached

    monkeypatch.chdir(tmp_path)
    assert linattn_main(["figure", "8"]) == 0
    out = tmp_path / "figures" / "out"
    assert_image_files([out / "fig8_partitions.png", out / "fig8_partitions.pdf"])
    printed = capsys.readouterr().out.splitlines()
    assert (tmp_path / printed[0]).resolve() == out / "fig8_partitions.png"
    _, hit = cached("probe", {"n": 1}, lambda: {"value": 1})
    assert not hit and len(list((out / ".cache").glob("probe-*.json"))) == 1


def test_cached_json_keeps_integer_counts(tmp_path):
    from figures.cache import cached

    def compute():
        return {"rounds": np.int64(10), "clients": 4, "error": np.float64(0.25),
                "curve": np.arange(3), "missing": float("nan")}

    first, hit = cached("counts", {"k": 1}, compute, cache_dir=tmp_path)
    assert not hit
    (path,) = tmp_path.glob("counts-*.json")
    stored = json.loads(path.read_text())
    assert stored["rounds"] == 10 and type(stored["rounds"]) is int
    assert stored["curve"] == [0, 1, 2] and all(type(v) is int for v in stored["curve"])
    assert stored["error"] == 0.25 and np.isnan(stored["missing"])
    again, hit = cached("counts", {"k": 1}, compute, cache_dir=tmp_path)
    assert hit and type(again["rounds"]) is int


def test_figure_files_are_readable_by_others(tmp_path, small_fig8):
    from figures.cache import cached

    old = os.umask(0o022)
    try:
        assert linattn_main(["figure", "8", "--out", str(tmp_path / "out")]) == 0
        cached("probe", {"n": 2}, lambda: {"value": 2}, cache_dir=tmp_path / "out" / ".cache")
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "out")
    assert len(modes) == 3 and set(modes.values()) == {oct(0o644)}, modes


def test_reproduce_files_are_readable_by_others(quick_run):
    """Every file ``linattn reproduce --quick`` wrote (figures, report, validation, cache):
    0644 whatever the process's umask, since every writer sets the mode itself."""
    modes = _modes(quick_run["out"])
    assert "report.md" in modes and "validation/validation.json" in modes
    assert set(modes.values()) == {oct(0o644)}, modes


def test_partition_figure_tick_labels_are_readable(monkeypatch, small_fig8, tmp_path):
    """At about page width, 8-point tick labels that do not overlap."""
    from figures import style

    figures = []
    monkeypatch.setattr(style.plt, "close", figures.append)
    small_fig8.make(tmp_path, num_clients=10)
    (fig,) = figures
    assert fig.get_size_inches()[0] <= 8.0
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 5
    for ax in panels:
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            labels = [t for t in labels if t.get_text()]
            assert labels and all(t.get_fontsize() >= 8 for t in labels)
            boxes = [t.get_window_extent(renderer) for t in labels]
            for a, b in zip(boxes, boxes[1:]):
                assert not a.overlaps(b), (ax.get_title(), a, b)
    style.plt.close(fig)
