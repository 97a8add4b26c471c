"""Unfinished run groups carried to another machine, so that a killed call's progress resumes.

A time-limited GPU call (``scripts/gpu_study.sh``) kills its workers at the limit; the runs of
the stacked groups still in flight keep their last checkpoint, and the next call on the same
machine resumes them. A machine handed back loses them: :func:`pack_partial` archives every
T0 family (or single run) that has started and is not finished, each run directory whole (the
files a resume reads: ``checkpoints/last.pt`` with its RNG states, the T0 snapshots the
branches fork from, ``metrics.csv`` with its client rows, the partition), the lock file
excepted. :func:`restore_partial` puts them back into another machine's ``out_dir``, where the
study resumes them to the same result as an uninterrupted group (a killed group resumes
exactly; here its files only change machine).

A family is restored whole, replacing what ``out_dir`` holds of it (a ``--markers`` or
``--pack`` copy of a finished member keeps no full checkpoint for its branches), except where
this machine has state of its own that is at least as new: a member trained here
(``checkpoints/last.pt`` present) or every member finished (finished elsewhere, say, and
marked).
"""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from linattn.errors import DataError
from linattn.fileio import atomic_path
from real_data.lock import LOCK_FILE
from real_data.study.plan import Plan, stage_runs
from real_data.study.runner import FINAL, families, run_status

__all__ = ["pack_partial", "restore_partial"]


def _started_unfinished(members) -> bool:
    status = [run_status(m.run_dir) for m in members]
    return any(s != "missing" for s in status) and not all(s in FINAL for s in status)


def pack_partial(plans: Plan | list[Plan], dest: Path) -> dict:
    """Write ``dest`` (.tar.gz) with the whole run directories of every started, unfinished
    family of ``plans`` (a plan, or the tuning and final plans of one study); returns
    ``{"families", "runs", "bytes"}`` (bytes before compression)."""
    dest = Path(dest)
    out_dir, specs = stage_runs(plans)
    counts = {"families": 0, "runs": 0, "bytes": 0}
    with atomic_path(dest) as tmp, tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        for members in families(specs):
            if not _started_unfinished(members):
                continue
            counts["families"] += 1
            for m in members:
                if not m.run_dir.is_dir():
                    continue
                counts["runs"] += 1
                rel = m.run_dir.relative_to(out_dir).as_posix()
                for path in sorted(m.run_dir.rglob("*")):
                    if path.is_file() and path.name != LOCK_FILE:
                        tar.add(path, arcname=f"{rel}/{path.relative_to(m.run_dir).as_posix()}",
                                recursive=False)
                        counts["bytes"] += path.stat().st_size
    return counts


def _member_files(tar: tarfile.TarFile, archive: Path, runs: dict) -> tuple[dict, int]:
    """The archive's regular files by the run directory (key: path under out_dir) they belong
    to, and how many belong to no run of ``runs`` (another stage's runs, say); anything but a
    plain file under a relative path (a link, an absolute or parent path) is refused before a
    file is written."""
    by_run: dict[str, list] = {}
    other = 0
    for info in tar.getmembers():
        if info.isdir():
            continue
        name = PurePosixPath(info.name)
        if not info.isfile() or name.is_absolute() or ".." in name.parts:
            raise DataError(f"{archive}: member {info.name!r} is not a plain file under the "
                            "plan's out_dir; pass an archive written by `linattn study "
                            "--pack-partial`")
        owner = next((str(p) for p in name.parents if str(p) in runs), None)
        if owner is None:
            other += 1
        else:
            by_run.setdefault(owner, []).append(info)
    return by_run, other


def restore_partial(plans: Plan | list[Plan], archive: Path) -> dict:
    """Put the families of a :func:`pack_partial` archive into the out_dir of ``plans`` (a
    plan, or the stages of one study; see the module docstring for what is kept instead);
    returns ``{"restored", "kept"}`` counted in runs and ``other``, the archive's files of no
    run of ``plans`` (left out). Each run
    directory is written beside its place and then swapped in, so a kill leaves the old
    directory or the new one (or none, which a later restore fills)."""
    archive = Path(archive)
    out_dir, specs = stage_runs(plans)
    runs = {s.run_dir.relative_to(out_dir).as_posix(): s for s in specs}
    try:
        tar = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as exc:
        raise DataError(f"{archive}: not a readable --pack-partial archive ({exc}); "
                        "concatenate its .part files in order first") from exc
    with tar:
        by_run, other = _member_files(tar, archive, runs)
        counts = {"restored": 0, "kept": 0, "other": other}
        for members in families(specs):
            keys = [m.run_dir.relative_to(out_dir).as_posix() for m in members]
            packed = [k for k in keys if k in by_run]
            if not packed:
                continue
            here = [m.run_dir for m in members]
            if any((d / "checkpoints" / "last.pt").is_file() for d in here) \
                    or all(run_status(d) in FINAL for d in here):
                counts["kept"] += len(packed)
                continue
            for key in packed:
                run_dir = runs[key].run_dir
                tmp = run_dir.with_name(f".{run_dir.name}.restore")
                shutil.rmtree(tmp, ignore_errors=True)
                for info in by_run[key]:
                    target = tmp / PurePosixPath(info.name).relative_to(key)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(info) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    os.utime(target, (info.mtime, info.mtime))
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                tmp.rename(run_dir)
                counts["restored"] += 1
    return counts
