"""Shared fixtures: one ``linattn reproduce --quick`` into a temporary folder (with tiny
synthetic real-data runs for figure 7), whose cache the per-figure tests then reuse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from figure_checks import make_study  # noqa: E402


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """``linattn reproduce --quick --real-data STUDY --out OUT``, once per test run."""
    from linattn.cli import main

    root = tmp_path_factory.mktemp("reproduce")
    study = make_study(root / "study")
    out = root / "out"
    threads = torch.get_num_threads()
    try:
        code = main(["reproduce", "--quick", "--out", str(out), "--real-data", str(study)])
    finally:
        torch.set_num_threads(threads)  # leave the test run's setting to the other test folders
    assert code == 0
    return {"out": out, "cache": out / ".cache", "study": study}
