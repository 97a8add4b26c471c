"""Partition invariants: disjoint, covering, deterministic, label skew, local test splits, I/O."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.errors import DataError
from real_data.data.base import TensorDataset
from real_data.data.partition import (
    label_counts,
    label_skew,
    local_test_indices,
    make_partition,
    split_classes,
    split_dirichlet,
    split_iid,
)
from real_data.data.partition_io import (
    check_partition,
    load_partition,
    plot_partition,
    save_partition,
)


def synthetic(n_train: int = 2000, n_test: int = 500, num_classes: int = 10,
              seed: int = 0) -> TensorDataset:
    """Balanced labels, features irrelevant to partitioning."""
    rng = np.random.default_rng(seed)
    y_train = torch.from_numpy(rng.permutation(np.arange(n_train) % num_classes))
    y_test = torch.from_numpy(rng.permutation(np.arange(n_test) % num_classes))
    return TensorDataset("synthetic", "image", torch.zeros(n_train, 1, 2, 2), y_train,
                         torch.zeros(n_test, 1, 2, 2), y_test, num_classes)


def text_dataset() -> TensorDataset:
    """Three natural clients of 5, 3 and 8 windows (train) and 2, 1, 3 (test)."""
    tr, te = [5, 3, 8], [2, 1, 3]
    off_tr, off_te = np.cumsum([0] + tr), np.cumsum([0] + te)
    ids = torch.zeros(16, 4, dtype=torch.int64), torch.zeros(6, 4, dtype=torch.int64)
    return TensorDataset(
        "text", "text", ids[0], ids[0], ids[1], ids[1], 100,
        groups_train=tuple(np.arange(a, b) for a, b in zip(off_tr[:-1], off_tr[1:])),
        groups_test=tuple(np.arange(a, b) for a, b in zip(off_te[:-1], off_te[1:])),
        group_names=("p/A", "p/B", "p/C"))


def assert_disjoint_cover(parts, n: int, cover: bool = True) -> None:
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat), "clients share samples"
    assert flat.min() >= 0 and flat.max() < n
    if cover:
        assert len(flat) == n, "some samples are not assigned"


@pytest.fixture(scope="module")
def data() -> TensorDataset:
    return synthetic()


# ---- iid -----------------------------------------------------------------------------------

def test_iid_disjoint_cover_balanced_and_deterministic(data):
    p = make_partition(data, "iid", 7, seed=3)
    assert p.num_clients == 7 and p.scheme == "iid" and p.seed == 3
    assert_disjoint_cover(p.train, 2000)
    assert p.sizes.max() - p.sizes.min() <= 1
    q = make_partition(data, "iid", 7, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(p.train, q.train))
    assert all(np.array_equal(a, b) for a, b in zip(p.test, q.test))
    r = make_partition(data, "iid", 7, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(p.train, r.train))
    np.testing.assert_allclose(p.weights.sum(), 1.0, rtol=0, atol=1e-12)


# ---- dirichlet -----------------------------------------------------------------------------

def test_dirichlet_invariants_and_min_size(data):
    p = make_partition(data, "dirichlet", 20, seed=0, alpha=0.1, min_size=25)
    assert_disjoint_cover(p.train, 2000)
    assert p.sizes.min() >= 25
    assert p.params["alpha"] == 0.1 and p.params["min_size"] == 25
    q = make_partition(data, "dirichlet", 20, seed=0, alpha=0.1, min_size=25)
    assert all(np.array_equal(a, b) for a, b in zip(p.train, q.train))


def test_dirichlet_skew_grows_as_alpha_shrinks(data):
    """Mean TV distance to the pooled label mix, averaged over 3 seeds, per alpha."""
    y = data.y_train.numpy()
    skew = {}
    for alpha in (100.0, 1.0, 0.1, 0.01):
        skew[alpha] = np.mean([label_skew(make_partition(data, "dirichlet", 10, s, alpha=alpha,
                                                         min_size=5).train, y, 10)
                               for s in range(3)])
    # Measured on this data (seeds 0-2): 0.037, 0.336, 0.718, 0.853; the bound for one class
    # per client is 1 - 1/10 = 0.9.
    assert skew[100.0] < 0.1
    assert skew[1.0] - skew[100.0] > 0.2
    assert skew[0.1] - skew[1.0] > 0.2
    assert skew[0.01] - skew[0.1] > 0.05
    assert skew[0.01] <= 0.9


def test_dirichlet_gives_up_with_clear_error():
    tiny = synthetic(n_train=60, n_test=20)
    with pytest.raises(DataError, match=r"larger alpha"):
        make_partition(tiny, "dirichlet", 10, 0, alpha=0.001, min_size=5, max_attempts=3)


@pytest.mark.parametrize("params, key", [
    ({"alpha": 0.0}, "alpha"), ({"alpha": -1.0}, "alpha"), ({"min_size": 0}, "min_size"),
    ({"min_size": 300}, "min_size"), ({"max_attempts": 0}, "max_attempts"),
])
def test_dirichlet_bad_parameters_name_the_key(data, params, key):
    with pytest.raises(DataError, match=key):
        make_partition(data, "dirichlet", 10, 0, **params)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes"])
def test_bad_num_clients_is_named(data, scheme):
    for bad in (0, -3):
        with pytest.raises(DataError, match="num_clients"):
            make_partition(data, scheme, bad, 0)
    with pytest.raises(DataError, match="num_clients=2001 exceeds"):
        make_partition(data, scheme, 2001, 0)


def test_registry_errors_list_valid_names(data):
    with pytest.raises(DataError, match="valid schemes: iid, dirichlet, classes, natural"):
        make_partition(data, "shards", 10, 0)
    with pytest.raises(DataError, match="unknown parameter.*beta.*valid parameters: alpha"):
        make_partition(data, "dirichlet", 10, 0, beta=0.5)
    with pytest.raises(DataError, match="seed"):
        make_partition(data, "iid", 10, -1)


# ---- classes -------------------------------------------------------------------------------

def test_classes_gives_exactly_k_classes_balanced_holders(data):
    p = make_partition(data, "classes", 15, seed=1, classes_per_client=2)
    y = data.y_train.numpy()
    assert_disjoint_cover(p.train, 2000)  # 15 * 2 >= 10 classes: every class is held
    counts = label_counts(p.train, y, 10)
    assert ((counts > 0).sum(1) == 2).all()
    holders = (counts > 0).sum(0)
    assert holders.max() - holders.min() <= 1 and holders.sum() == 30
    assert len({tuple(np.flatnonzero(c)) for c in counts}) >= 10  # varied class pairs


def test_classes_with_few_clients_leaves_classes_unused(data):
    p = make_partition(data, "classes", 2, seed=0, classes_per_client=3)
    assert_disjoint_cover(p.train, 2000, cover=False)
    assert p.sizes.sum() == 6 * 200


def test_classes_bad_k(data):
    for k in (0, 11):
        with pytest.raises(DataError, match="classes_per_client"):
            make_partition(data, "classes", 5, 0, classes_per_client=k)


# ---- local test splits ---------------------------------------------------------------------

def test_local_test_follows_train_label_mix(data):
    """Client m draws t_m = round(n_m N_test / N_train) test samples, c_mk t_m / n_m of class k
    (rounded: off by < 1), fewer only where class k's 50 test samples run out."""
    p = make_partition(data, "dirichlet", 10, seed=2, alpha=0.2, min_size=20)
    y_tr, y_te = data.y_train.numpy(), data.y_test.numpy()
    pool = np.bincount(y_te, minlength=10)
    for train, test in zip(p.train, p.test):
        t = max(1, round(len(train) * 500 / 2000))
        assert len(np.unique(test)) == len(test) and test.max() < 500
        target = np.bincount(y_tr[train], minlength=10) * t / len(train)
        got = np.bincount(y_te[test], minlength=10)
        capped = got == pool
        assert np.all(np.abs(got - target)[~capped] < 1)
        assert np.all(got[capped] <= target[capped] + 1)
        assert len(test) == t or capped.any()
        assert np.all(got[target == 0] == 0)


def test_fixed_test_size_and_independent_streams(data):
    a = make_partition(data, "dirichlet", 8, seed=5, alpha=0.5, test_size=30)
    b = make_partition(data, "dirichlet", 8, seed=5, alpha=0.5)
    assert [len(t) for t in a.test] == [30] * 8
    assert all(np.array_equal(x, z) for x, z in zip(a.train, b.train))  # test_size: train same
    with pytest.raises(DataError, match="test_size"):
        make_partition(data, "iid", 4, 0, test_size="half")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), m=st.integers(1, 20), seed=st.integers(0, 2**31))
def test_property_iid(n, m, seed):
    if m > n:
        with pytest.raises(DataError):
            split_iid(n, m, np.random.default_rng(seed))
        return
    parts = split_iid(n, m, np.random.default_rng(seed))
    assert len(parts) == m
    assert_disjoint_cover(parts, n)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@settings(max_examples=40, deadline=None)
@given(labels=st.lists(st.integers(0, 5), min_size=20, max_size=200),
       m=st.integers(1, 6), alpha=st.floats(0.05, 50.0), seed=st.integers(0, 2**31))
def test_property_dirichlet(labels, m, alpha, seed):
    y = np.array(labels)
    try:
        parts = split_dirichlet(y, m, alpha, 2, np.random.default_rng(seed), max_attempts=20)
    except DataError as exc:
        assert "alpha" in str(exc) or "min_size" in str(exc)
        return
    assert_disjoint_cover(parts, len(y))
    assert min(map(len, parts)) >= 2
    again = split_dirichlet(y, m, alpha, 2, np.random.default_rng(seed), max_attempts=20)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@settings(max_examples=40, deadline=None)
@given(labels=st.lists(st.integers(0, 4), min_size=10, max_size=200),
       m=st.integers(1, 8), k=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_property_classes(labels, m, k, seed):
    y = np.array(labels)
    c = len(np.unique(y))
    try:
        parts = split_classes(y, m, k, np.random.default_rng(seed))
    except DataError as exc:
        assert k > c or "no samples" in str(exc)
        return
    assert_disjoint_cover(parts, len(y), cover=m * k >= c)
    for p in parts:
        assert 1 <= len(np.unique(y[p])) <= k


@settings(max_examples=30, deadline=None)
@given(labels=st.lists(st.integers(0, 3), min_size=8, max_size=100),
       test_labels=st.lists(st.integers(0, 3), min_size=4, max_size=60),
       m=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_property_local_test(labels, test_labels, m, seed):
    y, yt = np.array(labels), np.array(test_labels)
    if m > len(y):
        return
    parts = split_iid(len(y), m, np.random.default_rng(seed))
    tests = local_test_indices(parts, y, yt, len(yt), np.random.default_rng(seed))
    for train, test in zip(parts, tests):
        assert len(np.unique(test)) == len(test)
        assert set(yt[test]) <= set(y[train])
        assert len(test) <= max(1, round(len(train) * len(yt) / len(y)))


# ---- natural -------------------------------------------------------------------------------

def test_natural_all_largest_random():
    d = text_dataset()
    p = make_partition(d, "natural", None, seed=0)
    assert p.num_clients == 3 and list(p.sizes) == [5, 3, 8]
    assert [len(t) for t in p.test] == [2, 1, 3]
    assert p.params["groups"] == ["p/A", "p/B", "p/C"]
    top = make_partition(d, "natural", 2, seed=0)
    assert top.params["groups"] == ["p/A", "p/C"]
    r1 = make_partition(d, "natural", 2, seed=9, select="random")
    r2 = make_partition(d, "natural", 2, seed=9, select="random")
    assert r1.params["groups"] == r2.params["groups"]
    with pytest.raises(DataError, match="num_clients=4 exceeds the 3 natural clients"):
        make_partition(d, "natural", 4, seed=0)
    with pytest.raises(DataError, match="select"):
        make_partition(d, "natural", 2, seed=0, select="smallest")


def test_text_rejects_label_schemes_and_natural_needs_groups(data):
    d = text_dataset()
    for scheme in ("dirichlet", "classes"):
        with pytest.raises(DataError, match="needs class labels"):
            make_partition(d, scheme, 2, 0)
    p = make_partition(d, "iid", 2, 0)  # iid works on text; local tests are uniform draws
    assert_disjoint_cover(p.train, 16)
    with pytest.raises(DataError, match="natural clients"):
        make_partition(data, "natural", 2, 0)


# ---- save, load, check, plot ---------------------------------------------------------------

def test_save_load_round_trip(tmp_path, data):
    p = make_partition(data, "dirichlet", 6, seed=4, alpha=0.3)
    path = save_partition(p, tmp_path / "part")
    assert path.name == "part.npz" and (tmp_path / "part.json").is_file()
    q = load_partition(path)
    assert (q.scheme, q.seed, q.params) == (p.scheme, p.seed, p.params)
    assert all(np.array_equal(a, b) for a, b in zip(p.train, q.train))
    assert all(np.array_equal(a, b) for a, b in zip(p.test, q.test))
    meta = json.loads((tmp_path / "part.json").read_text())
    assert meta["train_sizes"] == p.sizes.tolist()
    check_partition(q, data)


def test_load_and_check_errors_name_the_file(tmp_path, data):
    with pytest.raises(DataError, match="nothere.npz does not exist"):
        load_partition(tmp_path / "nothere.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="bad.npz is not a partition file"):
        load_partition(bad)
    p = make_partition(synthetic(n_train=3000), "iid", 3, 0)
    with pytest.raises(DataError, match="indices outside"):
        check_partition(p, data)


def test_plot_partition_draws_stacked_bars(tmp_path, data):
    p = make_partition(data, "dirichlet", 12, seed=0, alpha=0.5)
    fig = plot_partition(p, data.y_train, 10, path=tmp_path / "p.png", max_clients=10)
    ax = fig.axes[0]
    assert len(ax.patches) == 10 * 10  # 10 clients x 10 classes
    heights = np.array([b.get_height() for b in ax.patches]).reshape(10, 10)  # (class, client)
    np.testing.assert_array_equal(heights.sum(0), p.sizes[:10])
    assert (tmp_path / "p.png").stat().st_size > 1000
    text = plot_partition(make_partition(text_dataset(), "natural", None, 0),
                          text_dataset().y_train)
    assert [b.get_height() for b in text.axes[0].patches] == [5, 3, 8]
