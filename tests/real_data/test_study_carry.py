"""Unfinished run groups moved to a fresh machine: a study killed mid-group, its groups packed
whole (``--pack-partial``) and restored into another out_dir (``--restore-partial``) beside the
finished runs' pack and markers, resumes to metrics.csv files byte-identical to an
uninterrupted study. What a machine already holds is kept; bad archives exit 2, nothing
written."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_cli
from pause_run import wait_paused

from linattn.errors import DataError
from real_data import study
from real_data.study.runner import families

PLAN = {
    "name": "carry",
    "seeds": [0],
    "sweeps": [{
        "name": "digits",
        "config": "digits_vit",
        "overrides": ["train.rounds=4", "run.plot=false", "model.depth=1", "model.dim=8",
                      "eval.clients=false"],
        "alphas": [0.5],
        "arms": [
            {"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
            {"name": "frozen", "overrides": ["algorithm.name=fedfrozen", "algorithm.train=v"],
             "warmup_rounds": [1, 3]},
        ],
    }],
}
HEAD = "frozen-T0=3"

# a study process that hangs after round 2's rows of the T0 family's head (the test kills it)
_SCRIPT = r"""
import sys, time
from pathlib import Path
import real_data.stacked_runs as sr
from real_data import study
plan_path, out, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
inner = sr.run_group
def hook(rnd, run_dir):
    if rnd == 2 and "frozen-T0=3" in str(run_dir):
        marker.write_text(str(rnd))
        while True:
            time.sleep(1)
def run_group(*args, **kw):
    return inner(*args, **{**kw, "on_round_end": hook})
sr.run_group = run_group
study.run_study(study.load_plan(plan_path, out), log=print)
"""


def _plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(PLAN))
    return path


def _killed_study(tmp_path: Path, plan_path: Path, out: Path) -> None:
    marker = tmp_path / "paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(plan_path), str(out),
                             str(marker)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_paused(proc, marker, "the study never reached round 2", timeout=600, poll=0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The whole study, and one killed at round 2 with its three archives."""
    tmp = tmp_path_factory.mktemp("carry")
    plan_path = _plan_file(tmp)
    whole = study.load_plan(plan_path, tmp / "whole")
    counts = study.run_study(whole, log=lambda *_: None)
    assert counts["failed"] == 0 and counts["started"] >= 2
    plan = study.load_plan(plan_path, tmp / "killed")
    _killed_study(tmp, plan_path, plan.out_dir)
    archives = {name: tmp / f"{name}.tar.gz" for name in ("runs", "markers", "partial")}
    study.pack_results(plan, archives["runs"])
    study.write_markers(plan, archives["markers"])
    packed = study.pack_partial(plan, archives["partial"])
    return tmp, plan_path, whole, plan, archives, packed


def _fresh(tmp: Path, plan_path: Path, name: str, archives: dict):
    """Another machine's out_dir given the finished runs' markers and pack, as gpu_study.sh
    unpacks them."""
    plan = study.load_plan(plan_path, tmp / name)
    plan.out_dir.mkdir(parents=True)
    for key in ("markers", "runs"):
        with tarfile.open(archives[key]) as tar:
            tar.extractall(plan.out_dir)
    return plan


def test_a_killed_group_resumes_on_a_fresh_machine_to_identical_metrics(killed):
    tmp, plan_path, whole, plan, archives, packed = killed
    specs = study.plan_runs(plan)
    status = {s.key: study.run_status(s.run_dir) for s in specs}
    assert "partial" in status.values(), status  # the kill left unfinished runs
    unfinished = [k for k, v in status.items() if v != "completed"]
    assert packed["runs"] >= len(unfinished) and packed["families"] >= 1
    with tarfile.open(archives["partial"]) as tar:
        names = tar.getnames()
    assert any(n.endswith(f"{HEAD}/alpha=0.5/seed=0/checkpoints/last.pt") for n in names)
    assert not any(n.endswith("/.lock") for n in names)

    fresh = _fresh(tmp, plan_path, "fresh", archives)
    got = study.restore_partial(fresh, archives["partial"])
    assert got == {"restored": packed["runs"], "kept": 0, "other": 0}
    # priced from where each restored run resumes (its checkpoint's round), not from round 0
    left = 0
    for family in families(study.plan_runs(fresh)):
        for i, s in enumerate(family):  # a branch without a checkpoint starts at its T0
            ckpt = s.run_dir / "checkpoints" / "last.pt"
            start = torch.load(ckpt, weights_only=False)["round"] if ckpt.is_file() else \
                0 if i == 0 else s.warmup_rounds
            left += 0 if study.run_status(s.run_dir) == "completed" else 4 - start
    assert [r["run_rounds"] for r in study.estimate(fresh, None)] == [left]
    counts = study.run_study(fresh, log=lambda *_: None)
    assert counts["failed"] == 0 and counts["started"] == 0 and counts["resumed"] >= 1
    for s in study.plan_runs(fresh):
        assert study.run_status(s.run_dir) == "completed", s.key
        if s.key in unfinished:  # resumed here: every row equals the uninterrupted study's
            ref = whole.out_dir / s.run_dir.relative_to(fresh.out_dir) / "metrics.csv"
            assert (s.run_dir / "metrics.csv").read_bytes() == ref.read_bytes(), s.key


def test_a_restore_keeps_what_this_machine_trained_or_finished(killed):
    tmp, plan_path, whole, plan, archives, packed = killed
    # the killed machine itself: its own checkpoints are at least as new, nothing replaced
    before = {p: p.read_bytes() for p in plan.out_dir.rglob("*") if p.is_file()}
    assert study.restore_partial(plan, archives["partial"]) == \
        {"restored": 0, "kept": packed["runs"], "other": 0}
    assert {p: p.read_bytes() for p in plan.out_dir.rglob("*") if p.is_file()} == before
    # a machine where the whole study finished (its markers): every group stays finished
    done = study.load_plan(plan_path, tmp / "done")
    done.out_dir.mkdir(parents=True)
    study.write_markers(whole, tmp / "all_markers.tar.gz")
    with tarfile.open(tmp / "all_markers.tar.gz") as tar:
        tar.extractall(done.out_dir)
    got = study.restore_partial(done, archives["partial"])
    assert got["restored"] == 0 and got["kept"] == packed["runs"]
    assert all(study.run_status(s.run_dir) == "completed" for s in study.plan_runs(done))
    assert not any(p.name == "last.pt" for p in done.out_dir.rglob("*"))


def _archive(path: Path, name: str, data: bytes = b"x", link: bool = False) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        if link:
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("name, link", [("../escape/metrics.csv", False),
                                        ("/abs/metrics.csv", False),
                                        ("digits/fedavg/alpha=0.5/seed=0/metrics.csv", True)])
def test_an_archive_with_unsafe_members_is_refused_before_writing(tmp_path, name, link):
    plan = study.load_plan(_plan_file(tmp_path), tmp_path / "out")
    bad = _archive(tmp_path / "bad.tar.gz", name, link=link)
    with pytest.raises(DataError, match="bad.tar.gz"):
        study.restore_partial(plan, bad)
    assert not plan.out_dir.exists()


def test_the_cli_restores_and_refuses_a_broken_archive_with_exit_2(killed, tmp_path):
    tmp, plan_path, whole, plan, archives, packed = killed
    out = tmp_path / "cli"
    done = run_cli("study", "--plan", str(plan_path), "--out", str(out),
                   "--restore-partial", str(archives["partial"]))
    assert done.returncode == 0, done.stderr
    assert f"restored {packed['runs']} unfinished runs" in done.stdout
    # files of no run of the plan (another plan's archive) are left out and counted
    other = _archive(tmp_path / "other.tar.gz", "elsewhere/run/metrics.csv")
    done = run_cli("study", "--plan", str(plan_path), "--out", str(tmp_path / "o2"),
                   "--restore-partial", str(other))
    assert done.returncode == 0
    assert "1 files of no run of the selected stages left out" in done.stdout
    assert not (tmp_path / "o2" / "elsewhere").exists()
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(b"not a tar file")
    done = run_cli("study", "--plan", str(plan_path), "--out", str(tmp_path / "o3"),
                   "--restore-partial", str(broken))
    assert done.returncode == 2 and "broken.tar.gz" in done.stderr
    assert "concatenate its .part files" in done.stderr
    assert not (tmp_path / "o3").exists()
