"""IDX and CIFAR python-pickle parsing on small files written here, and the digits loader."""

from __future__ import annotations

import gzip
import lzma
import pickle
import struct
import tarfile

import numpy as np
import pytest
import torch

from linattn.errors import DataError
from real_data.data import store
from real_data.data.datasets import load_dataset
from real_data.data.fetchers import fetch
from real_data.data.images import NORMALIZATION, parse_cifar_batch, parse_idx


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    """An IDX file: 00 00 TYPE NDIM, big-endian sizes, big-endian data."""
    dtype = {0x08: ">u1", 0x0B: ">i2", 0x0D: ">f4"}[code]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(dtype).tobytes()


def test_parse_idx_types_and_shapes():
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    np.testing.assert_array_equal(parse_idx(idx_bytes(images)), images)
    shorts = np.array([-2, 300, 7], dtype=np.int16)
    np.testing.assert_array_equal(parse_idx(idx_bytes(shorts, 0x0B)), shorts)
    floats = np.array([[1.5, -2.25]], dtype=np.float32)
    out = parse_idx(idx_bytes(floats, 0x0D))
    assert out.dtype == np.float32 and out.dtype.isnative
    np.testing.assert_array_equal(out, floats)


@pytest.mark.parametrize("data, message", [
    (b"\x01\x00\x08\x01", "not an IDX file"),
    (b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", "unknown IDX type"),
    (b"\x00\x00\x08\x03\x00\x00", "truncated IDX header"),
    (bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]),
     r"IDX header says \(5,\) \(13 bytes\) but the file has 10"),
])
def test_parse_idx_rejects_bad_files_naming_them(data, message):
    with pytest.raises(DataError, match=f"^train-x: {message}"):
        parse_idx(data, "train-x")


def write_idx_set(folder, n_train=12, n_test=5, encoding=""):
    """A tiny MNIST-like set; returns {name: sha256 of the raw bytes} and the arrays."""
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    digests = {}
    compress = {"": lambda b: b, ".gz": gzip.compress, ".xz": lzma.compress}[encoding]
    for name, array in arrays.items():
        raw = idx_bytes(array)
        digests[name] = store.digest(raw)
        (folder / (name + encoding)).write_bytes(compress(raw))
    return digests, arrays


def pin(monkeypatch, name, digests, algorithm="sha256"):
    """Point the pinned checksums of ``name`` at the test files."""
    old = store.SOURCES[name]
    files = tuple(store.DataFile(f.name, digests[f.name], algorithm) for f in old.files)
    monkeypatch.setitem(store.SOURCES, name, store.DataSource(name, files, old.origin,
                                                              old.archive))


@pytest.mark.parametrize("encoding", ["", ".gz", ".xz"])
def test_idx_loader_reads_raw_gz_xz_and_normalizes(tmp_path, monkeypatch, encoding):
    digests, arrays = write_idx_set(tmp_path / "mnist", encoding=encoding)
    pin(monkeypatch, "mnist", digests)
    d = load_dataset("mnist", tmp_path)
    assert d.task == "image" and d.num_classes == 10
    assert d.x_train.shape == (12, 1, 28, 28) and d.x_train.dtype == torch.float32
    assert d.y_test.dtype == torch.int64 and d.y_test.tolist() == arrays[
        "t10k-labels-idx1-ubyte"].tolist()
    (mean,), (std,) = NORMALIZATION["mnist"]
    expected = (arrays["train-images-idx3-ubyte"][3] / 255.0 - mean) / std
    np.testing.assert_allclose(d.x_train[3, 0].numpy(), expected, rtol=1e-5, atol=1e-5)
    small = load_dataset("mnist", tmp_path, train_limit=4, test_limit=2)
    assert len(small.x_train) == 4 and len(small.y_test) == 2
    torch.testing.assert_close(small.x_train, d.x_train[:4])


def test_idx_loader_missing_and_corrupt_files_name_file_and_fix(tmp_path, monkeypatch):
    digests, _ = write_idx_set(tmp_path / "fmnist", encoding=".gz")
    pin(monkeypatch, "fmnist", digests)
    (tmp_path / "fmnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte.*missing.*"
                                        r"`linattn data fetch fmnist`"):
        load_dataset("fmnist", tmp_path)
    write_idx_set(tmp_path / "fmnist", encoding=".gz")
    path = tmp_path / "fmnist" / "train-images-idx3-ubyte.gz"
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[-1] ^= 0xFF
    path.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte.gz is corrupt.*"
                                        r"`linattn data fetch fmnist`"):
        load_dataset("fmnist", tmp_path)
    path.write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(DataError, match="cannot read .*train-images-idx3-ubyte.gz"):
        load_dataset("fmnist", tmp_path)


def cifar_batch(n: int, label_key: str, seed: int, protocol: int) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, n).tolist()
    batch = {b"batch_label": b"testing batch", label_key.encode(): labels, b"data": data}
    return pickle.dumps(batch, protocol=protocol), data


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_parse_cifar_batch_layout(protocol):
    raw, data = cifar_batch(4, "labels", 0, protocol)
    images, labels = parse_cifar_batch(raw, "data_batch_1")
    assert images.shape == (4, 3, 32, 32) and labels.dtype == np.int64
    # channel planes: the first 1024 values are red, row-major
    np.testing.assert_array_equal(images[2, 0].ravel(), data[2, :1024])
    np.testing.assert_array_equal(images[2, 2, 31], data[2, 3072 - 32:])


def test_parse_cifar_batch_rejects_bad_and_unsafe_pickles():
    with pytest.raises(DataError, match="data_batch_9: missing key 'labels'"):
        parse_cifar_batch(pickle.dumps({"data": np.zeros((1, 3072), np.uint8)}), "data_batch_9")
    with pytest.raises(DataError, match=r"'data' must be uint8 \(N, 3072\)"):
        parse_cifar_batch(pickle.dumps({"data": np.zeros((1, 10), np.uint8), "labels": [1]}))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(DataError, match="refusing to load builtins.print"):
        parse_cifar_batch(pickle.dumps({"data": Evil(), "labels": []}), "evil")


def write_cifar(folder, name: str, protocol: int = 2) -> dict:
    """CIFAR-10 (5 train batches of 3 + a test batch of 2) or CIFAR-100 (train 6, test 2)."""
    digests = {}
    if name == "cifar10":
        files = [(f"cifar-10-batches-py/data_batch_{i}", 3, "labels") for i in range(1, 6)]
        files.append(("cifar-10-batches-py/test_batch", 2, "labels"))
    else:
        files = [("cifar-100-python/train", 6, "fine_labels"),
                 ("cifar-100-python/test", 2, "fine_labels")]
    for seed, (rel, n, key) in enumerate(files):
        raw, _ = cifar_batch(n, key, seed, protocol)
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(raw)
        digests[rel] = store.digest(raw, "md5")
    return digests


@pytest.mark.parametrize("name, n_train, classes", [("cifar10", 15, 10), ("cifar100", 6, 100)])
def test_cifar_loader_on_written_batches(tmp_path, monkeypatch, name, n_train, classes):
    digests = write_cifar(tmp_path / name, name)
    pin(monkeypatch, name, digests, "md5")
    d = load_dataset(name, tmp_path)
    assert d.x_train.shape == (n_train, 3, 32, 32) and d.x_test.shape == (2, 3, 32, 32)
    assert d.num_classes == classes and d.y_train.dtype == torch.int64
    assert load_dataset(name, tmp_path, train_limit=4).x_train.shape[0] == 4


def test_cifar_missing_error_says_where_to_get_it(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", tmp_path)
    text = str(info.value)
    assert "cifar-10-batches-py/data_batch_1" in text
    assert "https://www.cs.toronto.edu/~kriz/cifar.html" in text
    assert "linattn data fetch cifar10 --from /path/to/cifar-10-python.tar.gz" in text
    with pytest.raises(DataError, match="is on no package registry"):
        fetch("cifar100", tmp_path, log=lambda s: None)


def test_cifar_import_from_archive_checks_md5(tmp_path, monkeypatch):
    src = tmp_path / "src"
    digests = write_cifar(src, "cifar10")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    pin(monkeypatch, "cifar10", digests, "md5")
    with pytest.raises(DataError, match="differs from the published"):
        fetch("cifar10", tmp_path / "cache", from_path=archive, log=lambda s: None)
    old = store.SOURCES["cifar10"]
    monkeypatch.setitem(store.SOURCES, "cifar10", store.DataSource(
        "cifar10", old.files, old.origin, (archive.name, store.digest(archive.read_bytes(),
                                                                      "md5"))))
    fetch("cifar10", tmp_path / "cache", from_path=archive, log=lambda s: None)
    assert load_dataset("cifar10", tmp_path / "cache").x_train.shape == (15, 3, 32, 32)
    fetch("cifar10", tmp_path / "cache2", from_path=src, log=lambda s: None)  # a folder works
    assert load_dataset("cifar10", tmp_path / "cache2").x_test.shape == (2, 3, 32, 32)


def test_digits_split_is_stratified_deterministic_and_normalized():
    d = load_dataset("digits")
    assert d.x_train.shape == (1438, 1, 8, 8) and d.x_test.shape == (359, 1, 8, 8)
    counts_tr, counts_te = np.bincount(d.y_train.numpy()), np.bincount(d.y_test.numpy())
    np.testing.assert_allclose(counts_te / (counts_tr + counts_te), 0.2, atol=0.011)
    assert abs(float(d.x_train.mean())) < 1e-5 and abs(float(d.x_train.std()) - 1) < 1e-3
    again = load_dataset("digits")
    torch.testing.assert_close(again.x_test, d.x_test, rtol=0, atol=0)
    other = load_dataset("digits", seed=1)
    assert not torch.equal(other.y_test, d.y_test)
    assert load_dataset("digits", train_limit=100).x_train.shape[0] == 100


def test_registry_errors():
    with pytest.raises(DataError, match="valid names: fmnist, mnist, digits, cifar10"):
        load_dataset("imagenet")
    with pytest.raises(DataError, match="unknown option.*shuffle.*valid options: train_limit"):
        load_dataset("fmnist", shuffle=True)
    with pytest.raises(DataError, match="train_limit must be a positive integer"):
        load_dataset("digits", train_limit=0)
    with pytest.raises(DataError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.5)
