"""Faults of the machine and of a run's files: one-line errors, nothing half-written.

Disk full (at the start and in the middle of a run), a read-only output folder, corrupt
checkpoints, a garbled ``metrics.csv``, non-UTF-8 files, corrupt data files, a run that
diverges before its first checkpoint, and sizes that cannot fit in memory. Disk full and
read-only use a small tmpfs mounted for the test, which needs root (skipped otherwise; the
read-only case then uses a folder without write permission).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TINY, tiny_config

from linattn.cli import OS_FIXES, os_error_line
from linattn.cli import main as linattn_main
from linattn.errors import DataError
from real_data import engines
from real_data.lock import LOCK_FILE, holder
from real_data.runs import resume_run, start_run

SMALL = [*TINY, "train.rounds=4", "partition.num_clients=3", "algorithm.warmup_rounds=2"]
RUN = ["run", "--config", "digits_vit", *SMALL]


@contextlib.contextmanager
def tmpfs(path: Path, size: str, readonly: bool = False):
    """A tmpfs of ``size`` mounted at ``path`` for the duration (root only, else skip)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    opts = f"size={size}" + (",ro" if readonly else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> Path:
    """Write zeros into ``folder`` until its file system is full; returns the filler."""
    filler = folder / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def strays(folder: Path) -> list[Path]:
    """Temporary files of atomic writes (``.<name>.XXXX<suffix>``) left under ``folder``."""
    return [p for p in folder.rglob(".*") if p.name != LOCK_FILE]


def test_disk_full_at_start_exits_1_and_leaves_nothing(tmp_path, capsys):
    with tmpfs(tmp_path / "fs", "8k") as fs:
        code = linattn_main([*RUN, "--out", str(fs / "run")])
        line = one_error_line(capsys.readouterr().err)
        assert code == 1 and "No space left on device" in line and "disk is full" in line
        assert "nothing was kept" in line
        assert not (fs / "run").exists() and not strays(fs)


def test_disk_full_mid_run_keeps_the_last_checkpoint(tmp_path, capsys):
    with tmpfs(tmp_path / "fs", "2m") as fs:
        run, filler = fs / "run", []

        def hook(rnd: int, run_dir: Path) -> None:  # after round 2's rows, before its .pt
            if rnd == 2:
                filler.append(fill(fs))

        with pytest.raises(OSError) as info:
            start_run(tiny_config(*SMALL), out=run, on_round_end=hook)
        exc = info.value
        assert exc.errno == errno.ENOSPC and exc.filename == str(run / "checkpoints" / "last.pt")
        assert any("linattn run --resume" in note for note in exc.__notes__)
        saved = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
        assert saved["round"] == 1  # the previous checkpoint, whole
        assert not strays(fs) and holder(run) is None
        # resuming on the full disk: one line, exit 1
        assert linattn_main(["run", "--resume", str(run)]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert "No space left on device" in line and str(run) in line
        filler[0].unlink()
        assert linattn_main(["run", "--resume", str(run)]) == 0
        whole = start_run(tiny_config(*SMALL), out=tmp_path / "whole")
        assert (run / "metrics.csv").read_bytes() == \
            (whole.run_dir / "metrics.csv").read_bytes()
        assert not strays(fs)


def test_read_only_output_folder_exits_1(tmp_path, capsys):
    if os.geteuid() == 0:
        ctx = tmpfs(tmp_path / "ro", "1m", readonly=True)
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        ctx = contextlib.nullcontext(tmp_path / "ro")
    with ctx as ro:
        code = linattn_main([*RUN, "--out", str(ro / "run")])
        line = one_error_line(capsys.readouterr().err)
        assert code == 1 and str(ro / "run") in line
        assert "Read-only file system" in line or "Permission denied" in line
        assert not (ro / "run").exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return start_run(tiny_config(*SMALL), out=tmp_path_factory.mktemp("f") / "run").run_dir


def _copy(run: Path, dest: Path) -> Path:
    subprocess.run(["cp", "-a", str(run), str(dest)], check=True)
    return dest


@pytest.mark.parametrize("damage, text", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
     "not a readable checkpoint"),
    (lambda p: p.write_bytes(os.urandom(2048)), "not a readable checkpoint"),
    (lambda p: torch.save({"weights": torch.zeros(3)}, p), "not a linattn checkpoint"),
])
def test_corrupt_checkpoint_on_resume_exits_2(finished, tmp_path, capsys, damage, text):
    run = _copy(finished, tmp_path / "run")
    (run / "summary.json").unlink()
    damage(run / "checkpoints" / "last.pt")
    before = (run / "metrics.csv").read_bytes()
    assert linattn_main(["run", "--resume", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(run / "checkpoints" / "last.pt") in line and text in line and "move it away" in line
    assert (run / "metrics.csv").read_bytes() == before and holder(run) is None


@pytest.mark.parametrize("damage, text", [
    (lambda t: t.replace("\n2,global,", "\n2,glo\x00bal\n#?!garbage,global,", 1), "line"),
    (lambda t: "garbage header\n" + t.split("\n", 1)[1], "header"),
])
def test_garbled_metrics_on_resume_exits_2(finished, tmp_path, capsys, damage, text):
    run = _copy(finished, tmp_path / "run")
    metrics = run / "metrics.csv"
    metrics.write_text(damage(metrics.read_text()))
    assert linattn_main(["run", "--resume", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(metrics) in line and text in line


def test_non_utf8_files_name_themselves(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    for path, argv in [
        (run / "config.yaml", ["run", "--resume", str(run)]),
        (run / "metrics.csv", ["run", "--resume", str(run)]),
        (tmp_path / "c.yaml", ["run", "--config", str(tmp_path / "c.yaml")]),
        (tmp_path / "plan.yaml", ["study", "--plan", str(tmp_path / "plan.yaml"), "--list"]),
        (tmp_path / "sim.yaml", ["simulate", "run", "--config", str(tmp_path / "sim.yaml"),
                                 "--out", str(tmp_path / "sim")]),
        (tmp_path / "p.yaml", ["warmup", "--problem", str(tmp_path / "p.yaml"), "--lr", "0.1",
                               "--local-steps", "2"]),
    ]:
        original = path.read_bytes() if path.exists() else b"name: x\n"
        path.write_bytes(original[:5] + b"\xff\xfe" + original[5:])
        assert linattn_main(argv) == 2, path
        line = one_error_line(capsys.readouterr().err)
        assert str(path) in line and "UTF-8" in line, line
        path.write_bytes(original)
    assert not (tmp_path / "sim").exists()


def test_resumed_config_that_is_not_a_mapping_names_the_file(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    (run / "config.yaml").write_text("- just\n- a list\n")
    assert linattn_main(["run", "--resume", str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(run / "config.yaml") in line and "mapping" in line


def test_nan_in_round_1_names_no_checkpoint(tmp_path, monkeypatch, capsys):
    real = engines.ENGINES["vectorized"]

    def poisoned(job):
        res = real(job)
        res.objective[0] = float("nan")
        return res

    monkeypatch.setitem(engines.ENGINES, "vectorized", poisoned)
    assert linattn_main([*RUN, "--out", str(tmp_path / "nan")]) == 1
    err = capsys.readouterr().err
    assert "round 1" in err and "no checkpoint was written" in err and "train.lr" in err
    assert "round 0" not in err and not (tmp_path / "nan" / "checkpoints" / "last.pt").exists()


def test_memory_that_cannot_fit_is_refused(tmp_path, capsys):
    out = tmp_path / "runs"
    code = linattn_main([*RUN, f"run.out_dir={out}", "train.batch_size=1000000000"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and "train.batch_size" in line and "GiB" in line and not out.exists()


def test_corrupt_fmnist_files_name_the_fix(tmp_path):
    from real_data.data import load_dataset

    folder = tmp_path / "fmnist"
    folder.mkdir()
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")
    for name in names:  # truncated gzip
        (folder / f"{name}.gz").write_bytes(gzip.compress(b"\0" * 4096)[:40])
    with pytest.raises(DataError, match="linattn data fetch fmnist"):
        load_dataset("fmnist", root=tmp_path)
    for name in names:  # whole files, not IDX
        (folder / f"{name}.gz").unlink()
        (folder / name).write_bytes(b"\x01\x02garbage" * 10)
    with pytest.raises(DataError, match="linattn data fetch fmnist") as info:
        load_dataset("fmnist", root=tmp_path)
    assert "corrupt" in str(info.value)
    with pytest.raises(DataError, match="linattn data fetch fmnist"):
        load_dataset("fmnist", root=tmp_path, verify=False)


def test_os_errors_become_one_line_with_the_fix():
    for code in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        exc = OSError(code, os.strerror(code), "/data/run/metrics.csv")
        exc.add_note("once fixed, continue with `linattn run --resume /data/run`")
        status, line = os_error_line(exc)
        assert status == 1 and line.startswith(f"/data/run/metrics.csv: {os.strerror(code)}; ")
        assert OS_FIXES[code][1] in line and line.endswith("--resume /data/run`")
        assert "\n" not in line
    assert os_error_line(IsADirectoryError(errno.EISDIR, "Is a directory", "/x"))[0] == 2


def test_resume_of_a_completed_run_keeps_it_and_releases(finished, tmp_path):
    run = _copy(finished, tmp_path / "run")
    before = (run / "metrics.csv").read_bytes()
    res = resume_run(run)
    assert res.status == "completed" and (run / "metrics.csv").read_bytes() == before
    assert holder(run) is None
