"""Heterogeneity of two kinds, on top of any partition: concept shift and covariate shift.

Label skew (``dirichlet``, ``classes``) changes which inputs a client sees as well as which
labels, so it mixes the two kinds of heterogeneity that the theory separates (THEORY.md: a
client's teacher against its input covariance). A shift applied on top of a partition isolates
one of them:

- ``concept``: the clients disagree on the labelling and see alike inputs. The clients fall in
  ``groups`` groups (client m in group m mod groups); group 0 keeps the data set's labels, and
  every other group relabels the same ``classes`` classes (a seeded choice) by a permutation of
  its own that moves every one of them (a derangement). With an ``iid`` partition the inputs
  are alike; with ``dirichlet`` the two kinds combine.
- ``covariate``: one labelling, and every client's inputs pass through a transform of its own,
  with a client parameter u_m evenly spread over [-1, 1] (in a seeded order):
  ``rotation`` by ``spread * u_m`` degrees (bilinear, the border pixel extends the image),
  ``contrast`` x -> mean + exp(spread * u_m) (x - mean) per image, or ``pattern`` x -> x +
  spread * P_m with P_m a fixed Gaussian pattern of unit RMS per client.

A client's training, validation and local test samples all carry its own labelling and
transform. Training and validation samples belong to one client each, so they are changed in
place; local test splits may overlap between clients, so the shifted test set holds one copy
per client (client m's copy of its split under its own shift) and the partition's test indices
point into it. The global ``test_acc`` is then the federated objective: every client's local
test accuracy under its own labelling, weighted by its test size (proportional to its training
size), the only score that means something when no single model can fit every client.

The partition file stores the unshifted partition and the shift's parameters; the shifted data
are recomputed from them (deterministic in the partition's seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from linattn.errors import DataError
from real_data.data.base import Partition, TensorDataset

KINDS = ("concept", "covariate")
TRANSFORMS = ("rotation", "contrast", "pattern")


@dataclass(frozen=True)
class Shift:
    """A checked shift (module docstring); ``None`` fields belong to the other kind."""

    kind: str
    classes: int | None = None
    groups: int | None = None
    transform: str | None = None
    spread: float | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def shift_from_dict(raw, key: str = "partition.shift") -> Shift | None:
    """``raw`` (a mapping, or ``None`` for no shift) as a :class:`Shift`; every bad value is a
    DataError naming ``key`` and the allowed values."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise DataError(f"{key}={raw!r} must be a mapping such as {{kind: concept, classes: 4, "
                        "groups: 2}} or {kind: covariate, transform: rotation, spread: 30}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise DataError(f"{key}.kind={kind!r}: allowed {', '.join(KINDS)}")
    allowed = {"concept": {"kind", "classes", "groups"},
               "covariate": {"kind", "transform", "spread"}}[kind]
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise DataError(f"{key}: unknown key(s) {', '.join(unknown)} for kind {kind}; allowed: "
                        f"{', '.join(sorted(allowed))}")

    def integer(name, default, low):
        v = raw.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise DataError(f"{key}.{name}={v!r} must be an integer >= {low}")
        return v

    if kind == "concept":
        return Shift(kind, classes=integer("classes", 2, 2), groups=integer("groups", 2, 2))
    transform = raw.get("transform", "rotation")
    if transform not in TRANSFORMS:
        raise DataError(f"{key}.transform={transform!r}: allowed {', '.join(TRANSFORMS)}")
    spread = raw.get("spread")
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or \
            not math.isfinite(spread) or spread <= 0:
        raise DataError(f"{key}.spread={spread!r} must be a number > 0 (rotation: degrees, "
                        "at most 180; contrast: log-factor; pattern: pattern RMS)")
    if transform == "rotation" and spread > 180:
        raise DataError(f"{key}.spread={spread} degrees exceeds 180")
    return Shift(kind, transform=transform, spread=float(spread))


def _rng(seed: int) -> np.random.Generator:
    # fourth child of the partition's seed sequence (train, test, validation come first)
    return np.random.default_rng(np.random.SeedSequence(int(seed)).spawn(4)[3])


def client_labellings(shift: Shift, num_clients: int, num_classes: int, seed: int
                      ) -> np.ndarray:
    """``(M, C)`` int64: client m's label for each original class (concept shift)."""
    if shift.classes > num_classes:
        raise DataError(f"partition.shift.classes={shift.classes} exceeds the data set's "
                        f"{num_classes} classes")
    if shift.groups > num_clients:
        raise DataError(f"partition.shift.groups={shift.groups} exceeds "
                        f"partition.num_clients={num_clients}")
    rng = _rng(seed)
    moved = np.sort(rng.choice(num_classes, size=shift.classes, replace=False))
    maps = [np.arange(num_classes)]
    for _ in range(1, shift.groups):
        while True:  # a derangement of the chosen classes: every one of them changes label
            perm = rng.permutation(shift.classes)
            if not np.any(perm == np.arange(shift.classes)):
                break
        m = np.arange(num_classes)
        m[moved] = moved[perm]
        maps.append(m)
    return np.stack([maps[c % shift.groups] for c in range(num_clients)]).astype(np.int64)


def client_parameters(num_clients: int, seed: int) -> np.ndarray:
    """u_m in [-1, 1], evenly spread, in a seeded order (covariate shift)."""
    u = np.linspace(-1.0, 1.0, num_clients) if num_clients > 1 else np.zeros(1)
    return u[_rng(seed).permutation(num_clients)]


def _transform(x: torch.Tensor, shift: Shift, u: float, pattern: torch.Tensor | None
               ) -> torch.Tensor:
    if shift.transform == "rotation":
        # one client, one rotation: the sampling grid of one image serves every image
        theta = math.radians(shift.spread * u)
        c, s = math.cos(theta), math.sin(theta)
        mat = torch.tensor([[[c, -s, 0.0], [s, c, 0.0]]], dtype=x.dtype)
        grid = torch.nn.functional.affine_grid(mat, [1, *x.shape[1:]], align_corners=False)
        return torch.nn.functional.grid_sample(x, grid.expand(len(x), *grid.shape[1:]),
                                               mode="bilinear", padding_mode="border",
                                               align_corners=False)
    if shift.transform == "contrast":
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        return mean + math.exp(shift.spread * u) * (x - mean)
    return x + shift.spread * pattern


def apply_shift(dataset: TensorDataset, partition: Partition, shift: Shift | dict | None
                ) -> tuple[TensorDataset, Partition]:
    """The shifted data set and the partition indexing it (module docstring); ``(dataset,
    partition)`` unchanged without a shift."""
    if isinstance(shift, dict) or shift is None:
        shift = shift_from_dict(shift)
    if shift is None:
        return dataset, partition
    if partition.params.get("shifted_test"):
        raise DataError("the partition is already shifted (its test indices point into a "
                        "shifted test set); shift the unshifted partition it came from")
    if dataset.task != "image" or dataset.y_train.ndim != 1:
        raise DataError(f"partition.shift needs an image data set with class labels; "
                        f"{dataset.name} is a {dataset.task} data set")
    m_count = partition.num_clients
    # concept shift changes labels only: the shifted data set shares the inputs' tensor, so
    # runs on any partition or labelling hold (and move to a device) one copy of them
    x_train = dataset.x_train if shift.kind == "concept" else dataset.x_train.clone()
    y_train = dataset.y_train.clone()
    owned = [*partition.train, *(partition.val or ())]
    owners = [*range(m_count), *(range(m_count) if partition.val else ())]
    if shift.kind == "concept":
        maps = torch.as_tensor(client_labellings(shift, m_count, dataset.num_classes,
                                                 partition.seed))
    else:
        u = client_parameters(m_count, partition.seed)
        patterns = None
        if shift.transform == "pattern":
            g = torch.Generator().manual_seed(int(_rng(partition.seed).integers(2**31)))
            patterns = torch.randn((m_count, *dataset.input_shape), generator=g,
                                   dtype=torch.float64)
            patterns /= patterns.pow(2).mean(dim=tuple(range(1, patterns.dim())),
                                             keepdim=True).sqrt()
            patterns = patterns.to(dataset.x_train.dtype)

    def shifted(x, y, m):
        if shift.kind == "concept":
            return x, maps[m][y]
        return _transform(x, shift, float(u[m]), None if patterns is None else patterns[m]), y

    for idx, m in zip(owned, owners):
        ix = torch.as_tensor(idx, dtype=torch.int64)
        if shift.kind == "concept":
            y_train[ix] = maps[m][y_train[ix]]
        else:
            x_train[ix] = shifted(x_train[ix], None, m)[0]
    xs, ys, tests, start = [], [], [], 0
    for m, idx in enumerate(partition.test):
        ix = torch.as_tensor(idx, dtype=torch.int64)
        x, y = shifted(dataset.x_test[ix], dataset.y_test[ix], m)
        xs.append(x)
        ys.append(y)
        tests.append(np.arange(start, start + len(idx), dtype=np.int64))
        start += len(idx)
    shifted_data = TensorDataset(dataset.name, dataset.task, x_train, y_train,
                                 torch.cat(xs), torch.cat(ys), dataset.num_classes)
    shifted_part = Partition(partition.train, tuple(tests), partition.scheme,
                             {**partition.params, "shift": shift.as_dict(),
                              "shifted_test": True}, partition.seed, partition.val)
    return shifted_data, shifted_part
