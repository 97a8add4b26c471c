"""Partitioners: which training samples each client holds, plus its local test split.

Four schemes, one explicit registry (``SCHEMES``), all deterministic in their seed:

- ``iid``: a uniform random permutation cut into ``num_clients`` near-equal parts.
- ``dirichlet``: label skew after Hsu et al. (2019) as implemented in NIID-Bench (Li et al.,
  2022): for every class k draw q_k ~ Dir(alpha 1_M) and give client m the share q_km of class
  k's samples; clients that already hold N/M samples get no more. Repeated until every client
  has at least ``min_size`` samples, at most ``max_attempts`` times. Small alpha -> few
  classes per client; alpha -> inf -> IID.
- ``classes``: pathological skew (McMahan et al., 2017), exactly ``classes_per_client``
  distinct classes per client, dealt from shuffled decks of the C classes so each class has
  ``M k / C`` holders (+-1); each class is split equally among its holders.
- ``natural``: Shakespeare's roles (the data set's ``groups_train``), all of them, the
  ``num_clients`` largest, or a random subset.

Local test splits. Client m's test indices (into ``x_test``) follow its own training label
mix: ``test_size="proportional"`` (default) gives it ``round(n_m N_test / N_train)`` (at least
1) test samples, an integer gives every client that many; the per-class counts are
``t_m c_mk / n_m`` rounded by largest remainder, drawn without replacement from class k's test
samples (capped at what exists). Clients' test sets are drawn independently and may overlap;
evaluation only reads them. For text data (no class labels) the draw is uniform; ``natural``
uses each role's own test part.

Validation splits. ``validation_fraction=f`` (in (0, 0.5]) moves ``round(f n_m)`` of client
m's training samples (at least 1, and at least 1 left for training) into its validation split
``val[m]``, drawn uniformly from its own samples, so the validation data follow each client's
own mix and the pooled validation set follows the federation's. The local test split is drawn
from the client's full training mix first, so adding a validation split changes neither the
test splits nor which samples a client holds in all.

Seeds: ``seed`` feeds one ``np.random.SeedSequence`` spawned into a training stream, a test
stream and a validation stream, so changing ``test_size`` or ``validation_fraction`` leaves the
others unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from linattn.errors import DataError
from real_data.data.base import Partition, TensorDataset

# ---------------------------------------------------------------------------------------------
# Core splits on plain label arrays (pure numpy; the property tests exercise these directly).
# ---------------------------------------------------------------------------------------------


def _check_clients(num_clients, n: int) -> None:
    if not isinstance(num_clients, (int, np.integer)) or isinstance(num_clients, bool) \
            or num_clients < 1:
        raise DataError(f"num_clients must be an integer >= 1 (got {num_clients!r})")
    if num_clients > n:
        raise DataError(f"num_clients={num_clients} exceeds the {n} training samples")


def split_iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation of ``range(n)`` cut into ``num_clients`` parts (sizes within 1)."""
    _check_clients(num_clients, n)
    return [np.sort(p) for p in np.array_split(rng.permutation(n), num_clients)]


def split_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, min_size: int,
                    rng: np.random.Generator, max_attempts: int = 100) -> list[np.ndarray]:
    """Dirichlet(alpha) label skew; every client ends with at least ``min_size`` samples.

    Raises
    ------
    DataError
        If ``alpha <= 0``, ``min_size < 1``, ``num_clients * min_size > len(labels)``, or no
        draw in ``max_attempts`` gives every client ``min_size`` samples.
    """
    n = len(labels)
    _check_clients(num_clients, n)
    if not np.isfinite(alpha) or alpha <= 0:
        raise DataError(f"alpha must be > 0 (got {alpha!r})")
    if not isinstance(min_size, (int, np.integer)) or min_size < 1:
        raise DataError(f"min_size must be an integer >= 1 (got {min_size!r})")
    if num_clients * min_size > n:
        raise DataError(f"min_size={min_size} for {num_clients} clients needs "
                        f"{num_clients * min_size} samples; there are {n}")
    if not isinstance(max_attempts, (int, np.integer)) or max_attempts < 1:
        raise DataError(f"max_attempts must be an integer >= 1 (got {max_attempts!r})")
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    cap = n / num_clients
    for _ in range(max_attempts):
        held = np.zeros(num_clients)  # samples given to each client so far
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in by_class:
            members = rng.permutation(members)
            q = rng.dirichlet(np.full(num_clients, alpha))
            q = np.where(held < cap, q, 0.0)  # NIID-Bench balancing: full clients get no more
            if not np.isfinite(q).all() or q.sum() <= 0:
                q = np.full(num_clients, 1.0)
            cuts = (np.cumsum(q / q.sum()) * len(members)).astype(int)[:-1]
            for m, chunk in enumerate(np.split(members, cuts)):
                parts[m].append(chunk)
                held[m] += len(chunk)
        if held.min() >= min_size:
            return [np.sort(np.concatenate(p)) for p in parts]
    raise DataError(f"dirichlet: no draw in max_attempts={max_attempts} gave each of the "
                    f"{num_clients} clients min_size={min_size} samples at alpha={alpha}; use "
                    "a larger alpha, fewer clients or a smaller min_size")


def split_classes(labels: np.ndarray, num_clients: int, classes_per_client: int,
                  rng: np.random.Generator) -> list[np.ndarray]:
    """Pathological skew: each client holds exactly ``classes_per_client`` distinct classes.

    The classes are dealt like cards, k to a client, from a sequence of fresh random
    permutations of the C classes (at a permutation boundary the classes the client already
    holds are moved to the back of the next one), so every class has ``M k / C`` holders (+-1)
    and the class sets vary between clients. Each class's samples are shuffled and cut equally
    among its holders. With ``M k < C`` some classes are held by nobody and go unused.
    """
    n = len(labels)
    _check_clients(num_clients, n)
    classes = np.unique(labels)
    k = classes_per_client
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= len(classes):
        raise DataError(f"classes_per_client must be an integer in [1, {len(classes)}] "
                        f"(got {k!r})")
    deck: list = []
    while len(deck) < num_clients * k:
        held = set(deck[len(deck) - len(deck) % k:])  # the current client's classes so far
        perm = rng.permutation(classes).tolist()
        deck += [c for c in perm if c not in held] + [c for c in perm if c in held]
    held_by: dict = {c: [] for c in classes}
    for m in range(num_clients):
        for c in deck[m * k:(m + 1) * k]:
            held_by[c].append(m)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, holders in held_by.items():
        members = rng.permutation(np.flatnonzero(labels == c))
        for m, chunk in zip(holders, np.array_split(members, max(len(holders), 1))):
            parts[m].append(chunk)
    out = [np.sort(np.concatenate(p)) for p in parts]
    empty = [m for m, p in enumerate(out) if len(p) == 0]
    if empty:
        raise DataError(f"classes: {len(empty)} of {num_clients} clients got no samples; use "
                        "fewer clients or more classes_per_client")
    return out


def local_test_indices(train_parts: list[np.ndarray], y_train: np.ndarray | None,
                       y_test: np.ndarray | None, n_test: int, rng: np.random.Generator,
                       test_size: int | str = "proportional") -> list[np.ndarray]:
    """Each client's test indices with its own training label mix (module docstring)."""
    n_train = sum(len(p) for p in train_parts)
    if test_size == "proportional":
        sizes = [max(1, int(round(len(p) * n_test / max(n_train, 1)))) for p in train_parts]
    elif isinstance(test_size, (int, np.integer)) and not isinstance(test_size, bool) \
            and test_size >= 1:
        sizes = [int(test_size)] * len(train_parts)
    else:
        raise DataError(f"test_size must be 'proportional' or an integer >= 1 "
                        f"(got {test_size!r})")
    if y_train is None or y_test is None:
        return [np.sort(rng.choice(n_test, size=min(t, n_test), replace=False)) for t in sizes]
    classes = np.unique(np.concatenate([y_train, y_test]))
    pools = [np.flatnonzero(y_test == c) for c in classes]
    out = []
    for part, t in zip(train_parts, sizes):
        counts = np.array([np.count_nonzero(y_train[part] == c) for c in classes], float)
        want = _round_to_total(t * counts / counts.sum(), t)
        chosen = [rng.choice(pool, size=min(w, len(pool)), replace=False)
                  for pool, w in zip(pools, want) if w > 0]
        out.append(np.sort(np.concatenate(chosen)) if chosen else np.empty(0, np.int64))
    return out


def _round_to_total(x: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to ``total = sum(x)`` closest to ``x`` (largest remainder)."""
    base = np.floor(x).astype(int)
    extra = total - base.sum()
    base[np.argsort(-(x - base), kind="stable")[:extra]] += 1
    return base


def label_counts(parts: list[np.ndarray] | tuple[np.ndarray, ...], labels: np.ndarray,
                 num_classes: int) -> np.ndarray:
    """``(M, num_classes)`` int array: client m's number of samples of each class."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def label_skew(parts, labels: np.ndarray, num_classes: int) -> float:
    """Mean total-variation distance between each client's label distribution and the pooled one.

    0 for identical mixes; up to 1 - 1/C for clients holding one class each under balanced data.
    """
    counts = label_counts(parts, labels, num_classes).astype(float)
    pooled = counts.sum(0) / counts.sum()
    mix = counts / counts.sum(1, keepdims=True)
    return float(0.5 * np.abs(mix - pooled).sum(1).mean())


# ---------------------------------------------------------------------------------------------
# Schemes on a TensorDataset.
# ---------------------------------------------------------------------------------------------


def _labels(dataset: TensorDataset, scheme: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    if dataset.y_train.ndim != 1:
        if scheme in ("dirichlet", "classes"):
            raise DataError(f"scheme {scheme!r} needs class labels, but {dataset.name} is a "
                            f"{dataset.task} data set; use 'natural' or 'iid'")
        return None, None
    return dataset.y_train.cpu().numpy(), dataset.y_test.cpu().numpy()


def _streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise DataError(f"seed must be a non-negative integer (got {seed!r})")
    train, test = np.random.SeedSequence(int(seed)).spawn(2)
    return np.random.default_rng(train), np.random.default_rng(test)


def check_validation_fraction(fraction, key: str = "validation_fraction") -> float:
    """``fraction`` as a float in (0, 0.5], else a DataError naming ``key``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating)) \
            or not np.isfinite(fraction) or not 0 < fraction <= 0.5:
        raise DataError(f"{key}={fraction!r} must be a number in (0, 0.5] (the share of each "
                        "client's training samples held out for validation)")
    return float(fraction)


def carve_validation(partition: Partition, fraction: float) -> Partition:
    """``partition`` with ``round(fraction n_m)`` of each client's training samples moved to
    its validation split (module docstring); deterministic in the partition's seed."""
    fraction = check_validation_fraction(fraction)
    if partition.has_validation:
        raise DataError("the partition already has a validation split")
    # third child of the partition's seed sequence: the train and test streams are unchanged
    rng = np.random.default_rng(np.random.SeedSequence(int(partition.seed)).spawn(3)[2])
    train, val = [], []
    for m, part in enumerate(partition.train):
        n = len(part)
        if n < 2:
            raise DataError(f"client {m} holds {n} training sample(s); a validation split "
                            "needs at least 2 per client (lower partition.num_clients or "
                            "raise partition.min_size)")
        k = min(max(1, int(round(fraction * n))), n - 1)
        chosen = np.zeros(n, dtype=bool)
        chosen[rng.choice(n, size=k, replace=False)] = True
        train.append(np.asarray(part[~chosen], np.int64))
        val.append(np.sort(np.asarray(part[chosen], np.int64)))
    params = {**partition.params, "validation_fraction": fraction}
    return Partition(tuple(train), partition.test, partition.scheme, params, partition.seed,
                     tuple(val))


def _finish(dataset, parts, scheme, params, seed, rng_test, test_size) -> Partition:
    y_train, y_test = _labels(dataset, scheme)
    test = local_test_indices(parts, y_train, y_test, len(dataset.x_test), rng_test, test_size)
    params = {"dataset": dataset.name, "num_clients": len(parts), **params,
              "test_size": test_size}
    return Partition(tuple(p.astype(np.int64) for p in parts),
                     tuple(t.astype(np.int64) for t in test), scheme, params, int(seed))


def iid(dataset: TensorDataset, num_clients: int, seed: int, *,
        test_size: int | str = "proportional") -> Partition:
    """IID: a uniform random split of the training samples (sizes differ by at most one)."""
    rng_train, rng_test = _streams(seed)
    parts = split_iid(len(dataset.x_train), num_clients, rng_train)
    return _finish(dataset, parts, "iid", {}, seed, rng_test, test_size)


def dirichlet(dataset: TensorDataset, num_clients: int, seed: int, *, alpha: float = 0.5,
              min_size: int = 10, max_attempts: int = 100,
              test_size: int | str = "proportional") -> Partition:
    """Dirichlet(alpha) label skew with at least ``min_size`` samples per client."""
    y_train, _ = _labels(dataset, "dirichlet")
    rng_train, rng_test = _streams(seed)
    parts = split_dirichlet(y_train, num_clients, alpha, min_size, rng_train, max_attempts)
    params = {"alpha": float(alpha), "min_size": int(min_size), "max_attempts": int(max_attempts)}
    return _finish(dataset, parts, "dirichlet", params, seed, rng_test, test_size)


def classes(dataset: TensorDataset, num_clients: int, seed: int, *,
            classes_per_client: int = 2, test_size: int | str = "proportional") -> Partition:
    """Pathological non-IID: exactly ``classes_per_client`` classes per client."""
    y_train, _ = _labels(dataset, "classes")
    rng_train, rng_test = _streams(seed)
    parts = split_classes(y_train, num_clients, classes_per_client, rng_train)
    params = {"classes_per_client": int(classes_per_client)}
    return _finish(dataset, parts, "classes", params, seed, rng_test, test_size)


def natural(dataset: TensorDataset, num_clients: int | None, seed: int, *,
            select: str = "largest") -> Partition:
    """The data set's natural clients (Shakespeare roles) with their own test parts.

    ``num_clients=None`` keeps every role; otherwise ``select="largest"`` keeps the roles with
    the most training samples (ties by name order) and ``select="random"`` a random subset.
    """
    if dataset.groups_train is None or dataset.groups_test is None:
        raise DataError(f"scheme 'natural' needs natural clients; {dataset.name} has none "
                        "(use 'iid', 'dirichlet' or 'classes')")
    total = len(dataset.groups_train)
    rng_train, _ = _streams(seed)
    if num_clients is None:
        chosen = np.arange(total)
    else:
        if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
            raise DataError(f"num_clients must be an integer >= 1 or None (got {num_clients!r})")
        if num_clients > total:
            raise DataError(f"num_clients={num_clients} exceeds the {total} natural clients of "
                            f"{dataset.name}")
        if select == "largest":
            sizes = np.array([len(g) for g in dataset.groups_train])
            chosen = np.sort(np.argsort(-sizes, kind="stable")[:num_clients])
        elif select == "random":
            chosen = np.sort(rng_train.choice(total, size=num_clients, replace=False))
        else:
            raise DataError(f"select must be 'largest' or 'random' (got {select!r})")
    params = {"dataset": dataset.name, "num_clients": len(chosen), "select": select,
              "groups": [dataset.group_names[i] for i in chosen] if dataset.group_names else []}
    return Partition(tuple(np.asarray(dataset.groups_train[i], np.int64) for i in chosen),
                     tuple(np.asarray(dataset.groups_test[i], np.int64) for i in chosen),
                     "natural", params, int(seed))


SCHEMES: dict[str, Callable[..., Partition]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "classes": classes,
    "natural": natural,
}


def make_partition(dataset: TensorDataset, scheme: str, num_clients: int | None, seed: int,
                   validation_fraction: float | None = None, **params) -> Partition:
    """Partition ``dataset`` with a registered scheme; unknown names and options are errors.

    ``validation_fraction``: hold out that share of each client's training samples as its
    validation split (:func:`carve_validation`); ``None`` keeps no validation split.
    """
    if validation_fraction is not None:
        check_validation_fraction(validation_fraction)
        return carve_validation(make_partition(dataset, scheme, num_clients, seed, **params),
                                validation_fraction)
    if scheme not in SCHEMES:
        raise DataError(f"unknown partition scheme {scheme!r}; valid schemes: "
                        f"{', '.join(SCHEMES)}")
    fn = SCHEMES[scheme]
    valid = list(inspect.signature(fn).parameters)[3:]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise DataError(f"unknown parameter(s) {', '.join(unknown)} for scheme {scheme!r}; "
                        f"valid parameters: {', '.join(valid) or 'none'}")
    return fn(dataset, num_clients, seed, **params)
