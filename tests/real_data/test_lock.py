"""The run-directory lock: one writer per run, a stale lock taken over, concurrent resumes.

A second ``linattn run --resume`` of a run directory in use exits 2 naming the holder and
changes nothing; a lock left by a killed process is stale and taken over; ``metrics.csv``
never holds a round twice.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, cli_command, tiny_config
from pause_run import start as start_paused
from pause_run import wait_paused

from linattn.cli import main as linattn_main
from real_data import engines
from real_data.lock import LOCK_FILE, RunLock, RunLocked, holder
from real_data.runs import prepare_resume, prepare_start, start_run, train_prepared

SMALL = [*TINY, "train.rounds=4", "partition.num_clients=3", "algorithm.warmup_rounds=2"]


def rounds_of(metrics: Path) -> list[tuple[int, str, str]]:
    return [tuple(line.split(",")[:3]) for line in metrics.read_text().splitlines()[1:]]


def test_a_second_holder_is_refused_and_named(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock.acquire(run) as lock:
        assert lock.held and (run / LOCK_FILE).is_file()
        with pytest.raises(RunLocked) as info:
            RunLock.acquire(run)
        message = str(info.value)
        assert f"pid {os.getpid()} on {socket.gethostname()}" in message and str(run) in message
        assert holder(run) is not None and f"pid {os.getpid()}" in holder(run)
    assert not (run / LOCK_FILE).exists() and holder(run) is None
    RunLock.acquire(run).release()  # free again


def test_a_lock_left_by_a_killed_process_is_stale(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    code = (f"import os, signal, sys; sys.path.insert(0, {str(REPO)!r}); "
            f"from real_data.lock import RunLock; lock = RunLock.acquire({str(run)!r}); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = (run / LOCK_FILE).read_text()
    assert left.startswith("pid=")  # the file survives the crash ...
    assert holder(run) is None  # ... but nobody holds it
    with RunLock.acquire(run) as lock:  # taken over, and the dead holder is reported
        assert lock.stale is not None and lock.stale.split()[0] == left.split()[0]


def test_the_lock_is_held_while_training_and_released_after(tmp_path, monkeypatch):
    seen = []
    res = start_run(tiny_config(*SMALL), out=tmp_path / "r",
                    on_round_end=lambda rnd, run_dir: seen.append(holder(run_dir)))
    assert res.status == "completed" and all(h and f"pid {os.getpid()}" in h for h in seen)
    assert holder(res.run_dir) is None and not (res.run_dir / LOCK_FILE).exists()
    # an exception in a round releases it too
    prep = prepare_resume(res.run_dir)
    assert prep.lock is not None and prep.lock.held
    prep.lock.release()
    def broken(job):
        raise RuntimeError("engine fault")

    monkeypatch.setitem(engines.ENGINES, "vectorized", broken)
    prep = prepare_start(tiny_config(*SMALL), out=tmp_path / "boom")
    with pytest.raises(RuntimeError, match="engine fault"):
        train_prepared(prep)
    assert holder(tmp_path / "boom") is None and not prep.lock.held


def test_resume_while_another_process_trains_exits_2_and_changes_nothing(tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "paused"
    args = [*SMALL, "train.rounds=5"]
    proc = start_paused(2, marker, run, *args)
    try:
        wait_paused(proc, marker, "the run never reached round 2")
        before = (run / "metrics.csv").read_bytes()
        assert linattn_main(["run", "--resume", str(run)]) == 2
        err = capsys.readouterr().err
        assert f"is in use by pid {proc.pid} on {socket.gethostname()}" in err, err
        assert (run / "metrics.csv").read_bytes() == before  # not truncated, not appended
        proc.send_signal(signal.SIGKILL)  # crash: the lock is now stale
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert linattn_main(["run", "--resume", str(run)]) == 0
    whole = start_run(tiny_config(*args), out=tmp_path / "whole")
    assert (run / "metrics.csv").read_bytes() == (whole.run_dir / "metrics.csv").read_bytes()
    rows = rounds_of(run / "metrics.csv")
    assert len(rows) == len(set(rows))  # no round written twice


def test_two_resumes_started_together_never_duplicate_rounds(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config(*SMALL, "train.rounds=40", "run.checkpoint_every=1")
    with pytest.raises(_Stop):  # rounds 1-2 written, as if killed in round 3
        start_run(cfg, out=run, on_round_end=_stop_after(2))
    procs = [subprocess.Popen(cli_command("run", "--resume", str(run)), cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes in ([0, 2], [0, 0]), results  # [0, 0]: the second came after the first ended
    if codes == [0, 2]:
        assert "is in use by pid" in next(err for code, err in results if code == 2)
    rows = rounds_of(run / "metrics.csv")
    assert len(rows) == len(set(rows)) and max(int(r[0]) for r in rows) == 40


class _Stop(Exception):
    pass


def _stop_after(last: int):
    def hook(rnd: int, run_dir: Path) -> None:
        if rnd > last:
            raise _Stop

    return hook

