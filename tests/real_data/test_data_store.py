"""The cache: verification, atomic fetches, packing, ``linattn data list``; one real fetch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from linattn.errors import DataError
from real_data import data_cli
from real_data.data import fetchers as fetch_mod
from real_data.data import store
from real_data.data.datasets import load_dataset

REPO = Path(__file__).resolve().parents[2]
QUIET = {"log": lambda s: None}


def fake_mnist_files() -> dict[str, bytes]:
    """Four small IDX files under the MNIST names."""
    rng = np.random.default_rng(1)
    out = {}
    for prefix, n in (("train", 6), ("t10k", 3)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        out[f"{prefix}-images-idx3-ubyte"] = bytes([0, 0, 8, 3]) + np.array(
            [n, 28, 28], ">u4").tobytes() + images.tobytes()
        out[f"{prefix}-labels-idx1-ubyte"] = bytes([0, 0, 8, 1]) + np.array(
            [n], ">u4").tobytes() + labels.tobytes()
    return out


@pytest.fixture
def fake_mnist(monkeypatch):
    """Pin the MNIST checksums to small files and make ``fetch`` build them (no network)."""
    files = fake_mnist_files()
    old = store.SOURCES["mnist"]
    monkeypatch.setitem(store.SOURCES, "mnist", store.DataSource(
        "mnist", tuple(store.DataFile(n, store.digest(b)) for n, b in files.items()), old.origin))
    calls = []

    def build(work, out, log):
        calls.append(out)
        for name, data in files.items():
            (out / name).write_bytes(data)

    monkeypatch.setitem(fetch_mod._FETCHERS, "mnist", build)
    return files, calls


def test_fetch_verifies_installs_and_skips_when_present(tmp_path, fake_mnist):
    files, calls = fake_mnist
    target = fetch_mod.fetch("mnist", tmp_path, **QUIET)
    assert target == tmp_path / "mnist" and sorted(p.name for p in target.iterdir()) == sorted(
        files)
    assert len(calls) == 1 and not list(tmp_path.glob(".tmp-*"))
    fetch_mod.fetch("mnist", tmp_path, **QUIET)
    assert len(calls) == 1  # verified copy present: nothing fetched
    fetch_mod.fetch("mnist", tmp_path, force=True, **QUIET)
    assert len(calls) == 2
    assert load_dataset("mnist", tmp_path).x_train.shape == (6, 1, 28, 28)


def test_failed_or_corrupt_fetch_leaves_nothing_half_written(tmp_path, fake_mnist, monkeypatch):
    files, _ = fake_mnist

    def dies(work, out, log):
        (out / "train-images-idx3-ubyte").write_bytes(files["train-images-idx3-ubyte"][:100])
        raise KeyboardInterrupt  # as if the fetch were killed mid-way

    monkeypatch.setitem(fetch_mod._FETCHERS, "mnist", dies)
    with pytest.raises(KeyboardInterrupt):
        fetch_mod.fetch("mnist", tmp_path, **QUIET)
    assert not (tmp_path / "mnist").exists() and not list(tmp_path.glob(".tmp-*"))

    def wrong(work, out, log):
        for name, data in files.items():
            (out / name).write_bytes(data[:-1] + b"\x00")

    monkeypatch.setitem(fetch_mod._FETCHERS, "mnist", wrong)
    with pytest.raises(DataError, match="is corrupt"):
        fetch_mod.fetch("mnist", tmp_path, **QUIET)
    assert not (tmp_path / "mnist").exists()


def test_refetch_failure_keeps_the_old_copy_and_stale_tmp_is_removed(tmp_path, fake_mnist,
                                                                     monkeypatch):
    fetch_mod.fetch("mnist", tmp_path, **QUIET)
    stale = tmp_path / ".tmp-mnist-999999999"  # no such process
    stale.mkdir()

    def fails(work, out, log):
        raise DataError("registry unreachable")

    monkeypatch.setitem(fetch_mod._FETCHERS, "mnist", fails)
    with pytest.raises(DataError, match="registry unreachable"):
        fetch_mod.fetch("mnist", tmp_path, force=True, **QUIET)
    assert not stale.exists()
    assert {s.state for s in store.file_status(store.SOURCES["mnist"], tmp_path)} == {"verified"}


def test_pack_round_trip_through_xz(tmp_path, fake_mnist):
    fetch_mod.fetch("mnist", tmp_path / "cache", **QUIET)
    written = fetch_mod.pack("mnist", tmp_path / "carry", tmp_path / "cache", level=1, **QUIET)
    assert sorted(p.name for p in written) == sorted(f + ".xz" for f in fake_mnist[0])
    a = load_dataset("mnist", tmp_path / "cache")
    b = load_dataset("mnist", tmp_path / "carry")
    assert np.array_equal(a.x_train.numpy(), b.x_train.numpy())
    assert np.array_equal(a.y_test.numpy(), b.y_test.numpy())
    messages = []
    fetch_mod.pack("mnist", tmp_path / "carry", tmp_path / "cache", log=messages.append)
    assert all("already packed and verified" in m for m in messages)
    with pytest.raises(DataError, match="`linattn data fetch fmnist`"):
        fetch_mod.pack("fmnist", tmp_path / "carry", tmp_path / "cache", **QUIET)


def test_unknown_names(tmp_path):
    with pytest.raises(DataError, match="valid names: fmnist, mnist, shakespeare"):
        fetch_mod.fetch("svhn", tmp_path, **QUIET)
    messages = []
    fetch_mod.fetch("digits", tmp_path, log=messages.append)
    assert "nothing to fetch" in messages[0]


def test_list_reports_verified_corrupt_and_missing(tmp_path, fake_mnist, capsys):
    fetch_mod.fetch("mnist", tmp_path, **QUIET)
    assert data_cli.main(["data", "list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mnist        verified" in out and "fmnist       missing" in out
    assert "linattn data fetch fmnist" in out
    path = tmp_path / "mnist" / "t10k-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:-1] + b"\x09")
    data_cli.main(["data", "list", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert "mnist        corrupt" in out and str(path) in out and "linattn data fetch mnist" in out


def test_cli_list_on_an_empty_cache(tmp_path):
    """``python -m linattn data list`` through the real router, with nothing cached."""
    env = {**os.environ, "LINATTN_DATA": str(tmp_path / "empty"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "linattn", "data", "list"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"data root: {tmp_path / 'empty'}" in proc.stdout
    for name in ("fmnist", "mnist", "shakespeare", "cifar10", "cifar100"):
        assert f"linattn data fetch {name}" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "linattn", "data", "fetch", "svhn"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: no data source 'svhn'" in proc.stderr


def test_cli_partition_writes_file_and_plot(tmp_path, capsys):
    out = tmp_path / "p.npz"
    assert data_cli.main(["data", "partition", "digits", "--scheme", "dirichlet", "--clients",
                          "5", "--seed", "1", "-p", "alpha=0.3", "--out", str(out), "--plot",
                          str(tmp_path / "p.png")]) == 0
    assert out.is_file() and (tmp_path / "p.png").is_file()
    assert "5 clients" in capsys.readouterr().out
    with pytest.raises(DataError, match="KEY=VALUE"):
        data_cli.main(["data", "partition", "digits", "--scheme", "iid", "--clients", "2",
                       "-p", "alpha", "--out", str(out)])


@pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
                    reason="needs apt-get and dpkg-deb (a Debian-family machine)")
@pytest.mark.skipif(os.environ.get("LINATTN_SKIP_NETWORK") == "1", reason="LINATTN_SKIP_NETWORK=1")
def test_real_fmnist_fetch_from_the_debian_registry(tmp_path, monkeypatch):
    """The real fetch (private apt lists, no root needed): ~10 s, 31 MB."""
    monkeypatch.setattr(fetch_mod, "FMNIST_SYSTEM_DIR", tmp_path / "no-system-copy")
    start = time.perf_counter()
    fetch_mod.fetch("fmnist", tmp_path, **QUIET)
    elapsed = time.perf_counter() - start
    assert {s.state for s in store.file_status(store.SOURCES["fmnist"], tmp_path)} == {"verified"}
    d = load_dataset("fmnist", tmp_path, train_limit=500, test_limit=100)
    assert d.x_train.shape == (500, 1, 28, 28) and d.y_train[:5].tolist() == [9, 0, 0, 3, 0]
    assert elapsed < 300
