"""scripts/gpu_study.sh end to end on the CPU, with a stand-in ``nvidia-smi`` that
reports two GPUs: pretraining spread over them, the workers, the packed results and the
markers, and a second "fresh machine" that, given the markers, skips every finished group and
does not pretrain again. Catches script mistakes before they cost GPU time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from real_data import study

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_study.sh"
FAKE_SMI = """#!/usr/bin/env bash
case "$*" in
  *-L*) echo "GPU 0: stand-in"; echo "GPU 1: stand-in" ;;
  *) echo "stand-in, 1 MiB, 0"; echo "stand-in, 1 MiB, 0" ;;
esac
"""
TINY = ["train.rounds=3", "run.plot=false", "model.depth=1", "model.dim=8", "eval.clients=false"]


def _stand_in_env(tmp_path: Path) -> dict:
    """The environment with a stand-in ``nvidia-smi`` (two GPUs) and this Python first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}"
            f"{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None
                    or shutil.which("split") is None, reason="needs bash, timeout and split")
def test_gpu_study_script_runs_packs_and_resumes_from_markers(tmp_path):
    env = _stand_in_env(tmp_path)
    out_dir = tmp_path / "runs"
    plan_data = {
        "name": "script", "out_dir": str(out_dir), "seeds": [0, 1],
        "pretrain": [{"name": "src", "config": "digits_vit", "source": "digits", "epochs": 1,
                      "overrides": ["model.depth=1", "model.dim=8", "model.activation=relu"]}],
        "sweeps": [{"name": "digits", "config": "digits_vit", "overrides": TINY,
                    "alphas": [0.5], "arms": [
                        {"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
                        {"name": "frozen", "overrides": ["algorithm.name=fedfrozen",
                                                         "algorithm.train=v"],
                         "warmup_rounds": [0, 2]},
                        {"name": "fedsq", "overrides": [
                            "algorithm.name=fedsq", "model.activation=relu",
                            "algorithm.init=pretrained",
                            "algorithm.pretrained={out_dir}/pretrained/src.pt"]}]}],
    }
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan_data))

    def call(out: Path, seconds: int = 120, **extra) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), str(plan_path), str(seconds), "1", str(out)],
                              cwd=ROOT, env={**env, **extra}, capture_output=True, text=True,
                              timeout=600)

    first = call(tmp_path / "out1")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "pretrain src" in first.stdout  # pretrained once, by the pretraining step
    plan = study.load_plan(plan_path)
    specs = study.plan_runs(plan)
    assert len(specs) == 8 and all(study._status(s.run_dir) == "completed" for s in specs)
    names = sorted(p.name for p in (tmp_path / "out1").iterdir())
    assert names == ["done_markers.tar.gz", "gpu.txt", "logs.tar.gz", "study_runs.tar.gz.part00"]
    with tarfile.open(tmp_path / "out1" / "done_markers.tar.gz") as tar:
        members = tar.getnames()
    assert "pretrained/src.pt" in members
    assert sum(m.endswith("summary.json") for m in members) == 8
    # the packed parts unpack into a fresh out_dir that aggregates to the same runs
    packed = tmp_path / "packed"
    packed.mkdir()
    data = b"".join(p.read_bytes() for p in sorted((tmp_path / "out1").glob("study_runs*")))
    (tmp_path / "all.tar.gz").write_bytes(data)
    with tarfile.open(tmp_path / "all.tar.gz") as tar:
        tar.extractall(packed, filter="data")
    rows = study.aggregate(study.load_plan(plan_path, packed))
    assert {(r["arm"], r["warmup_rounds"]) for r in rows} == {
        ("fedavg", None), ("frozen", 0), ("frozen", 2), ("fedsq", None)}
    assert all(r["n_seeds"] == 2 for r in rows)

    # the same machine, a later call with PACK_NEW_ONLY: nothing new trained, nothing comes back
    # twice (the runs the markers hold are left out of the pack)
    again = call(tmp_path / "out1b", DONE_ARCHIVE=str(tmp_path / "out1" / "done_markers.tar.gz"),
                 PACK_NEW_ONLY="1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "packed 0 runs" in again.stdout and "8 that came back before left out" in again.stdout

    # a group killed after its last checkpoint: packed whole, in two parts, for a fresh machine
    # (the third call below) that restores it (PARTIAL_ARCHIVE) and resumes it
    family = [s for s in specs if s.arm.name == "frozen" and s.seed == 0]
    for s in family:
        (s.run_dir / "summary.json").unlink()
    study.write_markers(plan, tmp_path / "markers2.tar.gz")
    whole = tmp_path / "partial.tar.gz"
    assert study.pack_partial(plan, whole)["runs"] == 2
    data = whole.read_bytes()
    for i, part in enumerate((data[:len(data) // 2], data[len(data) // 2:])):
        (tmp_path / f"partial.tar.gz.part0{i}").write_bytes(part)

    # a fresh machine given the markers: nothing is run again, nothing pretrained again
    shutil.rmtree(out_dir)
    second = call(tmp_path / "out2", DONE_ARCHIVE=str(tmp_path / "out1" / "done_markers.tar.gz"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "pretrain src" not in second.stdout
    with tarfile.open(tmp_path / "out2" / "logs.tar.gz") as tar:
        logs = "".join(tar.extractfile(m).read().decode() for m in tar.getmembers()
                       if m.name.startswith("logs/worker_"))
    assert "start " not in logs and "branch " not in logs
    assert all(study._status(s.run_dir) == "completed" for s in specs)

    # the fresh machine of the partial archive: the group resumes, nothing starts again
    shutil.rmtree(out_dir)
    third = call(tmp_path / "out3", DONE_ARCHIVE=str(tmp_path / "markers2.tar.gz"),
                 PARTIAL_ARCHIVE=str(tmp_path / "partial.tar.gz.part*"))
    assert third.returncode == 0, third.stdout + third.stderr
    assert "restored 2 unfinished runs" in third.stdout
    with tarfile.open(tmp_path / "out3" / "logs.tar.gz") as tar:
        logs = "".join(tar.extractfile(m).read().decode() for m in tar.getmembers()
                       if m.name.startswith("logs/worker_"))
    assert "start " not in logs and "resumed 1" in logs, logs
    assert all(study._status(s.run_dir) == "completed" for s in specs)
    assert not list((tmp_path / "out3").glob("partial_runs*"))  # nothing left unfinished

    # PACK_PARTIAL=0 with no time left to train: the unfinished group is not archived (its
    # checkpoints would crowd out what comes back); by default it is
    for s in family:
        (s.run_dir / "summary.json").unlink()
    for out, extra, archived in (("out4", {"PACK_PARTIAL": "0"}, False), ("out5", {}, True)):
        res = call(tmp_path / out, seconds=10, **extra)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "no time left for workers" in res.stdout
        names = sorted(p.name for p in (tmp_path / out).iterdir())
        assert any(n.startswith("partial_runs") for n in names) == archived, names
        assert "study_runs.tar.gz.part00" in names and "done_markers.tar.gz" in names


def test_gpu_study_script_stops_when_pretraining_fails(tmp_path):
    env = _stand_in_env(tmp_path)
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump({
        "name": "broken", "out_dir": str(tmp_path / "runs"), "seeds": [0],
        "pretrain": [{"name": "src", "config": "digits_vit", "source": "digits", "epochs": 1,
                      "overrides": ["model.nonsense=1"]}],
        "sweeps": [{"name": "digits", "config": "digits_vit", "overrides": TINY,
                    "alphas": [0.5], "arms": [{"name": "fedsq", "overrides": [
                        "algorithm.name=fedsq", "model.activation=relu",
                        "algorithm.init=pretrained",
                        "algorithm.pretrained={out_dir}/pretrained/src.pt"]}]}]}))
    res = subprocess.run(["bash", str(SCRIPT), str(plan_path), "120", "1", str(tmp_path / "o")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "pretraining failed" in res.stdout
    assert not (tmp_path / "o" / "logs").exists() and (tmp_path / "o" / "logs.tar.gz").is_file()
    assert not list((tmp_path / "o").glob("study_runs*"))  # no worker ran


def _lost_context_call(tmp_path: Path, worker0: str, env: dict) -> tuple:
    """gpu_study.sh over a 2-run plan with one worker per shard, 150 s, under a stand-in
    ``python`` that records each worker's arguments in ``tmp_path / "args"`` and runs the
    shell line ``worker0`` for worker 0's processes before it would start them (an ``exit
    3`` there is a lost GPU context). Returns the result and the plan's runs."""
    args = tmp_path / "args"
    shim = tmp_path / "bin" / "python"
    shim.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *"--pending-before"*) echo "$*" >> {args} ;;
esac
case "$*" in
  *"--shard 0/2 --pending-before"*) {worker0} ;;
esac
exec {sys.executable} "$@"
""")
    shim.chmod(0o755)
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump({
        "name": "lost", "out_dir": str(tmp_path / "runs"), "seeds": [0, 1],
        "sweeps": [{"name": "digits", "config": "digits_vit", "overrides": TINY,
                    "alphas": [0.5], "arms": [
                        {"name": "fedavg", "overrides": ["algorithm.name=fedavg"]}]}]}))
    res = subprocess.run(["bash", str(SCRIPT), str(plan_path), "150", "1", str(tmp_path / "o")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    return res, study.plan_runs(study.load_plan(plan_path))


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None
                    or shutil.which("split") is None, reason="needs bash, timeout and split")
def test_a_worker_whose_gpu_context_is_lost_starts_again(tmp_path):
    """A worker process that exits with status 3 (its CUDA context unusable, linattn study's
    DeviceLost) is started again while time is left, and its runs all finish: here a stand-in
    ``python`` makes worker 0's first process exit with 3 before it trains anything."""
    flag = tmp_path / "lost_once"
    # the stand-in loses the context at once, which by default counts as a broken device
    res, specs = _lost_context_call(
        tmp_path, f"if [ ! -e {flag} ]; then touch {flag}; exit 3; fi",
        {**_stand_in_env(tmp_path), "FAST_LOSS_S": "0"})
    assert flag.is_file() and "worker 0: the GPU context was lost" in res.stdout
    assert "it stops" not in res.stdout
    assert len(specs) == 2 and all(study._status(s.run_dir) == "completed" for s in specs)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None
                    or shutil.which("split") is None, reason="needs bash, timeout and split")
@pytest.mark.parametrize("fast_loss_s, restarts, message", [
    ("0", 2, "lost again (exit 3, after 2 restarts); it stops"),
    ("30", 0, "lost within 30 s of the process's start (exit 3, after 0 restarts); it stops")])
def test_a_worker_that_keeps_losing_its_gpu_context_stops(tmp_path, fast_loss_s, restarts,
                                                          message):
    """A worker whose every process exits with status 3 is restarted at most MAX_RESTARTS
    times, and not at all when the context is lost within FAST_LOSS_S seconds of a start; the
    other worker's runs still finish and come back. With NO_DEADLINE=1 (the first case) no
    worker gets a --deadline."""
    count = tmp_path / "starts"
    no_deadline = fast_loss_s == "0"
    res, specs = _lost_context_call(
        tmp_path, f"echo x >> {count}; exit 3",
        {**_stand_in_env(tmp_path), "FAST_LOSS_S": fast_loss_s, "MAX_RESTARTS": "2",
         "NO_DEADLINE": "1" if no_deadline else "0"})
    assert len(count.read_text().split()) == restarts + 1
    assert f"worker 0: the GPU context was {message}" in res.stdout
    assert [study._status(s.run_dir) == "completed" for s in specs].count(True) == 1
    calls = (tmp_path / "args").read_text().splitlines()
    assert len(calls) == restarts + 2  # worker 0's processes and worker 1's one
    assert all(("--deadline" in c) != no_deadline for c in calls), calls


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("var", ["MAX_RESTARTS", "FAST_LOSS_S"])
def test_gpu_study_script_rejects_a_restart_limit_that_is_not_a_number(tmp_path, var):
    res = subprocess.run(["bash", str(SCRIPT), "plan.yaml", "150", "1", str(tmp_path / "o")],
                         cwd=ROOT, env={**os.environ, var: "three"}, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and f"{var}=three: a whole number" in res.stderr
    assert not (tmp_path / "o").exists()  # nothing written


def _tuned_plan(tmp_path: Path) -> Path:
    """A tuned plan (lr grid, FedAvg and a FedFrozen T0 family) written to tmp_path."""
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump({
        "name": "tuned", "out_dir": str(tmp_path / "runs"), "seeds": [0, 1],
        "tune": {"seed": 7, "last": 2, "validation_fraction": 0.2},
        "sweeps": [{"name": "digits", "config": "digits_vit", "overrides": TINY,
                    "alphas": [0.5], "grid": {"train.lr": [0.05, 0.3]}, "arms": [
                        {"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
                        {"name": "frozen", "overrides": ["algorithm.name=fedfrozen",
                                                         "algorithm.train=v"],
                         "warmup_rounds": [1, 3]}]}]}))
    return plan_path


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None
                    or shutil.which("split") is None, reason="needs bash, timeout and split")
def test_gpu_study_script_packs_the_stage_and_slice_it_trains(tmp_path):
    """The study options reach the final listing, pack and markers: a tuned plan's tuning
    stage, then the final stage of one arm, packs that arm's final runs and nothing else, and
    the tuning's choices.json comes back."""
    env = _stand_in_env(tmp_path)
    plan_path = _tuned_plan(tmp_path)

    def call(out: Path, *args: str) -> subprocess.CompletedProcess:
        res = subprocess.run(["bash", str(SCRIPT), str(plan_path), "120", "1", str(out), *args],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
        data = b"".join(p.read_bytes() for p in sorted(out.glob("study_runs*")))
        (out / "all.tar.gz").write_bytes(data)
        with tarfile.open(out / "all.tar.gz") as tar:
            return {m.rsplit("/", 1)[0] for m in tar.getnames() if m.endswith("summary.json")}

    tuned = call(tmp_path / "tune", "--stage", "tune", "--slice", "digits/fedavg+*/*")
    assert tuned == {f"digits/fedavg+{i}/alpha=0.5/seed=7" for i in (0, 1)}
    final = call(tmp_path / "final", "--stage", "final", "--slice", "digits/fedavg/*")
    assert final == {f"digits/fedavg/alpha=0.5/seed={s}" for s in (0, 1)}
    # the choice comes back beside the runs, for the next machine's --choices
    assert ((tmp_path / "final" / "choices.json").read_text()
            == (tmp_path / "runs" / "choices.json").read_text())


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None
                    or shutil.which("split") is None, reason="needs bash, timeout and split")
def test_gpu_study_script_runs_both_stages_of_a_tuned_plan_in_one_call(tmp_path):
    """Both stages in one call on two stand-in GPUs: each worker tunes its shard, the final
    stage is planned once every tuning run has finished (a worker done first waits for the
    other), every final run trains, and what comes back holds the tuning runs with the finals
    and the choice, so a later machine can take it with --choices."""
    env = _stand_in_env(tmp_path)
    plan_path = _tuned_plan(tmp_path)
    out = tmp_path / "call"
    res = subprocess.run(["bash", str(SCRIPT), str(plan_path), "300", "1", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    plan = study.load_plan(plan_path)
    tune_keys = {s.key for s in study.plan_runs(study.tuning_plan(plan))}
    final_keys = {s.key for s in study.plan_runs(study.final_plan(plan, study.choose(plan)))}
    assert all(study.run_status(s.run_dir) == "completed"
               for s in study.plan_runs(study.final_plan(plan, study.choose(plan))))
    data = b"".join(p.read_bytes() for p in sorted(out.glob("study_runs*")))
    (out / "all.tar.gz").write_bytes(data)
    with tarfile.open(out / "all.tar.gz") as tar:
        packed = {m.rsplit("/", 1)[0] for m in tar.getnames() if m.endswith("summary.json")}
    assert packed == tune_keys | final_keys
    assert ((out / "choices.json").read_text()
            == (tmp_path / "runs" / "choices.json").read_text())
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()
                if m.name.endswith(".log") and "worker" in m.name}
    assert len(logs) == 2 and all("study (final):" in text for text in logs.values())


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None
                    or shutil.which("split") is None, reason="needs bash, timeout and split")
def test_gpu_study_script_profiles_the_cells_it_trained(tmp_path):
    env = _stand_in_env(tmp_path)
    out_dir = tmp_path / "runs"
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump({
        "name": "profiled", "out_dir": str(out_dir), "seeds": [0, 1],
        "sweeps": [{"name": "digits", "config": "digits_vit",
                    "overrides": [*TINY, "partition.validation_fraction=0.2"],
                    "alphas": [0.5], "arms": [
                        {"name": "frozen", "overrides": ["algorithm.name=fedfrozen",
                                                         "algorithm.train=all_but_qk"],
                         "warmup_rounds": [0, 2, 3]},
                        {"name": "reference", "overrides": ["algorithm.name=fedavg",
                                                            "partition.scheme=iid",
                                                            "partition.num_clients=1"],
                         "reference": True}]}]}))
    args = "--profile-steps 4 --profile-eval-every 2 --device cpu"
    res = subprocess.run(["bash", str(SCRIPT), str(plan_path), "300", "1", str(tmp_path / "o")],
                         cwd=ROOT, env={**env, "PROFILE_ARGS": args, "PROFILE_SECONDS": "150"},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "profiles stopped after" in res.stdout
    parts = sorted((tmp_path / "o").glob("profiles.tar.gz.part*"))
    assert parts and not (tmp_path / "o" / "profiles.tar.gz").exists()
    (tmp_path / "profiles.tar.gz").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "profiles.tar.gz") as tar:
        cached = [m for m in tar.getnames() if m.endswith(".json")]
        assert not [m for m in tar.getnames() if "partial_" in m]  # every stack ended
    # two cells (one per seed, spread over the two stand-in GPUs), each with the three T0
    # snapshots of the arm and the reference's at the same rounds
    assert len(cached) == 2 * (3 + 3)
    # unpacked into a fresh out_dir beside the packed runs, the tables read the cache alone
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    data = b"".join(p.read_bytes() for p in sorted((tmp_path / "o").glob("study_runs*")))
    (tmp_path / "all.tar.gz").write_bytes(data)
    for archive in (tmp_path / "all.tar.gz", tmp_path / "profiles.tar.gz"):
        with tarfile.open(archive) as tar:
            tar.extractall(fresh, filter="data")
    plan = study.load_plan(plan_path, fresh)
    from real_data.profile import Budget

    records = study.profile_plan(plan, Budget(4, phi_rule="min", eval_every=2), compute=False)
    assert len(records) == 12 and all(np.isfinite(r["phi"]) for r in records)
