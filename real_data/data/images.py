"""Image data sets as tensors: Fashion-MNIST and MNIST (IDX), CIFAR-10/100 (python pickles),
and scikit-learn's 8x8 digits.

Images come out float32 ``(N, C, H, W)``, scaled to [0, 1] and then standardized with the data
set's own training-set mean and standard deviation (pinned below, so a ``train_limit`` slice is
normalized exactly like the full set); labels come out int64 ``(N,)``.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import torch

from linattn.errors import DataError
from real_data.data.base import TensorDataset
from real_data.data.store import corrupt, read_verified, source

# Mean and std of the training pixels in [0, 1], measured on the full training sets.
NORMALIZATION = {
    "fmnist": ((0.2860406,), (0.3530242,)),
    "mnist": ((0.1306605,), (0.3081078,)),
    "cifar10": ((0.49139968, 0.48215827, 0.44653124), (0.24703233, 0.24348505, 0.26158768)),
    "cifar100": ((0.50707516, 0.48654887, 0.44091784), (0.26733429, 0.25643846, 0.27615047)),
}

# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FORMAT").
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Decode one IDX file: magic ``00 00 TYPE NDIM``, NDIM big-endian uint32 sizes, the data.

    Raises
    ------
    DataError
        Naming ``name`` if the header is malformed or the payload length does not match it.
    """
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{name}: not an IDX file (the magic number must start with 00 00)")
    dtype_code, ndim = data[2], data[3]
    if dtype_code not in _IDX_DTYPES:
        raise DataError(f"{name}: unknown IDX type byte 0x{dtype_code:02x}")
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise DataError(f"{name}: truncated IDX header ({ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_DTYPES[dtype_code])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise DataError(f"{name}: IDX header says {shape} ({expected} bytes) but the file has "
                        f"{len(data)} bytes")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def _standardize(images: np.ndarray, name: str) -> torch.Tensor:
    """uint8 ``(N, C, H, W)`` -> float32, scaled to [0, 1], minus mean, over std per channel."""
    mean, std = (np.asarray(v, np.float32).reshape(1, -1, 1, 1) for v in NORMALIZATION[name])
    x = images.astype(np.float32) / 255.0
    return torch.from_numpy((x - mean) / std)


def _limit(n: int | None, key: str) -> int | None:
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise DataError(f"{key} must be a positive integer (got {n!r})")
    return n


def load_idx_dataset(name: str, root: str | os.PathLike | None = None, *,
                     train_limit: int | None = None, test_limit: int | None = None,
                     verify: bool = True) -> TensorDataset:
    """Fashion-MNIST (``name="fmnist"``) or MNIST (``"mnist"``): 60k/10k 28x28 grey images.

    ``train_limit``/``test_limit`` keep the first n samples of each split (the files are
    already shuffled), for tests and quick runs.
    """
    src = source(name)
    train_limit, test_limit = _limit(train_limit, "train_limit"), _limit(test_limit, "test_limit")
    arrays = {}
    for file in src.files:
        data = read_verified(src, file, root, verify)
        try:
            arrays[file.name] = parse_idx(data, f"{name}: {file.name}")
        except DataError as exc:
            raise corrupt(src, exc) from None
    splits = []
    for prefix, limit in (("train", train_limit), ("t10k", test_limit)):
        images = arrays[f"{prefix}-images-idx3-ubyte"]
        labels = arrays[f"{prefix}-labels-idx1-ubyte"]
        if images.ndim != 3 or len(images) != len(labels):
            raise corrupt(src, DataError(f"{name}: {prefix} images {images.shape} and labels "
                                         f"{labels.shape} do not match"))
        images, labels = images[:limit], labels[:limit]
        splits.append((_standardize(images[:, None], name),
                       torch.from_numpy(labels.astype(np.int64))))
    (x_train, y_train), (x_test, y_test) = splits
    return TensorDataset(name, "image", x_train, y_train, x_test, y_test, num_classes=10)


def load_fmnist(root=None, *, train_limit=None, test_limit=None, verify=True) -> TensorDataset:
    """Fashion-MNIST; see ``load_idx_dataset``."""
    return load_idx_dataset("fmnist", root, train_limit=train_limit, test_limit=test_limit,
                            verify=verify)


def load_mnist(root=None, *, train_limit=None, test_limit=None, verify=True) -> TensorDataset:
    """MNIST; see ``load_idx_dataset``."""
    return load_idx_dataset("mnist", root, train_limit=train_limit, test_limit=test_limit,
                            verify=verify)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists and numpy arrays only: a batch file cannot run code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def parse_cifar_batch(data: bytes, name: str = "<bytes>",
                      label_key: str = "labels") -> tuple[np.ndarray, np.ndarray]:
    """Decode one CIFAR python-pickle batch into uint8 ``(N, 3, 32, 32)`` and int64 ``(N,)``.

    A batch is a pickled dict with ``data`` (uint8 ``(N, 3072)``: 1024 red, then green, then
    blue values, row-major) and ``labels`` (CIFAR-10) or ``fine_labels`` (CIFAR-100).
    """
    try:
        batch = _ArrayUnpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise DataError(f"{name}: not a CIFAR python-pickle batch ({exc})") from exc
    if not isinstance(batch, dict):
        raise DataError(f"{name}: expected a pickled dict, got {type(batch).__name__}")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    for key in ("data", label_key):
        if key not in batch:
            raise DataError(f"{name}: missing key {key!r} (has {sorted(batch)})")
    images = np.asarray(batch["data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if images.dtype != np.uint8 or images.ndim != 2 or images.shape[1] != 3 * 32 * 32:
        raise DataError(f"{name}: 'data' must be uint8 (N, 3072), got {images.dtype} "
                        f"{images.shape}")
    if labels.shape != (len(images),):
        raise DataError(f"{name}: {len(images)} images but {labels.shape} labels")
    return images.reshape(-1, 3, 32, 32), labels


def load_cifar(name: str, root: str | os.PathLike | None = None, *,
               train_limit: int | None = None, test_limit: int | None = None,
               verify: bool = True) -> TensorDataset:
    """CIFAR-10 (``"cifar10"``, 50k/10k, 10 classes) or CIFAR-100 (``"cifar100"``, fine labels).

    The files are the standard python-pickle batches, which no package registry ships: download
    ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz`` from
    https://www.cs.toronto.edu/~kriz/cifar.html and run
    ``linattn data fetch cifar10 --from /path/to/cifar-10-python.tar.gz``.
    """
    src = source(name)
    train_limit, test_limit = _limit(train_limit, "train_limit"), _limit(test_limit, "test_limit")
    label_key = "labels" if name == "cifar10" else "fine_labels"
    parts: dict[str, list] = {"train": [], "test": []}
    for file in src.files:
        split = "test" if file.name.endswith("test_batch") or file.name.endswith("/test") \
            else "train"
        data = read_verified(src, file, root, verify)
        try:
            parts[split].append(parse_cifar_batch(data, f"{name}: {file.name}", label_key))
        except DataError as exc:
            raise corrupt(src, exc) from None
    out = []
    for split, limit in (("train", train_limit), ("test", test_limit)):
        images = np.concatenate([p[0] for p in parts[split]])[:limit]
        labels = np.concatenate([p[1] for p in parts[split]])[:limit]
        out += [_standardize(images, name), torch.from_numpy(labels)]
    return TensorDataset(name, "image", *out, num_classes=10 if name == "cifar10" else 100)


def load_cifar10(root=None, *, train_limit=None, test_limit=None, verify=True) -> TensorDataset:
    """CIFAR-10; see ``load_cifar``."""
    return load_cifar("cifar10", root, train_limit=train_limit, test_limit=test_limit,
                      verify=verify)


def load_cifar100(root=None, *, train_limit=None, test_limit=None, verify=True) -> TensorDataset:
    """CIFAR-100 with its 100 fine labels; see ``load_cifar``."""
    return load_cifar("cifar100", root, train_limit=train_limit, test_limit=test_limit,
                      verify=verify)


def stratified_split(labels: np.ndarray, test_fraction: float,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices with ``round(test_fraction * n_c)`` test samples per class."""
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1) (got {test_fraction!r})")
    rng = np.random.default_rng(seed)
    test = []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        test.append(members[: int(round(test_fraction * len(members)))])
    test = np.sort(np.concatenate(test))
    train = np.setdiff1d(np.arange(len(labels)), test)
    return train, test


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (1797, 64) pixels and int64 labels.

    Read from the CSV that scikit-learn ships (what ``sklearn.datasets.load_digits`` parses),
    which avoids importing scikit-learn (seconds on a small CPU).
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("digits ships with scikit-learn: run `pip install scikit-learn` "
                        "(or install linattn[dev])")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    return bunch.data, bunch.target.astype(np.int64)


def load_digits(root=None, *, test_fraction: float = 0.2, seed: int = 0,
                train_limit: int | None = None, test_limit: int | None = None) -> TensorDataset:
    """scikit-learn's 1,797 8x8 digits as ``(N, 1, 8, 8)``; a stratified split, fixed by ``seed``.

    With the defaults: 1,438 train and 359 test images, 10 classes. Pixels (0..16) are scaled
    to [0, 1] and standardized with the training split's mean and std. ``root`` is unused (the
    data ship with scikit-learn).
    """
    train_limit, test_limit = _limit(train_limit, "train_limit"), _limit(test_limit, "test_limit")
    pixels, labels = _digits_arrays()
    images = (pixels.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    train, test = stratified_split(labels, test_fraction, seed)
    mean, std = images[train].mean(), images[train].std()
    train, test = train[:train_limit], test[:test_limit]
    x = (images - mean) / std
    return TensorDataset("digits", "image", torch.from_numpy(x[train]),
                         torch.from_numpy(labels[train]), torch.from_numpy(x[test]),
                         torch.from_numpy(labels[test]), num_classes=10)
